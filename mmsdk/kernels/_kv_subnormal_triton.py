"""Subnormal-nibble int4 decode attention for MHA (one KV head per query head), behind mmsdk.kernels.kv_decode: V's
nibbles (and, without ``KDOT``, K's) decoded as exact subnormal floats; with ``KDOT`` (the default) K's scores are
integer dot products (mmsdk/kernels/_kv_intdot_triton.py).

Imported only when the kernel is launched. Partials and log-sum-exps have the layout of
:func:`mmsdk.kernels._kv_triton.decode_partial_int4`, so
:func:`~mmsdk.kernels._split_merge_triton.decode_combine_natural` merges them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmsdk.kernels._kv_intdot_triton import integer_query, integer_scores
from mmsdk.kernels._kv_triton import encode, rope_rotate, softmax_total, split_program, token_tile
from mmsdk.kernels._pdl_triton import let_next_launch
from mmsdk.kernels._split_merge_triton import last_to_arrive, merge_natural, row_merged

# Subnormal decoding. An integer x < 2**24 in the low bits of an
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
def rotated_words(row, cos_row, sin_row, channel, W: tl.constexpr):
    """One head's vector at ``row`` (8W channels) rotated by RoPE, as fp32 ``[W, 8]`` (``channel`` = 8w + j): the
    partner of channel c is c +- 4W, the same column of the row W/2 rows away, so every load is contiguous."""
    partner = (channel + 4 * W) % (8 * W)
    return rope_rotate(tl.load(row + channel), tl.load(row + partner), tl.load(cos_row + channel),
                       tl.load(sin_row + channel), channel >= 4 * W)


@triton.jit
def load_q_nibble(q_row, ks_ptr, rw, scale, rotated, J: tl.constexpr, F: tl.constexpr, ROPE: tl.constexpr):
    """One head's q channels ``8w + J`` [W] times K's scale and ``scale``, and them pre-scaled by ``F``.

    With ``ROPE`` the channels are column J of ``rotated`` (:func:`rotated_words` of q: loading each column with its
    partners and cos / sin would take four strided loads per column and spill registers); the sum over the row picks
    it exactly. Everything after that pick is the same code with and without ``ROPE``: the compiler fuses the
    ``* scale`` into the additions of the softmax offset (FMA), and did so only where the channel was loaded while
    the scaling was done on the [W, 8] tile, so the offset, and on an H200 an output element of 1 in 48 cases,
    differed in the last bit.
    """
    ch = 8 * rw + J
    if ROPE:
        x = tl.sum(tl.where(tl.arange(0, 8)[None, :] == J, rotated, 0.0), 1)
    else:
        x = tl.load(q_row + ch).to(tl.float32)
    q = x * tl.load(ks_ptr + ch) * scale
    return q, q * F


@triton.jit
def subnormal_scores(kw, q0, q1, q2, q3, q4, q5, q6, q7):
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
def store_nibble_out(po_ptr, slot, rw, acc, l_i, l_safe, J: tl.constexpr, W: tl.constexpr):
    """One head's channels ``8w + J`` of the partial output (see :func:`store_nibble_out`)."""
    tl.store(po_ptr + slot * (8 * W) + 8 * rw + J, (tl.sum(acc, 0) * SUB_UNDO - 8.0 * l_i) / l_safe)


@triton.jit
def token_quarters(x):
    """``[BLOCK_T, W]`` as four ``[BLOCK_T / 4, W]`` tiles, tokens ``t`` with the same ``t mod BLOCK_T / 4`` summed
    by the caller. Triton lays a one-warp ``[BLOCK_T, W]`` tile out as repeats of an 8-token block in each thread's
    registers (``t = 8 rep + lane row``), so with 32-token tiles the quarters are those repeats: reshape, permute and
    split only rename registers."""
    rows: tl.constexpr = x.shape[0] // 4
    y = tl.permute(tl.reshape(x, (4, rows, x.shape[1])), (1, 2, 0))
    a, b = tl.split(tl.reshape(y, (rows, x.shape[1], 2, 2)))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, a1, b0, b1


