"""Triton kernel behind mmsdk.kernels.greedy (imported only when it is launched)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def first_max(v1, i1, v2, i2):
    """The greater of (value, index) pairs as torch.argmax decides: NaN above everything, ties to the lower index."""
    n1 = v1 != v1
    n2 = v2 != v2
    take2 = (n2 & ~n1) | ((n1 == n2) & ((v2 > v1) | (((v2 == v1) | n1) & (i2 < i1))))
    return tl.where(take2, v2, v1), tl.where(take2, i2, i1)


@triton.jit
def argmax_rows(x_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
    """Index of row ``program_id(0)``'s first maximum over ``V`` values (int64), in one program per row.

    Each lane keeps the best (value, index) of its columns, tile after tile (a later tile's indices are higher, so
    ties keep the earlier one), and one reduction over the lanes ends it. Padding lanes read -inf with indices past
    ``V``, so they never win, not even against a row of -inf.
    """
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        v = tl.load(x_ptr + row * stride + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        best_v, best_i = first_max(best_v, best_i, v, idx)
    _, index = tl.reduce((best_v, best_i), 0, first_max)
    tl.store(out_ptr + row, index.to(tl.int64))
