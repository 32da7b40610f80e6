"""A gated MLP's gate and up projections for one token on integer dot products (kind "idot" of
mmsdk.kernels.w4a16_gated): ``silu(x @ Wg.T) * (x @ Wu.T)`` against activations rounded to 16-bit integers per quad of
32 channels (mmsdk/kernels/_gemv_idot_triton.py says why and how exact). Imported only when a kernel is launched
(through mmsdk.kernels._w4a16_triton).

Each program holds the same output rows of both weights, as the "gated" quad kernel does: a step loads both weights'
words and scales, then the rounded activations once, shared by both weights' ``dp2a`` chains.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmsdk.kernels._gemv_gated_triton import store_gated
from mmsdk.kernels._gemv_idot_triton import (ROW_SCALE_BLOCK, idot_products, idot_program, rounded_row, step_inputs,
                                             step_tile)
from mmsdk.kernels._gemv_quad_triton import inverse_rms
from mmsdk.kernels._gemv_store_triton import load_norm_parts, rms_from_parts
from mmsdk.kernels._pdl_triton import wait_for_inputs


@triton.jit
def gated_idot_step(gate, up, gate_words, gate_s, up_words, up_s, xq_row, xs_row, xsum_row, q0, quads, c_ok, pair_at,
                    z_ptr, z2_ptr, rn, ok, stride_zn, x_row, K_in, row_scale, g_ptr, pq_ptr, WPG: tl.constexpr,
                    HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ASM: tl.constexpr,
                    MASK_K: tl.constexpr, SELF_ROUND: tl.constexpr, NORM: tl.constexpr, PREQUANT: tl.constexpr):
    """``(gate, up)`` plus one step's products of both weights (the step's activations loaded, or with
    ``SELF_ROUND`` rounded, once)."""
    p0, p1, p2, p3, xs, xsum = step_inputs(xq_row, xs_row, xsum_row, q0, quads, c_ok, pair_at, x_row, K_in, row_scale,
                                           g_ptr, pq_ptr, MASK_K, SELF_ROUND, NORM, PREQUANT)
    gate += idot_products(gate_words, gate_s, p0, p1, p2, p3, xs, xsum, quads, z_ptr, rn, ok, stride_zn, WPG, HAS_ZP,
                          BLOCK_N, BLOCK_C, ASM)
    up += idot_products(up_words, up_s, p0, p1, p2, p3, xs, xsum, quads, z2_ptr, rn, ok, stride_zn, WPG, HAS_ZP,
                        BLOCK_N, BLOCK_C, ASM)
    return gate, up


@triton.jit
def gated_idot_steps(gate, up, q_from, q_to, q_end, gate_rows, s_ptr, up_rows, s2_ptr, z_ptr, z2_ptr, stride_zn, rn,
                     n_ok, rc, rw, k_blocks, xq_row, xs_row, xsum_row, pair_at, x_row, K_in, row_scale, g_ptr, pq_ptr,
                     WPG: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                     ROW_MASK: tl.constexpr, ASM: tl.constexpr, MASK_K: tl.constexpr, SELF_ROUND: tl.constexpr,
                     NORM: tl.constexpr, PREQUANT: tl.constexpr):
    """The steps from quad ``q_from`` to ``q_to`` of both weights (``MASK_K`` False: every quad of them exists)."""
    for q0 in range(q_from, q_to, BLOCK_C):
        gate_words, gate_s, quads, c_ok, ok = step_tile(gate_rows, s_ptr, q0, q_end, rn, n_ok, rc, rw, k_blocks, WPG,
                                                        BLOCK_N, BLOCK_C, ROW_MASK, MASK_K)
        up_words, up_s, quads, c_ok, ok = step_tile(up_rows, s2_ptr, q0, q_end, rn, n_ok, rc, rw, k_blocks, WPG,
                                                    BLOCK_N, BLOCK_C, ROW_MASK, MASK_K)
        gate, up = gated_idot_step(gate, up, gate_words, gate_s, up_words, up_s, xq_row, xs_row, xsum_row, q0, quads,
                                   c_ok, pair_at, z_ptr, z2_ptr, rn, ok, stride_zn, x_row, K_in, row_scale, g_ptr,
                                   pq_ptr, WPG, HAS_ZP, BLOCK_N, BLOCK_C, ASM, MASK_K, SELF_ROUND, NORM, PREQUANT)
    return gate, up


@triton.jit
def gemv_idot_gated(xq_ptr, xs_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, w2_ptr, s2_ptr, z2_ptr, out_ptr, M, N, KW,
                    quads_per_split, stride_zn, K_in, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, DIRECT: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ROW_MASK: tl.constexpr, ASM: tl.constexpr,
                    PDL: tl.constexpr = False, sq_ptr=None, n_parts=0, eps=0.0, PARTS: tl.constexpr = 1,
                    ROW_SCALE: tl.constexpr = False, x_ptr=None, stride_xm=0, g_ptr=None, pq_ptr=None,
                    SELF_ROUND: tl.constexpr = False, NORM: tl.constexpr = False, PREQUANT: tl.constexpr = False):
    """``silu(x @ Wg.T) * (x @ Wu.T)`` for one activation row per program (grid axis 2), ``x`` rounded by
    :func:`mmsdk.kernels._gemv_idot_triton.quantize_activations`.

    Gate (``w/s/z``) and up (``w2/s2/z2``, same shape and zero-point layout) rows ``rn`` are two accumulators over
    the same steps of the program's K slice. With ``DIRECT`` (one slice) the program stores ``silu(gate) * up`` in
    out's dtype; otherwise fp32 partials at ``out[split]`` (rows ``2N`` wide, up at columns ``N ..``) for
    mmsdk.kernels.split_k.finish_splits. ``PDL``: both weights' first step loads before the wait for the rounding
    kernel. ``ROW_SCALE`` as in the "gated" quad kernel: ``x`` is an RMSNorm's input times its weight (what o_proj's
    store left), both products are scaled by the row's ``1 / rms`` from the ``n_parts`` partial sums of squares at
    ``sq_ptr`` (``K_in`` channels, ``eps``).

    ``SELF_ROUND`` (kind "idotr"): no rounding kernel; each program rounds its steps' quads from the activation row
    (``x_ptr``, ``stride_xm``; with ``NORM`` an RMSNorm's input, its weight at ``g_ptr``, ``PREQUANT`` at ``pq_ptr``,
    ``eps``) as :func:`mmsdk.kernels._gemv_idot_triton.gemv_idot` does.
    """
    WPG: tl.constexpr = GROUP // 8
    split, row, rn, n_ok, rc, rw, q_begin, q_end, n_quads, k_blocks = idot_program(N, KW, quads_per_split, GROUP,
                                                                                   BLOCK_N, BLOCK_C)
    offsets = rn[:, None].to(tl.int64) * KW
    gate_rows, up_rows = w_ptr + offsets, w2_ptr + offsets
    xq_row, xs_row, xsum_row, pair_at = rounded_row(xq_ptr, xs_ptr, xsum_ptr, row, KW, n_quads, rc)
    x_row = x_ptr + row.to(tl.int64) * stride_xm if SELF_ROUND else x_ptr
    gate = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    q_loop = q_begin
    if PDL:  # both weights' first step loads while the rounding kernel runs
        gate_words, gate_s, quads, c_ok, ok = step_tile(gate_rows, s_ptr, q_begin, q_end, rn, n_ok, rc, rw, k_blocks,
                                                        WPG, BLOCK_N, BLOCK_C, ROW_MASK)
        up_words, up_s, quads, c_ok, ok = step_tile(up_rows, s2_ptr, q_begin, q_end, rn, n_ok, rc, rw, k_blocks, WPG,
                                                    BLOCK_N, BLOCK_C, ROW_MASK)
        wait_for_inputs(PDL)
        # a folded norm's 1 / rms, read from the row itself (ROW_SCALE's below comes from a store's sums instead)
        norm_scale = inverse_rms(x_row, K_in, eps, ROW_SCALE_BLOCK) if SELF_ROUND and NORM else 1.0
        gate, up = gated_idot_step(gate, up, gate_words, gate_s, up_words, up_s, xq_row, xs_row, xsum_row, q_begin,
                                   quads, c_ok, pair_at, z_ptr, z2_ptr, rn, ok, stride_zn, x_row, K_in, norm_scale,
                                   g_ptr, pq_ptr, WPG, HAS_ZP, BLOCK_N, BLOCK_C, ASM, True, SELF_ROUND, NORM, PREQUANT)
        q_loop = q_begin + BLOCK_C
    else:
        norm_scale = inverse_rms(x_row, K_in, eps, ROW_SCALE_BLOCK) if SELF_ROUND and NORM else 1.0
    if ROW_SCALE:  # reduced now (after the wait, which orders it after the kernel that left the sums)
        row_scale = rms_from_parts(load_norm_parts(sq_ptr, row, n_parts, PARTS), K_in, eps)
    whole_end = q_loop + tl.maximum(q_end - q_loop, 0) // BLOCK_C * BLOCK_C
    gate, up = gated_idot_steps(gate, up, q_loop, whole_end, q_end, gate_rows, s_ptr, up_rows, s2_ptr, z_ptr, z2_ptr,
                                stride_zn, rn, n_ok, rc, rw, k_blocks, xq_row, xs_row, xsum_row, pair_at, x_row, K_in,
                                norm_scale, g_ptr, pq_ptr, WPG, HAS_ZP, BLOCK_N, BLOCK_C, ROW_MASK, ASM, False,
                                SELF_ROUND, NORM, PREQUANT)
    gate, up = gated_idot_steps(gate, up, whole_end, q_end, q_end, gate_rows, s_ptr, up_rows, s2_ptr, z_ptr, z2_ptr,
                                stride_zn, rn, n_ok, rc, rw, k_blocks, xq_row, xs_row, xsum_row, pair_at, x_row, K_in,
                                norm_scale, g_ptr, pq_ptr, WPG, HAS_ZP, BLOCK_N, BLOCK_C, ROW_MASK, ASM, True,
                                SELF_ROUND, NORM, PREQUANT)
    gate_out = tl.sum(gate, 1)
    up_out = tl.sum(up, 1)
    if ROW_SCALE:
        gate_out *= row_scale
        up_out *= row_scale
    store_gated(out_ptr, gate_out, up_out, row, split, M, N, rn, n_ok, DIRECT)
