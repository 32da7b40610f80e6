"""The decoder's self-attention KV cache as GroupQueryAttention stores it: float, INT8 or INT4."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

import numpy as np

from mmsdk.plugins.backends.onnxruntime.graph import FLOAT

__all__ = ["KVQuant", "cache_type", "cache_last_dim", "kv_from_record", "QMAX"]

INT8, UINT8 = 3, 2  # onnx.TensorProto element types


@dataclass(frozen=True)
class KVQuant:
    """Static symmetric KV quantization: ``q = clamp(rint(x / scale))``, K quantized after RoPE.

    Scales per self-attention layer (decoder index): shape (1,) per tensor or (kv_heads * head_dim,)
    per channel, as GroupQueryAttention's ``k_scale`` / ``v_scale`` inputs take them.
    """

    bits: Literal[4, 8]
    k_scales: Mapping[int, np.ndarray] = field(default_factory=dict)
    v_scales: Mapping[int, np.ndarray] = field(default_factory=dict)
    source: str = ""

    def quant_type(self, scales: np.ndarray) -> str:
        """GQA's ``k_quant_type`` / ``v_quant_type`` for a scale array."""
        return "PER_TENSOR" if scales.size == 1 else "PER_CHANNEL"


def cache_type(kv: KVQuant | None, float_type: int = FLOAT) -> int:
    """The ONNX element type of past/present tensors."""
    if kv is None:
        return float_type
    return INT8 if kv.bits == 8 else UINT8


def cache_last_dim(kv: KVQuant | None, head_dim: int) -> int:
    """Last axis of past/present: ``head_dim``, or half of it when two INT4 values share a byte."""
    return head_dim // 2 if kv is not None and kv.bits == 4 else head_dim


QMAX = {"int4": 7.0, "int8": 127.0}


def _scales(amax: list[float], granularity: str, qmax: float) -> np.ndarray:
    values = np.abs(np.asarray(amax, dtype=np.float32))
    if granularity == "tensor":
        values = values.max(keepdims=True)
    return np.where(values > 0, values / qmax, 1.0).astype(np.float32)


def kv_from_record(record: Mapping, fmt: str, source: str) -> tuple[KVQuant, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """GQA scales from a calibration record's KV section (the ``kv_cache`` / ``kv_ranges`` JSON form).

    Ranges are |x| maxima per (KV head, channel); the scale is ``amax / 7`` (int4) or ``amax / 127``
    (int8), one per channel or, for ``tensor`` granularity, one per layer: the numbers the
    TensorRT-LLM exporter derives from the same record. Returns the self-attention KVQuant and the
    cross-attention (decoder index -> (k, v) scales) ranges for blocks whose K/V the vision graph
    computes (they are quantized and dequantized there, as the torch cache does).
    """
    qmax = QMAX[fmt]
    k_gran, v_gran = record.get("key_granularity", "channel"), record.get("value_granularity", "channel")
    k_scales, v_scales, cross = {}, {}, {}
    for layer in record.get("layers", []):
        k = _scales(layer["k_amax"], k_gran, qmax)
        v = _scales(layer["v_amax"], v_gran, qmax)
        if layer["kind"] == "self":
            k_scales[int(layer["layer"])], v_scales[int(layer["layer"])] = k, v
        else:
            cross[(layer["kind"], int(layer["layer"]))] = (k, v)
    kv = KVQuant(bits=4 if fmt == "int4" else 8, k_scales=k_scales, v_scales=v_scales, source=source)
    return kv, cross
