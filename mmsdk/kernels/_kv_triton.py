"""Triton kernels behind mmsdk.kernels.kv_decode (imported only when a kernel is launched).

Code formats (``FMT``): 0 = int4 (``q + 8`` two per byte, even channel low), 1 = int8, 2 = fp8 e4m3.
Channels are handled as even/odd halves throughout, so int4 bytes unpack without shuffles.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def round_half_even(y):
    """torch.round's rounding (ties to even) for fp32."""
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def encode(x, s, FMT: tl.constexpr):
    """Codes of x (fp32) with scale s: int4 as 0..15 (fp32), int8 as int8, fp8 as e4m3."""
    y = tl.math.div_rn(x, s)
    if FMT == 0:
        return tl.minimum(tl.maximum(round_half_even(y), -8.0), 7.0) + 8.0
    elif FMT == 1:
        return tl.minimum(tl.maximum(round_half_even(y), -128.0), 127.0).to(tl.int8)
    else:
        return tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)


@triton.jit
def append(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, len_ptr, H, TMAX, D, HDP,
           sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, FMT: tl.constexpr, BLOCK_HD: tl.constexpr):
    """Quantize token ``program_id(1)`` of one (batch, head) row of K and V and store it at ``length + l``."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    pos = tl.load(len_ptr) + tl.program_id(1)
    rd = tl.arange(0, BLOCK_HD)
    even, odd = 2 * rd, 2 * rd + 1
    me, mo = even < D, odd < D
    for which in tl.static_range(2):
        if which == 0:
            src = k_ptr + b * sk_b + h * sk_h + tl.program_id(1) * sk_t
            scale_ptr, dst = ks_ptr, kc_ptr
        else:
            src = v_ptr + b * sv_b + h * sv_h + tl.program_id(1) * sv_t
            scale_ptr, dst = vs_ptr, vc_ptr
        xe = tl.load(src + even, mask=me, other=0.0).to(tl.float32)
        xo = tl.load(src + odd, mask=mo, other=0.0).to(tl.float32)
        se = tl.load(scale_ptr + h * D + even, mask=me, other=1.0)
        so = tl.load(scale_ptr + h * D + odd, mask=mo, other=1.0)
        ce = encode(xe, se, FMT)
        co = encode(xo, so, FMT)
        row = (bh.to(tl.int64) * TMAX + pos)
        if FMT == 0:
            co = tl.where(mo, co, 0.0)  # an odd head_dim pads its last byte's high nibble with 0
            byte = ce.to(tl.uint8) | (co.to(tl.uint8) << 4)
            tl.store(dst + row * HDP + rd, byte, mask=rd < HDP)
        else:
            tl.store(dst + row * D + even, ce, mask=me)
            tl.store(dst + row * D + odd, co, mask=mo)


@triton.jit
def load_codes(c_ptr, rows, t_ok, rd, D, HDP, FMT: tl.constexpr):
    """Even- and odd-channel values (fp32, scale not applied) of code rows ``rows`` [BLOCK_T]."""
    if FMT == 0:
        byte = tl.load(c_ptr + rows[:, None] * HDP + rd[None, :], mask=t_ok[:, None] & (rd < HDP)[None, :], other=0)
        return (byte & 15).to(tl.float32) - 8.0, (byte >> 4).to(tl.float32) - 8.0
    else:
        base = c_ptr + rows[:, None] * D
        ce = tl.load(base + 2 * rd[None, :], mask=t_ok[:, None] & (2 * rd < D)[None, :], other=0)
        co = tl.load(base + 2 * rd[None, :] + 1, mask=t_ok[:, None] & (2 * rd + 1 < D)[None, :], other=0)
        return ce.to(tl.float32), co.to(tl.float32)


@triton.jit
def decode_partial(q_ptr, kc_ptr, vc_ptr, ks_ptr, len_ptr, mask_ptr, po_ptr, pl_ptr,
                   sq_b, sq_h, sm_b, mask_len, H_KV, G, TMAX, D, HDP, SPLIT_T, qk_scale,
                   FMT: tl.constexpr, HAS_MASK: tl.constexpr, USE_DOT: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr):
    """One (batch, KV head, split of the sequence): softmax-weighted V of its query heads, and their log-sum-exp."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = bh // H_KV
    hk = bh % H_KV
    length = tl.load(len_ptr)
    t_begin = split * SPLIT_T
    t_end = tl.minimum(t_begin + SPLIT_T, length)
    rg = tl.arange(0, BLOCK_G)
    g_ok = rg < G
    heads = hk * G + rg
    rd = tl.arange(0, BLOCK_HD)
    de, do = (2 * rd) < D, (2 * rd + 1) < D
    q_row = q_ptr + b * sq_b + heads[:, None] * sq_h
    qe = tl.load(q_row + 2 * rd[None, :], mask=g_ok[:, None] & de[None, :], other=0.0).to(tl.float32)
    qo = tl.load(q_row + 2 * rd[None, :] + 1, mask=g_ok[:, None] & do[None, :], other=0.0).to(tl.float32)
    # K's per-channel scale and the softmax scale fold into q once; exp2 replaces exp.
    qe = qe * (tl.load(ks_ptr + hk * D + 2 * rd, mask=de, other=0.0) * qk_scale)[None, :]
    qo = qo * (tl.load(ks_ptr + hk * D + 2 * rd + 1, mask=do, other=0.0) * qk_scale)[None, :]
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc_e = tl.zeros((BLOCK_G, BLOCK_HD), tl.float32)
    acc_o = tl.zeros((BLOCK_G, BLOCK_HD), tl.float32)
    base = bh.to(tl.int64) * TMAX
    for t0 in range(t_begin, t_end, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        t_ok = rt < t_end
        if HAS_MASK:
            keep = tl.load(mask_ptr + b * sm_b + rt, mask=t_ok & (rt < mask_len), other=0)
            t_ok = t_ok & (keep != 0)
        ke, ko = load_codes(kc_ptr, base + rt, t_ok, rd, D, HDP, FMT)
        if USE_DOT:
            s = tl.dot(qe, tl.trans(ke)) + tl.dot(qo, tl.trans(ko))
        else:
            s = tl.sum(qe[:, None, :] * ke[None, :, :], 2) + tl.sum(qo[:, None, :] * ko[None, :, :], 2)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        ve, vo = load_codes(vc_ptr, base + rt, t_ok, rd, D, HDP, FMT)
        if USE_DOT:
            acc_e = acc_e * alpha[:, None] + tl.dot(p, ve)
            acc_o = acc_o * alpha[:, None] + tl.dot(p, vo)
        else:
            acc_e = acc_e * alpha[:, None] + tl.sum(p[:, :, None] * ve[None, :, :], 1)
            acc_o = acc_o * alpha[:, None] + tl.sum(p[:, :, None] * vo[None, :, :], 1)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
    slot = (b * (H_KV * G) + heads).to(tl.int64) * n_splits + split
    out = po_ptr + slot[:, None] * (2 * BLOCK_HD) + rd[None, :]
    tl.store(out, acc_e / l_safe[:, None], mask=g_ok[:, None])
    tl.store(out + BLOCK_HD, acc_o / l_safe[:, None], mask=g_ok[:, None])
    tl.store(pl_ptr + slot, lse, mask=g_ok)


@triton.jit
def split_weights(pl_ptr, bh, n_splits, BLOCK_S: tl.constexpr):
    """(split ids, valid mask, weight of each split's partial, sum of weights) from the splits' log-sum-exp."""
    rs = tl.arange(0, BLOCK_S)
    s_ok = rs < n_splits
    lse = tl.load(pl_ptr + bh.to(tl.int64) * n_splits + rs, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with no keys: every weight 0, total 1
    w = tl.where(s_ok, tl.math.exp2(lse - top), 0.0)
    total = tl.sum(w, 0)
    return rs, s_ok, w, tl.where(total == 0.0, 1.0, total)


@triton.jit
def decode_combine(po_ptr, pl_ptr, vs_ptr, out_ptr, HQ, G, D, n_splits, so_b, so_h,
                   BLOCK_S: tl.constexpr, BLOCK_HD: tl.constexpr):
    """Merge the splits of one (batch, query head) by their log-sum-exp, apply V's scale, write [B, 1, Hq, D]."""
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    hk = h // G
    rs, s_ok, w, total = split_weights(pl_ptr, bh, n_splits, BLOCK_S)
    rd = tl.arange(0, BLOCK_HD)
    rows = po_ptr + (bh.to(tl.int64) * n_splits + rs)[:, None] * (2 * BLOCK_HD) + rd[None, :]
    oe = tl.sum(w[:, None] * tl.load(rows, mask=s_ok[:, None], other=0.0), 0) / total
    oo = tl.sum(w[:, None] * tl.load(rows + BLOCK_HD, mask=s_ok[:, None], other=0.0), 0) / total
    de, do = (2 * rd) < D, (2 * rd + 1) < D
    oe = oe * tl.load(vs_ptr + hk * D + 2 * rd, mask=de, other=0.0)
    oo = oo * tl.load(vs_ptr + hk * D + 2 * rd + 1, mask=do, other=0.0)
    dst = out_ptr + b * so_b + h * so_h
    tl.store(dst + 2 * rd, oe.to(out_ptr.dtype.element_ty), mask=de)
    tl.store(dst + 2 * rd + 1, oo.to(out_ptr.dtype.element_ty), mask=do)


@triton.jit
def int4_words(c_ptr, rows, t_ok, rw, rs, W):
    """Values (fp32, ``code - 8``, scale not applied) of int4 code rows read as int32 words: ``[BLOCK_T, W, 8]``.

    Word ``w`` holds channels ``8w .. 8w+7`` (nibble ``s`` = channel ``8w + s``); a nibble becomes a
    float by OR-ing it into the mantissa of 2^23, which replaces an int-to-float conversion.
    """
    words = tl.load(c_ptr + rows[:, None] * W + rw[None, :], mask=t_ok[:, None], other=0)
    nib = (words[:, :, None] >> (rs * 4)[None, None, :]) & 15
    return (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def decode_partial_int4(q_ptr, kc_ptr, vc_ptr, ks_ptr, len_ptr, mask_ptr, po_ptr, pl_ptr,
                        sq_b, sq_h, sm_b, mask_len, H_KV, G, TMAX, SPLIT_T, qk_scale,
                        HAS_MASK: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_T: tl.constexpr, W: tl.constexpr):
    """Like :func:`decode_partial` for int4 codes read as int32 words (head_dim = 8 * W, a power of two).

    Partials are stored in natural channel order (``[slot, 8 * W]``) for :func:`decode_combine_natural`.
    """
    D: tl.constexpr = 8 * W
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = bh // H_KV
    hk = bh % H_KV
    length = tl.load(len_ptr)
    t_begin = split * SPLIT_T
    t_end = tl.minimum(t_begin + SPLIT_T, length)
    rg = tl.arange(0, BLOCK_G)
    g_ok = rg < G
    heads = hk * G + rg
    rw, rs = tl.arange(0, W), tl.arange(0, 8)
    ch = rw[:, None] * 8 + rs[None, :]  # [W, 8] channel index
    q = tl.load(q_ptr + b * sq_b + heads[:, None, None] * sq_h + ch[None, :, :], mask=g_ok[:, None, None],
                other=0.0).to(tl.float32)
    q = q * (tl.load(ks_ptr + hk * D + ch) * qk_scale)[None, :, :]  # K's scale and the softmax scale, once
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    if USE_DOT:
        q2 = tl.reshape(q, (BLOCK_G, D))
        acc2 = tl.zeros((BLOCK_G, D), tl.float32)
    else:
        acc = tl.zeros((BLOCK_G, W, 8), tl.float32)
    base = bh.to(tl.int64) * TMAX
    for t0 in range(t_begin, t_end, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        t_ok = rt < t_end
        if HAS_MASK:
            keep = tl.load(mask_ptr + b * sm_b + rt, mask=t_ok & (rt < mask_len), other=0)
            t_ok = t_ok & (keep != 0)
        k = int4_words(kc_ptr, base + rt, t_ok, rw, rs, W)
        if USE_DOT:
            s = tl.dot(q2, tl.trans(tl.reshape(k, (BLOCK_T, D))))
        else:
            s = tl.sum(tl.sum(q[:, None, :, :] * k[None, :, :, :], 3), 2)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = int4_words(vc_ptr, base + rt, t_ok, rw, rs, W)
        if USE_DOT:
            acc2 = acc2 * alpha[:, None] + tl.dot(p, tl.reshape(v, (BLOCK_T, D)))
        else:
            acc = acc * alpha[:, None, None] + tl.sum(p[:, :, None, None] * v[None, :, :, :], 1)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
    slot = (b * (H_KV * G) + heads).to(tl.int64) * n_splits + split
    if USE_DOT:
        rd = tl.arange(0, D)
        tl.store(po_ptr + slot[:, None] * D + rd[None, :], acc2 / l_safe[:, None], mask=g_ok[:, None])
    else:
        tl.store(po_ptr + slot[:, None, None] * D + ch[None, :, :], acc / l_safe[:, None, None],
                 mask=g_ok[:, None, None])
    tl.store(pl_ptr + slot, lse, mask=g_ok)


@triton.jit
def decode_combine_natural(po_ptr, pl_ptr, vs_ptr, out_ptr, HQ, G, n_splits, so_b, so_h,
                           BLOCK_S: tl.constexpr, D: tl.constexpr):
    """Merge the splits of one (batch, query head) from natural-order partials (see decode_combine)."""
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    hk = h // G
    rs, s_ok, w, total = split_weights(pl_ptr, bh, n_splits, BLOCK_S)
    rd = tl.arange(0, D)
    rows = po_ptr + (bh.to(tl.int64) * n_splits + rs)[:, None] * D + rd[None, :]
    o = tl.sum(w[:, None] * tl.load(rows, mask=s_ok[:, None], other=0.0), 0) / total
    o = o * tl.load(vs_ptr + hk * D + rd)
    tl.store(out_ptr + b * so_b + h * so_h + rd, o.to(out_ptr.dtype.element_ty))


# Subnormal decoding (``decode_partial_int4_subnormal*``). An integer x < 2**24 in the low bits of an
# int32 reads, as fp32, as exactly ``x * 2**-149`` (exponent field 0: subnormal; exponent field 1 with
# mantissa m: 2**-126 + m * 2**-149, the same line). So a nibble masked in place at bit ``b`` <= 20
# is ``c * 2**(b - 149)``, and the other operand carries ``2**(149 - b)``: one AND and one FMA do the
# work of shift + AND + convert + subtract + FMA (the integer pipe has half the fp32 pipe's lanes).
# The factor 2**-40 keeps pre-scaled operands (|x| * 2**109, for p <= 256 and |q * K scale * softmax
# scale| < 2**18) below fp32's 2**128; results are multiplied by 2**40 at the end (exact: powers of
# two). This needs the FMA to keep subnormal inputs (PTX fma.rn.f32 without .ftz does); a flush would
# zero most code sums, leaving nearly uniform attention and outputs near -8 * V's scale, which the
# tests catch.
SUB_F0 = tl.constexpr(2.0 ** 109)  # nibble at bit 0 (nibble 0, and nibble 7 after >> 28)
SUB_F1 = tl.constexpr(2.0 ** 105)  # bit 4 (nibble 1, and nibble 6 after >> 20)
SUB_F2 = tl.constexpr(2.0 ** 101)  # bit 8 (nibble 2)
SUB_F3 = tl.constexpr(2.0 ** 97)  # bit 12 (nibble 3)
SUB_F4 = tl.constexpr(2.0 ** 93)  # bit 16 (nibble 4)
SUB_F5 = tl.constexpr(2.0 ** 89)  # bit 20 (nibble 5)
SUB_UNDO = tl.constexpr(2.0 ** 40)
RESCALE_SLACK = tl.constexpr(8.0)  # log2 units: p stays <= 256 between lazy rescales


@triton.jit
def subnormal_nibbles(w):
    """The 8 nibbles of int32 words ``w`` as exact tiny floats (see above), at bits 0, 4, .., 20, 4, 0.

    Nibbles 6 and 7 reach bits the exponent does not keep linear, so they come from logical shifts;
    the masks are not low-bit masks, so the compiler cannot turn them into two-instruction bit extracts.
    """
    u = w.to(tl.uint32, bitcast=True)
    f = tl.float32
    return ((w & 0xF).to(f, bitcast=True), (w & 0xF0).to(f, bitcast=True), (w & 0xF00).to(f, bitcast=True),
            (w & 0xF000).to(f, bitcast=True), (w & 0xF0000).to(f, bitcast=True),
            (w & 0xF00000).to(f, bitcast=True), ((u >> 20) & 0xF0).to(f, bitcast=True), (u >> 28).to(f, bitcast=True))


@triton.jit
def load_q_nibble(q_row, ks_ptr, rw, g_ok, scale, J: tl.constexpr, F: tl.constexpr):
    """q's channels ``8w + J`` [BLOCK_G, W] (K's scale and ``scale`` folded in), and them pre-scaled by ``F``."""
    q = tl.load(q_row + 8 * rw[None, :] + J, mask=g_ok[:, None], other=0.0).to(tl.float32)
    q = q * (tl.load(ks_ptr + 8 * rw + J) * scale)[None, :]
    return q, q * F


@triton.jit
def subnormal_scores(kw, q0, q1, q2, q3, q4, q5, q6, q7):
    """``sum_d q_d c_d * 2**-40`` [BLOCK_G, BLOCK_T] of word tile ``kw`` [BLOCK_T, W] and pre-scaled q [BLOCK_G, W]."""
    k0, k1, k2, k3, k4, k5, k6, k7 = subnormal_nibbles(kw)
    s = k0[None, :, :] * q0[:, None, :]
    s += k1[None, :, :] * q1[:, None, :]
    s += k2[None, :, :] * q2[:, None, :]
    s += k3[None, :, :] * q3[:, None, :]
    s += k4[None, :, :] * q4[:, None, :]
    s += k5[None, :, :] * q5[:, None, :]
    s += k6[None, :, :] * q6[:, None, :]
    s += k7[None, :, :] * q7[:, None, :]
    return tl.sum(s, 2)


@triton.jit
def store_nibble_out(po_ptr, slot, rw, g_ok, acc, l_i, l_safe, J: tl.constexpr, W: tl.constexpr):
    """Channels ``8w + J`` of the partial output: tokens reduced, 2**40 undone, the ``- 8`` offset applied."""
    o = (tl.sum(acc, 1) * SUB_UNDO - 8.0 * l_i[:, None]) / l_safe[:, None]
    tl.store(po_ptr + slot[:, None] * (8 * W) + 8 * rw[None, :] + J, o, mask=g_ok[:, None])


@triton.jit
def load_q_nibble_1(q_row, ks_ptr, rw, scale, J: tl.constexpr, F: tl.constexpr):
    """One head's q channels ``8w + J`` [W] (see :func:`load_q_nibble`), and them pre-scaled by ``F``."""
    q = tl.load(q_row + 8 * rw + J).to(tl.float32) * tl.load(ks_ptr + 8 * rw + J) * scale
    return q, q * F


@triton.jit
def subnormal_scores_1(kw, q0, q1, q2, q3, q4, q5, q6, q7):
    """One head's ``sum_d q_d c_d * 2**-40`` [BLOCK_T] of word tile ``kw`` [BLOCK_T, W] and pre-scaled q [W]."""
    k0, k1, k2, k3, k4, k5, k6, k7 = subnormal_nibbles(kw)
    s = k0 * q0[None, :]
    s += k1 * q1[None, :]
    s += k2 * q2[None, :]
    s += k3 * q3[None, :]
    s += k4 * q4[None, :]
    s += k5 * q5[None, :]
    s += k6 * q6[None, :]
    s += k7 * q7[None, :]
    return tl.sum(s, 1)


@triton.jit
def store_nibble_out_1(po_ptr, slot, rw, acc, l_i, l_safe, J: tl.constexpr, W: tl.constexpr):
    """One head's channels ``8w + J`` of the partial output (see :func:`store_nibble_out`)."""
    tl.store(po_ptr + slot * (8 * W) + 8 * rw + J, (tl.sum(acc, 0) * SUB_UNDO - 8.0 * l_i) / l_safe)


@triton.jit
def decode_partial_int4_subnormal_mha(q_ptr, kc_ptr, vc_ptr, ks_ptr, len_ptr, mask_ptr, po_ptr, pl_ptr,
                                      sq_b, sq_h, sm_b, mask_len, H_KV, G, TMAX, SPLIT_T, qk_scale,
                                      HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, W: tl.constexpr):
    """:func:`decode_partial_int4_subnormal` for one query head per KV head, with 2-D tiles.

    Kept separate because Triton lays 3-D tiles with a size-1 head axis out one word per lane, which
    costs shared-memory round trips; the 2-D word tile keeps four consecutive words (a 16-byte load)
    of a token per thread from the load through the V sums. The rescale test is a scalar branch.
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = bh // H_KV
    hk = bh % H_KV
    length = tl.load(len_ptr)
    t_begin = split * SPLIT_T
    t_end = tl.minimum(t_begin + SPLIT_T, length)
    rw = tl.arange(0, W)
    q_row = q_ptr + b * sq_b + hk * sq_h
    ks_row = ks_ptr + hk * (8 * W)
    a0, q0 = load_q_nibble_1(q_row, ks_row, rw, qk_scale, 0, SUB_F0)
    a1, q1 = load_q_nibble_1(q_row, ks_row, rw, qk_scale, 1, SUB_F1)
    a2, q2 = load_q_nibble_1(q_row, ks_row, rw, qk_scale, 2, SUB_F2)
    a3, q3 = load_q_nibble_1(q_row, ks_row, rw, qk_scale, 3, SUB_F3)
    a4, q4 = load_q_nibble_1(q_row, ks_row, rw, qk_scale, 4, SUB_F4)
    a5, q5 = load_q_nibble_1(q_row, ks_row, rw, qk_scale, 5, SUB_F5)
    a6, q6 = load_q_nibble_1(q_row, ks_row, rw, qk_scale, 6, SUB_F1)
    a7, q7 = load_q_nibble_1(q_row, ks_row, rw, qk_scale, 7, SUB_F0)
    q_off = 8.0 * tl.sum(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7, 0)
    m_ref = tl.full([], float("-inf"), tl.float32)
    l_acc = tl.zeros((BLOCK_T,), tl.float32)
    v0 = tl.zeros((BLOCK_T, W), tl.float32)
    v1 = tl.zeros((BLOCK_T, W), tl.float32)
    v2 = tl.zeros((BLOCK_T, W), tl.float32)
    v3 = tl.zeros((BLOCK_T, W), tl.float32)
    v4 = tl.zeros((BLOCK_T, W), tl.float32)
    v5 = tl.zeros((BLOCK_T, W), tl.float32)
    v6 = tl.zeros((BLOCK_T, W), tl.float32)
    v7 = tl.zeros((BLOCK_T, W), tl.float32)
    base = bh.to(tl.int64) * TMAX
    for t0 in range(t_begin, t_end, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        t_ok = rt < t_end
        if HAS_MASK:
            keep = tl.load(mask_ptr + b * sm_b + rt, mask=t_ok & (rt < mask_len), other=0)
            t_ok = t_ok & (keep != 0)
        rows = (base + rt)[:, None] * W + rw[None, :]
        kw = tl.load(kc_ptr + rows, mask=t_ok[:, None], other=0)
        s = subnormal_scores_1(kw, q0, q1, q2, q3, q4, q5, q6, q7) * SUB_UNDO - q_off
        s = tl.where(t_ok, s, float("-inf"))
        m_tile = tl.max(s, 0)
        if m_tile > m_ref + RESCALE_SLACK:  # also the first tile with a valid token (m_ref = -inf)
            alpha = tl.math.exp2(m_ref - m_tile)
            l_acc *= alpha
            v0 *= alpha
            v1 *= alpha
            v2 *= alpha
            v3 *= alpha
            v4 *= alpha
            v5 *= alpha
            v6 *= alpha
            v7 *= alpha
            m_ref = m_tile
        p = tl.math.exp2(s - tl.where(m_ref == float("-inf"), 0.0, m_ref))
        l_acc += p
        vw = tl.load(vc_ptr + rows, mask=t_ok[:, None], other=0)
        c0, c1, c2, c3, c4, c5, c6, c7 = subnormal_nibbles(vw)
        # one factor per nibble position, shared by all words of a token
        p0 = (p * SUB_F0)[:, None]
        p1 = (p * SUB_F1)[:, None]
        p2 = (p * SUB_F2)[:, None]
        v0 += c0 * p0
        v1 += c1 * p1
        v2 += c2 * p2
        v3 += c3 * (p * SUB_F3)[:, None]
        v4 += c4 * (p * SUB_F4)[:, None]
        v5 += c5 * (p * SUB_F5)[:, None]
        v6 += c6 * p1
        v7 += c7 * p0
    l_i = tl.sum(l_acc, 0)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_ref + tl.math.log2(l_safe))
    slot = (b * H_KV + hk).to(tl.int64) * n_splits + split
    store_nibble_out_1(po_ptr, slot, rw, v0, l_i, l_safe, 0, W)
    store_nibble_out_1(po_ptr, slot, rw, v1, l_i, l_safe, 1, W)
    store_nibble_out_1(po_ptr, slot, rw, v2, l_i, l_safe, 2, W)
    store_nibble_out_1(po_ptr, slot, rw, v3, l_i, l_safe, 3, W)
    store_nibble_out_1(po_ptr, slot, rw, v4, l_i, l_safe, 4, W)
    store_nibble_out_1(po_ptr, slot, rw, v5, l_i, l_safe, 5, W)
    store_nibble_out_1(po_ptr, slot, rw, v6, l_i, l_safe, 6, W)
    store_nibble_out_1(po_ptr, slot, rw, v7, l_i, l_safe, 7, W)
    tl.store(pl_ptr + slot, lse)


@triton.jit
def decode_partial_int4_subnormal(q_ptr, kc_ptr, vc_ptr, ks_ptr, len_ptr, mask_ptr, po_ptr, pl_ptr,
                                  sq_b, sq_h, sm_b, mask_len, H_KV, G, TMAX, SPLIT_T, qk_scale,
                                  HAS_MASK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr,
                                  W: tl.constexpr):
    """Like :func:`decode_partial_int4`, decoding nibbles as subnormals, with per-thread V sums and lazy rescaling.

    V is accumulated per (head, token slot, word, nibble) and reduced over token slots once after
    the loop. The running max is a reference that moves only when a tile beats it by more than
    RESCALE_SLACK, so the accumulators are rescaled rarely instead of every tile. Codes are ``c + 8``:
    the offset comes out as ``- 8 * sum(q)`` for scores and ``- 8 * l`` for the output.
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = bh // H_KV
    hk = bh % H_KV
    length = tl.load(len_ptr)
    t_begin = split * SPLIT_T
    t_end = tl.minimum(t_begin + SPLIT_T, length)
    rg = tl.arange(0, BLOCK_G)
    g_ok = rg < G
    heads = hk * G + rg
    rw = tl.arange(0, W)
    q_row = q_ptr + b * sq_b + heads[:, None] * sq_h
    ks_row = ks_ptr + hk * (8 * W)
    # K's scale and the softmax scale (log2 units) fold into q once, as does each nibble's 2**(149 - bit) * 2**-40.
    a0, q0 = load_q_nibble(q_row, ks_row, rw, g_ok, qk_scale, 0, SUB_F0)
    a1, q1 = load_q_nibble(q_row, ks_row, rw, g_ok, qk_scale, 1, SUB_F1)
    a2, q2 = load_q_nibble(q_row, ks_row, rw, g_ok, qk_scale, 2, SUB_F2)
    a3, q3 = load_q_nibble(q_row, ks_row, rw, g_ok, qk_scale, 3, SUB_F3)
    a4, q4 = load_q_nibble(q_row, ks_row, rw, g_ok, qk_scale, 4, SUB_F4)
    a5, q5 = load_q_nibble(q_row, ks_row, rw, g_ok, qk_scale, 5, SUB_F5)
    a6, q6 = load_q_nibble(q_row, ks_row, rw, g_ok, qk_scale, 6, SUB_F1)
    a7, q7 = load_q_nibble(q_row, ks_row, rw, g_ok, qk_scale, 7, SUB_F0)
    q_off = 8.0 * tl.sum(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7, 1)  # [BLOCK_G]
    m_ref = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_acc = tl.zeros((BLOCK_G, BLOCK_T), tl.float32)
    v0 = tl.zeros((BLOCK_G, BLOCK_T, W), tl.float32)
    v1 = tl.zeros((BLOCK_G, BLOCK_T, W), tl.float32)
    v2 = tl.zeros((BLOCK_G, BLOCK_T, W), tl.float32)
    v3 = tl.zeros((BLOCK_G, BLOCK_T, W), tl.float32)
    v4 = tl.zeros((BLOCK_G, BLOCK_T, W), tl.float32)
    v5 = tl.zeros((BLOCK_G, BLOCK_T, W), tl.float32)
    v6 = tl.zeros((BLOCK_G, BLOCK_T, W), tl.float32)
    v7 = tl.zeros((BLOCK_G, BLOCK_T, W), tl.float32)
    base = bh.to(tl.int64) * TMAX
    for t0 in range(t_begin, t_end, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        t_ok = rt < t_end
        if HAS_MASK:
            keep = tl.load(mask_ptr + b * sm_b + rt, mask=t_ok & (rt < mask_len), other=0)
            t_ok = t_ok & (keep != 0)
        rows = (base + rt)[:, None] * W + rw[None, :]
        kw = tl.load(kc_ptr + rows, mask=t_ok[:, None], other=0)
        s = subnormal_scores(kw, q0, q1, q2, q3, q4, q5, q6, q7) * SUB_UNDO - q_off[:, None]
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_tile = tl.max(s, 1)
        grow = m_tile > m_ref + RESCALE_SLACK  # true on the first tile with a valid token (m_ref = -inf)
        if tl.max(grow.to(tl.int32), 0) != 0:
            m_new = tl.where(grow, m_tile, m_ref)
            alpha = tl.where(grow, tl.math.exp2(m_ref - m_new), 1.0)
            l_acc *= alpha[:, None]
            a3d = alpha[:, None, None]
            v0 *= a3d
            v1 *= a3d
            v2 *= a3d
            v3 *= a3d
            v4 *= a3d
            v5 *= a3d
            v6 *= a3d
            v7 *= a3d
            m_ref = m_new
        p = tl.math.exp2(s - tl.where(m_ref == float("-inf"), 0.0, m_ref)[:, None])
        l_acc += p
        vw = tl.load(vc_ptr + rows, mask=t_ok[:, None], other=0)
        c0, c1, c2, c3, c4, c5, c6, c7 = subnormal_nibbles(vw)
        # one factor per nibble position, shared by all words of a token
        p0 = (p * SUB_F0)[:, :, None]
        p1 = (p * SUB_F1)[:, :, None]
        p2 = (p * SUB_F2)[:, :, None]
        v0 += c0[None, :, :] * p0
        v1 += c1[None, :, :] * p1
        v2 += c2[None, :, :] * p2
        v3 += c3[None, :, :] * (p * SUB_F3)[:, :, None]
        v4 += c4[None, :, :] * (p * SUB_F4)[:, :, None]
        v5 += c5[None, :, :] * (p * SUB_F5)[:, :, None]
        v6 += c6[None, :, :] * p1
        v7 += c7[None, :, :] * p0
    l_i = tl.sum(l_acc, 1)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_ref + tl.math.log2(l_safe))
    slot = (b * (H_KV * G) + heads).to(tl.int64) * n_splits + split
    store_nibble_out(po_ptr, slot, rw, g_ok, v0, l_i, l_safe, 0, W)
    store_nibble_out(po_ptr, slot, rw, g_ok, v1, l_i, l_safe, 1, W)
    store_nibble_out(po_ptr, slot, rw, g_ok, v2, l_i, l_safe, 2, W)
    store_nibble_out(po_ptr, slot, rw, g_ok, v3, l_i, l_safe, 3, W)
    store_nibble_out(po_ptr, slot, rw, g_ok, v4, l_i, l_safe, 4, W)
    store_nibble_out(po_ptr, slot, rw, g_ok, v5, l_i, l_safe, 5, W)
    store_nibble_out(po_ptr, slot, rw, g_ok, v6, l_i, l_safe, 6, W)
    store_nibble_out(po_ptr, slot, rw, g_ok, v7, l_i, l_safe, 7, W)
    tl.store(pl_ptr + slot, lse, mask=g_ok)
