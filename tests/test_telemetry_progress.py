"""Optional OpenTelemetry spans and progress bars that stay quiet off a terminal."""

from __future__ import annotations

import importlib.util

import pytest

from mmsdk import Optimizer, telemetry
from mmsdk.progress import progress, progress_enabled, track


def test_span_is_a_no_op_without_opentelemetry(monkeypatch):
    monkeypatch.setattr(telemetry, "enabled", lambda: False)
    with telemetry.span("mmsdk.anything", name="x", value=object()) as current:
        assert current is None


def _sdk_installed() -> bool:
    """Whether opentelemetry-sdk is importable. ``find_spec`` of a submodule imports its parent first, and raises
    where the parent package is missing too, so the parent is looked up on its own first."""
    return (importlib.util.find_spec("opentelemetry") is not None
            and importlib.util.find_spec("opentelemetry.sdk") is not None)


@pytest.mark.skipif(not _sdk_installed(), reason="opentelemetry-sdk not installed")
def test_passes_exports_and_generation_stages_emit_spans(session, tiny, tmp_path, monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply("qkv-fuse")
    from opentelemetry import trace

    from mmsdk.profiling import ProfileSample
    from mmsdk.testing import sample_image

    # The global provider can be set once per process; route this test's tracers to its own provider.
    monkeypatch.setattr(trace, "get_tracer", lambda *args, **kwargs: provider.get_tracer(*args, **kwargs))
    opt.profile(ProfileSample(sample_image(0, 30), "is it even ?", 2), modules=False)
    opt.export("torch", tmp_path / "out")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["mmsdk.optimize.pass"].attributes["name"] == "qkv-fuse"
    assert spans["mmsdk.export"].attributes["backend"] == "torch"
    assert {"mmsdk.generate.vision_encode", "mmsdk.generate.prefill", "mmsdk.generate.decode"} <= set(spans)
    prefill, run = spans["mmsdk.generate.prefill"], spans["mmsdk.profile.run"]
    assert prefill.parent is not None and prefill.context.trace_id == run.context.trace_id


def test_progress_is_silent_off_a_terminal_and_can_be_forced(monkeypatch, capsys):
    monkeypatch.delenv("MMSDK_PROGRESS", raising=False)
    assert not progress_enabled()  # pytest captures stderr: not a terminal
    assert list(track(range(3), "quiet")) == [0, 1, 2]
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MMSDK_PROGRESS", "1")
    with progress("forced", total=2) as advance:
        advance(2)
    assert progress_enabled()
    monkeypatch.setenv("MMSDK_PROGRESS", "0")
    assert not progress_enabled()
