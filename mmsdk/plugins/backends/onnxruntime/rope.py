"""Rotary position embeddings: cos/sin caches from the model's own ``inv_freq``, fused rotary ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.onnxruntime.ops import MS

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.plugins.backends.onnxruntime.graph import GraphBuilder

__all__ = ["RopeSpec", "rope_spec", "RopeCache", "add_rope_cache", "apply_rope"]


@dataclass(frozen=True)
class RopeSpec:
    """cos/sin tables [max_positions, rotary_dim / 2] (attention scaling folded in) and M-RoPE sections."""

    cos: np.ndarray
    sin: np.ndarray
    sections: tuple[int, ...] | None

    @property
    def max_positions(self) -> int:
        return int(self.cos.shape[0])


def rope_spec(model: nn.Module, adapter: ModelAdapter, max_positions: int, head_dim: int) -> RopeSpec:
    """Tables computed the way transformers does (fp32 ``positions * inv_freq``), for positions < max."""
    import torch

    rotary = adapter.rotary_embedding(model)
    if rotary is None:
        raise ExportError(
            f"{adapter.name}: the adapter names no rotary-embedding module, so the ONNX decoder has no RoPE tables.",
            fix="implement rotary_embedding(model) in the adapter, or use the 'torch' backend.",
        )
    kind = getattr(rotary, "rope_type", "default")
    if kind == "dynamic":
        raise ExportError(
            "dynamic NTK RoPE rescales its frequencies with the sequence length at run time; the ONNX decoder "
            "uses fixed cos/sin tables.",
            fix="export a model with static RoPE scaling (default, linear, llama3, yarn), or use the 'torch' backend.",
        )
    inv_freq = rotary.inv_freq.detach().float().cpu()
    if 2 * inv_freq.numel() != head_dim:
        raise ExportError(
            f"partial rotary embeddings ({2 * inv_freq.numel()} of {head_dim} head dims) are not lowered yet.",
            fix="export to the 'torch' backend for this model.",
        )
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos = (freqs.cos() * scaling).numpy()
    sin = (freqs.sin() * scaling).numpy()
    return RopeSpec(cos, sin, adapter.rope_sections(model))


@dataclass(frozen=True)
class RopeCache:
    """Names of the cos/sin initializers in one graph."""

    cos: str
    sin: str
    sections: tuple[int, ...] | None


def add_rope_cache(g: GraphBuilder, spec: RopeSpec) -> RopeCache:
    """Add the tables once per graph."""
    return RopeCache(g.const("rotary.cos_cache", spec.cos), g.const("rotary.sin_cache", spec.sin), spec.sections)


def apply_rope(g: GraphBuilder, x: str, cache: RopeCache, position_ids: str, num_heads: int, hint: str) -> str:
    """Rotate-half RoPE on ``x`` [B, S, heads * D]: RotaryEmbedding, or MRotaryEmbedding for M-RoPE.

    Positions come from the graph input, so left-padded rows keep transformers' positions.
    """
    if cache.sections is None:
        return g.op("RotaryEmbedding", [x, position_ids, cache.cos, cache.sin], domain=MS, hint=hint,
                    interleaved=0, num_heads=num_heads)
    return g.op("MRotaryEmbedding", [x, position_ids, cache.cos, cache.sin], domain=MS, hint=hint,
                mrope_section=list(cache.sections), num_heads=num_heads)
