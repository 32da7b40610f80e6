"""Launch of the integer-dot batch-1 GEMV (kind "idot" of mmsdk.kernels.w4a16): the activation row rounded to 16-bit
integers per quad of 32 channels by one small kernel, then the GEMV on ``dp2a`` (mmsdk/kernels/_gemv_idot_triton.py
says why and how exact).

A config is ``(BLOCK_N, quads per step, warps, 1, "idot"[, target programs])``, as for the "quad" kinds. The same
configs run a gated MLP's gate and up projections in one GEMV launch (:func:`launch_idot_gated`, kind "idot" of
mmsdk.kernels.w4a16_gated). Kind "idotr" takes the same configs without the rounding launch: each GEMV program rounds
the quads it reads (faster on an H100 for the same tile by 0.4-1.3 µs, the launch and the wait for it gone, though
each program executes up to 1.4x the instructions: docs/benchmarks.md, forty-first pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmsdk.kernels import interpreting, pdl_preload_ready, pdl_ready
from mmsdk.kernels.norm_fold import InputNorm, NormRequest, NormStatistics, row_scale_arguments
from mmsdk.kernels.split_k import finish_splits

__all__ = ["IntegerActivations", "launch_idot", "launch_idot_gated", "quantize_row_activations"]

QUANTIZE_BLOCK = 64  # quads per program of the rounding kernel (2048 channels)


@dataclass(frozen=True)
class IntegerActivations:
    """Activations rounded for :func:`launch_idot`: int16 pairs ``[M, 4 KW]`` (int32), each quad's scale and integer
    sum ``[M, KW / 4]``."""

    pairs: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor


def quantize_row_activations(x: torch.Tensor, words: int, norm: InputNorm | None = None) -> IntegerActivations:
    """``x`` ``[M, K_in]`` rounded per quad of 32 channels for a weight of ``words`` int32 words per row (channels
    past ``K_in`` are zeros); with ``norm`` ``x`` is that RMSNorm's input, normalized in the same launch."""
    import triton

    from mmsdk.kernels import _w4a16_triton as kernels

    _check_words(words)
    m, k_in = x.shape
    n_quads = words // 4
    rounded = IntegerActivations(torch.empty(m, 4 * words, device=x.device, dtype=torch.int32),
                                 torch.empty(m, n_quads, device=x.device, dtype=torch.float32),
                                 torch.empty(m, n_quads, device=x.device, dtype=torch.int32))
    kernels.quantize_activations[(triton.cdiv(n_quads, QUANTIZE_BLOCK), m)](
        x, rounded.pairs, rounded.scales, rounded.sums, k_in, n_quads, x.stride(0), BLOCK_Q=QUANTIZE_BLOCK,
        PDL=pdl_ready(x), launch_pdl=pdl_ready(x), num_warps=4, **_norm_arguments(norm, x), enable_fp_fusion=True)
    return rounded


def _norm_arguments(norm: InputNorm | None, x: torch.Tensor) -> dict[str, Any]:
    """The rounding kernel's arguments for a norm it applies (none without one)."""
    if norm is None:
        return {}
    for name, vector in (("weight", norm.weight), ("prequant", norm.prequant)):
        if vector is not None and (vector.shape != (x.shape[1],) or vector.device != x.device
                                   or not vector.is_contiguous()):
            raise ValueError(f"an RMSNorm {name} of shape {tuple(vector.shape)} on {vector.device} cannot normalize "
                             f"a row of {x.shape[1]} channels on {x.device}: pass the contiguous {name} of the norm "
                             "whose output this GEMV reads.")
    prequant = norm.prequant
    return dict(g_ptr=norm.weight, pq_ptr=prequant if prequant is not None else norm.weight, eps=float(norm.eps),
                NORM=True, PREQUANT=prequant is not None)


