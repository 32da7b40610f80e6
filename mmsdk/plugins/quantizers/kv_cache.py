"""``int4-kv``, ``int8-kv``, ``fp8-kv``: a packed KV cache that ``generate()`` uses by itself.

The three passes share this module and ``exclusive_group="kv-cache"``. Static scales (default)
are calibrated: K per (KV head, channel) after RoPE, V per channel or per tensor, the form ONNX
Runtime's GroupQueryAttention and (per tensor) TensorRT-LLM consume; ranges come from min-max,
a percentile, or a straight-through-estimator fit. Dynamic scales (per token, KIVI style, with a
full-precision window of recent tokens) need no data and run in torch only: exporters refuse them.

When ``ptq-align`` ran earlier, the static ranges are its ranges (``ste`` refines them): one
calibration for every quantizer and both export paths. Self-attention K/V of every family,
Mllama's cached cross-attention K/V, and IDEFICS's recomputed ones (now computed once per image)
are all stored packed; ``cross_attention=False`` keeps cross-attention K/V in full precision.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

import mmsdk
from mmsdk.core.config import PassConfig
from mmsdk.core.errors import ConfigError, IncompatiblePassError
from mmsdk.core.passes import CheckContext, PassContext, PassSpec
from mmsdk.core.registry import Registrar

__all__ = ["KV_FORMATS", "FP8KVConfig", "Int4KVConfig", "Int8KVConfig", "KVCacheConfig"]


class KVCacheConfig(PassConfig):
    """Options shared by the KV-cache quantizers."""

    scales: Literal["static", "dynamic"] = Field(
        "static", description="static: calibrated ranges (exportable); dynamic: per-token groups (torch only)."
    )
    calibration: Literal["minmax", "percentile", "ste"] = Field(
        "minmax", description="How static ranges are set: max |x|, a percentile of |x|, or learned (STE)."
    )
    percentile: float = Field(99.99, gt=50.0, le=100.0, description="Percentile of |x| for calibration='percentile'.")
    ste_steps: int = Field(200, ge=1, le=20000, description="Optimizer steps for calibration='ste'.")
    ste_lr: float = Field(0.01, gt=0.0, description="Adam learning rate on log(range) for calibration='ste'.")
    key_granularity: Literal["channel", "tensor"] = Field(
        "channel", description="Static K scale per (KV head, channel) or one per layer (TensorRT-LLM's form)."
    )
    value_granularity: Literal["channel", "tensor"] = Field("channel", description="Static V scale granularity.")
    rotary_envelope: bool = Field(
        False, description="Range K by the norm of each RoPE channel pair, so scales hold at unseen positions."
    )
    group_size: int | None = Field(None, ge=1, description="Dynamic: channels per scale group (default head_dim).")
    residual_length: int = Field(32, ge=0, description="Dynamic: recent tokens kept in full precision.")
    cross_attention: bool = Field(True, description="Also quantize cross-attention K/V (Flamingo family).")
    prefill_attention: Literal["quantized", "exact"] = Field(
        "quantized",
        description="quantized: attention reads K/V as stored from the first forward on (ONNX Runtime "
        "GQA; what calibration sees); exact: a forward's own tokens are attended in full precision and read back "
        "quantized from the next step (TensorRT-LLM's context phase, transformers' QuantizedCache).",
    )
    max_rows: int = Field(2048, ge=16, description="Tokens sampled per layer for percentile ranges.")


class Int4KVConfig(KVCacheConfig):
    """``int4-kv``: 4-bit KV cache (ONNX Runtime GQA ``kv_cache_bit_width=4``; not in TensorRT-LLM)."""


class Int8KVConfig(KVCacheConfig):
    """``int8-kv``: 8-bit integer KV cache (ONNX Runtime GQA, TensorRT-LLM INT8)."""


class FP8KVConfig(KVCacheConfig):
    """``fp8-kv``: float8 e4m3 KV cache (TensorRT-LLM FP8, ONNX Runtime GQA on CUDA)."""


KV_FORMATS: dict[str, tuple[str, type[KVCacheConfig]]] = {
    "int4-kv": ("int4", Int4KVConfig),
    "int8-kv": ("int8", Int8KVConfig),
    "fp8-kv": ("fp8", FP8KVConfig),
}


def _wants_calibration(config: KVCacheConfig) -> bool:
    return config.scales == "static"


def _check(name: str) -> Any:
    def check(ctx: CheckContext) -> None:
        from mmsdk.plugins.quantizers.kv_runtime import installed_state

        config: KVCacheConfig = ctx.config  # type: ignore[assignment]
        present = installed_state(ctx.model)
        if present is not None:
            raise IncompatiblePassError(
                f"this model's KV cache is already quantized ({present.fmt}, {present.scales} scales); {name!r} "
                "cannot stack on it.",
                fix="start from the model without a KV-cache pass and apply one of int4-kv, int8-kv, fp8-kv.",
            )
        if config.scales == "dynamic" and config.calibration != "minmax":
            raise ConfigError(
                f"calibration={config.calibration!r} sets static ranges, but scales='dynamic' computes them per token.",
                fix="use scales='static' with that calibration, or drop calibration= for dynamic scales.",
            )
        head_dim = ctx.adapter.kv_layout(ctx.model).head_dim
        group = config.group_size or head_dim
        if config.scales == "dynamic" and (head_dim % group or (name == "int4-kv" and group % 2)):
            raise ConfigError(
                f"group_size={group} does not split head_dim={head_dim} into whole (even, for int4) groups.",
                fix=f"use a divisor of {head_dim}, e.g. group_size={head_dim}.",
            )
        aligned = "ptq-align" in ctx.before
        if aligned and (config.calibration == "percentile" or config.rotary_envelope):
            raise ConfigError(
                f"ptq-align already fixed the K/V ranges that {name!r} uses, so its percentile / rotary_envelope "
                "settings would be ignored.",
                fix="set method='percentile' / rotary_envelope=True on ptq-align instead, or drop ptq-align.",
            )

    return check


def _kinds(model: nn.Module, adapter: Any) -> dict[int, str]:
    layout = adapter.kv_layout(model)
    kinds = {i: "self" for i in layout.self_attention_layers}
    kinds.update({b.decoder_index: "cross" for b in adapter.cross_attention_blocks(model) if b.kv_cached})
    return kinds


def _state(model: nn.Module, adapter: Any, fmt: str, config: KVCacheConfig) -> Any:
    from mmsdk.plugins.quantizers.kv_runtime import KVQuantState, LayerRanges

    layout = adapter.kv_layout(model)
    state = KVQuantState(
        fmt=fmt,
        scales=config.scales,
        num_layers=layout.num_layers,
        head_dim=layout.head_dim,
        group_size=config.group_size or layout.head_dim,
        residual_length=config.residual_length,
        key_granularity=config.key_granularity,
        value_granularity=config.value_granularity,
        cross_attention=config.cross_attention,
        exact_prefill=config.prefill_attention == "exact",
    )
    state.layers = {i: LayerRanges(kind) for i, kind in _kinds(model, adapter).items()}
    return state


def _aligned_ranges(context: PassContext, heads: int, head_dim: int) -> dict[int, Any] | None:
    from mmsdk.plugins.quantizers.kv_runtime import LayerRanges

    result = context.previous_result("ptq-align")
    record = (result.records.get("calibration") or {}).get("kv_ranges") if result is not None else None
    if not record:
        return None
    shape = (heads, head_dim)
    return {
        (entry["layer"] if entry["kind"] != "recomputed" else -1 - entry["layer"]): LayerRanges(
            entry["kind"], torch.tensor(entry["k_amax"]).reshape(shape), torch.tensor(entry["v_amax"]).reshape(shape)
        )
        for entry in record["layers"]
    }


def _calibrate(model: nn.Module, config: KVCacheConfig, context: PassContext, state: Any, name: str) -> dict[str, Any]:
    from mmsdk.plugins.quantizers.calibration_stats import collect_statistics
    from mmsdk.plugins.quantizers.kv_calibration import learn_ranges_ste, ranges_from_stats

    calib = context.require_calibration(name)
    layout = context.adapter.kv_layout(model)
    ranges = _aligned_ranges(context, layout.num_kv_heads, layout.head_dim)
    method = "minmax" if config.calibration == "ste" else config.calibration
    if ranges is None:
        stats = collect_statistics(
            model,
            context.adapter,
            calib,
            context.processor,
            kv=True,
            max_rows=config.max_rows,
            description=f"{name}: K/V ranges",
        )
        ranges = {
            i: ranges_from_stats(s, method, config.percentile, config.rotary_envelope) for i, s in stats.kv.items()
        }
    for index, layer_ranges in ranges.items():
        if index >= 0:
            state.layers[index] = layer_ranges
        else:
            state.recomputed[-1 - index] = layer_ranges
    info: dict[str, Any] = {"calibration_set": calib.name, "samples": len(calib)}
    if config.calibration == "ste":
        info["ste"] = learn_ranges_ste(
            model, context.adapter, calib, context.processor, state, steps=config.ste_steps, lr=config.ste_lr
        )
    return info


def _kv_record(state: Any, config: KVCacheConfig, heads: int) -> dict[str, Any]:
    def flat(t: torch.Tensor | None) -> list[float]:
        return [] if t is None else [float(v) for v in t.reshape(-1)]

    entries = [(i, r) for i, r in sorted(state.layers.items()) if r.k_amax is not None]
    entries += [(i, r) for i, r in sorted(state.recomputed.items()) if r.k_amax is not None]
    return {
        "format": state.fmt,
        "scales": state.scales,
        "method": config.calibration,
        "key_granularity": config.key_granularity,
        "value_granularity": config.value_granularity,
        "prefill_attention": config.prefill_attention,
        "num_kv_heads": heads,
        "head_dim": state.head_dim,
        "layers": [
            {"layer": i, "kind": r.kind, "k_amax": flat(r.k_amax), "v_amax": flat(r.v_amax)} for i, r in entries
        ],
    }


def _apply(name: str, fmt: str) -> Any:
    def apply(model: nn.Module, config: KVCacheConfig, context: PassContext) -> dict[str, Any]:
        from mmsdk.plugins.quantizers.kv_runtime import install

        state = _state(model, context.adapter, fmt, config)
        info = _calibrate(model, config, context, state, name) if config.scales == "static" else {}
        install(model, state, context.adapter)
        layout = context.adapter.kv_layout(model)
        calibration = {k: v for k, v in info.items() if k in ("calibration_set", "samples")}
        calibration["kv_cache"] = _kv_record(state, config, layout.num_kv_heads)
        records: dict[str, Any] = {"format": fmt, "scales": config.scales, "calibration": calibration}
        if "ste" in info:
            records["ste"] = info["ste"]
        return records

    return apply


def _restore(fmt: str) -> Any:
    def restore(model: nn.Module, config: KVCacheConfig, records: Mapping[str, Any], context: PassContext) -> None:
        from mmsdk.plugins.quantizers.kv_runtime import LayerRanges, install

        state = _state(model, context.adapter, fmt, config)
        kv = (records.get("calibration") or {}).get("kv_cache") or {}
        shape = (kv.get("num_kv_heads", 1), state.head_dim)
        for entry in kv.get("layers", []):
            ranges = LayerRanges(
                entry["kind"],
                torch.tensor(entry["k_amax"]).reshape(shape),
                torch.tensor(entry["v_amax"]).reshape(shape),
            )
            target = state.recomputed if entry["kind"] == "recomputed" else state.layers
            target[entry["layer"]] = ranges
        install(model, state, context.adapter)

    return restore


@mmsdk.hookimpl
def mmsdk_register_quantizers(register: Registrar[PassSpec]) -> None:
    summaries = {
        "int4-kv": "4-bit KV cache (static calibrated scales for ONNX Runtime GQA, or dynamic per-token groups)",
        "int8-kv": "8-bit integer KV cache (ONNX Runtime GQA, TensorRT-LLM INT8)",
        "fp8-kv": "float8 e4m3 KV cache (TensorRT-LLM FP8, ONNX Runtime GQA on CUDA)",
    }
    for name, (fmt, config_cls) in KV_FORMATS.items():
        register(
            PassSpec(
                name=name,
                config_cls=config_cls,
                apply=_apply(name, fmt),
                summary=summaries[name],
                check=_check(name),
                restore=_restore(fmt),
                exclusive_group="kv-cache",
                needs_calibration=_wants_calibration,
                # the fast path's packed static cache: same tokens as transformers' loop (tests/test_fast_generate.py)
                fast_generate=True,
            )
        )
