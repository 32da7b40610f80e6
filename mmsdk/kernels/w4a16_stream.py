"""Launcher of the batch-1 "stream" GEMV (mmsdk/kernels/_gemv_stream_triton.py): programs that walk several row
blocks each, loading the next block's weights before this block's arithmetic. Not yet among the tuner's candidates:
benchmarks/gpu_stream_gemv.py measures it against the "quad" GEMV first.
"""

from __future__ import annotations

import torch

from mmsdk.kernels.w4a16 import check_columns

__all__ = ["STREAM_TILES", "stream_reason", "w4a16_stream_gemv"]

# (rows, quads of 4 words, warps); 128 quads hold K = 4096. Offline sm_90 builds (Triton 3.9, g128): 127, 168, 80,
# 95, 128 and 180 registers, no spills
STREAM_TILES = ((8, 128, 4), (16, 128, 4), (8, 128, 8), (4, 128, 4), (16, 128, 8), (8, 128, 2))


def stream_reason(x: torch.Tensor, qweight: torch.Tensor, block_size: int, block_c: int) -> str | None:
    """Why the stream GEMV cannot take these inputs with ``block_c`` quads per step (None when it can)."""
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous():
        return "the stream GEMV takes one contiguous activation row [1, K]"
    if block_size < 32 or block_size % 32:
        return f"the stream GEMV reads 4-word quads of one group: group size {block_size} is not a multiple of 32"
    if qweight.shape[1] * block_size > 32 * block_c:
        return (f"K = {qweight.shape[1] * block_size} does not fit one step of {block_c} quads ({32 * block_c} "
                "channels): use the quad GEMV")
    return None


def w4a16_stream_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                      block_size: int, bias: torch.Tensor | None = None, tile: tuple[int, int, int] = STREAM_TILES[0],
                      programs: int = 264) -> torch.Tensor:
    """``x @ W.T`` (+ bias) for one row ``x`` [1, K] (bf16/fp16) and a packed INT4 weight ``[N, k_blocks,
    block_size / 2]`` (MatMulNBits layout), ``[1, N]`` in x's dtype. ``tile`` is (BLOCK_N, BLOCK_C quads, warps);
    ``programs`` the grid (each program walks every ``programs``-th row block)."""
    import triton

    from mmsdk.kernels import _gemv_stream_triton

    block_n, block_c, warps = tile
    reason = stream_reason(x, qweight, block_size, block_c)
    if reason is not None:
        raise ValueError(reason)
    n, k_blocks, _ = qweight.shape
    check_columns(x.shape[1], k_blocks * block_size)
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    grid = (min(programs, triton.cdiv(n, block_n)),)
    _gemv_stream_triton.gemv_stream[grid](
        x, qweight.view(torch.int32), scales, zero_points if zero_points is not None else scales,
        bias if bias is not None else scales, out, n, x.shape[1], k_blocks * block_size // 8,
        zero_points.stride(0) if zero_points is not None else 0, GROUP=block_size, HAS_ZP=zero_points is not None,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_C=block_c, num_warps=warps)
    return out
