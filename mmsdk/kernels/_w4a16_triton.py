"""Triton kernels behind mmsdk.kernels.w4a16 (imported only when a kernel is launched)."""

from __future__ import annotations

import triton
import triton.language as tl


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
def split_sum(p_ptr, b_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``out = sum over splits of p[split] (+ bias)``, cast to out's dtype (p is fp32 ``[SPLITS, M, N]``)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + s * MN + r, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + r % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def split_gated(p_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``out = silu(gate) * up`` from fp32 partials ``p [SPLITS, M, 2N]`` (gate at columns < N, up after).

    SiLU and the product run in fp32 and are rounded once (transformers rounds the SiLU output and
    the product to the model dtype separately: the difference is one bf16 rounding).
    """
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < MN
    at = (r // N) * (2 * N) + r % N
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        gate += tl.load(p_ptr + s * 2 * MN + at, mask=ok, other=0.0)
        up += tl.load(p_ptr + s * 2 * MN + at + N, mask=ok, other=0.0)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + r, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def nibble_factor(P: tl.constexpr):
    """2**(85 - P): turns a nibble left at bit position ``P`` of a subnormal float into ``code * 2**-64``."""
    if P == 0:
        return 3.8685626227668134e+25  # 2**85
    elif P == 4:
        return 2.4178516392292583e+24  # 2**81
    elif P == 8:
        return 1.5111572745182865e+23  # 2**77
    elif P == 12:
        return 9.44473296573929e+21  # 2**73
    else:
        return 5.902958103587057e+20  # 2**69


@triton.jit
def nibble_term(t, masked, xj, P: tl.constexpr):
    """``t + code * x * 2**-64`` for the nibble left at bit ``P`` of ``masked`` (a subnormal once bitcast); also x."""
    xj = xj.to(tl.float32)
    return t + masked.to(tl.float32, bitcast=True) * (xj * nibble_factor(P))[None, :, :], xj


@triton.jit
def activations_by_nibble(x_row, cw, c_ok, K_in):
    """The 8 activations of every word of a step, ``[C, 4]`` each, from one 16-byte vector per word.

    ``x[8w .. 8w+7]`` is loaded as ``[C, 4, 8]`` (contiguous per word) and split by nibble position
    with three in-register splits (``j = 4 i0 + 2 i1 + i2``).
    """
    rq, rj = tl.arange(0, 4), tl.arange(0, 8)
    k = (cw[:, None, None] + rq[None, :, None]) * 8 + rj[None, None, :]
    x = tl.load(x_row + k, mask=c_ok[:, None, None] & (k < K_in), other=0.0)
    even, odd = tl.split(tl.reshape(x, (x.shape[0], 4, 2, 2, 2)))
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def gemv_quad(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K_in, KW, groups_per_split, stride_xm,
              stride_zn, w2_ptr, s2_ptr, z2_ptr, n_blocks, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
              HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, PAIRED: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_C: tl.constexpr, PREFETCH: tl.constexpr = False):
    """Batch-1 GEMV over ``[BLOCK_N, BLOCK_C, 4]`` word tiles (one activation row per program).

    With ``PAIRED`` two weights of the same shape share the launch (a gated MLP's gate and up
    projections): programs past ``n_blocks`` along axis 0 read the second weight (``w2/s2/z2``) and
    write its fp32 partials at columns ``N .. 2N`` of ``out`` (rows ``2N`` wide), for
    :func:`split_gated` to finish as ``silu(gate) * up``.

    Three things make it fast where :func:`gemv` is not (H200 measurements in docs/benchmarks.md):

    * Activations as 16-byte vectors. :func:`gemv` gathers each nibble position's activation
      (``x[8w + j]``) with a 2-byte load whose 32 lanes hit addresses 64 bytes apart, about 16 L1
      wavefronts per load and 8 loads per weight word: the activations, not the weights, saturated
      the load path (1.0-1.2 TB/s whatever else changed). Here a word's 8 activations are one
      16-byte load, split by nibble position in registers.
    * Subnormal nibbles. A nibble masked in place, ``w & (15 << 4j)``, read as an fp32 bit pattern
      is the exact subnormal ``code * 2**(4j - 149)`` (nibble in mantissa bits 0..19); times
      ``x * 2**(85 - 4j)`` it gives ``code * x * 2**-64`` in one FMA, so a nibble costs one AND
      instead of a shift, an AND, an OR and a subtraction (nibbles 5..7 come from one shift by 20).
      The zero point folds out (``s * (sum c x - z sum x)``), the 2**-64 is undone at the end (exact;
      activations up to 2**42 stay finite). Needs subnormals kept (PTX ``fma.rn.f32`` without
      ``.ftz``, Triton's default); the GPU tests compare against the reference and catch a flush.
    * Quads. The last tile axis is one 16-byte weight load of 4 words of one group, so a thread
      loads one scale per row and quad and sums its 4 words before scaling; the weights are loaded
      as one contiguous run per row (lanes along K) and viewed as quads; rows run over warps, so an
      activation a thread loads serves ``BLOCK_N / num_warps`` rows. The fastest tiles measured carry
      128-256 weight bytes per thread and step, and at 8 rows or fewer the activations' split by
      nibble position needs at most 5 shared-memory barriers per program (23-24 for wider tiles;
      benchmarks/sm90_gemv_builds.py).

    With ``PREFETCH`` (kind "quadp") each step issues the next step's weight loads before its own
    arithmetic (registers for two word tiles), so a program keeps loads in flight while it computes.
    """
    WPG: tl.constexpr = GROUP // 8
    pid_n, split, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    out_cols = N
    column0 = 0
    if PAIRED:
        out_cols = 2 * N
        if pid_n >= n_blocks:  # the second weight: same shape, its own buffers
            pid_n -= n_blocks
            column0 = N
            w_ptr, s_ptr, z_ptr = w2_ptr, s2_ptr, z2_ptr
    k_blocks = KW // WPG
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, BLOCK_C)
    n_ok = rn < N
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    w_begin = split * groups_per_split * WPG
    w_end = tl.minimum(w_begin + groups_per_split * WPG, KW)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * KW
    rw = tl.arange(0, 4 * BLOCK_C)
    if PREFETCH:  # the first step's words; each step then loads the next step's before its arithmetic
        flat = tl.load(w_rows + w_begin + rw[None, :], mask=n_ok[:, None] & (w_begin + rw < w_end)[None, :], other=0)
    for w0 in range(w_begin, w_end, 4 * BLOCK_C):
        cw = w0 + 4 * rc  # first word of each quad
        c_ok = cw < w_end
        ok = n_ok[:, None] & c_ok[None, :]
        if PREFETCH:
            words = tl.reshape(flat, (BLOCK_N, BLOCK_C, 4))
            at = w0 + 4 * BLOCK_C + rw
            flat = tl.load(w_rows + at[None, :], mask=n_ok[:, None] & (at < w_end)[None, :], other=0)
        else:
            flat = tl.load(w_rows + w0 + rw[None, :], mask=n_ok[:, None] & (w0 + rw < w_end)[None, :], other=0)
            words = tl.reshape(flat, (BLOCK_N, BLOCK_C, 4))
        g = cw // WPG
        s = tl.load(s_ptr + rn[:, None] * k_blocks + g[None, :], mask=ok, other=0.0).to(tl.float32)
        a0, a1, a2, a3, a4, a5, a6, a7 = activations_by_nibble(x_row, cw, c_ok, K_in)
        high = words >> 20  # nibbles 5..7 at bits 0..11 (the sign extension is masked off below)
        t, x0 = nibble_term(0.0, words & 15, a0, 0)
        t, x1 = nibble_term(t, words & 0xF0, a1, 4)
        t, x2 = nibble_term(t, words & 0xF00, a2, 8)
        t, x3 = nibble_term(t, words & 0xF000, a3, 12)
        t, x4 = nibble_term(t, words & 0xF0000, a4, 16)
        t, x5 = nibble_term(t, high & 15, a5, 0)
        t, x6 = nibble_term(t, high & 0xF0, a6, 4)
        t, x7 = nibble_term(t, high & 0xF00, a7, 8)
        xs = tl.sum((x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7) * 5.421010862427522e-20, 1)  # 2**-64 * sum x, [C]
        if HAS_ZP:
            zb = tl.load(z_ptr + rn[:, None] * stride_zn + g[None, :] // 2, mask=ok, other=0)
            z = ((zb >> ((g[None, :] % 2) * 4).to(tl.uint8)) & 15).to(tl.float32)
        else:
            z = tl.full((BLOCK_N, BLOCK_C), 8.0, tl.float32)
        acc += s * (tl.sum(t, 2) - z * xs[None, :])
    out = tl.sum(acc, 1) * 1.8446744073709552e+19  # undo 2**-64
    dst = out_ptr + (split * M + row).to(tl.int64) * out_cols + column0 + rn
    if DIRECT:
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(dst, out, mask=n_ok)
