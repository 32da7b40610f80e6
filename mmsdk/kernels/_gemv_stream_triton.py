"""Batch-1 "stream" GEMV: each program walks several row blocks of the weight, the next block's words and scales loaded
before this block's arithmetic; for weights whose whole K fits one step of the "quad" tile.

Why (Nsight Compute on an H200, benchmarks/ncu_targets.py, docs/benchmarks.md): the "quad" GEMV with K in one step
(the 7B q/k/v, gate/up and o_proj weights under the 8 x 128 x 4 tile) loads its words, then waits for them (the
first nibble's AND carried 22% of the kernel's stall samples, long scoreboard) and computes; a program has nothing
else in flight, and only other programs on the multiprocessor hide that wait. Here a program issues the next row
block's loads first, so its own loads overlap its arithmetic, and it loads and splits the activations once for all
its row blocks instead of once per block. The nibble arithmetic is the "quad" kernel's
(:func:`~mmsdk.kernels._gemv_quad_triton.quad_step`).

Imported only when a kernel is launched.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmsdk.kernels._gemv_quad_triton import quad_scales, quad_step, step_activations


@triton.jit
def block_words(w_ptr, s_ptr, rb, N, KW, k_blocks, rc, rw, c_ok, WPG: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row block ``rb``'s words ``[BLOCK_N, BLOCK_C, 4]`` and scales ``[BLOCK_N, BLOCK_C]`` (zeros past N, which
    includes every block from ``n_blocks`` on, and past K)."""
    rn = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    flat = tl.load(w_ptr + rn[:, None].to(tl.int64) * KW + rw[None, :], mask=n_ok[:, None] & (rw < KW)[None, :],
                   other=0)
    g = 4 * rc // WPG
    s = quad_scales(s_ptr, rn, g, n_ok[:, None] & c_ok[None, :], k_blocks)
    return tl.reshape(flat, (BLOCK_N, BLOCK_C, 4)), s


@triton.jit
def gemv_stream(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, N, K_in, KW, stride_zn, GROUP: tl.constexpr,
                HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out[0, :] = x[0] @ W.T`` (+ bias), rounded to out's dtype, for ``KW <= 4 * BLOCK_C`` words per row.

    Grid: (programs,); program ``p`` computes row blocks ``p, p + programs, ...`` of ``BLOCK_N`` rows. Before a row
    block's arithmetic it loads the next one's words and scales (registers for two tiles).
    """
    WPG: tl.constexpr = GROUP // 8
    pid, programs = tl.program_id(0), tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    k_blocks = KW // WPG
    rc = tl.arange(0, BLOCK_C)
    rw = tl.arange(0, 4 * BLOCK_C)
    cw = 4 * rc  # first word of each quad: the step is the whole row
    c_ok = cw < KW
    xs, y0, y1, y2, y3, y4, y5, y6, y7 = step_activations(x_ptr, cw, c_ok, K_in)
    words, s = block_words(w_ptr, s_ptr, pid, N, KW, k_blocks, rc, rw, c_ok, WPG, BLOCK_N, BLOCK_C)
    for rb in range(pid, n_blocks, programs):
        ahead_words, ahead_s = block_words(w_ptr, s_ptr, rb + programs, N, KW, k_blocks, rc, rw, c_ok, WPG,
                                           BLOCK_N, BLOCK_C)
        rn = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        ok = n_ok[:, None] & c_ok[None, :]
        acc = quad_step(words, s, z_ptr, rn, 4 * rc // WPG, ok, stride_zn, xs, y0, y1, y2, y3, y4, y5, y6, y7,
                        HAS_ZP, BLOCK_N, BLOCK_C)
        out = tl.sum(acc, 1) * 1.8446744073709552e+19  # undo 2**-64
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty), mask=n_ok)
        words, s = ahead_words, ahead_s
