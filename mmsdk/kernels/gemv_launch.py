"""One batch-1 / few-row W4A16 GEMV configuration launched (mmsdk.kernels.w4a16 chooses the configuration).

A configuration is ``(BLOCK_N, BLOCK_G, num_warps, BLOCK_M, KIND[, target programs[, num_stages]])``; the kinds and
their candidates per row count are described in mmsdk.kernels.w4a16. :func:`launch_gemv` runs one into ``out``: the
"quad" kinds (mmsdk/kernels/_gemv_quad_triton.py), "idot" / "idotr" (mmsdk.kernels.gemv_idot), "mma" (tensor cores)
or the plain "fma" / "dot" kernel, a K split summed by the epilogue kernel (mmsdk.kernels.split_k).
"""

from __future__ import annotations

from typing import Any

import torch

from mmsdk.kernels import interpreting, pdl_preload_ready, pdl_ready
from mmsdk.kernels.gemv_idot import launch_idot
from mmsdk.kernels.norm_fold import InputNorm, NormRequest, NormStatistics, norm_arguments
from mmsdk.kernels.split_k import TARGET_PROGRAMS, finish_splits, k_slices

__all__ = ["GEMV_KINDS", "IDOT_KINDS", "QUAD_KINDS", "GemvConfig", "PackedWeight", "launch_gemv", "launch_paired_mma",
           "triton_kernels"]

GemvConfig = tuple[Any, ...]
PackedWeight = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # (qweight, scales, zero_points)
GEMV_KINDS = ("quad", "quadp", "idot", "idotr", "fma", "dot", "mma")
IDOT_KINDS = ("idot", "idotr")
QUAD_KINDS = ("quad", "quadp")


def launch_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                bias: torch.Tensor | None, out: torch.Tensor, group: int, cfg: GemvConfig,
                splits: int | None, second: PackedWeight | None = None, residual: torch.Tensor | None = None,
                norm: InputNorm | None = None, leave: NormRequest | None = None,
                row_scale: NormStatistics | None = None) -> None:
    """Launch one GEMV configuration into ``out``; with ``second`` (same shape) ``out = silu(x W1.T) * (x W2.T)``
    from programs split between the two weights (the paired GEMV's "quad" kinds); with ``residual`` (``out``'s
    shape and dtype, contiguous) ``out = residual + x W.T``, added in the last store ("quad" kinds, or the K
    slices' sum); with ``norm`` ``x`` is normalized first, inside the "quad" kinds' programs
    (mmsdk.kernels.norm_fold) or "idot"'s rounding kernel ("idotr": its own programs), by the norm kernel for the
    others. ``leave``: the one-slice store of the "quad" and integer-dot kinds, or the K slices' sum, leaves the
    statistics of the RMSNorm that reads ``out`` (one row, a GEMV that reads no norm itself; others leave none);
    ``row_scale`` (a paired GEMV, or one of kind "idot" / "idotr"): ``x`` is an RMSNorm's input times its weight and
    these its statistics, applied to the finished sums (mmsdk.kernels.norm_fold.NormStatistics)."""
    block_n, block_g, warps, block_m, kind = cfg[:5]
    target_programs = cfg[5] if len(cfg) > 5 else TARGET_PROGRAMS
    paired = second is not None
    _check_kind(kind, paired)
    if residual is not None and (paired or residual.shape != out.shape or not residual.is_contiguous()):
        raise ValueError("a GEMV's residual must be a contiguous tensor of the output's shape, and a paired (gated) "
                         "GEMV takes none: add it after the launch.")
    if norm is not None and kind not in (*QUAD_KINDS, *IDOT_KINDS):
        x, norm = norm.normalize(x), None
    if row_scale is not None and not paired and kind not in IDOT_KINDS:
        raise ValueError(f"a GEMV of kind {kind!r} cannot apply norm statistics: pass a kind in {IDOT_KINDS} or a "
                         "paired (gated) GEMV (second=), or the norm itself (norm=).")
    if leave is not None and (kind == "mma" or paired or x.shape[0] != 1):
        leave = None  # the reader runs the norm itself
    if kind == "mma":
        _launch_mma(x, qweight, scales, zero_points, bias, out, group, cfg, splits, residual)
        return
    if kind in IDOT_KINDS:
        launch_idot(x, qweight, scales, zero_points, bias, out, group, cfg,
                    *k_slices(qweight.shape[0], qweight.shape[1], block_n, block_g, target_programs, splits), residual,
                    norm, row_scale, leave)
        return
    import triton

    dot = kind == "dot"
    m, k_in = x.shape
    n, k_blocks, _ = qweight.shape
    rows = 2 * n if paired else n
    block_m = max(16, block_m) if dot else min(block_m, triton.next_power_of_2(m))
    per_split, n_splits = k_slices(rows, k_blocks, block_n, block_g, target_programs, splits)
    direct = n_splits == 1 and not paired  # a program here holds one of the two products: always via fp32 partials
    target = out if direct else torch.empty(n_splits, m, rows, device=x.device, dtype=torch.float32)
    n_blocks = triton.cdiv(n, block_n)
    kernels = triton_kernels()
    args = (x, qweight.view(torch.int32), scales, zero_points if zero_points is not None else scales,
            bias if bias is not None else scales, target, m, n, k_in, k_blocks * group // 8, per_split, x.stride(0),
            zero_points.stride(0) if zero_points is not None else 0)
    flags = dict(GROUP=group, HAS_ZP=zero_points is not None, HAS_BIAS=bias is not None, DIRECT=direct,
                 BLOCK_N=block_n, num_warps=warps)
    if kind in QUAD_KINDS:  # one activation row per program (grid axis 2 is then the row)
        if group < 32:
            raise ValueError(f"GEMV kind {kind!r} reads 4-word quads of one group: group size {group} < 32; "
                             "use kind 'fma'.")
        w2, s2, z2 = second if paired else (qweight, scales, zero_points)
        pdl = pdl_preload_ready(x)  # weights load before the wait
        kernels.gemv_quad[(n_blocks * (2 if paired else 1), n_splits, m)](
            *args, w2.view(torch.int32), s2, z2 if z2 is not None else s2, n_blocks,
            residual if residual is not None else scales, BLOCK_C=block_g, PAIRED=paired, PREFETCH=kind == "quadp",
            PDL=pdl, HAS_RESIDUAL=residual is not None and direct, ROW_MASK=n % block_n != 0, launch_pdl=pdl,
            **norm_arguments(norm, x, warps, n_splits == 1),
            **(leave.arguments(out, n_blocks) if leave is not None and direct else {}),
            **flags, enable_fp_fusion=True)
    else:
        kernels.gemv[(n_blocks, n_splits, triton.cdiv(m, block_m))](*args, BLOCK_M=block_m, BLOCK_G=block_g,
                                                                    DOT=dot, **flags, enable_fp_fusion=True)
        if direct and residual is not None:
            out.add_(residual)
    if not direct:
        finish_splits(target, out, bias, n_splits, paired, residual, leave, row_scale, k_in)


