"""The byte-code decode attention kernel behind mmsdk.kernels.kv_decode (variant "generic": every code format, and
grouped-query heads on the tensor cores). Imported only when the kernel is launched.

Its partials (even channels, then odd ones, per slot) and log-sum-exps are merged by
:func:`mmsdk.kernels._split_merge_triton.decode_combine`. (Merging them in the kernel's own last program per KV head,
as the int4 MHA kernel does, took 1.4-2.0 µs more per call on Qwen2-VL-7B's heads, that one program summing every
split of 7 query heads alone, and was removed: benchmarks/results/h200_suite_merges_32.json, made at commit b164790.)

(Loading each split's first K/V tile before the wait for the kernel in front, as the batch-1 GEMVs load their first
weights, took the kernel alone from 6.97 to 5.15 µs at 1280 tokens together with PDL, but made Qwen2-VL-7B's decode
step 16 µs slower, where the kernel in front is the q/k/v GEMV, so that code was removed:
benchmarks/results/h200_kernel_sweeps_gqa_pdl.json, h200_step_attention_qwen_pdl.json, made at commit 4e69d66.
Loading it after that wait but before the token count, the query and its scales, with the appended token folded in
from registers, made the call slower too: 5.76 / 7.35 / 11.10 µs at 1280 / 4k / 16k tokens against 5.47 / 6.87 /
11.20; benchmarks/results/h200_gqa_parts_early_34.json, made at commit 51dccd8.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmsdk.kernels._gemv_mma_triton import centred_nibbles
from mmsdk.kernels._kv_triton import (decode_raw_codes, load_raw_codes, load_rotated, softmax_step, softmax_total,
                                      split_pairs, split_program, store_token, token_tile)
from mmsdk.kernels._pdl_triton import wait_for_inputs


@triton.jit
def decode_dot_codes(raw_even, raw_odd, FMT: tl.constexpr, ASM: tl.constexpr, PAIRS: tl.constexpr):
    """Even- and odd-channel values of :func:`load_raw_codes`' result as fp16 tensor-core operands (scale not
    applied): exact for every format (int4 and int8 codes are small integers; e4m3 has fewer mantissa and exponent
    bits than fp16). int4 bytes decode four at a time with ``ASM`` (two nibbles per ``lop3``, no int-to-float
    conversions, which issue at a quarter of the fp32 rate); int8 / fp8 ``PAIRS`` by :func:`split_pairs`."""
    if FMT == 0:
        return centred_nibbles(raw_even, tl.float16, ASM)
    if PAIRS:
        return split_pairs(raw_even, FMT)
    return raw_even.to(tl.float16), raw_odd.to(tl.float16)


@triton.jit
def attend_tile(qe, qo, k_raw_even, k_raw_odd, v_raw_even, v_raw_odd, vc_ptr, rows, t_ok, rd, D, HDP,
                m_i, l_i, acc_e, acc_o, FMT: tl.constexpr, USE_DOT: tl.constexpr, V_LOADED: tl.constexpr,
                ASM: tl.constexpr, PAIRS: tl.constexpr):
    """One tile of tokens (code rows ``rows``, valid where ``t_ok``) folded into the online softmax's state
    ``(m_i, l_i, acc_e, acc_o)``, which is returned updated. The K codes come loaded; the V codes too with
    ``V_LOADED``, else they are loaded here after the scores (``v_raw_*`` are then ignored)."""
    if USE_DOT:
        ke, ko = decode_dot_codes(k_raw_even, k_raw_odd, FMT, ASM, PAIRS)
        s = tl.dot(qo, tl.trans(ko), tl.dot(qe, tl.trans(ke)))
    else:
        ke, ko = decode_raw_codes(k_raw_even, k_raw_odd, FMT, PAIRS)
        s = tl.sum(qe[:, None, :] * ke[None, :, :], 2) + tl.sum(qo[:, None, :] * ko[None, :, :], 2)
    p, alpha, m_new, l_i = softmax_step(s, t_ok, m_i, l_i)
    if not V_LOADED:
        v_raw_even, v_raw_odd = load_raw_codes(vc_ptr, rows, t_ok, rd, D, HDP, FMT, PAIRS)
    if USE_DOT:
        ve, vo = decode_dot_codes(v_raw_even, v_raw_odd, FMT, ASM, PAIRS)
        p = p.to(tl.float16)
        acc_e = tl.dot(p, ve, acc_e * alpha[:, None])
        acc_o = tl.dot(p, vo, acc_o * alpha[:, None])
    else:
        ve, vo = decode_raw_codes(v_raw_even, v_raw_odd, FMT, PAIRS)
        acc_e = acc_e * alpha[:, None] + tl.sum(p[:, :, None] * ve[None, :, :], 1)
        acc_o = acc_o * alpha[:, None] + tl.sum(p[:, :, None] * vo[None, :, :], 1)
    return m_new, l_i, acc_e, acc_o


@triton.jit
def decode_partial(q_ptr, kc_ptr, vc_ptr, ks_ptr, len_ptr, mask_ptr, po_ptr, pl_ptr,
                   sq_b, sq_h, sm_b, mask_len, H_KV, G, TMAX, D, HDP, SPLIT_T, qk_scale,
                   kn_ptr, vn_ptr, vs_ptr, sk_b, sk_h, sv_b, sv_h, cos_ptr, sin_ptr, sc_b,
                   FMT: tl.constexpr, HAS_MASK: tl.constexpr, USE_DOT: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
                   APPEND: tl.constexpr = False, ROPE: tl.constexpr = False, V_AHEAD: tl.constexpr = False,
                   ASM: tl.constexpr = False, PDL: tl.constexpr = False, PAIRS: tl.constexpr = False):
    """One (batch, KV head, split of the sequence): softmax-weighted V of its query heads, and their log-sum-exp.

    ``APPEND``: the step's new token (``kn`` / ``vn``, ``[B, H_KV, 1, D]``) is written into the cache at
    position ``len`` by the program whose split holds it, which then attends over it (see
    mmsdk.kernels._kv_subnormal_triton.decode_partial_int4_subnormal_mha); the combine kernel advances ``len``.
    ``ROPE``: q (and the appended K) are not rotated yet; the kernel rotates them by the step's cos / sin rows
    (``[B, 1, D]``, batch stride ``sc_b``) as it loads them. ``V_AHEAD``: each tile's V codes are loaded together
    with its K codes (decoded after the scores) instead of after the softmax. ``USE_DOT`` (grouped-query heads):
    the scores and the weighted V sum on the tensor cores, fp16 operands (q, already scaled, and the softmax
    weights rounded to fp16; the codes exact), fp32 accumulators; ``ASM``: int4 bytes decoded by
    :func:`centred_nibbles`' PTX (CUDA only, not Triton's interpreter).

    ``PAIRS``: int8 / fp8 codes read as 16-bit channel pairs (``HDP`` = D / 2 words per token; see
    :func:`~mmsdk.kernels._kv_triton.load_raw_codes`) instead of two loads of every other byte.

    ``PDL``: launched as a dependent of the kernel before it (programmatic dependent launch), so its programs are
    resident when that kernel ends; each waits for it before reading anything, then lets the combine kernel launch.
    """
    wait_for_inputs(PDL)
    bh, b, hk, split, n_splits, t_begin = split_program(H_KV, SPLIT_T)
    base = bh.to(tl.int64) * TMAX
    rd = tl.arange(0, BLOCK_HD)
    cos_row, sin_row = cos_ptr + b * sc_b, sin_ptr + b * sc_b
    if APPEND:
        length = tl.load(len_ptr)
        if (length >= t_begin) & (length < t_begin + SPLIT_T):  # this program's split holds the new token
            row = base + length
            store_token(kn_ptr + b * sk_b + hk * sk_h, ks_ptr, kc_ptr, hk, row, D, HDP, cos_row, sin_row, FMT,
                        BLOCK_HD, ROPE)
            store_token(vn_ptr + b * sv_b + hk * sv_h, vs_ptr, vc_ptr, hk, row, D, HDP, cos_row, sin_row, FMT,
                        BLOCK_HD)
            tl.debug_barrier()  # the codes are read back below by other threads of this program
        t_end = tl.minimum(t_begin + SPLIT_T, length + 1)
    else:
        t_end = tl.minimum(t_begin + SPLIT_T, tl.load(len_ptr))
    rg = tl.arange(0, BLOCK_G)
    g_ok = rg < G
    heads = hk * G + rg
    de, do = (2 * rd) < D, (2 * rd + 1) < D
    q_row = q_ptr + b * sq_b + heads[:, None] * sq_h
    even = 2 * rd[None, :] + 0 * rg[:, None]  # [BLOCK_G, BLOCK_HD]: every load below has the mask's shape
    qe = load_rotated(q_row, even, g_ok[:, None] & de[None, :], cos_row, sin_row, D // 2, ROPE)
    qo = load_rotated(q_row, even + 1, g_ok[:, None] & do[None, :], cos_row, sin_row, D // 2, ROPE)
    # K's per-channel scale and the softmax scale fold into q once; exp2 replaces exp.
    qe = qe * (tl.load(ks_ptr + hk * D + 2 * rd, mask=de, other=0.0) * qk_scale)[None, :]
    qo = qo * (tl.load(ks_ptr + hk * D + 2 * rd + 1, mask=do, other=0.0) * qk_scale)[None, :]
    if USE_DOT:  # fp16 operands: one 16-deep tensor-core step where fp32 ones take two (tf32)
        qe, qo = qe.to(tl.float16), qo.to(tl.float16)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc_e = tl.zeros((BLOCK_G, BLOCK_HD), tl.float32)
    acc_o = tl.zeros((BLOCK_G, BLOCK_HD), tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_T):
        rt, t_ok = token_tile(t0, t_end, mask_ptr, b, sm_b, mask_len, HAS_MASK, BLOCK_T)
        k_raw_even, k_raw_odd = load_raw_codes(kc_ptr, base + rt, t_ok, rd, D, HDP, FMT, PAIRS)
        v_raw_even, v_raw_odd = k_raw_even, k_raw_odd  # placeholders, ignored unless V_AHEAD
        if V_AHEAD:
            v_raw_even, v_raw_odd = load_raw_codes(vc_ptr, base + rt, t_ok, rd, D, HDP, FMT, PAIRS)
        m_i, l_i, acc_e, acc_o = attend_tile(qe, qo, k_raw_even, k_raw_odd, v_raw_even, v_raw_odd, vc_ptr, base + rt,
                                             t_ok, rd, D, HDP, m_i, l_i, acc_e, acc_o, FMT, USE_DOT, V_AHEAD, ASM,
                                             PAIRS)
    l_safe, lse = softmax_total(m_i, l_i)
    slot = (b * (H_KV * G) + heads).to(tl.int64) * n_splits + split
    out = po_ptr + slot[:, None] * (2 * BLOCK_HD) + rd[None, :]
    tl.store(out, acc_e / l_safe[:, None], mask=g_ok[:, None])
    tl.store(out + BLOCK_HD, acc_o / l_safe[:, None], mask=g_ok[:, None])
    tl.store(pl_ptr + slot, lse, mask=g_ok)
