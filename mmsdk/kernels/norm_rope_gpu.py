"""Fused RMSNorm / RoPE ops that run one Triton kernel on CUDA and the torch reference elsewhere.

Each function has the signature and results of its reference in :mod:`mmsdk.kernels.norm_rope`.
The Triton path runs for CUDA tensors (or under Triton's interpreter) in bf16 / fp16 / fp32 with a
contiguous last dimension, when no input needs a gradient (the kernels have no backward); anything
else runs the reference op, and the ``mmsdk.kernels`` log says so once per reason.

* :func:`add_rms_norm`: one pass over a row reads x and the residual, writes their sum and the
  normalized sum (three tensors of traffic instead of the reference's eight).
* :func:`rope_qk` / :func:`rms_norm_rope_qk`: each program rotates a block of one token's q or k heads with
  that token's cos/sin row, optionally after a per-head RMSNorm (:func:`rope_tile` sizes the blocks).
* :func:`mrope_cos_sin`: M-RoPE tables, each frequency slot reading its own position stream.
"""

from __future__ import annotations

from typing import Any

import torch

from mmsdk.kernels import norm_rope as ref
from mmsdk.kernels import note_fallback, pdl_ready, triton_ready

__all__ = ["add_rms_norm", "mrope_cos_sin", "rms_norm", "rms_norm_rope_qk", "rope_qk"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _reason(*tensors: torch.Tensor) -> str | None:
    if not triton_ready(*tensors):
        return "not CUDA tensors on one device, or no Triton"
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return "an input needs a gradient (the kernels have no backward)"
    if any(t.dtype not in DTYPES for t in tensors):
        return f"dtypes {sorted({str(t.dtype) for t in tensors})} (bfloat16, float16, float32 are supported)"
    return None


def _kernels() -> Any:
    from mmsdk.kernels import _norm_rope_triton

    return _norm_rope_triton


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, H] without a copy where its layout allows."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> Any:
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, device=x.device, dtype=out_dtype)
    total = torch.empty_like(x2) if residual is not None else x2
    hidden = x2.shape[1]
    warps = 4 if hidden <= 2048 else 8
    _kernels().add_rms_norm[(x2.shape[0],)](
        x2, r2, weight, out, total, hidden, x2.stride(0), r2.stride(0), out.stride(0), total.stride(0), float(eps),
        HAS_RES=residual is not None, BLOCK_H=_pow2(hidden), PDL=pdl_ready(x), num_warps=warps, enable_fp_fusion=True,
    )
    return out.view(x.shape), total.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` (one kernel on CUDA)."""
    reason = _reason(x, weight)
    if reason is not None:
        note_fallback("rms_norm", reason)
        return ref.rms_norm(x, weight, eps)
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in one kernel on CUDA."""
    reason = _reason(x, residual, weight)
    if reason is None and (x.shape != residual.shape or x.dtype != residual.dtype):
        reason = "x and residual differ in shape or dtype"
    if reason is not None:
        note_fallback("add_rms_norm", reason)
        return ref.add_rms_norm(x, residual, weight, eps)
    return _norm(x, residual, weight, eps)


def _bhl(x: torch.Tensor, unsqueeze_dim: int) -> tuple[int, int, int, int, int, int]:
    """(heads, length) and the (batch, head, token) strides of a [B, H, L, D] or [B, L, H, D] tensor."""
    if unsqueeze_dim == 1:
        return x.shape[1], x.shape[2], x.stride(0), x.stride(1), x.stride(2), 0
    return x.shape[2], x.shape[1], x.stride(0), x.stride(2), x.stride(1), 0


ROPE_MIN_PROGRAMS = 264  # about two per multiprocessor on an H100/H200: below this, RoPE takes smaller head blocks


def _head_blocks(q_heads: int, k_heads: int, block: int) -> int:
    """Programs per token of the RoPE kernel: q's blocks of ``block`` heads, then k's."""
    return -(-q_heads // block) + -(-k_heads // block)


def rope_tile(tokens: int, q_heads: int, k_heads: int, half: int) -> tuple[int, int]:
    """(heads per program, warps) of the RoPE kernel for ``tokens`` tokens of ``q_heads`` + ``k_heads`` heads.

    Up to 2048 values of a half-row tile per program (4 warps); where fewer than ``ROPE_MIN_PROGRAMS`` programs
    would run, 1024 values. Measured on an H200 (benchmarks/gpu_kernel_sweeps.py rope, 32 + 32 heads of 128): at 16
    tokens 16 heads per program (4 warps) ran 1.86 µs against 2.00 for 32 and 2.3-2.4 for 4-8; at one token 16, 2
    and 1 heads ran 1.64-1.67 µs (launch-bound), 4-8 heads 2.1-2.2 and 32 heads 1.78-1.82; at 4096 tokens 32 heads
    ran 36.5 µs against 38.8 for 16.
    """
    block_d2 = _pow2(half)
    block = max(1, min(_pow2(max(q_heads, k_heads)), 2048 // block_d2))
    while block > 1 and block * block_d2 > 1024 and tokens * _head_blocks(q_heads, k_heads, block) < ROPE_MIN_PROGRAMS:
        block //= 2
    return block, max(1, min(4, block * block_d2 // 256))


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
          weights: tuple[torch.Tensor, torch.Tensor] | None, eps: tuple[float, float],
          tile: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
    batch, dim = q.shape[0], q.shape[-1]
    hq, length, sqb, sqh, sql, _ = _bhl(q, unsqueeze_dim)
    hk, _, skb, skh, skl, _ = _bhl(k, unsqueeze_dim)
    cos = cos.expand(batch, length, dim)
    sin = sin.expand(batch, length, dim)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _, _, oqb, oqh, oql, _ = _bhl(q_out, unsqueeze_dim)
    _, _, okb, okh, okl, _ = _bhl(k_out, unsqueeze_dim)
    qw, kw = weights if weights is not None else (cos, cos)
    block_heads, warps = tile or rope_tile(batch * length, hq, hk, dim // 2)
    _kernels().rope_qk[(batch * length, _head_blocks(hq, hk, block_heads))](
        q, k, q_out, k_out, cos, sin, qw, kw, length, hq, hk, dim // 2, dim,
        sqb, sqh, sql, skb, skh, skl, oqb, oqh, oql, okb, okh, okl, cos.stride(0), cos.stride(1),
        float(eps[0]), float(eps[1]),
        NORM=weights is not None, BLOCK_HEADS=block_heads, BLOCK_D2=_pow2(dim // 2), num_warps=warps,
        enable_fp_fusion=True,
    )
    return q_out, k_out


def _rope_reason(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int, *weights: torch.Tensor) -> str | None:
    reason = _reason(q, k, cos, sin, *weights)
    if reason is not None:
        return reason
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or unsqueeze_dim not in (1, 2) or q.shape[-1] % 2:
        return "shapes other than q/k [B, H, L, D] (or [B, L, H, D]) with cos/sin [B, L, D] and even D"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.shape[-1] != q.shape[-1] or len({q.dtype, k.dtype}) > 1:
        return "q/k with a strided last dimension, different dtypes, or partial rotary dimensions"
    return None


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by cos/sin (one kernel on CUDA for both)."""
    reason = _rope_reason(q, k, cos, sin, unsqueeze_dim)
    if reason is not None:
        note_fallback("rope_qk", reason)
        return ref.rope_qk(q, k, cos, sin, unsqueeze_dim)
    return _rope(q, k, cos, sin, unsqueeze_dim, None, (0.0, 0.0))  # type: ignore[return-value]


def rms_norm_rope_qk(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: tuple[float, float], cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, then RoPE (one kernel on CUDA)."""
    reason = _rope_reason(q, k, cos, sin, 1, q_weight, k_weight)
    if reason is None and (q_weight.dtype != q.dtype or k_weight.dtype != k.dtype):
        reason = "norm weights in another dtype than q/k"
    if reason is not None:
        note_fallback("rms_norm_rope_qk", reason)
        return ref.rms_norm_rope_qk(q, k, q_weight, k_weight, eps, cos, sin)
    return _rope(q, k, cos, sin, 1, (q_weight, k_weight), eps)  # type: ignore[return-value]


def mrope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, streams: list[int] | torch.Tensor,
                  scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE cos/sin [B, L, 2 * len(streams)] for positions [3, B, L] (one kernel on CUDA).

    Pass ``streams`` as a device tensor where the call may be captured in a CUDA graph: a list is copied
    to the device on every call, and a capture refuses host-to-device copies.
    """
    # positions are integers: checked for the device only (a cast to float would be a kernel launch per call)
    reason = "not CUDA tensors on one device, or no Triton"
    if triton_ready(position_ids, inv_freq):
        reason = _reason(inv_freq)
    if reason is None and (dtype not in DTYPES or inv_freq.numel() != len(streams)):
        reason = f"dtype {dtype} or {inv_freq.numel()} frequencies for {len(streams)} stream slots"
    if reason is not None:
        note_fallback("mrope_cos_sin", reason)
        return ref.mrope_cos_sin(position_ids, inv_freq, streams, scaling, dtype)
    _, batch, length = position_ids.shape
    pos = position_ids.contiguous()
    half = len(streams)
    stream = torch.as_tensor(streams, dtype=torch.int32, device=pos.device)  # no copy for an int32 device buffer
    cos = torch.empty(batch, length, 2 * half, device=pos.device, dtype=dtype)
    sin = torch.empty_like(cos)
    _kernels().mrope_cos_sin[(batch * length,)](
        pos, inv_freq.float().contiguous(), stream, cos, sin, batch * length, half, pos.stride(0), float(scaling),
        BLOCK_D2=_pow2(half), num_warps=1, enable_fp_fusion=True,
    )
    return cos, sin