@triton.jit
def add_folded(acc, c, p):
    """``acc`` ``[BLOCK_T / 4, W]`` plus ``c * p`` (``[BLOCK_T, W]`` each) summed over token quarters, as four FMAs
    per element (:func:`token_quarters`)."""
    c0, c1, c2, c3 = token_quarters(c)
    p0, p1, p2, p3 = token_quarters(tl.broadcast_to(p, c.shape))
    acc += c0 * p0
    acc += c1 * p1
    acc += c2 * p2
    acc += c3 * p3
    return acc


@triton.jit
def add_products(acc, c, p, FOLD: tl.constexpr):
    """``acc + c * p``, the token axis folded into quarters with ``FOLD`` (:func:`add_folded`)."""
    if FOLD:
        out = add_folded(acc, c, p)
    else:
        out = acc + c * p
    return out


@triton.jit
def attend_tile(s, vw, t_ok, m_ref, l_acc, v0, v1, v2, v3, v4, v5, v6, v7, FOLD: tl.constexpr = False):
    """One tile's scores ``s`` [BLOCK_T] and V words ``[BLOCK_T, W]`` folded into the online softmax: the updated
    (m_ref, l_acc, v0..v7).

    Tokens outside ``t_ok`` get probability 0 (their words may be anything: a nibble read as a subnormal is finite).
    With ``FOLD`` the V sums ``v*`` hold a quarter of the tile's tokens (:func:`add_folded`): a quarter of the
    registers, the same FMAs.
    """
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
    c0, c1, c2, c3, c4, c5, c6, c7 = subnormal_nibbles(vw)
    # one factor per nibble position, shared by all words of a token
    p0 = (p * SUB_F0)[:, None]
    p1 = (p * SUB_F1)[:, None]
    p2 = (p * SUB_F2)[:, None]
    v0 = add_products(v0, c0, p0, FOLD)
    v1 = add_products(v1, c1, p1, FOLD)
    v2 = add_products(v2, c2, p2, FOLD)
    v3 = add_products(v3, c3, (p * SUB_F3)[:, None], FOLD)
    v4 = add_products(v4, c4, (p * SUB_F4)[:, None], FOLD)
    v5 = add_products(v5, c5, (p * SUB_F5)[:, None], FOLD)
    v6 = add_products(v6, c6, p1, FOLD)
    v7 = add_products(v7, c7, p0, FOLD)
    return m_ref, l_acc, v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def store_token_words(new_row, scale_row, codes_ptr, word_row, rw, cos_row, sin_row, W: tl.constexpr,
                      ROPE: tl.constexpr = False):
    """Quantize one head's token ``new_row`` [8W] (int4 with per-channel scales, as the append kernel does; rotated
    first with ``ROPE``) and store it as W int32 words at ``word_row``: channel ``8w + j`` in nibble ``j`` of word
    ``w``, the bytes the append kernel writes (channel ``2i`` in byte ``i``'s low nibble) read as little-endian
    words."""
    rj = tl.arange(0, 8)
    channel = 8 * rw[:, None] + rj[None, :]
    if ROPE:
        token = rotated_words(new_row, cos_row, sin_row, channel, W)
    else:
        token = tl.load(new_row + channel).to(tl.float32)
    codes = encode(token, tl.load(scale_row + channel), 0).to(tl.int32)
    tl.store(codes_ptr + word_row * W + rw, tl.sum(codes << (4 * rj)[None, :], 1))  # disjoint bits: the sum is an OR


