"""The decoder's self-attention KV cache as GroupQueryAttention stores it: float, INT8 or INT4."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

import numpy as np

from mmsdk.plugins.backends.onnxruntime.graph import FLOAT

__all__ = ["KVQuant", "cache_type", "cache_last_dim"]

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
