"""Triton kernels behind mmsdk.kernels.kv_decode (imported only when a kernel is launched): writing K/V into the
packed cache, reading its tiles, the "magic" int4 decode kernel and the online softmax's steps. Merging the splits:
mmsdk/kernels/_split_merge_triton.py.

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
def rope_rotate(x, partner, c, s, upper):
    """Rotate-half RoPE of channel values ``x``, given each one's partner channel (``+ D/2`` in the lower half,
    ``- D/2`` in the upper) and cos / sin: ``x cos - partner sin`` below, ``x cos + partner sin`` above.

    fp32, rounded to ``x``'s dtype and returned as fp32, as the RoPE kernel (mmsdk.kernels._norm_rope_triton.rope_qk)
    computes it: products of two bf16 / fp16 values are exact in fp32, so only the sum rounds, whatever the order.
    """
    p = partner.to(tl.float32)
    r = x.to(tl.float32) * c.to(tl.float32) + tl.where(upper, p, -p) * s.to(tl.float32)
    return r.to(x.dtype).to(tl.float32)


@triton.jit
def load_rotated(row, ch, ok, cos_row, sin_row, HALF, ROPE: tl.constexpr):
    """Channels ``ch`` (where ``ok``; same shape) of one head's vector at ``row`` as fp32, rotated by the token's
    RoPE (cos / sin rows of head_dim = 2 * HALF values) with ``ROPE``."""
    x = tl.load(row + ch, mask=ok, other=0.0)
    if ROPE:
        upper = ch >= HALF
        partner = tl.load(row + tl.where(upper, ch - HALF, ch + HALF), mask=ok, other=0.0)
        c = tl.load(cos_row + ch, mask=ok, other=0.0)
        s = tl.load(sin_row + ch, mask=ok, other=0.0)
        return rope_rotate(x, partner, c, s, upper)
    return x.to(tl.float32)


@triton.jit
def append(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, len_ptr, H, TMAX, D, HDP,
           sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, FMT: tl.constexpr, BLOCK_HD: tl.constexpr):
    """Quantize token ``program_id(1)`` of one (batch, head) row of K and V and store it at ``length + l``."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    row = bh.to(tl.int64) * TMAX + tl.load(len_ptr) + tl.program_id(1)
    k_row = k_ptr + b * sk_b + h * sk_h + tl.program_id(1) * sk_t
    store_token(k_row, ks_ptr, kc_ptr, h, row, D, HDP, k_row, k_row, FMT, BLOCK_HD)
    v_row = v_ptr + b * sv_b + h * sv_h + tl.program_id(1) * sv_t
    store_token(v_row, vs_ptr, vc_ptr, h, row, D, HDP, v_row, v_row, FMT, BLOCK_HD)


