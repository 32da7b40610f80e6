"""Optional OpenTelemetry spans: ``with span("mmsdk.pass", name="int4-kv"):`` is a no-op without the package.

Install ``mmsdk[otel]`` (``opentelemetry-api``) and configure any OpenTelemetry SDK/exporter in your
application; mmsdk then reports a span per pass (``mmsdk.optimize.pass``), per export
(``mmsdk.export``), per evaluation (``mmsdk.eval``) and per generation stage while profiling
(``mmsdk.generate.vision_encode`` / ``projector`` / ``prefill`` / ``decode``). Backends and runtimes
use the same helper for their own stages. Without the package nothing is imported or recorded.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["TRACER_NAME", "enabled", "span"]

TRACER_NAME = "mmsdk"


def enabled() -> bool:
    """True when ``opentelemetry-api`` is importable (spans are then recorded by whatever SDK is set up)."""
    return importlib.util.find_spec("opentelemetry") is not None and importlib.util.find_spec(
        "opentelemetry.trace") is not None


def _attribute(value: Any) -> Any:
    # OpenTelemetry takes str, bool, int, float and sequences of them; anything else becomes text.
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, bool, int, float)) for v in value):
        return list(value)
    return str(value)


@contextmanager
def span(name: str, /, **attributes: Any) -> Iterator[Any]:
    """A span named ``name`` with ``attributes`` around the block; yields it (None when disabled)."""
    if not enabled():
        yield None
        return
    from opentelemetry import trace

    from mmsdk import __version__

    tracer = trace.get_tracer(TRACER_NAME, __version__)
    clean = {key: _attribute(value) for key, value in attributes.items() if value is not None}
    with tracer.start_as_current_span(name, attributes=clean) as current:
        yield current