def launch_idot(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                bias: torch.Tensor | None, out: torch.Tensor, group: int, cfg: tuple[Any, ...], per_split: int,
                n_splits: int, residual: torch.Tensor | None = None, norm: InputNorm | None = None,
                statistics: NormStatistics | None = None, leave: NormRequest | None = None) -> None:
    """``out = x W.T (+ bias) (+ residual)`` by the integer-dot GEMV, K cut in ``n_splits`` slices of ``per_split``
    groups (mmsdk.kernels.split_k.k_slices); more than one slice goes through fp32 partials and
    :func:`finish_splits`. The last store (the GEMV's own with one slice) leaves the statistics ``leave`` asks for,
    unless the GEMV reads a norm itself (``norm`` or ``statistics``: then it leaves none). With ``norm``
    ``x`` is that RMSNorm's input, normalized by the rounding kernel; with ``statistics`` ``x`` is an RMSNorm's input
    times its weight, what a store left, and the sums are scaled by the row's ``1 / rms`` (pass one of the two). Kind
    "idotr" (``cfg[4]``) launches no rounding kernel: the GEMV's programs round the quads they read themselves, the
    same way, so the output is kind "idot"'s bit for bit (with ``norm``: up to the last bit of the row's 1 / rms)."""
    import triton

    from mmsdk.kernels import _w4a16_triton as kernels

    _check_one_norm(norm, statistics)
    _check_group(group)
    block_n, block_c, warps = cfg[:3]
    self_round = _rounds_itself(cfg)
    m, k_in = x.shape
    n, k_blocks, _ = qweight.shape
    words = k_blocks * group // 8
    direct = n_splits == 1
    rounded, inputs = _rounded_inputs(x, words, norm, self_round)
    if self_round or statistics is not None:  # the gated GEMV has K_in among its arguments already
        inputs["K_in"] = k_in
    if leave is not None and (norm is not None or statistics is not None):
        leave = None  # the kernel's norm arguments and those of the statistics it would leave share names
    n_blocks = triton.cdiv(n, block_n)
    if leave is not None and direct:
        inputs.update(leave.arguments(out, n_blocks), n_parts=n_blocks)
    pdl = pdl_preload_ready(x)  # the first weights load while the kernel before runs
    target = out if direct else torch.empty(n_splits, m, n, device=x.device, dtype=torch.float32)
    kernels.gemv_idot[(n_blocks, n_splits, m)](
        rounded.pairs, rounded.scales, rounded.sums, qweight.view(torch.int32), scales,
        zero_points if zero_points is not None else scales, bias if bias is not None else scales, target, m, n, words,
        per_split * group // 32, zero_points.stride(0) if zero_points is not None else 0,
        residual if residual is not None else scales, GROUP=group, HAS_ZP=zero_points is not None,
        HAS_BIAS=bias is not None, DIRECT=direct, HAS_RESIDUAL=residual is not None and direct, BLOCK_N=block_n,
        BLOCK_C=block_c, ROW_MASK=n % block_n != 0, ASM=not interpreting(), PDL=pdl, launch_pdl=pdl, num_warps=warps,
        **row_scale_arguments(statistics, k_in), **inputs, enable_fp_fusion=True)
    if not direct:  # the partials are scaled already
        finish_splits(target, out, bias, n_splits, False, residual, leave)


