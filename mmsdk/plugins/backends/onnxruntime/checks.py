"""Deciding, before anything is written, whether and how each applied pass reaches the ONNX graphs."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Callable

from mmsdk.core.backend import LowerTarget
from mmsdk.core.errors import BackendUnavailableError, ExportError, IncompatiblePassError
from mmsdk.plugins.backends.onnxruntime.plan import ExportPlan

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext
    from mmsdk.core.passes import PassResult
    from mmsdk.plugins.backends.onnxruntime.options import OrtOptions

__all__ = ["require_runtime", "make_plan", "PASS_SUPPORT", "REFUSED"]

BACKEND = "onnxruntime"
INSTALL = "pip install 'mmsdk[ort]'"

# How each built-in pass reaches the graphs (documentation for docs/onnxruntime.md and the manifest).
PASS_SUPPORT: dict[str, str] = {
    "qkv-fuse": "the decoder always computes q|k|v with one matmul; fused projections are read as they are",
    "token-prune": "traced into vision.onnx",
    "token-merge": "traced into vision.onnx",
    "vit-prune": "traced into vision.onnx",
}
# Passes the backend refuses, with the reason (checked before any pass-specific work).
REFUSED: dict[str, str] = {
    "fp8-kv": "ONNX Runtime's CPU GroupQueryAttention has no FP8 KV-cache kernel (FP8 caches are CUDA-only); "
    "use int8-kv or int4-kv for ONNX Runtime, or export fp8-kv models to TensorRT-LLM",
}

PassHandler = Callable[["ExportContext", "PassResult", dict[str, Any]], None]


def require_runtime(*, dynamo: bool = False) -> None:
    """Raise BackendUnavailableError naming the extra if onnxruntime (or onnxscript) is missing."""
    missing = [m for m in ("onnxruntime", "onnx") if importlib.util.find_spec(m) is None]
    if dynamo and importlib.util.find_spec("onnxscript") is None:
        missing.append("onnxscript")
    if missing:
        raise BackendUnavailableError(
            f"the onnxruntime backend needs {', '.join(missing)}, which is not installed.",
            fix=f"{INSTALL} (CPU) or pip install 'mmsdk[ort-gpu]' (CUDA).",
        )


def make_plan(context: ExportContext, options: OrtOptions) -> ExportPlan:
    """The ExportPlan for ``context``; raises IncompatiblePassError / ExportError for what cannot be expressed."""
    from mmsdk.plugins.backends.onnxruntime import xattn

    model, adapter = context.model, context.adapter
    if context.processor is None:
        raise ExportError(
            "the onnxruntime export needs the model's processor: it traces the vision graph on a processed "
            "sample image and ships the processor with the export.",
            fix="create the Optimizer with Optimizer(model, processor) (mmsdk.load_model returns both).",
        )
    decided: dict[str, Any] = {"skipped_cross_layers": frozenset()}
    for result in context.results:
        if result.name in REFUSED:
            raise IncompatiblePassError(
                f"pass {result.name!r} cannot be exported to onnxruntime: {REFUSED[result.name]}.",
                fix=f"drop {result.name!r} for this export, or export to another backend.",
            )
        handler = PASS_HANDLERS.get(result.name)
        if handler is not None:
            handler(context, result, decided)
    cfg = adapter.text_config(model)
    max_positions = options.max_sequence_length or int(getattr(cfg, "max_position_embeddings", 4096))
    blocks = adapter.cross_attention_blocks(model)
    recipe = xattn.recipe_for(adapter) if blocks else None
    cross = xattn.cross_plans(model, adapter, decided["skipped_cross_layers"]) if blocks else ()
    return ExportPlan(
        target=LowerTarget(BACKEND, {"accuracy_level": options.accuracy_level}),
        max_positions=max_positions,
        accuracy_level=options.accuracy_level,
        kv=decided.get("kv"),
        recipe=recipe,
        cross=cross,
    )


# Passes that need a decision of their own register a handler here (name -> handler).
PASS_HANDLERS: dict[str, PassHandler] = {}
