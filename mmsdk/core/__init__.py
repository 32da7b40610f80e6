"""mmsdk's core: hook specs, plugin manager, registries, session, optimizer, manifest. No model knowledge."""
