"""Merging flash-decoding's splits (mmsdk.kernels.kv_decode, mmsdk.kernels.grouped_decode).

A decode attention kernel cuts a row's cached tokens (one batch entry and KV head) into splits, one program each,
which store partial outputs and log-sum-exps. A combine kernel merges them (:func:`decode_combine`,
:func:`decode_combine_natural`), or the int4 MHA partial kernel does it itself (``merge_counters``): each program counts
itself in at ``cnt[row]`` after its stores, and the last of the row's programs to arrive merges the row, one launch
fewer per layer. Counters go back to 0 when the row is merged, so the same int32 zeros serve every later launch, a
CUDA graph's replays included. Imported only when a kernel is launched.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmsdk.kernels._pdl_triton import let_next_launch, wait_for_inputs


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
def combine_program(HQ, G, n_splits, BLOCK_S: tl.constexpr):
    """A combine program's (row, batch, query head, KV head) and its splits' (ids, valid mask): one program per
    (batch, query head)."""
    bh = tl.program_id(0)
    h = bh % HQ
    rs = tl.arange(0, BLOCK_S)
    return bh, bh // HQ, h, h // G, rs, rs < n_splits


@triton.jit
def split_weights(pl_ptr, bh, rs, s_ok, n_splits, PAST_L1: tl.constexpr = False):
    """Each split's weight ``2**(lse - max lse)`` and their sum (1 for a row with no keys).

    The combine kernels load their partials and V's scales before calling this: every load of the kernel is then
    in flight at once, where loads written after the weights waited for them (one memory round trip each).
    ``PAST_L1``: load past L1 (".cg"), for values other programs of the same kernel wrote. (A flag, not the modifier
    string as a constexpr: Triton 3.6 rejects strings passed between jit functions.)
    """
    if PAST_L1:
        lse = tl.load(pl_ptr + bh.to(tl.int64) * n_splits + rs, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
    else:
        lse = tl.load(pl_ptr + bh.to(tl.int64) * n_splits + rs, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with no keys: every weight 0, total 1
    w = tl.where(s_ok, tl.math.exp2(lse - top), 0.0)
    total = tl.sum(w, 0)
    return w, tl.where(total == 0.0, 1.0, total)


@triton.jit
def decode_combine(po_ptr, pl_ptr, vs_ptr, out_ptr, HQ, G, D, n_splits, so_b, so_h, len_ptr,
                   BLOCK_S: tl.constexpr, BLOCK_HD: tl.constexpr, ADVANCE: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    """Merge the splits of one (batch, query head) by their log-sum-exp, apply V's scale, write [B, 1, Hq, D];
    ``ADVANCE`` as in :func:`decode_combine_natural`. With ``PDL`` the kernel is launched as a dependent of the
    partial kernel (mmsdk.kernels._kv_grouped_triton.decode_partial): it waits for the partials, then lets the next
    kernel launch."""
    wait_for_inputs(PDL)
    bh, b, h, hk, rs, s_ok = combine_program(HQ, G, n_splits, BLOCK_S)
    rd = tl.arange(0, BLOCK_HD)
    rows = po_ptr + (bh.to(tl.int64) * n_splits + rs)[:, None] * (2 * BLOCK_HD) + rd[None, :]
    part_e = tl.load(rows, mask=s_ok[:, None], other=0.0)
    part_o = tl.load(rows + BLOCK_HD, mask=s_ok[:, None], other=0.0)
    de, do = (2 * rd) < D, (2 * rd + 1) < D
    scale_e = tl.load(vs_ptr + hk * D + 2 * rd, mask=de, other=0.0)
    scale_o = tl.load(vs_ptr + hk * D + 2 * rd + 1, mask=do, other=0.0)
    tl.debug_barrier()  # keeps the compiler from moving these loads after the weights' (see split_weights)
    w, total = split_weights(pl_ptr, bh, rs, s_ok, n_splits)
    oe = tl.sum(w[:, None] * part_e, 0) / total * scale_e
    oo = tl.sum(w[:, None] * part_o, 0) / total * scale_o
    dst = out_ptr + b * so_b + h * so_h
    tl.store(dst + 2 * rd, oe.to(out_ptr.dtype.element_ty), mask=de)
    tl.store(dst + 2 * rd + 1, oo.to(out_ptr.dtype.element_ty), mask=do)
    if ADVANCE:
        if bh == 0:  # every partial program has read the length: the partial kernel has finished
            tl.store(len_ptr, tl.load(len_ptr) + 1)


@triton.jit
def merge_natural(po_ptr, pl_ptr, vs_ptr, out_ptr, row, b, h, hk, n_splits, so_b, so_h, BLOCK_S: tl.constexpr,
                  D: tl.constexpr, SCALED: tl.constexpr = True, PAST_L1: tl.constexpr = False):
    """Merge the ``n_splits`` natural-order partials of partial row ``row`` (batch ``b``, query head ``h``, KV head
    ``hk``) by their log-sum-exp, apply V's scale (``SCALED``), write the head's output. ``PAST_L1``: the partials
    load past L1 (see :func:`split_weights`)."""
    rs = tl.arange(0, BLOCK_S)
    s_ok = rs < n_splits
    rd = tl.arange(0, D)
    rows = po_ptr + (row.to(tl.int64) * n_splits + rs)[:, None] * D + rd[None, :]
    if PAST_L1:
        parts = tl.load(rows, mask=s_ok[:, None], other=0.0, cache_modifier=".cg")
    else:
        parts = tl.load(rows, mask=s_ok[:, None], other=0.0)
    if SCALED:
        scale = tl.load(vs_ptr + hk * D + rd)
    else:
        scale = tl.full((D,), 1.0, tl.float32)
    tl.debug_barrier()  # keeps the compiler from moving these loads after the weights' (see split_weights)
    w, total = split_weights(pl_ptr, row, rs, s_ok, n_splits, PAST_L1)
    o = tl.sum(w[:, None] * parts, 0) / total * scale
    tl.store(out_ptr + b * so_b + h * so_h + rd, o.to(out_ptr.dtype.element_ty))


@triton.jit
def decode_combine_natural(po_ptr, pl_ptr, vs_ptr, out_ptr, HQ, G, n_splits, so_b, so_h, len_ptr,
                           BLOCK_S: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False,
                           ADVANCE: tl.constexpr = False, SCALED: tl.constexpr = True):
    """Merge the splits of one (batch, query head) from natural-order partials (see decode_combine).

    With ``PDL`` the next kernel (the output projection's GEMV) may launch at once. With ``ADVANCE`` program 0
    adds the step's token to the cache length ``len`` (the partial kernel appended it: its ``APPEND``). Without
    ``SCALED`` V has no scale to apply (unquantized K/V, mmsdk.kernels.grouped_decode).
    """
    let_next_launch(PDL)
    bh, b, h, hk, rs, s_ok = combine_program(HQ, G, n_splits, BLOCK_S)
    merge_natural(po_ptr, pl_ptr, vs_ptr, out_ptr, bh, b, h, hk, n_splits, so_b, so_h, BLOCK_S, D, SCALED)
    if ADVANCE:
        if bh == 0:  # every partial program has read the length: the partial kernel has finished
            tl.store(len_ptr, tl.load(len_ptr) + 1)
