"""Torch reference ops for the fused normalization and rotary modules (bit-exact with transformers' math).

These are what ``rmsnorm-rope-fusion`` runs on CPU and what GPU kernels must reproduce:

* ``add_rms_norm``: residual add + RMSNorm in one op (ORT ``SkipSimplifiedLayerNormalization``).
* ``rope_qk``: rotate q and k together with the same cos/sin (ORT ``RotaryEmbedding``; for M-RoPE
  the cos/sin already hold the T/H/W sections, ORT ``MRotaryEmbedding`` builds them itself).
* ``rms_norm_rope_qk``: per-head RMSNorm of q and k followed by RoPE, as Qwen3 models chain them.
* ``mrope_cos_sin``: M-RoPE cos/sin for 3-D positions, choosing each frequency slot's position
  stream before the trigonometry (transformers computes all three streams, then selects).
"""

from __future__ import annotations

import torch

__all__ = ["add_rms_norm", "mrope_cos_sin", "mrope_streams", "rms_norm", "rms_norm_rope_qk", "rope_qk", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[-x2, x1] for the two halves of the last dimension (the non-interleaved RoPE layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)``, accumulated in fp32, cast back before the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the sum is the next residual."""
    total = residual + x
    return rms_norm(total, weight, eps), total


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, H, L, D] and k [B, Hkv, L, D] by cos/sin [B, L, D] (broadcast over heads)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def rms_norm_rope_qk(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: tuple[float, float],
    cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (over the head dimension) then RoPE, in one op."""
    return rope_qk(rms_norm(q, q_weight, eps[0]), rms_norm(k, k_weight, eps[1]), cos, sin)


def mrope_streams(section: list[int]) -> list[int]:
    """Qwen2-VL's sectioned layout: frequency slot -> position stream (0 = T, 1 = H, 2 = W)."""
    return [i % 3 for i, n in enumerate(section) for _ in range(n)]


def mrope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, streams: list[int] | torch.Tensor,
                  scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, L, 2 * len(streams)] for 3-D positions [3, B, L]; ``streams[j]`` feeds frequency slot j.

    ``streams`` may be a tensor already on the positions' device (no host-to-device copy per call, which
    a CUDA-graph capture would refuse).
    """
    stream = torch.as_tensor(streams, dtype=torch.long, device=position_ids.device)
    picked = position_ids[stream]  # [slots, B, L]: each slot's own stream
    freqs = picked.permute(1, 2, 0).float() * inv_freq.to(position_ids.device, torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
