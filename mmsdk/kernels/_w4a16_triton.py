"""Triton kernels behind mmsdk.kernels.w4a16 (imported only when a kernel is launched)."""

from __future__ import annotations

import triton
import triton.language as tl

# the batch-1 quad GEMVs and the tensor-core GEMV live in their own modules; launched through this one
from mmsdk.kernels._gemv_mma_triton import gemv_mma
from mmsdk.kernels._gemv_gated_triton import gemv_quad_gated, silu_times
from mmsdk.kernels._gemv_idot_gated_triton import gemv_idot_gated
from mmsdk.kernels._gemv_idot_triton import gemv_idot, quantize_activations
from mmsdk.kernels._gemv_quad_triton import gemv_quad
from mmsdk.kernels._gemv_store_triton import load_norm_parts, rms_from_parts, store_output
from mmsdk.kernels._pdl_triton import wait_for_inputs

__all__ = ["dequant", "fused", "gemv", "gemv_idot", "gemv_idot_gated", "gemv_mma", "gemv_quad", "gemv_quad_gated",
           "quantize_activations", "split_gated", "split_sum"]


@triton.jit
def dequant_tile(w, s_ptr, z_ptr, rn, n_ok, k0, kp, stride_zn,
                 GROUP: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Even- and odd-k weights of a [BLOCK_K/2, BLOCK_N] byte tile, fp32, scaled (k along dim 0)."""
    NG: tl.constexpr = BLOCK_K // GROUP
    GH: tl.constexpr = GROUP // 2
    k_blocks = kp // GROUP
    g = k0 // GROUP + tl.arange(0, NG)
    g_ok = n_ok[None, :] & (g[:, None] < k_blocks)
    s = tl.load(s_ptr + rn[None, :] * k_blocks + g[:, None], mask=g_ok, other=0.0).to(tl.float32)
    if HAS_ZP:
        zb = tl.load(z_ptr + rn[None, :] * stride_zn + g[:, None] // 2, mask=g_ok, other=0)
        z = ((zb >> ((g[:, None] % 2) * 4).to(tl.uint8)) & 15).to(tl.float32)
    else:
        z = tl.full((NG, BLOCK_N), 8.0, tl.float32)
    lo = tl.reshape((w & 15).to(tl.float32), (NG, GH, BLOCK_N))
    hi = tl.reshape((w >> 4).to(tl.float32), (NG, GH, BLOCK_N))
    lo = (lo - z[:, None, :]) * s[:, None, :]
    hi = (hi - z[:, None, :]) * s[:, None, :]
    return tl.reshape(lo, (BLOCK_K // 2, BLOCK_N)), tl.reshape(hi, (BLOCK_K // 2, BLOCK_N))


@triton.jit
def fused(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K_in, KP, stride_xm, stride_om, stride_zn,
          GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rh = tl.arange(0, HALF)
    n_ok, m_ok = rn < N, rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KP, BLOCK_K):
        ke = k0 + 2 * rh
        x_row = x_ptr + rm[:, None] * stride_xm + ke[None, :]
        xe = tl.load(x_row, mask=m_ok[:, None] & (ke[None, :] < K_in), other=0.0)
        xo = tl.load(x_row + 1, mask=m_ok[:, None] & (ke[None, :] + 1 < K_in), other=0.0)
        kb = k0 // 2 + rh
        w = tl.load(w_ptr + rn[None, :] * (KP // 2) + kb[:, None], mask=n_ok[None, :] & (kb[:, None] < KP // 2),
                    other=0)
        lo, hi = dequant_tile(w, s_ptr, z_ptr, rn, n_ok, k0, KP, stride_zn, GROUP, HAS_ZP, BLOCK_N, BLOCK_K)
        acc += tl.dot(xe, lo.to(xe.dtype))
        acc += tl.dot(xo, hi.to(xo.dtype))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def dequant(w_ptr, s_ptr, z_ptr, out_ptr, N, K_out, KP, stride_zn,
            GROUP: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rh = tl.arange(0, HALF)
    n_ok = rn < N
    kb = k0 // 2 + rh
    w = tl.load(w_ptr + rn[None, :] * (KP // 2) + kb[:, None], mask=n_ok[None, :] & (kb[:, None] < KP // 2),
                other=0)
    lo, hi = dequant_tile(w, s_ptr, z_ptr, rn, n_ok, k0, KP, stride_zn, GROUP, HAS_ZP, BLOCK_N, BLOCK_K)
    tile = tl.reshape(tl.join(tl.trans(lo), tl.trans(hi)), (BLOCK_N, BLOCK_K))  # interleave even/odd k
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rn[:, None] * K_out + rk[None, :], tile.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (rk[None, :] < K_out))


@triton.jit
def gemv(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K_in, KW, groups_per_split, stride_xm, stride_zn,
         GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, DOT: tl.constexpr):
    """``x @ W.T`` over one K split (few rows, decode): fp32 partial at ``out[split]``, or with ``DIRECT``
    (one split) the finished ``[M, N]`` output with bias, in out's dtype.

    The packed bytes are read as int32 words (8 nibbles, k = 8 * word + nibble in the MatMulNBits
    layout), ``BLOCK_G`` whole groups per step, so each group's scale is loaded once. A nibble turns
    into its fp32 value by OR-ing it into the mantissa of 2^23 (no int-to-float conversion). With
    ``DOT`` the dequantized tile goes to the tensor cores; otherwise each row is a multiply-reduce
    in registers, with the zero point folded out: ``s * (sum q x - z sum x)``.
    """
    WPG: tl.constexpr = GROUP // 8
    pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_blocks = KW // WPG
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rg, rw, rs = tl.arange(0, BLOCK_G), tl.arange(0, WPG), tl.arange(0, 8)
    n_ok = rn < N
    k_in = (rg[:, None, None] * GROUP + rw[None, :, None] * 8 + rs[None, None, :])  # [BG, WPG, 8] within a step
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_G, WPG), dtype=tl.float32)  # one row: per-thread partials, reduced once
    k2 = rg[:, None] * GROUP + rw[None, :] * 8
    g_begin = split * groups_per_split
    g_end = tl.minimum(g_begin + groups_per_split, k_blocks)
    for g0 in range(g_begin, g_end, BLOCK_G):
        g = g0 + rg
        g_ok = g < g_end
        ok2 = n_ok[:, None] & g_ok[None, :]
        words = tl.load(w_ptr + rn[:, None, None].to(tl.int64) * KW + g[None, :, None] * WPG + rw[None, None, :],
                        mask=ok2[:, :, None], other=0)
        s = tl.load(s_ptr + rn[:, None] * k_blocks + g[None, :], mask=ok2, other=0.0).to(tl.float32)
        if HAS_ZP:
            zb = tl.load(z_ptr + rn[:, None] * stride_zn + g[None, :] // 2, mask=ok2, other=0)
            z = ((zb >> ((g[None, :] % 2) * 4).to(tl.uint8)) & 15).to(tl.float32)
        else:
            z = tl.full((BLOCK_N, BLOCK_G), 8.0, tl.float32)
        if BLOCK_M == 1 and not DOT:
            # nibble by nibble on the word tile itself: elementwise FMAs only, no cross-thread work per step
            row = pid_m
            t3 = tl.zeros((BLOCK_N, BLOCK_G, WPG), dtype=tl.float32)
            xs = tl.zeros((BLOCK_G, WPG), dtype=tl.float32)
            for j in tl.static_range(8):
                kj = g0 * GROUP + k2 + j
                xj = tl.load(x_ptr + row * stride_xm + kj, mask=g_ok[:, None] & (kj < K_in), other=0.0).to(tl.float32)
                qj = (((words >> (4 * j)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                t3 += qj * xj[None, :, :]
                xs += xj
            acc3 += s[:, :, None] * (t3 - z[:, :, None] * xs[None, :, :])
        elif DOT:
            k = g0 * GROUP + k_in
            x_ok = (g_ok[:, None, None]) & (k < K_in)
            nib = (words[:, :, :, None] >> (rs * 4)[None, None, None, :]) & 15
            q = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # [BN, BG, WPG, 8], exact 0..15
            wq = (q - z[:, :, None, None]) * s[:, :, None, None]
            wt = tl.reshape(wq, (BLOCK_N, BLOCK_G * GROUP)).to(x_ptr.dtype.element_ty)
            kk = tl.reshape(k, (BLOCK_G * GROUP,))
            kk_ok = tl.reshape(x_ok, (BLOCK_G * GROUP,))
            xt = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm < M)[:, None] & kk_ok[None, :],
                         other=0.0)
            acc += tl.dot(xt, tl.trans(wt))
        else:  # a few rows: the same nibble loop per row, reduced to [BLOCK_N] per step
            for i in tl.static_range(BLOCK_M):
                # rows past M read row M - 1 (a scalar row mask is not a valid load mask everywhere); the
                # store masks them out
                row = tl.minimum(pid_m * BLOCK_M + i, M - 1)
                t3 = tl.zeros((BLOCK_N, BLOCK_G, WPG), dtype=tl.float32)
                xs = tl.zeros((BLOCK_G, WPG), dtype=tl.float32)
                for j in tl.static_range(8):
                    kj = g0 * GROUP + k2 + j
                    xj = tl.load(x_ptr + row * stride_xm + kj, mask=g_ok[:, None] & (kj < K_in),
                                 other=0.0).to(tl.float32)
                    qj = (((words >> (4 * j)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    t3 += qj * xj[None, :, :]
                    xs += xj
                part = tl.sum(tl.sum(s[:, :, None] * (t3 - z[:, :, None] * xs[None, :, :]), 2), 1)
                acc = tl.where((tl.arange(0, BLOCK_M) == i)[:, None], acc + part[None, :], acc)
    if BLOCK_M == 1 and not DOT:
        acc = tl.sum(tl.sum(acc3, 2), 1)[None, :]
    dst = out_ptr + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[:, None] & n_ok[None, :])
    else:
        tl.store(dst, acc, mask=(rm < M)[:, None] & n_ok[None, :])


@triton.jit
def split_sum(p_ptr, b_ptr, r_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, g_ptr=None, scaled_ptr=None, sq_ptr=None, n_parts=0,
              LEAVE_NORM: tl.constexpr = False, PDL: tl.constexpr = False):
    """``out = sum over splits of p[split] (+ bias)``, cast to out's dtype (p is fp32 ``[SPLITS, M, N]``; programs
    ``(column block, row)``); with ``HAS_RESIDUAL`` that product plus the residual ``r``; with ``LEAVE_NORM`` the
    statistics of the RMSNorm that reads ``out`` as well, one part per column block (the store:
    mmsdk/kernels/_gemv_store_triton.py, ``store_output``). With ``PDL`` the launch overlaps the GEMV's tail and the
    next kernel's first loads overlap this one (mmsdk/kernels/_pdl_triton.py)."""
    wait_for_inputs(PDL)
    part, row = tl.program_id(0), tl.program_id(1)
    columns = part * BLOCK + tl.arange(0, BLOCK)
    ok = columns < N
    r = row * N + columns
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + s * MN + r, mask=ok, other=0.0)
    store_output(acc, columns, ok, row, part, N, b_ptr, r_ptr, out_ptr, g_ptr, scaled_ptr, sq_ptr, n_parts, HAS_BIAS,
                 HAS_RESIDUAL, LEAVE_NORM)