@triton.jit
def store_token(src, scale_ptr, dst, h, row, D, HDP, cos_row, sin_row, FMT: tl.constexpr, BLOCK_HD: tl.constexpr,
                ROPE: tl.constexpr = False):
    """Quantize one head's token ``src`` [D] with head ``h``'s per-channel scales and store its codes at code
    row ``row`` (int4: channel ``2i`` in byte ``i``'s low nibble); with ``ROPE`` the token is rotated first
    (:func:`load_rotated`)."""
    rd = tl.arange(0, BLOCK_HD)
    even, odd = 2 * rd, 2 * rd + 1
    me, mo = even < D, odd < D
    xe = load_rotated(src, even, me, cos_row, sin_row, D // 2, ROPE)
    xo = load_rotated(src, odd, mo, cos_row, sin_row, D // 2, ROPE)
    se = tl.load(scale_ptr + h * D + even, mask=me, other=1.0)
    so = tl.load(scale_ptr + h * D + odd, mask=mo, other=1.0)
    ce = encode(xe, se, FMT)
    co = encode(xo, so, FMT)
    if FMT == 0:
        co = tl.where(mo, co, 0.0)  # an odd head_dim pads its last byte's high nibble with 0
        byte = ce.to(tl.uint8) | (co.to(tl.uint8) << 4)
        tl.store(dst + row * HDP + rd, byte, mask=rd < HDP)
    else:
        tl.store(dst + row * D + even, ce, mask=me)
        tl.store(dst + row * D + odd, co, mask=mo)


@triton.jit
def decode_program(len_ptr, H_KV, SPLIT_T):
    """This decode program's (batch * KV head row, batch, KV head, split, number of splits, first token, end token).

    Grid: axis 0 is batch * KV heads, axis 1 the splits of ``SPLIT_T`` tokens; the valid length is read
    from the device (CUDA-graph safe), so splits past it get an empty range.
    """
    bh, b, hk, split, n_splits, t_begin = split_program(H_KV, SPLIT_T)
    return bh, b, hk, split, n_splits, t_begin, tl.minimum(t_begin + SPLIT_T, tl.load(len_ptr))


@triton.jit
def split_program(H_KV, SPLIT_T):
    """:func:`decode_program` without the end token (which needs the token count)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    return bh, bh // H_KV, bh % H_KV, split, tl.num_programs(1), split * SPLIT_T


@triton.jit
def token_tile(t0, t_end, mask_ptr, b, sm_b, mask_len, HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr):
    """Token ids of a tile and which to attend to: inside the split and, with a mask, not dropped by it."""
    rt = t0 + tl.arange(0, BLOCK_T)
    t_ok = rt < t_end
    if HAS_MASK:
        keep = tl.load(mask_ptr + b * sm_b + rt, mask=t_ok & (rt < mask_len), other=0)
        t_ok = t_ok & (keep != 0)
    return rt, t_ok


@triton.jit
def load_codes(c_ptr, rows, t_ok, rd, D, HDP, FMT: tl.constexpr, PAIRS: tl.constexpr = False):
    """Even- and odd-channel values (fp32, scale not applied) of code rows ``rows`` [BLOCK_T]."""
    raw_even, raw_odd = load_raw_codes(c_ptr, rows, t_ok, rd, D, HDP, FMT, PAIRS)
    return decode_raw_codes(raw_even, raw_odd, FMT, PAIRS)


@triton.jit
def load_raw_codes(c_ptr, rows, t_ok, rd, D, HDP, FMT: tl.constexpr, PAIRS: tl.constexpr = False):
    """The code rows as stored, for :func:`decode_raw_codes` (int4: the same bytes twice; else even, odd channels).

    Loading apart from decoding lets a kernel issue the V tile's loads together with K's and decode V later,
    so the two memory round trips overlap without V's fp32 values taking registers during the scores.

    ``PAIRS`` (int8 / fp8 rows of an even number of channels, ``HDP`` = D / 2): each channel pair is read as one
    16-bit word, even channel in the low byte, the way int4's bytes hold theirs (the same words twice). Otherwise the
    even and odd channels are two loads of every other byte.
    """
    if FMT == 0:
        byte = tl.load(c_ptr + rows[:, None] * HDP + rd[None, :], mask=t_ok[:, None] & (rd < HDP)[None, :], other=0)
        return byte, byte
    elif PAIRS:
        words = c_ptr.to(tl.pointer_type(tl.int16))
        pair = tl.load(words + rows[:, None] * HDP + rd[None, :], mask=t_ok[:, None] & (rd < HDP)[None, :], other=0)
        return pair, pair
    else:
        base = c_ptr + rows[:, None] * D
        # a float fill: Triton cannot cast an integer constant to float8 (it can cast 0.0 to int8)
        ce = tl.load(base + 2 * rd[None, :], mask=t_ok[:, None] & (2 * rd < D)[None, :], other=0.0)
        co = tl.load(base + 2 * rd[None, :] + 1, mask=t_ok[:, None] & (2 * rd + 1 < D)[None, :], other=0.0)
        return ce, co


@triton.jit
def split_pairs(pair, FMT: tl.constexpr):
    """Even- and odd-channel values of 16-bit code pairs (even channel in the low byte), exact in fp16.

    int8: each byte offset by 128 and placed in the mantissa of fp16's 1024, less 1152; sign-extending shifts and an
    int-to-float conversion took 20.4 SASS instructions per channel pair in the decode loop, two of them
    conversions that issue at a quarter rate, against 18.9 and none (sm_90, Triton 3.9, 128-token tiles on 4 warps;
    int4: 17.1). fp8 (e4m3): each byte's sign, exponent and mantissa moved into fp16's fields (e4m3's exponent bias
    is 7, fp16's 15, hence the factor 2**8), which also maps e4m3's subnormals onto fp16's, with no float
    conversions (21.9 instructions per pair). e4m3's NaN codes (never written: the encoder clamps) would read as
    finite values.
    """
    if FMT == 1:
        offset = pair ^ -32640  # 0x8080 as int16: each byte + 128 (0..255); fp16 0x64XX is 1024 + XX
        even = ((offset & 0xFF) | 0x6400).to(tl.float16, bitcast=True)
        odd = (((offset >> 8) & 0xFF) | 0x6400).to(tl.float16, bitcast=True)
        return even - 1152.0, odd - 1152.0
    even = (((pair & 0x7F) << 7) | ((pair & 0x80) << 8)).to(tl.float16, bitcast=True)
    odd = (((pair >> 1) & 0x3F80) | (pair & -32768)).to(tl.float16, bitcast=True)
    return even * 256.0, odd * 256.0


@triton.jit
def decode_raw_codes(raw_even, raw_odd, FMT: tl.constexpr, PAIRS: tl.constexpr = False):
    """Even- and odd-channel values (fp32, scale not applied) of :func:`load_raw_codes`' result."""
    if FMT == 0:
        return (raw_even & 15).to(tl.float32) - 8.0, (raw_odd >> 4).to(tl.float32) - 8.0
    if PAIRS:
        even, odd = split_pairs(raw_even, FMT)
        return even.to(tl.float32), odd.to(tl.float32)
    return raw_even.to(tl.float32), raw_odd.to(tl.float32)


@triton.jit
def dequantize(c_ptr, s_ptr, out_ptr, H, TMAX, ROWS_B, T, D, HDP, so_b, so_h, so_t,
               FMT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr, PAIRS: tl.constexpr = False):
    """``BLOCK_T`` tokens of one (batch, head) row: ``code * scale`` in fp32, rounded once to out's dtype.

    The same arithmetic as the torch decode (``(q - 8) * s`` or ``q * s`` in fp32, then one rounding), so
    the result is bitwise equal, without its fp32 temporaries the size of the whole prefix. The codes
    may be a run of heads of a larger buffer: a batch row starts ``ROWS_B`` token rows after the last.
    Even and odd channels are interleaved in registers and stored as whole rows (two stores of every other
    channel wrote at a tenth of the memory's speed); with ``PAIRS`` int8 / fp8 codes load as 16-bit channel pairs
    (:func:`load_raw_codes`), whose values are exact, so the result is the same.
    """
    bh = tl.program_id(0)
    h = bh % H
    rt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = rt < T
    rd = tl.arange(0, BLOCK_HD)
    qe, qo = load_codes(c_ptr, (bh // H).to(tl.int64) * ROWS_B + h * TMAX + rt, t_ok, rd, D, HDP, FMT, PAIRS)
    se = tl.load(s_ptr + h * D + 2 * rd, mask=(2 * rd) < D, other=0.0)
    so = tl.load(s_ptr + h * D + 2 * rd + 1, mask=(2 * rd + 1) < D, other=0.0)
    kind = out_ptr.dtype.element_ty
    row = tl.reshape(tl.join((qe * se[None, :]).to(kind), (qo * so[None, :]).to(kind)), (BLOCK_T, 2 * BLOCK_HD))
    ch = tl.arange(0, 2 * BLOCK_HD)  # channel 2 * rd + (0 even, 1 odd): join's new last axis, flattened
    dst = out_ptr + (bh // H).to(tl.int64) * so_b + h.to(tl.int64) * so_h + rt[:, None].to(tl.int64) * so_t
    tl.store(dst + ch[None, :], row, mask=t_ok[:, None] & (ch < D)[None, :])


@triton.jit
def softmax_step(s, t_ok, m_i, l_i):
    """One tile of a base-2 online softmax over scores ``s`` [rows, tokens] (invalid tokens masked out).

    Returns the tile's weights, the factor that rescales what was summed before, the new running max and
    the new running sum. A row that has seen no valid token keeps max -inf and weight 0 (no NaN).
    """
    s = tl.where(t_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def softmax_total(m_i, l_i):
    """(sum safe to divide by, log2-sum-exp of the split; -inf where no token was valid)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return l_safe, tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))


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
    bh, b, hk, split, n_splits, t_begin, t_end = decode_program(len_ptr, H_KV, SPLIT_T)
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
        rt, t_ok = token_tile(t0, t_end, mask_ptr, b, sm_b, mask_len, HAS_MASK, BLOCK_T)
        k = int4_words(kc_ptr, base + rt, t_ok, rw, rs, W)
        if USE_DOT:
            s = tl.dot(q2, tl.trans(tl.reshape(k, (BLOCK_T, D))))
        else:
            s = tl.sum(tl.sum(q[:, None, :, :] * k[None, :, :, :], 3), 2)
        p, alpha, m_new, l_i = softmax_step(s, t_ok, m_i, l_i)
        v = int4_words(vc_ptr, base + rt, t_ok, rw, rs, W)
        if USE_DOT:
            acc2 = acc2 * alpha[:, None] + tl.dot(p, tl.reshape(v, (BLOCK_T, D)))
        else:
            acc = acc * alpha[:, None, None] + tl.sum(p[:, :, None, None] * v[None, :, :, :], 1)
        m_i = m_new
    l_safe, lse = softmax_total(m_i, l_i)
    slot = (b * (H_KV * G) + heads).to(tl.int64) * n_splits + split
    if USE_DOT:
        rd = tl.arange(0, D)
        tl.store(po_ptr + slot[:, None] * D + rd[None, :], acc2 / l_safe[:, None], mask=g_ok[:, None])
    else:
        tl.store(po_ptr + slot[:, None, None] * D + ch[None, :, :], acc / l_safe[:, None, None],
                 mask=g_ok[:, None, None])
    tl.store(pl_ptr + slot, lse, mask=g_ok)