@triton.jit
def tile_words(kc_ptr, vc_ptr, base, t0, t_end, rw, mask_ptr, b, sm_b, mask_len, HAS_MASK: tl.constexpr,
               BLOCK_T: tl.constexpr, W: tl.constexpr):
    """The K and V words ``[BLOCK_T, W]`` of the tile at token ``t0`` (rows from ``base``) and its valid tokens (words
    of invalid ones read as 0)."""
    rt, t_ok = token_tile(t0, t_end, mask_ptr, b, sm_b, mask_len, HAS_MASK, BLOCK_T)
    rows = (base + rt)[:, None] * W + rw[None, :]
    return (tl.load(kc_ptr + rows, mask=t_ok[:, None], other=0), tl.load(vc_ptr + rows, mask=t_ok[:, None], other=0),
            t_ok)


@triton.jit
def decode_partial_int4_subnormal_mha(q_ptr, kc_ptr, vc_ptr, ks_ptr, len_ptr, mask_ptr, po_ptr, pl_ptr,
                                      sq_b, sq_h, sm_b, mask_len, H_KV, G, TMAX, SPLIT_T, qk_scale,
                                      kn_ptr, vn_ptr, vs_ptr, sk_b, sk_h, sv_b, sv_h, cos_ptr, sin_ptr, sc_b,
                                      out_ptr, so_b, so_h, cnt_ptr,
                                      HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, W: tl.constexpr,
                                      PREFETCH: tl.constexpr = False, APPEND: tl.constexpr = False,
                                      ROPE: tl.constexpr = False, FOLD: tl.constexpr = False,
                                      KDOT: tl.constexpr = False, ASM: tl.constexpr = False,
                                      STAGES: tl.constexpr = None, MERGE: tl.constexpr = False,
                                      BLOCK_S: tl.constexpr = 1, PDL: tl.constexpr = False):
    """:func:`decode_partial_int4_subnormal` for one query head per KV head, with 2-D tiles.

    Kept separate because Triton lays 3-D tiles with a size-1 head axis out one word per lane, which
    costs shared-memory round trips; the 2-D word tile keeps four consecutive words (a 16-byte load)
    of a token per thread from the load through the V sums. The rescale test is a scalar branch.

    ``STAGES`` (None: not pipelined) has Triton pipeline the tile loop: the loads of ``STAGES - 1`` tiles ahead go
    through shared memory (``cp.async``), costing no registers.

    ``PREFETCH`` loads the next tile's K and V before this tile's arithmetic (registers for two tiles). Two tiles
    ahead (168 registers with ``FOLD``) measured slower on the H200 (29.6 against 28.1 µs at 16k tokens,
    h200_kernel_sweeps_mha_ahead2.json; code in commit cca8c43).

    With ``APPEND`` the step's new token is not in the cache yet: ``kn`` / ``vn`` hold its K and V (bf16/fp16
    ``[B, H, 1, 8W]``, strides ``sk_*`` / ``sv_*``) and ``len`` counts the tokens before it. The program whose
    split holds position ``len`` quantizes the token into the cache (the append kernel's codes) and, after a
    barrier, attends over it with the rest of its split; the combine kernel then advances ``len``. This saves
    the decode step an append launch and a length increment.

    With ``ROPE`` q and the new K are not rotated yet: the kernel rotates them as it loads them, by the step's
    cos / sin rows (``[B, 1, 8W]``, batch stride ``sc_b``), which saves the step the RoPE launch.

    With ``KDOT`` the scores are integer dot products of K's codes with the query rounded to 16-bit integers
    (mmsdk/kernels/_kv_intdot_triton.py: 7 instructions per word of K instead of ~18; ``ASM``: through PTX ``dp2a``,
    CUDA only, else by integer arithmetic with the same values).

    With ``MERGE`` the kernel also merges the splits, where a combine kernel did: each program counts itself in at
    ``cnt[row]`` after storing its partial, and the last of a row's ``n_splits`` programs merges them into ``out``
    (``[B, 1, H, 8W]``, strides ``so_*``), which saves the step a launch. With ``APPEND`` the last row to finish
    (counted at ``cnt[B * H_KV]``) advances ``len``. The last program sets each counter back to 0, so ``cnt``
    (int32, zeros before the first launch) serves every later one, a CUDA graph's replays included. ``PDL`` (with
    ``MERGE``) lets the next kernel launch at once, as the combine kernel does; it waits for this one to end.
    """
    if MERGE:
        let_next_launch(PDL)
    bh, b, hk, split, n_splits, t_begin = split_program(H_KV, SPLIT_T)
    rw = tl.arange(0, W)
    q_row = q_ptr + b * sq_b + hk * sq_h
    ks_row = ks_ptr + hk * (8 * W)
    cos_row, sin_row = cos_ptr + b * sc_b, sin_ptr + b * sc_b
    rotated = qk_scale  # stands in where ROPE is off
    if ROPE:
        rotated = rotated_words(q_row, cos_row, sin_row, 8 * rw[:, None] + tl.arange(0, 8)[None, :], W)
    a0, q0 = load_q_nibble(q_row, ks_row, rw, qk_scale, rotated, 0, SUB_F0, ROPE)
    a1, q1 = load_q_nibble(q_row, ks_row, rw, qk_scale, rotated, 1, SUB_F1, ROPE)
    a2, q2 = load_q_nibble(q_row, ks_row, rw, qk_scale, rotated, 2, SUB_F2, ROPE)
    a3, q3 = load_q_nibble(q_row, ks_row, rw, qk_scale, rotated, 3, SUB_F3, ROPE)
    a4, q4 = load_q_nibble(q_row, ks_row, rw, qk_scale, rotated, 4, SUB_F4, ROPE)
    a5, q5 = load_q_nibble(q_row, ks_row, rw, qk_scale, rotated, 5, SUB_F5, ROPE)
    a6, q6 = load_q_nibble(q_row, ks_row, rw, qk_scale, rotated, 6, SUB_F1, ROPE)
    a7, q7 = load_q_nibble(q_row, ks_row, rw, qk_scale, rotated, 7, SUB_F0, ROPE)
    # summed in fp64 and rounded once, so that it is the same fp32 value whichever order the reduction takes: the
    # order follows q's register layout, which ROPE changes, and a last-bit change here showed in fp16 outputs
    q_off = 8.0 * tl.sum((a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7).to(tl.float64), 0).to(tl.float32)
    if KDOT:  # K's codes against the query rounded to 16-bit integers (_kv_intdot_triton.py)
        qe01, qe23, qo01, qo23, q_int_off, q_unit = integer_query(a0, a1, a2, a3, a4, a5, a6, a7)
    else:  # stand-ins: the loop below takes the float query
        qe01, qe23, qo01, qo23, q_int_off, q_unit = rw, rw, rw, rw, tl.sum(rw, 0), q_off
    m_ref = tl.full([], float("-inf"), tl.float32)
    l_acc = tl.zeros((BLOCK_T,), tl.float32)
    V_ROWS: tl.constexpr = BLOCK_T // 4 if FOLD else BLOCK_T
    v0 = tl.zeros((V_ROWS, W), tl.float32)
    v1 = tl.zeros((V_ROWS, W), tl.float32)
    v2 = tl.zeros((V_ROWS, W), tl.float32)
    v3 = tl.zeros((V_ROWS, W), tl.float32)
    v4 = tl.zeros((V_ROWS, W), tl.float32)
    v5 = tl.zeros((V_ROWS, W), tl.float32)
    v6 = tl.zeros((V_ROWS, W), tl.float32)
    v7 = tl.zeros((V_ROWS, W), tl.float32)
    base = bh.to(tl.int64) * TMAX
    length = tl.load(len_ptr)  # read after the query (as measured on the H200)
    if APPEND:
        if (length >= t_begin) & (length < t_begin + SPLIT_T):  # this program's split holds the new token
            store_token_words(kn_ptr + b * sk_b + hk * sk_h, ks_row, kc_ptr, base + length, rw, cos_row, sin_row, W,
                              ROPE)
            store_token_words(vn_ptr + b * sv_b + hk * sv_h, vs_ptr + hk * (8 * W), vc_ptr, base + length, rw,
                              cos_row, sin_row, W)
            tl.debug_barrier()  # the words are read back below by other threads of this program
        length += 1
    t_end = tl.minimum(t_begin + SPLIT_T, length)
    if PREFETCH:  # the first tile; each tile then loads the next one's before its arithmetic
        next_k, next_v, next_ok = tile_words(kc_ptr, vc_ptr, base, t_begin, t_end, rw, mask_ptr, b, sm_b, mask_len,
                                             HAS_MASK, BLOCK_T, W)
    for t0 in tl.range(t_begin, t_end, BLOCK_T, num_stages=STAGES):
        if PREFETCH:
            kw, vw, t_ok = next_k, next_v, next_ok
            # new names: a token index inside the loop may be int64 (the count is), so it cannot carry over
            next_k, next_v, next_ok = tile_words(kc_ptr, vc_ptr, base, t0 + BLOCK_T, t_end, rw, mask_ptr, b, sm_b,
                                                 mask_len, HAS_MASK, BLOCK_T, W)
        else:
            kw, vw, t_ok = tile_words(kc_ptr, vc_ptr, base, t0, t_end, rw, mask_ptr, b, sm_b, mask_len, HAS_MASK,
                                      BLOCK_T, W)
        if KDOT:
            s = integer_scores(kw, qe01, qe23, qo01, qo23, q_int_off, q_unit, ASM)
        else:
            s = subnormal_scores(kw, q0, q1, q2, q3, q4, q5, q6, q7) * SUB_UNDO - q_off
        m_ref, l_acc, v0, v1, v2, v3, v4, v5, v6, v7 = attend_tile(s, vw, t_ok, m_ref, l_acc, v0, v1, v2, v3, v4, v5,
                                                                   v6, v7, FOLD)
    l_i = tl.sum(l_acc, 0)
    l_safe, lse = softmax_total(m_ref, l_i)
    slot = (b * H_KV + hk).to(tl.int64) * n_splits + split
    store_nibble_out(po_ptr, slot, rw, v0, l_i, l_safe, 0, W)
    store_nibble_out(po_ptr, slot, rw, v1, l_i, l_safe, 1, W)
    store_nibble_out(po_ptr, slot, rw, v2, l_i, l_safe, 2, W)
    store_nibble_out(po_ptr, slot, rw, v3, l_i, l_safe, 3, W)
    store_nibble_out(po_ptr, slot, rw, v4, l_i, l_safe, 4, W)
    store_nibble_out(po_ptr, slot, rw, v5, l_i, l_safe, 5, W)
    store_nibble_out(po_ptr, slot, rw, v6, l_i, l_safe, 6, W)
    store_nibble_out(po_ptr, slot, rw, v7, l_i, l_safe, 7, W)
    tl.store(pl_ptr + slot, lse)
    if MERGE:
        merge_if_last(po_ptr, pl_ptr, vs_ptr, out_ptr, len_ptr, cnt_ptr, bh, b, hk, n_splits, so_b, so_h, BLOCK_S,
                      8 * W, APPEND)


@triton.jit
def merge_if_last(po_ptr, pl_ptr, vs_ptr, out_ptr, len_ptr, cnt_ptr, bh, b, hk, n_splits, so_b, so_h,
                  BLOCK_S: tl.constexpr, D: tl.constexpr, ADVANCE: tl.constexpr):
    """The last of partial row ``bh``'s programs to arrive merges the row's splits (one query head per KV head);
    with ``ADVANCE`` the last row to be merged adds the step's token to ``len``. Counters are left at 0
    (mmsdk/kernels/_split_merge_triton.py)."""
    if last_to_arrive(cnt_ptr, bh, n_splits):
        merge_natural(po_ptr, pl_ptr, vs_ptr, out_ptr, bh, b, hk, hk, n_splits, so_b, so_h, BLOCK_S, D,
                      PAST_L1=True)
        row_merged(cnt_ptr, bh, len_ptr, ADVANCE)
