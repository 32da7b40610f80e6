"""In-launch merge of decode-attention splits (opt-in), behind mmsdk.kernels.kv_decode.

With ``FUSED`` set, a partial kernel's last program of each (batch, KV head) row merges that row's
splits itself, so the separate combine launch does not run. Imported only when a kernel is launched.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_of_row(tk_ptr, row, n_splits):
    """True in the program that finishes last among the ``n_splits`` programs of ``row``; it resets the row's ticket.

    Why its loads see every split: each program stores its partial and log-sum-exp, then a CTA barrier
    orders all its threads' stores before its one ticket atomic (release). The program drawing the last
    ticket has acquired every other program's release (the atomics on one ticket form a chain), and the
    barrier that broadcasts the ticket to its threads orders that acquire before their loads. The ticket
    goes back to 0 for the next launch (a CUDA graph replays the same buffer).
    """
    tl.debug_barrier()
    ticket = tl.atomic_add(tk_ptr + row, 1, sem="acq_rel")
    last = ticket == n_splits - 1
    if last:
        tl.store(tk_ptr + row, 0)
    return last


@triton.jit
def merge_head(po_ptr, pl_ptr, vs_row, dst, slot0, n_splits, cols, ch, ch_ok,
               WIDTH: tl.constexpr, CHUNK: tl.constexpr):
    """Merge one query head's split partials ``[n_splits, WIDTH]`` (from ``slot0``) by their log-sum-exp, store it.

    ``CHUNK`` splits at a time keep the tile small in the partial kernel's few warps. Partial column ``cols``
    is output channel ``ch``; V's per-channel scale is applied last, as the combine kernels do.
    """
    rs = tl.arange(0, CHUNK)
    top = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, n_splits, CHUNK):
        lse = tl.load(pl_ptr + slot0 + s0 + rs, mask=s0 + rs < n_splits, other=float("-inf"))
        top = tl.maximum(top, tl.max(lse, 0))
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with no keys: every weight 0, total 1
    acc = tl.zeros((WIDTH,), tl.float32)
    weights = tl.zeros((CHUNK,), tl.float32)
    for s0 in range(0, n_splits, CHUNK):
        s_ok = s0 + rs < n_splits
        lse = tl.load(pl_ptr + slot0 + s0 + rs, mask=s_ok, other=float("-inf"))
        w = tl.where(s_ok, tl.math.exp2(lse - top), 0.0)
        weights += w
        part = tl.load(po_ptr + (slot0 + s0 + rs)[:, None] * WIDTH + cols[None, :], mask=s_ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
    total = tl.sum(weights, 0)
    out = acc / tl.where(total == 0.0, 1.0, total) * tl.load(vs_row + ch, mask=ch_ok, other=0.0)
    tl.store(dst + ch, out.to(dst.dtype.element_ty), mask=ch_ok)


@triton.jit
def merge_rows(tk_ptr, po_ptr, pl_ptr, vs_ptr, out_ptr, bh, b, hk, G, H_KV, n_splits, so_b, so_h, D,
               EVEN_ODD: tl.constexpr, WIDTH: tl.constexpr, CHUNK: tl.constexpr):
    """In the last program of row ``bh``: merge the splits of the row's ``G`` query heads into ``out`` [B, 1, Hq, D].

    ``EVEN_ODD``: partials hold even channels then odd ones (``WIDTH`` = 2 * BLOCK_HD); else natural order.
    """
    if last_of_row(tk_ptr, bh, n_splits):
        cols = tl.arange(0, WIDTH)
        if EVEN_ODD:
            ch = tl.where(cols < WIDTH // 2, 2 * cols, 2 * (cols - WIDTH // 2) + 1)
        else:
            ch = cols
        ch_ok = ch < D
        for g in range(G):
            head = hk * G + g
            merge_head(po_ptr, pl_ptr, vs_ptr + hk * D, out_ptr + b * so_b + head * so_h,
                       (b * (H_KV * G) + head).to(tl.int64) * n_splits, n_splits, cols, ch, ch_ok, WIDTH, CHUNK)
