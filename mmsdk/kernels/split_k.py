"""A GEMV split along K: how many slices (:func:`k_slices`, about a target number of programs), and the epilogue that
sums the slices' fp32 partials into the output, or for a paired (gated) GEMV makes ``silu(gate) * up`` from them
(mmsdk.kernels.w4a16, mmsdk.kernels.w4a16_gated). The epilogue is one small launch; it also adds a bias and a
residual, and leaves or applies an RMSNorm's statistics (mmsdk.kernels.norm_fold) as the direct store of a one-slice
GEMV would.
"""

from __future__ import annotations

import torch

from mmsdk.kernels.norm_fold import NormRequest, NormStatistics, row_scale_arguments

__all__ = ["TARGET_PROGRAMS", "finish_splits", "gemv_splits", "k_slices"]

TARGET_PROGRAMS = 1056  # about eight per multiprocessor on an H100/H200


def finish_splits(partials: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, n_splits: int,
                  paired: bool, residual: torch.Tensor | None = None, leave: NormRequest | None = None,
                  row_scale: NormStatistics | None = None, k_in: int = 0) -> None:
    """``out`` from the fp32 partials: their sum (+ bias; then + ``residual`` as
    mmsdk.kernels.w4a16.int4_linear adds it; with ``leave`` the statistics of the norm that reads it), or for a
    paired GEMV ``silu(gate) * up`` (with ``row_scale``, of the sums scaled by the row's ``1 / rms`` over ``k_in``
    channels)."""
    import triton

    from mmsdk.kernels import _w4a16_triton, pdl_ready

    m, n = out.shape
    block = 1024
    pdl = pdl_ready(out)  # launched while the GEMV drains; the next kernel's first loads overlap this one
    if paired:
        _w4a16_triton.split_gated[(triton.cdiv(m * n, block),)](
            partials, out, m * n, n, SPLITS=n_splits, BLOCK=block, PDL=pdl, launch_pdl=pdl, num_warps=4,
            **(row_scale_arguments(row_scale, k_in) | ({"K_in": k_in} if row_scale is not None else {})),
            enable_fp_fusion=True)
    else:
        parts = triton.cdiv(n, block)
        leaving = leave.arguments(out, parts) | {"n_parts": parts} if leave is not None else {}
        _w4a16_triton.split_sum[(parts, m)](partials, bias if bias is not None else partials,
                                            residual if residual is not None else partials, out, m * n, n,
                                            SPLITS=n_splits, HAS_BIAS=bias is not None,
                                            HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=pdl, launch_pdl=pdl,
                                            num_warps=4, **leaving, enable_fp_fusion=True)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def gemv_splits(n: int, k_blocks: int, block_n: int, block_g: int, target: int = TARGET_PROGRAMS) -> int:
    """How many K slices give about ``target`` programs (whole ``block_g`` steps per slice)."""
    n_blocks = -(-n // block_n)
    steps = -(-k_blocks // block_g)
    return max(1, min(steps, -(-target // n_blocks)))


def k_slices(rows: int, k_blocks: int, block_n: int, block_g: int, target: int, splits: int | None) -> tuple[int, int]:
    """(groups per K slice, number of slices) for ``rows`` output rows in ``block_n`` blocks (``splits`` wins if given).

    Slices are whole multiples of ``block_g`` groups (for the quad kinds and "idot", whose ``block_g`` counts quads,
    this is coarser than a step; kept so, as measured on the H200: "idot" sliced in whole steps instead ran the
    4096 x 4096 weight 1.0-1.6 µs slower and the 4096 x 11008 one no faster, h200_kernel_sweeps_idot_slices.json).
    """
    wanted = splits or gemv_splits(rows, k_blocks, block_n, block_g, target)
    per_split = _ceil(_ceil(k_blocks, wanted), block_g) * block_g
    return per_split, _ceil(k_blocks, per_split)
