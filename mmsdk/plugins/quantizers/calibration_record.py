"""The calibration record: one schema for every range mmsdk's quantizers measured, and its per-target forms.

Passes put sections of it into ``PassResult.records["calibration"]``; ``Optimizer.export`` merges
them (a later section of the same name replaces an earlier one) into ``Manifest.calibration``.
The record stores **ranges** (absolute maxima), never a format's scale, so one calibration serves
every target: :func:`to_onnxruntime` and :func:`to_tensorrt_llm` turn the same numbers into
ONNX Runtime's GroupQueryAttention ``k_scale``/``v_scale`` (and QDQ activation scales) and
TensorRT-LLM's ``kv_cache_scaling_factor``/``k_scale``/``v_scale`` and AWQ pre-quant scales.
Scale formulas: ``amax / 7`` (int4), ``amax / 127`` (int8), ``amax / 448`` (fp8 e4m3); a zero
range gives scale 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmsdk.core.errors import ExportError

__all__ = [
    "QMAX",
    "AWQRecord",
    "CalibrationRecord",
    "KVLayerRecord",
    "KVRecord",
    "LinearRangeRecord",
    "scale_from_amax",
    "to_onnxruntime",
    "to_tensorrt_llm",
]

KVFormat = Literal["int4", "int8", "fp8"]
QMAX: dict[str, float] = {"int4": 7.0, "int8": 127.0, "fp8": 448.0}


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KVLayerRecord(_Record):
    """Ranges of one cache layer: per (KV head, channel), head-major, ``num_kv_heads * head_dim`` values."""

    layer: int = Field(
        description="Cache layer index (decoder layer); for recomputed cross-attention, the block index."
    )
    kind: Literal["self", "cross", "recomputed"] = Field(
        description="self-attention; cross-attention K/V kept in the Cache (Mllama); or recomputed each step (IDEFICS)."
    )
    k_amax: list[float] = Field(description="|K| max per channel, K taken after RoPE.")
    v_amax: list[float] = Field(description="|V| max per channel.")


class KVRecord(_Record):
    """KV-cache ranges: those a KV pass quantizes with, or (``format`` None) those ptq-align measured."""

    format: KVFormat | None = None
    scales: Literal["static", "dynamic"] = "static"
    method: Literal["minmax", "percentile", "ste"] = "minmax"
    key_granularity: Literal["channel", "tensor"] = "channel"
    value_granularity: Literal["channel", "tensor"] = "channel"
    prefill_attention: Literal["quantized", "exact"] = Field(
        "quantized", description="Whether torch attended a forward's own tokens quantized (as ORT GQA does) or exactly."
    )
    num_kv_heads: int
    head_dim: int
    layers: list[KVLayerRecord] = Field(default_factory=list)


class LinearRangeRecord(_Record):
    """The input range of one linear layer (QDQ activation scales, AWQ statistics)."""

    abs_max: float
    minimum: float
    maximum: float
    channel_abs_mean: list[float]
    channel_abs_max: list[float]


class AWQRecord(_Record):
    """AWQ's choice per linear: ``prequant[name]`` multiplies the input (``1 / s``); the weight holds ``W * s``."""

    group_size: int
    symmetric: bool
    prequant: dict[str, list[float]] = Field(default_factory=dict)
    ratios: dict[str, float] = Field(default_factory=dict, description="Chosen exponent per group of linears.")


class CalibrationRecord(_Record):
    """Everything calibration measured, as written into ``Manifest.calibration``."""

    schema_version: Literal[1] = 1
    calibration_set: str | None = None
    samples: int | None = None
    ranges: dict[str, LinearRangeRecord] = Field(
        default_factory=dict, description="Linear-input ranges by module name."
    )
    kv_ranges: KVRecord | None = Field(None, description="K/V ranges measured by ptq-align.")
    kv_cache: KVRecord | None = Field(None, description="K/V ranges the KV-cache pass quantizes with.")
    awq: AWQRecord | None = None

    @classmethod
    def from_manifest(cls, data: Mapping[str, Any] | None) -> CalibrationRecord | None:
        """Parse ``Manifest.calibration`` (None stays None)."""
        return None if data is None else cls.model_validate(dict(data))

    def kv(self) -> KVRecord | None:
        """The KV ranges exporters should use: the KV pass's if one ran, else ptq-align's."""
        return self.kv_cache or self.kv_ranges


def scale_from_amax(amax: float, fmt: str) -> float:
    """The dequantization scale of a symmetric ``fmt`` quantizer for range ``amax`` (1.0 for a zero range)."""
    return amax / QMAX[fmt] if amax > 0 else 1.0


