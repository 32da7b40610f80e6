"""Deciding, before anything is written, whether and how each applied pass reaches the ONNX graphs."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Callable

from mmsdk.core.backend import LowerTarget
from mmsdk.core.errors import BackendUnavailableError, ExportError, IncompatiblePassError
from mmsdk.plugins.backends.onnxruntime.plan import ExportPlan
from mmsdk.plugins.backends.onnxruntime.sparse import SparseRule
from mmsdk.plugins.backends.onnxruntime.tokens import token_pass

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
    "vit-prune": "traced into vision.onnx",
    "int4-weight": "MatMulNBits (bits=4) with the packed bytes copied as they are; AWQ input scales as a Mul",
    "int4-kv": "GroupQueryAttention kv_cache_bit_width=4 with the calibrated k_scale / v_scale; cross-attention K/V "
    "quantized and dequantized once in vision.onnx",
    "int8-kv": "GroupQueryAttention kv_cache_bit_width=8 with the calibrated k_scale / v_scale; cross-attention K/V "
    "quantized and dequantized once in vision.onnx",
    "ptq-align": "its ranges reach the graphs through the KV and weight passes that use them",
    "rmsnorm-rope-fusion": "the decoder's RMSNorms and rotary embeddings are always fused ORT ops "
    "((Skip)SimplifiedLayerNormalization, RoPE in GroupQueryAttention, MRotaryEmbedding); the fused modules are "
    "read for their weights",
    "gated-xattn": "skipped cross-attention layers are left out of both graphs; image K/V are computed once per "
    "image in vision.onnx",
    "token-prune": "visionzip: the same reducer runs in vision.onnx, which outputs the kept features and their slots; "
    "the runtime drops the other image tokens and keeps original positions (LLaVA / Qwen-VL)",
    "token-merge": "the same merge runs in vision.onnx, which outputs the merged features and their slots; "
    "the runtime drops the other image tokens and keeps original positions (LLaVA / Qwen-VL)",
    "sparse-xattn": "the block layout is computed in the decoder graph on every call (pooled q.k, TopK; each row's "
    "block grid starts at its first real token, as in the pass) and folded "
    "into the attention bias of GroupQueryAttention (self) or MultiHeadAttention (cross); with int4-kv / int8-kv "
    "on self-attention, the image keys' block sums (quantized and dequantized as the cache stores them) are "
    "carried between calls (past_key_values.{i}.image_key_sums -> present.{i}.image_key_sums), so the ranking "
    "matches the torch model",
}
# Passes the backend refuses, with the reason (checked before any pass-specific work).
_NOT_YET = ("changes how the model computes without a module or weight the graph builder can read, and this "
            "backend has no lowering for it yet")
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
    _check_architecture(context)
    _check_unknown(context, options)
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
        dtype=options.dtype,
        kv=decided.get("kv"),
        recipe=recipe,
        cross=cross,
        cross_kv_quant=decided.get("cross_kv_quant", {}),
        token_reduction=bool(decided.get("token_reduction")),
        sparse=decided.get("sparse"),
    )


def _check_unknown(context: ExportContext, options: OrtOptions) -> None:
    unknown = [r.name for r in context.results if r.name not in PASS_SUPPORT and r.name not in REFUSED]
    if unknown and not options.verify:
        raise ExportError(
            f"the onnxruntime backend does not know pass(es) {', '.join(unknown)}; it exports them only when the "
            "export-time check against the torch model runs, and verify=False turns that check off.",
            fix="export with verify=True (the default), or drop those passes for this export.",
        )


def _check_architecture(context: ExportContext) -> None:
    """Refuse decoders the graph builder does not write (Qwen3-VL's per-head q/k norms and deepstack inputs)."""
    import inspect

    adapter, model = context.adapter, context.model
    attentions = [a for a in map(adapter.self_attention, adapter.decoder_layers(model)) if a is not None]
    qk_norm = any(hasattr(a, "q_norm") or hasattr(a, "k_norm") for a in attentions)
    language = adapter.language_model(model)
    deepstack = "deepstack_visual_embeds" in inspect.signature(language.forward).parameters
    if qk_norm or deepstack:
        what = "per-head q/k RMSNorm in self-attention" if qk_norm else "deepstack vision features added in decoder layers"
        raise ExportError(
            f"the onnxruntime backend does not write decoders with {what} ({type(model).__name__}).",
            fix="export this model to the 'torch' backend; the onnxruntime backend covers LLaVA / LLaVA-NeXT, "
            "Qwen2-VL / Qwen2.5-VL, IDEFICS and Mllama.",
        )


def _kv_cache_pass(context: ExportContext, result: PassResult, decided: dict[str, Any]) -> None:
    """int4-kv / int8-kv: GroupQueryAttention's quantized cache with the pass's calibrated scales."""
    from mmsdk.plugins.backends.onnxruntime.kvcache import kv_from_record

    fmt = "int4" if result.name == "int4-kv" else "int8"
    if getattr(result.config, "scales", "static") != "static":
        raise IncompatiblePassError(
            f"{result.name} with dynamic per-token scales runs in torch only; GroupQueryAttention takes static "
            "calibrated scales.",
            fix=f"apply {result.name} with scales='static' (and opt.calibrate(...)) for this export.",
        )
    calibration = result.records.get("calibration") or {}
    record = calibration.get("kv_cache") or calibration.get("kv_ranges")
    if not record or not record.get("layers"):
        raise ExportError(
            f"pass {result.name!r} recorded no calibrated K/V ranges, so there are no k_scale / v_scale to export.",
            fix="calibrate before exporting (opt.calibrate(samples)), with static scales.",
        )
    if getattr(result.config, "prefill_attention", "quantized") == "exact":
        raise IncompatiblePassError(
            f"{result.name} with prefill_attention='exact' attends each forward's own tokens in full precision, "
            "but ONNX Runtime's GroupQueryAttention always attends to the quantized cache, so the exported "
            "graph would not reproduce the torch model (greedy tokens diverge within a few steps).",
            fix=f"apply {result.name} with the default prefill_attention='quantized' for onnxruntime exports, or "
            "export this model to the 'torch' backend.",
        )
    kv, cross = kv_from_record(record, fmt, f"{result.name}: {record.get('method', 'minmax')} ranges")
    missing = sorted(set(context.adapter.kv_layout(context.model).self_attention_layers) - set(kv.k_scales))
    if missing:
        raise ExportError(f"pass {result.name!r} recorded no K/V ranges for decoder layers {missing}.",
                          fix="re-run calibration on the whole model, then export again.")
    blocks = context.adapter.cross_attention_blocks(context.model)
    decided["kv"] = kv
    decided["cross_kv_quant"] = {
        (blocks[index].decoder_index if kind == "recomputed" else index): (k, v, kv.bits)
        for (kind, index), (k, v) in cross.items()
    }


def _sparse_xattn_pass(context: ExportContext, result: PassResult, decided: dict[str, Any]) -> None:
    """sparse-xattn: its rule, computed in the graph (sparse.py; sparse_cache.py with a quantized cache)."""
    kind = "cross" if context.adapter.cross_attention_blocks(context.model) else "self"
    decided["sparse"] = SparseRule(int(result.config.block_size), float(result.config.density), kind)


def _gated_xattn_pass(context: ExportContext, result: PassResult, decided: dict[str, Any]) -> None:
    """gated-xattn: the cross-attention layers it skipped (closed gates, latency budget) are not exported."""
    decided["skipped_cross_layers"] = frozenset(int(i) for i in result.records.get("skipped", []))


# Passes that need a decision of their own (name -> handler).
PASS_HANDLERS: dict[str, PassHandler] = {"int4-kv": _kv_cache_pass, "int8-kv": _kv_cache_pass,
                                         "gated-xattn": _gated_xattn_pass, "token-prune": token_pass,
                                         "token-merge": token_pass, "sparse-xattn": _sparse_xattn_pass}
