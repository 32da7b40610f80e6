"""An RMSNorm folded into the W4A16 GEMV that reads its output: ``rms_norm(x) @ W.T`` in one launch.

A decode step's RMSNorm is a launch of its own between two GEMVs, about 2.9 µs of an H200 step each (65 of them in a
Llama-7B step: 186 µs of 1.97 ms, benchmarks/results/h200_decode_reuse_quad_loop.json), nearly all of it launch gap
and one dependent round trip. The product is linear in the norm's scale, so the GEMV can read the norm's input
instead: ``W @ (w * x * r) = r * (W @ (w * x))`` with ``r = 1 / sqrt(mean(x**2) + eps)`` a scalar per row. The
batch-1 "quad" kernels multiply each activation by ``w`` in the K loop (folded into the per-channel factor they
multiply by anyway, :func:`quad_factors`) and scale the finished sums by ``r``, which they compute from the row
after the loop. Every other kernel (several rows, prefill) gets the normalized input from the norm kernel first
(:meth:`InputNorm.normalize`): the same launches as without the fold.

Rounding: the reference rounds ``x * r`` and then ``w * that`` to the model dtype before the GEMV; the folded kernel
does not round there (its products are exact in fp32), so outputs differ from the unfolded path by about one
rounding of the activations, averaged over K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NIBBLE_FACTORS", "InputNorm", "norm_arguments", "quad_factors"]

# The factor the quad kernels multiply channel k's activation by, per k % 8: 2**(85 - P) for the bit position P at
# which they read that nibble (mmsdk/kernels/_gemv_quad_triton.py, nibble_factor; nibbles 6 and 7 are shifted down).
NIBBLE_FACTORS = (2.0**85, 2.0**81, 2.0**77, 2.0**73, 2.0**69, 2.0**65, 2.0**81, 2.0**85)


def quad_factors(weight: torch.Tensor, prequant: torch.Tensor | None = None) -> torch.Tensor:
    """``[K]``: the norm's ``weight`` (times an AWQ ``prequant``, which multiplies the normalized input) times each
    channel's nibble factor, exact. bf16 for a bf16 weight without pre-scale (a power of two times a bf16 value is
    one; the kernels load half the bytes), else fp32 (a product of two 16-bit floats has at most 16 significant
    bits; fp16 cannot hold the factors)."""
    factors = weight.detach().float()
    if prequant is not None:
        factors = factors * prequant.detach().float()
    pattern = torch.tensor(NIBBLE_FACTORS, dtype=torch.float32, device=weight.device)
    factors = factors * pattern.repeat(-(-factors.shape[0] // 8))[: factors.shape[0]]
    compact = weight.dtype == torch.bfloat16 and prequant is None
    return (factors.to(torch.bfloat16) if compact else factors).contiguous()


@dataclass(frozen=True)
class InputNorm:
    """The RMSNorm a GEMV applies to its own input: ``(weight * rms_norm(x)) * prequant``, then the product.

    ``factors`` is :func:`quad_factors` of ``weight`` and ``prequant``, kept by the module that owns the GEMV.
    """

    weight: torch.Tensor
    eps: float
    factors: torch.Tensor
    prequant: torch.Tensor | None = None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The normalized input, for kernels that do not fold the norm (one norm kernel on CUDA; rounded as the
        unfolded model rounds it)."""
        from mmsdk.kernels.norm_rope_gpu import rms_norm

        out = rms_norm(x, self.weight, self.eps)
        return out if self.prequant is None else out * self.prequant.to(out.dtype)


def norm_arguments(norm: InputNorm | None, x: torch.Tensor, warps: int, whole_row: bool) -> dict[str, Any]:
    """The quad kernels' arguments for a folded norm (none without one): its factors and epsilon, whether a program's
    K slice is the whole row (``whole_row``: the K loop sums the squares), else how many channels the row is read in
    per pass after it (at most 32 per thread, so K = 4096 takes one pass at 4 warps)."""
    if norm is None:
        return {}
    factors = norm.factors
    if factors.shape != (x.shape[1],) or factors.dtype not in (torch.float32, torch.bfloat16) or \
            factors.device != x.device:
        raise ValueError(f"a folded norm's factors must be fp32 or bf16 [{x.shape[1]}] on {x.device}, one per input "
                         f"channel (got {factors.dtype} {tuple(factors.shape)} on {factors.device}): build them with "
                         "mmsdk.kernels.norm_fold.quad_factors.")
    import triton

    return dict(f_ptr=factors, eps=float(norm.eps), NORM=True, WHOLE_ROW=whole_row,
                NORM_BLOCK=min(triton.next_power_of_2(x.shape[1]), 1024 * warps))