def _per_tensor(values: list[float]) -> float:
    return max((abs(v) for v in values), default=0.0)


def _kv_for_export(record: CalibrationRecord, target: str) -> KVRecord | None:
    kv = record.kv()
    if kv is not None and kv.scales == "dynamic":
        raise ExportError(
            f"the KV cache uses dynamic per-token scales, which only the torch backend runs; {target} needs "
            "static scales.",
            fix="apply the KV pass with scales='static' (calibrated) to export it, or export to 'torch'.",
        )
    return kv


def to_onnxruntime(record: CalibrationRecord, fmt: KVFormat | None = None) -> dict[str, Any]:
    """GroupQueryAttention quantized-KV attributes and scales, plus QDQ scales of every linear input.

    Per-channel scales are flat ``[kv_heads * head_dim]`` float32 lists (the shape ORT GenAI emits);
    per-tensor ones have one value. Only self-attention layers: ORT's cross-attention op
    (MultiHeadAttention) has no quantized cache. Without K/V ranges only ``qdq`` is returned.
    """
    out: dict[str, Any] = {
        "qdq": {
            name: {"scale": scale_from_amax(r.abs_max, "int8"), "zero_point": 0} for name, r in record.ranges.items()
        }
    }
    kv = _kv_for_export(record, "ONNX Runtime")
    if kv is None:
        return out
    fmt = fmt or kv.format or "int8"
    k_scale, v_scale = {}, {}
    for layer in kv.layers:
        if layer.kind != "self":
            continue
        k_values = layer.k_amax if kv.key_granularity == "channel" else [_per_tensor(layer.k_amax)]
        v_values = layer.v_amax if kv.value_granularity == "channel" else [_per_tensor(layer.v_amax)]
        k_scale[layer.layer] = [scale_from_amax(a, fmt) for a in k_values]
        v_scale[layer.layer] = [scale_from_amax(a, fmt) for a in v_values]
    out.update(
        kv_cache_bit_width=4 if fmt == "int4" else 8,
        cache_dtype={"int4": "uint8", "int8": "int8", "fp8": "float8e4m3fn"}[fmt],
        k_quant_type="PER_CHANNEL" if kv.key_granularity == "channel" else "PER_TENSOR",
        v_quant_type="PER_CHANNEL" if kv.value_granularity == "channel" else "PER_TENSOR",
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return out


def _trt_kv_format(fmt: str, int4_fallback: str) -> str:
    if fmt != "int4":
        return fmt
    if int4_fallback == "error":
        raise ExportError(
            "TensorRT-LLM has no INT4 KV cache (its KV formats are INT8, FP8 and NVFP4).",
            fix="apply int8-kv or fp8-kv for this target, or pass int4_fallback='int8' (or 'fp8') to requantize "
            "the cache from the same calibrated ranges.",
        )
    return int4_fallback


def to_tensorrt_llm(
    record: CalibrationRecord, fmt: KVFormat | None = None, *, int4_fallback: Literal["error", "int8", "fp8"] = "error"
) -> dict[str, Any]:
    """TensorRT-LLM KV scales (one scalar per layer) and AWQ pre-quant scales.

    TensorRT-LLM has no INT4 KV cache: an int4 record is refused unless ``int4_fallback`` names
    the 8-bit format to requantize to from the same ranges (an explicit, documented opt-in).
    """
    out: dict[str, Any] = {}
    kv = _kv_for_export(record, "TensorRT-LLM")
    if kv is not None:
        fmt = _trt_kv_format(fmt or kv.format or "int8", int4_fallback)
        layers = {}
        for layer in kv.layers:
            if layer.kind == "recomputed":  # not a cache layer (IDEFICS), which TensorRT-LLM does not run
                continue
            k_amax, v_amax = _per_tensor(layer.k_amax), _per_tensor(layer.v_amax)
            layers[layer.layer] = {
                "kind": layer.kind,
                "kv_cache_scaling_factor": scale_from_amax(max(k_amax, v_amax), fmt),
                "k_scale": scale_from_amax(k_amax, fmt),
                "v_scale": scale_from_amax(v_amax, fmt),
            }
        out.update(kv_cache_quant_algo=fmt.upper(), layers=layers)
    if record.awq is not None:
        out["awq"] = {
            "quant_algo": "W4A16_AWQ",
            "group_size": record.awq.group_size,
            "has_zero_point": not record.awq.symmetric,
            "pre_quant_scale": dict(record.awq.prequant),
        }
    return out