def launch_idot_gated(x: torch.Tensor, gate: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
                      up: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], out: torch.Tensor, group: int,
                      cfg: tuple[Any, ...], per_split: int, n_splits: int, statistics: NormStatistics | None = None,
                      norm: InputNorm | None = None) -> None:
    """``out = silu(x Wg.T) * (x Wu.T)`` for a gated MLP's packed gate and up weights (qweight, scales, zero points;
    same shapes): both weights' rows in each program, K cut as :func:`launch_idot` cuts it (more than one slice goes
    through fp32 partials and :func:`finish_splits`). With ``statistics`` ``x`` is an RMSNorm's input times its weight
    and both products are scaled by the row's ``1 / rms`` (mmsdk.kernels.norm_fold.NormStatistics); with ``norm`` it
    is that RMSNorm's input, normalized by the rounding kernel (pass one of the two). Kind "idotr" (``cfg[4]``): no
    rounding kernel, as for :func:`launch_idot`."""
    import triton

    from mmsdk.kernels import _w4a16_triton as kernels

    _check_one_norm(norm, statistics)
    _check_group(group)
    block_n, block_c, warps = cfg[:3]
    (qweight, scales, zero_points), (qweight2, scales2, zero_points2) = gate, up
    m, k_in = x.shape
    n, k_blocks, _ = qweight.shape
    words = k_blocks * group // 8
    rounded, inputs = _rounded_inputs(x, words, norm, _rounds_itself(cfg))
    direct = n_splits == 1
    has_zp = zero_points is not None
    pdl = pdl_preload_ready(x)  # both weights' first step loads while the kernel before runs
    target = out if direct else torch.empty(n_splits, m, 2 * n, device=x.device, dtype=torch.float32)
    kernels.gemv_idot_gated[(triton.cdiv(n, block_n), n_splits, m)](
        rounded.pairs, rounded.scales, rounded.sums, qweight.view(torch.int32), scales,
        zero_points if has_zp else scales, qweight2.view(torch.int32), scales2, zero_points2 if has_zp else scales2,
        target, m, n, words, per_split * group // 32, zero_points.stride(0) if has_zp else 0, k_in, GROUP=group,
        HAS_ZP=has_zp, DIRECT=direct, BLOCK_N=block_n, BLOCK_C=block_c, ROW_MASK=n % block_n != 0,
        ASM=not interpreting(), PDL=pdl, launch_pdl=pdl, num_warps=warps, **row_scale_arguments(statistics, k_in),
        **inputs, enable_fp_fusion=True)
    if not direct:  # the partials are scaled already
        finish_splits(target, out, None, n_splits, True)


def _rounds_itself(cfg: tuple[Any, ...]) -> bool:
    """Whether a config's GEMV rounds its own activations (kind "idotr"): no rounding launch before it."""
    return len(cfg) > 4 and cfg[4] == "idotr"


def _rounded_inputs(x: torch.Tensor, words: int, norm: InputNorm | None,
                    self_round: bool) -> tuple[IntegerActivations, dict[str, Any]]:
    """(the rounding kernel's output, the GEMV's extra arguments) for kind "idot"; for kind "idotr" no rounding
    launch: ``x`` stands in for the buffers the GEMV then does not read, and the arguments give it the row (and the
    norm) to round itself."""
    if not self_round:
        return quantize_row_activations(x, words, norm), {}
    _check_words(words)
    arguments = dict(x_ptr=x, stride_xm=x.stride(0), SELF_ROUND=True, **_norm_arguments(norm, x))
    return IntegerActivations(x, x, x), arguments


def _check_one_norm(norm: InputNorm | None, statistics: NormStatistics | None) -> None:
    """A row is normalized once: by the norm applied to it, or by the statistics a store left."""
    if norm is not None and statistics is not None:
        raise ValueError("pass an RMSNorm for the rounding kernel to apply (norm=) or the statistics a store left for "
                         "it (statistics=), not both: either one normalizes the row.")


def _check_words(words: int) -> None:
    """An integer-dot GEMV reads whole quads of 4 words."""
    if words % 4:
        raise ValueError(f"an integer-dot GEMV reads quads of 4 words: {words} words per row is not a multiple of 4; "
                         "use a group size of at least 32 or kind 'fma'.")


def _check_group(group: int) -> None:
    """Kind "idot" reads whole 4-word quads (32 channels) of one group."""
    if group < 32:
        raise ValueError(f"GEMV kind 'idot' reads 4-word quads of one group: group size {group} < 32; use kind 'fma'.")
