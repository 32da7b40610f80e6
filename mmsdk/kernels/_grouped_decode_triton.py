"""Triton kernel behind mmsdk.kernels.grouped_decode (imported only when it is launched).

Flash-decoding over unquantized K/V ``[B, H_kv, T, D]`` (bf16 / fp16, contiguous): one program per (batch, KV head,
split of the T slots) loads each tile of K and V once, as whole rows, for all the query heads of its group, and
scores and sums them on the tensor cores; the splits are merged by
:func:`mmsdk.kernels._split_merge_triton.decode_combine_natural` (without V scales).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmsdk.kernels._kv_triton import softmax_step, softmax_total, split_program, token_tile
from mmsdk.kernels._pdl_triton import wait_for_inputs


@triton.jit
def decode_partial_grouped(q_ptr, k_ptr, v_ptr, mask_ptr, po_ptr, pl_ptr, sq_b, sq_h, sm_b, mask_len, H_KV, G, TMAX,
                           SPLIT_T, qk_scale, D: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_G: tl.constexpr,
                           BLOCK_T: tl.constexpr, PDL: tl.constexpr = False):
    """One (batch, KV head, split): the softmax-weighted V of the group's query heads over the split's slots (those
    the mask keeps), in natural channel order, and their log2-sum-exp. ``qk_scale`` is the softmax scale times
    log2(e); q is scaled once and rounded to the K/V dtype, as SDPA's kernels feed the tensor cores. With ``PDL``
    the program waits for the kernel before it, then lets the combine kernel launch."""
    wait_for_inputs(PDL)
    bh, b, hk, split, n_splits, t_begin = split_program(H_KV, SPLIT_T)
    t_end = tl.minimum(t_begin + SPLIT_T, TMAX)
    base = bh.to(tl.int64) * TMAX
    rd = tl.arange(0, D)
    rg = tl.arange(0, BLOCK_G)
    g_ok = rg < G
    heads = hk * G + rg
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + rd[None, :], mask=g_ok[:, None], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(k_ptr.dtype.element_ty)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_T):
        rt, t_ok = token_tile(t0, t_end, mask_ptr, b, sm_b, mask_len, HAS_MASK, BLOCK_T)
        rows = (base + rt)[:, None] * D + rd[None, :]
        k = tl.load(k_ptr + rows, mask=t_ok[:, None], other=0.0)
        v = tl.load(v_ptr + rows, mask=t_ok[:, None], other=0.0)
        p, alpha, m_i, l_i = softmax_step(tl.dot(q, tl.trans(k)), t_ok, m_i, l_i)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    l_safe, lse = softmax_total(m_i, l_i)
    slot = (b * (H_KV * G) + heads).to(tl.int64) * n_splits + split
    tl.store(po_ptr + slot[:, None] * D + rd[None, :], acc / l_safe[:, None], mask=g_ok[:, None])
    tl.store(pl_ptr + slot, lse, mask=g_ok)
