"""Building the plugin manager: hook specs, built-ins, installed entry points, then extras."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Iterable

import pluggy

from mmsdk.core import hookspecs
from mmsdk.core.errors import PluginLoadError

__all__ = [
    "BUILTIN_PLUGINS",
    "ESSENTIAL_PLUGINS",
    "ENTRY_POINT_GROUP",
    "DISABLE_AUTOLOAD_ENV",
    "DISABLE_PLUGINS_ENV",
    "PluginOrigin",
    "create_plugin_manager",
    "disabled_from_env",
]

ENTRY_POINT_GROUP = "mmsdk"
DISABLE_AUTOLOAD_ENV = "MMSDK_DISABLE_PLUGIN_AUTOLOAD"
DISABLE_PLUGINS_ENV = "MMSDK_DISABLE_PLUGINS"

# Built-in plugins: plugin name -> module. Registered exactly like third-party plugins.
BUILTIN_PLUGINS: dict[str, str] = {
    "mmsdk.models": "mmsdk.models.sources",
    "mmsdk.llava": "mmsdk.plugins.adapters.llava",
    "mmsdk.qwen_vl": "mmsdk.plugins.adapters.qwen_vl",
    "mmsdk.flamingo": "mmsdk.plugins.adapters.flamingo",
    "mmsdk.qkv_fuse": "mmsdk.plugins.attention.qkv_fuse",
    "mmsdk.token_prune": "mmsdk.plugins.encoders.token_prune",
    "mmsdk.vit_prune": "mmsdk.plugins.encoders.vit_prune",
    "mmsdk.token_merge": "mmsdk.plugins.projectors.token_merge",
    "mmsdk.rmsnorm_rope": "mmsdk.plugins.attention.rmsnorm_rope",
    "mmsdk.sparse_xattn": "mmsdk.plugins.attention.sparse_xattn",
    "mmsdk.gated_xattn": "mmsdk.plugins.attention.gated_xattn",
    "mmsdk.torch": "mmsdk.plugins.backends.torch",
    "mmsdk.onnxruntime": "mmsdk.plugins.backends.onnxruntime",
    "mmsdk.tensorrt_llm": "mmsdk.plugins.backends.tensorrt_llm.backend",
    "mmsdk.int4_weight": "mmsdk.plugins.quantizers.int4_weight",
    "mmsdk.kv_cache": "mmsdk.plugins.quantizers.kv_cache",
    "mmsdk.ptq_align": "mmsdk.plugins.quantizers.ptq_align",
}
# Plugins the rest of mmsdk cannot work without; MMSDK_DISABLE_PLUGINS refuses them.
ESSENTIAL_PLUGINS = frozenset({"mmsdk.torch"})


@dataclass(frozen=True)
class PluginOrigin:
    """Where a registered plugin came from."""

    name: str
    distribution: str
    version: str
    builtin: bool


def disabled_from_env() -> frozenset[str]:
    """Plugin names listed in MMSDK_DISABLE_PLUGINS (comma separated)."""
    raw = os.environ.get(DISABLE_PLUGINS_ENV, "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def create_plugin_manager(
    *,
    autoload: bool | None = None,
    extra: Iterable[object] = (),
    disabled: Iterable[str] | None = None,
) -> tuple[pluggy.PluginManager, dict[str, PluginOrigin]]:
    """Return a fresh plugin manager and the origin of every plugin it holds.

    Order: hook specs, built-ins, installed ``mmsdk`` entry points (unless ``autoload`` is False
    or MMSDK_DISABLE_PLUGIN_AUTOLOAD is set), then ``extra`` objects (tests, notebooks).
    Blocked names come from ``disabled`` or, when it is None, from MMSDK_DISABLE_PLUGINS.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    blocked = frozenset(disabled_from_env() if disabled is None else disabled)
    _refuse_blocking_essentials(blocked)
    for name in blocked:
        pm.set_blocked(name)
    origins: dict[str, PluginOrigin] = {}
    version = _mmsdk_version()
    for name, module_name in BUILTIN_PLUGINS.items():
        if pm.is_blocked(name):
            continue
        _register(pm, _import_builtin(name, module_name), name)
        origins[name] = PluginOrigin(name, "mmsdk", version, builtin=True)
    if autoload is None:
        autoload = not os.environ.get(DISABLE_AUTOLOAD_ENV)
    if autoload:
        origins.update(_load_entry_points(pm))
    for index, plugin in enumerate(extra):
        name = getattr(plugin, "__name__", None) or f"extra-{index}"
        if pm.is_blocked(name):
            continue
        _register(pm, plugin, name)
        origins[name] = PluginOrigin(name, "(in-process)", "", builtin=False)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        raise PluginLoadError(
            f"plugin {err.plugin!r} implements a hook mmsdk does not define: {err}.",
            fix="check the hook name's spelling against docs/writing-a-plugin.md, or upgrade mmsdk.",
        ) from err
    return pm, origins


def _refuse_blocking_essentials(blocked: frozenset[str]) -> None:
    refused = sorted(blocked & ESSENTIAL_PLUGINS)
    if refused:
        raise PluginLoadError(
            f"plugin(s) {', '.join(refused)} cannot be disabled: mmsdk needs them.",
            fix=f"remove them from {DISABLE_PLUGINS_ENV}.",
        )


def _import_builtin(name: str, module_name: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise PluginLoadError(
            f"built-in plugin {name!r} ({module_name}) failed to import: {err}.",
            fix=f"reinstall mmsdk, or set {DISABLE_PLUGINS_ENV}={name} to run without it.",
        ) from err


def _register(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as err:
        raise PluginLoadError(
            f"plugin {name!r} has an invalid hook implementation: {err}.",
            fix="make each @hookimpl function's arguments a subset of the hook spec's (docs/writing-a-plugin.md).",
        ) from err
    except ValueError as err:
        raise PluginLoadError(
            f"plugin {name!r} could not be registered: {err}.",
            fix=f"two plugins share the name {name!r}; uninstall one or block it with {DISABLE_PLUGINS_ENV}.",
        ) from err


def _load_entry_points(pm: pluggy.PluginManager) -> dict[str, PluginOrigin]:
    origins: dict[str, PluginOrigin] = {}
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP or pm.get_plugin(ep.name) or pm.is_blocked(ep.name):
                continue
            dist_name = dist.metadata["name"] or "(unknown)"
            try:
                plugin = ep.load()
            except Exception as err:  # a broken plugin must name itself, whatever it raised
                raise PluginLoadError(
                    f"plugin {ep.name!r} from distribution {dist_name} {dist.version} failed to import: "
                    f"{type(err).__name__}: {err}.",
                    fix=f"fix or upgrade {dist_name}, uninstall it, or set {DISABLE_PLUGINS_ENV}={ep.name} "
                    f"(or {DISABLE_AUTOLOAD_ENV}=1 to load no installed plugins).",
                ) from err
            _register(pm, plugin, ep.name)
            origins[ep.name] = PluginOrigin(ep.name, dist_name, dist.version, builtin=False)
    return origins


def _mmsdk_version() -> str:
    from mmsdk import __version__

    return __version__
