"""``ptq-align``: one calibration on real multimodal prompts, the same ranges on both export paths.

It runs the CalibrationSet through the model once (the vision features are cached in the set, so
later passes never re-trace the vision tower) and records, in the calibration record's schema
(:mod:`mmsdk.plugins.quantizers.calibration_record`): per-layer K/V ranges per (KV head, channel),
K after RoPE, and the input range of every linear layer. KV-cache passes applied after it take
these ranges instead of measuring their own; ``Optimizer.export`` writes them into
``Manifest.calibration``, where the ONNX Runtime exporter (GQA ``k_scale``/``v_scale``, QDQ scales)
and the TensorRT-LLM exporter (``kv_cache_scaling_factor``, ``k_scale``/``v_scale``, AWQ pre-quant
scales) read exactly the same numbers through ``to_onnxruntime`` / ``to_tensorrt_llm``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from torch import nn

import mmsdk
from mmsdk.core.config import PassConfig
from mmsdk.core.passes import PassContext, PassSpec
from mmsdk.core.registry import Registrar

__all__ = ["PTQAlignConfig", "apply_ptq_align"]


class PTQAlignConfig(PassConfig):
    """What ptq-align measures and how K/V ranges are taken."""

    kv: bool = Field(True, description="Measure K/V ranges of every cache layer (and recomputed cross K/V).")
    linears: Literal["none", "language_model", "all"] = Field(
        "language_model", description="Whose linear-input ranges to record (QDQ activation scales, AWQ statistics)."
    )
    method: Literal["minmax", "percentile"] = Field("minmax", description="K/V range: max |x| or a percentile of |x|.")
    percentile: float = Field(99.99, gt=50.0, le=100.0, description="Percentile of |x| for method='percentile'.")
    rotary_envelope: bool = Field(False, description="Range K by the norm of each RoPE channel pair.")
    max_rows: int = Field(2048, ge=16, description="Tokens sampled per layer for percentiles.")


def _linears(model: nn.Module, adapter: Any, which: str) -> dict[str, nn.Module]:
    from mmsdk.plugins.quantizers.int4_linear import Int4Linear

    if which == "none":
        return {}
    owner = adapter.component_map(model)
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, Int4Linear)) and (which == "all" or owner.get(name) == "language_model")
    }


def _kv_section(stats: Any, config: PTQAlignConfig, adapter: Any, model: nn.Module) -> dict[str, Any]:
    from mmsdk.plugins.quantizers.kv_calibration import ranges_from_stats

    layout = adapter.kv_layout(model)
    layers = []
    for index in sorted(stats.kv, key=lambda i: (i < 0, abs(i))):
        ranges = ranges_from_stats(stats.kv[index], config.method, config.percentile, config.rotary_envelope)
        layers.append(
            {
                "layer": index if index >= 0 else -1 - index,
                "kind": ranges.kind,
                "k_amax": [float(v) for v in ranges.k_amax.reshape(-1)],
                "v_amax": [float(v) for v in ranges.v_amax.reshape(-1)],
            }
        )
    return {
        "format": None,
        "scales": "static",
        "method": config.method,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "layers": layers,
    }


def apply_ptq_align(model: nn.Module, config: PTQAlignConfig, context: PassContext) -> dict[str, Any]:
    """Measure every range once; the model itself is not changed."""
    from mmsdk.plugins.quantizers.calibration_stats import collect_statistics

    calib = context.require_calibration("ptq-align")
    linears = _linears(model, context.adapter, config.linears)
    stats = collect_statistics(
        model,
        context.adapter,
        calib,
        context.processor,
        linears=linears,
        kv=config.kv,
        max_rows=config.max_rows,
        description="ptq-align: measuring ranges",
    )
    ranges = {
        name: {
            "abs_max": float(s.abs_max.max()),
            "minimum": s.minimum,
            "maximum": s.maximum,
            "channel_abs_mean": [float(v) for v in s.abs_mean],
            "channel_abs_max": [float(v) for v in s.abs_max],
        }
        for name, s in stats.linears.items()
    }
    calibration: dict[str, Any] = {"calibration_set": calib.name, "samples": len(calib), "ranges": ranges}
    if config.kv:
        calibration["kv_ranges"] = _kv_section(stats, config, context.adapter, model)
    unseen = sorted(set(linears) - set(stats.linears))
    return {"calibration": calibration, "linears_never_called": unseen}


def restore_ptq_align(model: nn.Module, config: PTQAlignConfig, records: Any, context: PassContext) -> None:
    """Nothing to rebuild: ptq-align only measures (its ranges live in the manifest)."""


@mmsdk.hookimpl
def mmsdk_register_quantizers(register: Registrar[PassSpec]) -> None:
    register(
        PassSpec(
            name="ptq-align",
            config_cls=PTQAlignConfig,
            apply=apply_ptq_align,
            restore=restore_ptq_align,
            summary="one calibration on image+text prompts: K/V and linear-input ranges for ORT and TensorRT-LLM alike",
            fast_generate=True,  # tests/test_fast_generate.py: same tokens as transformers' loop
            needs_calibration=True,
        )
    )