@triton.jit
def split_gated(p_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr, sq_ptr=None, n_parts=0, K_in=1,
                eps=0.0, PARTS: tl.constexpr = 1, ROW_SCALE: tl.constexpr = False, PDL: tl.constexpr = False):
    """``out = silu(gate) * up`` from fp32 partials ``p [SPLITS, M, 2N]`` (gate at columns < N, up after).

    SiLU and the product run in fp32 and are rounded once (transformers rounds the SiLU output and
    the product to the model dtype separately: the difference is one bf16 rounding). With ``ROW_SCALE`` (one row)
    both sums are scaled by the row's ``1 / rms`` first: the GEMV read an RMSNorm's input times its weight, whose
    statistics the kernel before it left (:func:`~mmsdk.kernels._gemv_store_triton.load_norm_parts`). ``PDL`` as in
    :func:`split_sum`.
    """
    wait_for_inputs(PDL)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < MN
    at = (r // N) * (2 * N) + r % N
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        gate += tl.load(p_ptr + s * 2 * MN + at, mask=ok, other=0.0)
        up += tl.load(p_ptr + s * 2 * MN + at + N, mask=ok, other=0.0)
    if ROW_SCALE:
        scale = rms_from_parts(load_norm_parts(sq_ptr, 0, n_parts, PARTS), K_in, eps)
        gate *= scale
        up *= scale
    tl.store(out_ptr + r, silu_times(gate, up).to(out_ptr.dtype.element_ty), mask=ok)
