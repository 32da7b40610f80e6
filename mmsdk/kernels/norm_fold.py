"""An RMSNorm folded into the W4A16 GEMV that reads its output: ``rms_norm(x) @ W.T`` in one launch.

A decode step's RMSNorm is a launch of its own between two GEMVs, about 2.9 µs of an H200 step each (65 of them in a
Llama-7B step: 186 µs of 1.97 ms, benchmarks/results/h200_decode_reuse_quad_loop.json), nearly all of it launch gap
and one dependent round trip. The product is linear in the norm's scale, so the GEMV can read the norm's input
instead: ``W @ (w * x * r) = r * (W @ (w * x))`` with ``r = 1 / sqrt(mean(x**2) + eps)`` a scalar per row. The
batch-1 "quad" kernels multiply each activation by ``w`` in the K loop (folded into the per-channel factor they
multiply by anyway, :func:`quad_factors`) and scale the finished sums by ``r``, which they compute from the row
after the loop. Kind "idot" normalizes the row in the kernel that rounds its activations (mmsdk.kernels.gemv_idot).
Every other kernel (several rows, prefill) gets the normalized input from the norm kernel first
(:meth:`InputNorm.normalize`): the same launches as without the fold.

The other way round, the kernel that computes a norm's input can leave what the norm's reader needs in its store
(:class:`NormRequest`, :class:`NormStatistics`): ``weight * x`` and partial sums of ``x**2``. The reader's K loop is
then the plain one, and only its finished sums are scaled by ``1 / rms``. A decoder layer's post-attention norm goes
this way (o_proj's store leaves it, the gated MLP's GEMV reads it): folding that norm into the gated GEMV's K loop
cost the loop more than the launch it saved.

Rounding: the reference rounds ``x * r`` and then ``w * that`` to the model dtype before the GEMV; the folded kernel
does not round there (its products are exact in fp32), so outputs differ from the unfolded path by about one
rounding of the activations, averaged over K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NIBBLE_FACTORS", "InputNorm", "NormRequest", "NormStatistics", "norm_arguments", "quad_factors",
           "row_scale_arguments"]

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
    # made on the device (each a fill), not copied from the host: a copy would end a CUDA graph capture that meets
    # this first (mmsdk.kernels.parallel_compile.compile_before_first_call's)
    pattern = torch.stack([torch.full((), factor, dtype=torch.float32, device=weight.device)
                           for factor in NIBBLE_FACTORS])
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


@dataclass
class NormStatistics:
    """What a store left for the RMSNorm that reads its output ``x`` (``[M, N]``): ``scaled = weight * x``, rounded
    to the model dtype, and ``squares`` ``[M, parts]``, fp32 sums of ``x**2`` over disjoint column blocks. Then
    ``rms_norm(x) @ W.T == (scaled @ W.T) / sqrt(squares.sum(1) / N + eps)`` up to roundings (the reference rounds
    ``x * r`` before the weight multiplies it). ``read``: set once a GEMV chose to apply them (one handed them with a
    folded norm may fold the norm instead: mmsdk.kernels.w4a16.w4a16_gemv), so their writer can stop leaving them."""

    scaled: torch.Tensor
    squares: torch.Tensor
    eps: float
    read: bool = False


class NormRequest:
    """Asks the GEMV (or K-slice sum) whose store computes an RMSNorm's input to leave that norm's statistics.

    ``weight`` and ``eps`` are the norm's. A kernel that can (a batch-1 "quad" GEMV's direct store, or the K slices'
    sum) sets ``statistics``; it stays None where the launched kernel cannot, and the reader runs the norm itself.
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight
        self.eps = float(eps)
        self.statistics: NormStatistics | None = None

    def arguments(self, out: torch.Tensor, parts: int) -> dict[str, Any]:
        """The storing kernel's arguments (``LEAVE_NORM`` and its buffers) for ``out`` in ``parts`` column blocks per
        row; records the statistics those buffers will hold."""
        if self.weight.shape != (out.shape[1],) or self.weight.device != out.device:
            raise ValueError(f"an RMSNorm weight of shape {tuple(self.weight.shape)} on {self.weight.device} cannot "
                             f"read a GEMV output of {out.shape[1]} columns on {out.device}: request the statistics "
                             "of the norm that reads this output.")
        scaled = torch.empty_like(out)
        squares = torch.empty(out.shape[0], parts, device=out.device, dtype=torch.float32)
        self.statistics = NormStatistics(scaled, squares, self.eps)
        return dict(g_ptr=self.weight, scaled_ptr=scaled, sq_ptr=squares, LEAVE_NORM=True)


def row_scale_arguments(statistics: NormStatistics | None, k_in: int) -> dict[str, Any]:
    """The reading kernel's arguments for statistics a store left (``ROW_SCALE``; none without them)."""
    if statistics is None:
        return {}
    import triton

    parts = statistics.squares.shape[1]
    if statistics.scaled.shape[1] != k_in:
        raise ValueError(f"norm statistics of {statistics.scaled.shape[1]} columns cannot scale a GEMV over {k_in} "
                         "input channels: pass the statistics of this GEMV's input.")
    return dict(sq_ptr=statistics.squares, n_parts=parts, PARTS=triton.next_power_of_2(parts),
                eps=statistics.eps, ROW_SCALE=True)
