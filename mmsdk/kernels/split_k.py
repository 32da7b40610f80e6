"""The epilogue of a GEMV split along K: its slices' fp32 partials summed into the output, or for a paired (gated)
GEMV ``silu(gate) * up`` from them (mmsdk.kernels.w4a16, mmsdk.kernels.w4a16_gated). One small launch; it also
adds a bias and a residual, and leaves or applies an RMSNorm's statistics (mmsdk.kernels.norm_fold) as the direct
store of a one-slice GEMV would.
"""

from __future__ import annotations

import torch

from mmsdk.kernels.norm_fold import NormRequest, NormStatistics, row_scale_arguments

__all__ = ["finish_splits"]


def finish_splits(partials: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, n_splits: int,
                  paired: bool, residual: torch.Tensor | None = None, leave: NormRequest | None = None,
                  row_scale: NormStatistics | None = None, k_in: int = 0) -> None:
    """``out`` from the fp32 partials: their sum (+ bias; then + ``residual`` as
    mmsdk.kernels.w4a16.int4_linear adds it; with ``leave`` the statistics of the norm that reads it), or for a
    paired GEMV ``silu(gate) * up`` (with ``row_scale``, of the sums scaled by the row's ``1 / rms`` over ``k_in``
    channels)."""
    import triton

    from mmsdk.kernels import _w4a16_triton

    m, n = out.shape
    block = 1024
    if paired:
        _w4a16_triton.split_gated[(triton.cdiv(m * n, block),)](
            partials, out, m * n, n, SPLITS=n_splits, BLOCK=block, num_warps=4,
            **(row_scale_arguments(row_scale, k_in) | ({"K_in": k_in} if row_scale is not None else {})))
    else:
        parts = triton.cdiv(n, block)
        leaving = leave.arguments(out, parts) | {"n_parts": parts} if leave is not None else {}
        _w4a16_triton.split_sum[(parts, m)](partials, bias if bias is not None else partials,
                                            residual if residual is not None else partials, out, m * n, n,
                                            SPLITS=n_splits, HAS_BIAS=bias is not None,
                                            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=4, **leaving)
