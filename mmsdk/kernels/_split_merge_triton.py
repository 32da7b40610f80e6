"""Decode attention kernels that merge their own splits (mmsdk.kernels.kv_decode's ``merge_counters``).

Flash-decoding cuts a row's cached tokens (one batch entry and KV head) into splits, one program each, which store
partial outputs and log-sum-exps. Instead of a combine kernel, each program counts itself in at ``cnt[row]`` after
its stores, and the last of the row's programs to arrive merges the row: one launch fewer per layer. Counters go
back to 0 when the row is merged, so the same int32 zeros serve every later launch, a CUDA graph's replays
included. Imported only when a kernel is launched.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(cnt_ptr, row, n_splits):
    """True in the last of row ``row``'s ``n_splits`` programs to count itself in at ``cnt[row]``.

    The barrier has every thread's partial stores issued before the counter's release; the merging program reads
    the other programs' partials past L1 (".cg"), which other SMs' writes do not update.
    """
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel") == n_splits - 1


@triton.jit
def row_merged(cnt_ptr, row, len_ptr, ADVANCE: tl.constexpr):
    """Row ``row`` is merged: its counter goes back to 0. With ``ADVANCE`` the last of the launch's rows to be merged
    (counted at ``cnt[rows]``, one row per program along axis 0) adds the step's appended token to ``len``: every
    program has read the length before counting itself in."""
    tl.store(cnt_ptr + row, 0)
    if ADVANCE:
        rows = tl.num_programs(0)
        if tl.atomic_add(cnt_ptr + rows, 1, sem="acq_rel") == rows - 1:
            tl.store(len_ptr, tl.load(len_ptr, cache_modifier=".cg") + 1)
            tl.store(cnt_ptr + rows, 0)


@triton.jit
def merge_group(po_ptr, pl_ptr, vs_ptr, out_ptr, b, hk, HQ, G, D, n_splits, so_b, so_h,
                MERGE_G: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_HD: tl.constexpr):
    """Merge the splits of the ``G`` query heads of KV head ``hk`` (batch ``b``) from the grouped kernel's partials
    (mmsdk.kernels._kv_grouped_triton.decode_partial: even channels, then odd ones, per slot), as
    :func:`mmsdk.kernels._kv_triton.decode_combine` does for one head, and write ``[B, 1, HQ, D]``.

    The log-sum-exps of all splits come first (the weights' maximum and sum); the partials are then summed
    ``CHUNK_S`` splits at a time, so that a chunk of every head's partials stays within the registers the wrapper
    budgets (all of them at once for up to ``CHUNK_S`` splits: one round trip to L2).
    """
    rg = tl.arange(0, MERGE_G)
    g_ok = rg < G
    heads = hk * G + rg
    first = (b * HQ + heads).to(tl.int64) * n_splits  # each head's first slot
    rs = tl.arange(0, BLOCK_S)
    ok = g_ok[:, None] & (rs < n_splits)[None, :]
    lse = tl.load(pl_ptr + first[:, None] + rs[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with no keys: every weight 0, total 1
    total = tl.sum(tl.where(ok, tl.math.exp2(lse - top[:, None]), 0.0), 1)
    total = tl.where(total == 0.0, 1.0, total)
    rd = tl.arange(0, BLOCK_HD)
    rc = tl.arange(0, CHUNK_S)
    acc_e = tl.zeros((MERGE_G, BLOCK_HD), tl.float32)
    acc_o = tl.zeros((MERGE_G, BLOCK_HD), tl.float32)
    for s0 in range(0, n_splits, CHUNK_S):
        c_ok = g_ok[:, None] & ((s0 + rc) < n_splits)[None, :]
        slot = first[:, None] + s0 + rc[None, :]
        rows = po_ptr + slot[:, :, None] * (2 * BLOCK_HD) + rd[None, None, :]
        part_e = tl.load(rows, mask=c_ok[:, :, None], other=0.0, cache_modifier=".cg")
        part_o = tl.load(rows + BLOCK_HD, mask=c_ok[:, :, None], other=0.0, cache_modifier=".cg")
        w = tl.load(pl_ptr + slot, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
        w = tl.where(c_ok, tl.math.exp2(w - top[:, None]), 0.0)
        acc_e += tl.sum(w[:, :, None] * part_e, 1)
        acc_o += tl.sum(w[:, :, None] * part_o, 1)
    de, do = (2 * rd) < D, (2 * rd + 1) < D
    scale_e = tl.load(vs_ptr + hk * D + 2 * rd, mask=de, other=0.0)
    scale_o = tl.load(vs_ptr + hk * D + 2 * rd + 1, mask=do, other=0.0)
    dst = out_ptr + b * so_b + heads[:, None] * so_h
    oe = acc_e / total[:, None] * scale_e[None, :]
    oo = acc_o / total[:, None] * scale_o[None, :]
    tl.store(dst + 2 * rd[None, :], oe.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & de[None, :])
    tl.store(dst + 2 * rd[None, :] + 1, oo.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & do[None, :])
