"""The gated MLP's paired batch-1 GEMV behind mmsdk.kernels.w4a16_gated: each program the same rows of the gate and
the up weight, ``silu(gate) * up`` stored by the program itself at one K slice.

Built from the quad kernel's step helpers (_gemv_quad_triton.py); its SiLU and store helpers also serve the integer-dot
gated kernel (_gemv_idot_gated_triton.py) and the split epilogue. Imported only when a kernel is launched (through
mmsdk.kernels._w4a16_triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmsdk.kernels._gemv_quad_triton import (
    norm_scale,
    quad_step,
    squares_at,
    step_activations,
    step_scales,
    step_words,
    whole_steps_end,
)
from mmsdk.kernels._gemv_store_triton import load_norm_parts, rms_from_parts
from mmsdk.kernels._pdl_triton import wait_for_inputs


@triton.jit
def silu_times(gate, up):
    """``silu(gate) * up`` in fp32 (rounded once by the caller's store)."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def store_gated(out_ptr, gate, up, row, split, M, N, rn, n_ok, DIRECT: tl.constexpr):
    """A gated program's finished rows ``rn`` of both products: with ``DIRECT`` (one K slice) ``silu(gate) * up`` in
    out's dtype, otherwise both fp32 partials at ``out[split]`` (rows ``2N`` wide, up at columns ``N ..``) for
    mmsdk.kernels.split_k.finish_splits."""
    if DIRECT:
        tl.store(out_ptr + row.to(tl.int64) * N + rn, silu_times(gate, up).to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        dst = out_ptr + (split * M + row).to(tl.int64) * (2 * N) + rn
        tl.store(dst, gate, mask=n_ok)
        tl.store(dst + N, up, mask=n_ok)


@triton.jit
def gated_weights(w_ptr, s_ptr, w2_ptr, s2_ptr, at, w0, w_end, rn, rc, rw, n_ok, k_blocks, WPG: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, MASK_K: tl.constexpr = True,
                  MASK_N: tl.constexpr = True):
    """A step's word tiles and scales of both weights (``at`` as :func:`step_words` takes it), with its quads' first
    words, masks and groups (masked as in :func:`step_words`)."""
    cw = w0 + 4 * rc  # first word of each quad
    c_ok = cw < w_end
    ok = n_ok[:, None] & c_ok[None, :]
    g = cw // WPG
    return (step_words(w_ptr, at, w0, rw, n_ok, w_end, BLOCK_N, BLOCK_C, MASK_K, MASK_N),
            step_words(w2_ptr, at, w0, rw, n_ok, w_end, BLOCK_N, BLOCK_C, MASK_K, MASK_N),
            step_scales(s_ptr, rn, g, ok, n_ok, k_blocks, BLOCK_N, BLOCK_C, MASK_K, MASK_N),
            step_scales(s2_ptr, rn, g, ok, n_ok, k_blocks, BLOCK_N, BLOCK_C, MASK_K, MASK_N), cw, c_ok, ok, g)


@triton.jit
def gated_accumulate(gate_words, up_words, gate_s, up_s, x_row, cw, c_ok, K_in, z_ptr, z2_ptr, rn, g, ok, stride_zn,
                     HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                     MASK_K: tl.constexpr = True, f_row=None, NORM: tl.constexpr = False):
    """Both weights' steps (:func:`quad_step`) over one load and split of the step's activations."""
    xs, y0, y1, y2, y3, y4, y5, y6, y7 = step_activations(x_row, cw, c_ok, K_in, MASK_K, f_row, NORM)
    return (quad_step(gate_words, gate_s, z_ptr, rn, g, ok, stride_zn, xs, y0, y1, y2, y3, y4, y5, y6, y7, HAS_ZP,
                      BLOCK_N, BLOCK_C),
            quad_step(up_words, up_s, z2_ptr, rn, g, ok, stride_zn, xs, y0, y1, y2, y3, y4, y5, y6, y7, HAS_ZP,
                      BLOCK_N, BLOCK_C))


@triton.jit
def gated_step_at(w_ptr, s_ptr, w2_ptr, s2_ptr, at, w0, w_end, rn, rc, rw, n_ok, k_blocks, x_row, K_in, z_ptr,
                  z2_ptr, stride_zn, WPG: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_C: tl.constexpr, MASK_K: tl.constexpr, MASK_N: tl.constexpr, f_row=None,
                  NORM: tl.constexpr = False):
    """Both weights' step at word ``w0`` (:func:`gated_weights`, then :func:`gated_accumulate`), masked as in
    :func:`step_words`: the gated kernel's :func:`quad_step_at`."""
    gate_words, up_words, gate_s, up_s, cw, c_ok, ok, g = gated_weights(
        w_ptr, s_ptr, w2_ptr, s2_ptr, at, w0, w_end, rn, rc, rw, n_ok, k_blocks, WPG, BLOCK_N, BLOCK_C, MASK_K, MASK_N)
    return gated_accumulate(gate_words, up_words, gate_s, up_s, x_row, cw, c_ok, K_in, z_ptr, z2_ptr, rn, g, ok,
                            stride_zn, HAS_ZP, BLOCK_N, BLOCK_C, MASK_K, f_row, NORM)


@triton.jit
def gated_steps(gate, up, ssq, w_from, w_to, w_ptr, s_ptr, w2_ptr, s2_ptr, at, w_end, rn, rc, rw, n_ok, k_blocks,
                x_row, K_in, z_ptr, z2_ptr, stride_zn, f_row, WPG: tl.constexpr, HAS_ZP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, MASK_K: tl.constexpr, MASK_N: tl.constexpr,
                NORM: tl.constexpr, WHOLE_ROW: tl.constexpr):
    """The steps from word ``w_from`` to ``w_to`` (:func:`gated_step_at`, masked as it takes ``MASK_K`` / ``MASK_N``)
    added to the gate and up accumulators, and with a folded norm over a whole row their activations' squares to
    ``ssq`` (:func:`squares_at`)."""
    for w0 in range(w_from, w_to, 4 * BLOCK_C):
        gate_step, up_step = gated_step_at(w_ptr, s_ptr, w2_ptr, s2_ptr, at, w0, w_end, rn, rc, rw, n_ok, k_blocks,
                                           x_row, K_in, z_ptr, z2_ptr, stride_zn, WPG, HAS_ZP, BLOCK_N, BLOCK_C,
                                           MASK_K, MASK_N, f_row, NORM)
        gate += gate_step
        up += up_step
        ssq += squares_at(x_row, w0, w_end, rc, K_in, MASK_K, NORM, WHOLE_ROW)
    return gate, up, ssq


@triton.jit
def gemv_quad_gated(x_ptr, w_ptr, s_ptr, z_ptr, w2_ptr, s2_ptr, z2_ptr, out_ptr, M, N, K_in, KW, groups_per_split,
                    stride_xm, stride_zn, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, DIRECT: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False,
                    ROW_MASK: tl.constexpr = True, f_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                    NORM_BLOCK: tl.constexpr = 1024, WHOLE_ROW: tl.constexpr = False, sq_ptr=None, n_parts=0,
                    PARTS: tl.constexpr = 1, ROW_SCALE: tl.constexpr = False):
    """``silu(x @ Wg.T) * (x @ Wu.T)`` for one activation row per program: each program the same rows of both.

    Gate (``w/s/z``) and up (``w2/s2/z2``, same shape) rows ``rn`` are two accumulators over the same
    steps: a step loads both word tiles, then the activations once (one 16-byte load per word, split by
    nibble position, shared by both weights), then runs :func:`quad_step` per weight. With ``DIRECT``
    (one K slice) the program holds both finished products and stores ``silu(gate) * up`` in out's
    dtype: no partials and no second kernel. Otherwise it stores fp32 partials at ``out[split]``
    (rows ``2N`` wide, up at columns ``N ..``) for ``split_gated``. The arithmetic is
    :func:`gemv_quad`'s; a tile carries twice its weight bytes per thread and step. ``PDL`` as in
    :func:`gemv_quad`: the first step's words and scales of both weights load before the wait. ``NORM``
    as in :func:`gemv_quad` (a decoder layer's post-attention RMSNorm read by its MLP): both products scaled.
    With ``ROW_SCALE`` ``x`` is an RMSNorm's input times its weight, as the kernel that computed the input left it
    (``LEAVE_NORM`` in :func:`gemv_quad`) with its partial sums of squares (``n_parts`` per row at ``sq_ptr``,
    loaded and reduced right after the wait): the K loop is the plain one, and both products are scaled by the
    row's ``1 / rms`` (``eps``).
    """
    WPG: tl.constexpr = GROUP // 8
    pid_n, split, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_blocks = KW // WPG
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc, rw = tl.arange(0, BLOCK_C), tl.arange(0, 4 * BLOCK_C)
    n_ok = rn < N
    x_row = x_ptr + row * stride_xm
    f_row = f_ptr if NORM else x_row
    ssq = tl.zeros((BLOCK_C,), tl.float32)
    gate = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    w_begin = split * groups_per_split * WPG
    w_end = tl.minimum(w_begin + groups_per_split * WPG, KW)
    at = rn[:, None].to(tl.int64) * KW + rw[None, :]
    w_loop = w_begin
    if PDL:  # the first step, both weights' words and scales loaded before the wait
        gate_words, up_words, gate_s, up_s, cw, c_ok, ok, g = gated_weights(
            w_ptr, s_ptr, w2_ptr, s2_ptr, at, w_begin, w_end, rn, rc, rw, n_ok, k_blocks, WPG, BLOCK_N, BLOCK_C)
        wait_for_inputs(PDL)
        gate_step, up_step = gated_accumulate(gate_words, up_words, gate_s, up_s, x_row, cw, c_ok, K_in, z_ptr, z2_ptr,
                                              rn, g, ok, stride_zn, HAS_ZP, BLOCK_N, BLOCK_C, True, f_row, NORM)
        gate += gate_step
        up += up_step
        ssq += squares_at(x_row, w_begin, w_end, rc, K_in, True, NORM, WHOLE_ROW)
        w_loop = w_begin + 4 * BLOCK_C
    if ROW_SCALE:  # reduced now: one register through the K loop, and no round trip after it
        row_scale = rms_from_parts(load_norm_parts(sq_ptr, row, n_parts, PARTS), K_in, eps)
    full_end = whole_steps_end(w_loop, w_end, K_in, 4 * BLOCK_C)
    # the whole steps without K masks (every word and activation exists), then the slice's last, partial step
    gate, up, ssq = gated_steps(gate, up, ssq, w_loop, full_end, w_ptr, s_ptr, w2_ptr, s2_ptr, at, w_end, rn, rc, rw,
                                n_ok, k_blocks, x_row, K_in, z_ptr, z2_ptr, stride_zn, f_row, WPG, HAS_ZP, BLOCK_N,
                                BLOCK_C, False, ROW_MASK, NORM, WHOLE_ROW)
    gate, up, ssq = gated_steps(gate, up, ssq, full_end, w_end, w_ptr, s_ptr, w2_ptr, s2_ptr, at, w_end, rn, rc, rw,
                                n_ok, k_blocks, x_row, K_in, z_ptr, z2_ptr, stride_zn, f_row, WPG, HAS_ZP, BLOCK_N,
                                BLOCK_C, True, True, NORM, WHOLE_ROW)
    gate_out = tl.sum(gate, 1) * 1.8446744073709552e+19  # undo 2**-64
    up_out = tl.sum(up, 1) * 1.8446744073709552e+19
    if NORM:
        scale = norm_scale(ssq, x_row, K_in, eps, WHOLE_ROW, NORM_BLOCK)
        gate_out *= scale
        up_out *= scale
    if ROW_SCALE:
        gate_out *= row_scale
        up_out *= row_scale
    store_gated(out_ptr, gate_out, up_out, row, split, M, N, rn, n_ok, DIRECT)