def _launch_mma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                bias: torch.Tensor | None, out: torch.Tensor, group: int, cfg: GemvConfig, splits: int | None,
                residual: torch.Tensor | None, second: PackedWeight | None = None) -> None:
    """Launch a kind "mma" configuration, ``(BLOCK_N, K channels per step, warps, BLOCK_M, "mma"[, target programs[,
    num_stages]])``, into ``out`` (``residual`` as :func:`launch_gemv` takes it). With ``second`` (the up weight of a
    gated MLP whose gate is the first; no bias or residual) ``out = silu(x W.T) * (x W2.T)``: each program the same
    rows of both weights, K slices counted from N rows, several slices finished by the gated epilogue."""
    import triton

    if group < 32:
        raise ValueError(f"GEMV kind 'mma' multiplies half groups of at least 16 channels: group size {group} < 32; "
                         "use kind 'fma'.")
    paired = second is not None
    if paired and (bias is not None or residual is not None):
        raise ValueError("a paired (gated) 'mma' GEMV takes no bias or residual: add them after the launch.")
    block_n, step_k, warps, block_m = cfg[:4]
    target_programs = cfg[5] if len(cfg) > 5 else TARGET_PROGRAMS
    options = {"num_stages": cfg[6]} if len(cfg) > 6 else {}
    step_g = max(1, step_k // group)
    m, k_in = x.shape
    n, k_blocks, _ = qweight.shape
    per_split, n_splits = k_slices(n, k_blocks, block_n, step_g, target_programs, splits)
    direct = n_splits == 1
    width = 2 * n if paired else n
    target = out if direct else torch.empty(n_splits, m, width, device=x.device, dtype=torch.float32)
    pdl = pdl_ready(x)  # the kernel waits before its first load
    block_m = min(block_m, triton.next_power_of_2(m))
    w2, s2, z2 = second if paired else (None, None, None)
    triton_kernels().gemv_mma[(triton.cdiv(n, block_n), n_splits, triton.cdiv(m, block_m))](
        x, qweight, scales, zero_points if zero_points is not None else scales, bias if bias is not None else scales,
        target, m, n, k_in, k_blocks * group // 8, per_split, x.stride(0),
        zero_points.stride(0) if zero_points is not None else 0, residual if residual is not None else scales,
        GROUP=group, HAS_ZP=zero_points is not None, HAS_BIAS=bias is not None, DIRECT=direct, BLOCK_N=block_n,
        BLOCK_M=block_m, STEP_G=step_g, ASM=not interpreting(), PDL=pdl, HAS_RESIDUAL=residual is not None and direct,
        w2_ptr=w2, s2_ptr=s2, z2_ptr=z2 if z2 is not None else s2, PAIRED=paired,
        launch_pdl=pdl, num_warps=warps, **options, enable_fp_fusion=True)
    if not direct:
        finish_splits(target, out, bias, n_splits, paired, residual)


def launch_paired_mma(x: torch.Tensor, gate: PackedWeight, up: PackedWeight, out: torch.Tensor, group: int,
                      cfg: GemvConfig, splits: int | None) -> None:
    """``out = silu(x @ Wg.T) * (x @ Wu.T)`` for a few activation rows from one kind "mma" configuration (see
    :func:`_launch_mma`)."""
    _launch_mma(x, *gate, None, out, group, cfg, splits, None, second=up)


def _check_kind(kind: str, paired: bool) -> None:
    """Refuse a GEMV kind this launch cannot run, naming the ones it can."""
    if kind not in GEMV_KINDS:
        raise ValueError(f"GEMV kind {kind!r}: use one of {GEMV_KINDS} (kind 'gated' is for the paired gate/up "
                         "GEMV, mmsdk.kernels.w4a16_gated.w4a16_gated_silu, only).")
    if paired and kind not in QUAD_KINDS:
        raise ValueError(f"the per-weight programs of a paired (gated) GEMV run the {QUAD_KINDS} kinds only, not "
                         f"{kind!r}: pass a 'quad', 'gated' or 'idot' config to w4a16_gated_silu, or none.")


def triton_kernels() -> Any:
    """The Triton kernels (a separate module, so importing this one does not import Triton)."""
    from mmsdk.kernels import _w4a16_triton

    return _w4a16_triton
