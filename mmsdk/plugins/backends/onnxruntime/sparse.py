"""sparse-xattn in ONNX: the block-sparse text-to-image mask computed in the graph, on every call.

The pass ranks, per text-query block, the visible image-key blocks by mean-pooled q.k (head mean)
and keeps the top ``ceil(density * visible)``; only text-row x image-column entries are dropped.
The layout depends on the input, so it is computed in-graph from the same q and k (after RoPE;
self-attention keys include the cache), on each row's own block grid (it starts at the row's
first real token, from ``attention_mask``, as in the pass), and folded into the attention's additive bias:
GroupQueryAttention's ``attention_bias`` for LLaVA/Qwen-VL self-attention, MultiHeadAttention's
for Flamingo cross-attention. ORT's SparseAttention was measured faster on CPU for a fixed
layout (docs/benchmarks.md) but takes neither a per-call layout computed in the graph together
with a quantized cache nor non-causal (cross) attention, so the masked form is what is emitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mmsdk.plugins.backends.onnxruntime.graph import INT64

if TYPE_CHECKING:
    from mmsdk.plugins.backends.onnxruntime.graph import GraphBuilder

__all__ = ["SparseRule", "dropped_entries", "dropped_from_key_sums", "first_real", "pad_blocks", "repeat_kv_heads"]

BOOL = 9


@dataclass(frozen=True)
class SparseRule:
    """sparse-xattn's rule as recorded by the pass."""

    block: int
    density: float
    kind: str  # "self" (text-to-image part of self-attention) or "cross"


def _arange(g: GraphBuilder, length: str) -> str:
    return g.op("Range", [g.const("zero_i64", np.int64(0)), length, g.const("one_i64", np.int64(1))])


def first_real(g: GraphBuilder, mask: str, length: str | None = None) -> str:
    """[B] int64: each row's first real column among the last ``length`` of a [B, T] 0/1 mask (all when None).

    The pass's block grid starts there (left padding is in no block); a row with no real column gives 0.
    """
    if length is not None:
        start = g.op("Unsqueeze", [g.op("Neg", [length]), g.ints("ax0_tail", [0])])
        mask = g.op("Slice", [mask, start, g.ints("end_tail", [2**62]), g.ints("axis_tail", [1])])
    real = g.op("Cast", [g.op("Cast", [mask], to=BOOL)], to=6)  # int32: ArgMax's CPU kernel has no int64
    return g.op("ArgMax", [real], axis=1, keepdims=0, select_last_index=0, hint="first_real")


def _one_hot(g: GraphBuilder, ids: str, count: str, hint: str) -> str:
    """[b, n] block ids -> [b, n, count] float one-hot."""
    grid = _arange(g, count)
    hits = g.op("Equal", [g.op("Unsqueeze", [ids, g.ints(f"{hint}.ax2o", [2])]), grid])
    return g.op("Cast", [hits], to=1)


def _block_means(g: GraphBuilder, x: str, weights: str, onehot: str, hint: str) -> tuple[str, str]:
    """x [B, H, n, d], weights [B, n] (0/1 float), onehot [b, n, NB] -> (means [B, H, NB, d], totals [B, NB])."""
    member = g.op("Mul", [g.op("Unsqueeze", [weights, g.ints(f"{hint}.ax2", [2])]), onehot])  # [B, n, NB]
    totals = g.op("ReduceSum", [member, g.ints(f"{hint}.ax1r", [1])], keepdims=0)  # [B, NB]
    spread = g.op("Unsqueeze", [g.op("Transpose", [member], perm=[0, 2, 1]), g.ints(f"{hint}.axh", [1])])
    sums = g.op("MatMul", [spread, x])  # [B, 1, NB, n] @ [B, H, n, d] -> [B, H, NB, d]
    safe = g.op("Max", [totals, g.const(f"{hint}.one", np.float32(1.0), keep_dtype=True)])
    means = g.op("Div", [sums, g.op("Unsqueeze", [safe, g.ints(f"{hint}.ax13", [1, 3])])])
    return means, totals


@dataclass(frozen=True)
class _Grid:
    """Per-row block ids of queries [B, S] and keys [b, T], which are real (not padding), block counts."""

    q_ids: str
    k_ids: str
    q_real: str
    k_real: str
    q_last: str  # [B, 1] last query's position counted from the row's first real token
    q_blocks: str
    k_blocks: str
    block: str


def _grid(g: GraphBuilder, q: str, t_len: str, starts: str, rule: SparseRule) -> _Grid:
    """Block grid of queries q [B, H, S, d] against ``t_len`` keys, each row's counted from ``starts`` [B].

    Self-attention: ``starts`` is on the key axis and the queries are the last S keys. Cross: it is
    on the query axis (the call's queries); the keys are image states, never padded.
    """
    s_len = g.op("Gather", [g.op("Shape", [q]), g.const("two", np.int64(2))], axis=0)
    block, one = g.const("block", np.int64(rule.block)), g.const("one", np.int64(1))
    zero = g.const("zero_pos", np.int64(0))
    offset = g.op("Sub", [t_len, s_len]) if rule.kind == "self" else g.const("no_offset", np.int64(0))
    shift = g.op("Unsqueeze", [starts, g.ints("ax1s", [1])])  # [B, 1]
    q_pos = g.op("Sub", [g.op("Unsqueeze", [g.op("Add", [_arange(g, s_len), offset]), g.ints("ax0q", [0])]), shift])
    k_pos = g.op("Unsqueeze", [_arange(g, t_len), g.ints("ax0k", [0])])  # [1, T]
    if rule.kind == "self":
        k_pos = g.op("Sub", [k_pos, shift])

    def count(length: str) -> str:
        return g.op("Add", [g.op("Div", [g.op("Sub", [length, one]), block]), one])

    def ids(pos: str) -> str:  # padding (negative positions) is clamped to block 0 and weighted 0
        return g.op("Div", [g.op("Max", [pos, zero]), block])

    k_blocks = count(t_len)
    q_last = g.op("Sub", [g.op("Sub", [g.op("Add", [offset, s_len]), one]), shift])
    return _Grid(ids(q_pos), ids(k_pos), g.op("GreaterOrEqual", [q_pos, zero]), g.op("GreaterOrEqual", [k_pos, zero]),
                 q_last, k_blocks if rule.kind == "self" else count(s_len), k_blocks, block)


def _length(g: GraphBuilder, x: str, axis: int, hint: str) -> str:
    return g.op("Gather", [g.op("Shape", [x]), g.const(hint, np.int64(axis))], axis=0)


def _visible(g: GraphBuilder, q_tot: str, k_tot: str, grid: _Grid, rule: SparseRule) -> str:
    """[B, NQ, NK]: blocks with text rows x blocks with image columns (self: not entirely in the future)."""
    zero = g.const("zero_f", np.float32(0.0), keep_dtype=True)
    valid = g.op("And", [g.op("Greater", [g.op("Unsqueeze", [q_tot, g.ints("ax2", [2])]), zero]),
                         g.op("Greater", [g.op("Unsqueeze", [k_tot, g.ints("ax1", [1])]), zero])])
    if rule.kind != "self":
        return valid
    one = g.const("one_r", np.int64(1))
    ends = g.op("Sub", [g.op("Mul", [g.op("Add", [_arange(g, grid.q_blocks), one]), grid.block]), one])
    last_row = g.op("Min", [g.op("Unsqueeze", [ends, g.ints("ax0e", [0])]), grid.q_last])  # [B, NQ]
    starts = g.op("Mul", [_arange(g, grid.k_blocks), grid.block])
    causal = g.op("LessOrEqual", [g.op("Unsqueeze", [starts, g.ints("ax01", [0, 1])]),
                                  g.op("Unsqueeze", [last_row, g.ints("ax2b", [2])])])  # [B, NQ, NK]
    return g.op("And", [valid, causal])


def _top_blocks(g: GraphBuilder, scores: str, valid: str, grid: _Grid, density: float) -> str:
    """[B, NQ, NK]: per query block, the top ceil(density * visible) visible key blocks (at least one)."""
    from onnx import helper

    zero = g.const("zero_w", np.float32(0.0), keep_dtype=True)
    counts = g.op("ReduceSum", [g.op("Cast", [valid], to=1), g.ints("last", [-1])], keepdims=1)  # [B, NQ, 1]
    want = g.op("Max", [g.op("Ceil", [g.op("Mul", [counts, g.const("density", np.float32(density), keep_dtype=True)])]),
                        g.const("one_f", np.float32(1.0), keep_dtype=True)])
    want = g.op("Where", [g.op("Greater", [counts, zero]), want, zero])
    masked = g.op("Where", [valid, scores, g.const("neg_inf", np.float32(-np.inf), keep_dtype=True)])
    order = g.op("TopK", [masked, g.op("Reshape", [grid.k_blocks, g.ints("one_shape", [1])])], outputs=2, axis=-1,
                 largest=1, sorted=1)[1]  # key blocks, best first
    blank = g.op("ConstantOfShape", [g.op("Shape", [order])], value=helper.make_tensor("zero", INT64, [1], [0]))
    ranks = g.op("ScatterElements", [blank, order, g.op("Expand", [_arange(g, grid.k_blocks), g.op("Shape", [order])])],
                 axis=-1)
    return g.op("And", [valid, g.op("Less", [g.op("Cast", [ranks], to=1), want])])


def dropped_entries(g: GraphBuilder, q: str, k: str, text_rows: str, image_cols: str, starts: str, rule: SparseRule,
                    hint: str = "sparse") -> str:
    """bool [B, 1, S, T]: text-row x image-column entries outside the kept blocks.

    ``q`` [B, H, S, d] and ``k`` [B, H, T, d] (KV heads already repeated) in float32; ``text_rows``
    [B, S] and ``image_cols`` [B, T] bool; ``starts`` [B] int64 each row's first real token
    (:func:`first_real`). Self-attention queries are the last S of the T positions (causal) and both
    grids start at the row's first real key; cross-attention blocks count from the first real query.
    """
    with g.scope(hint):
        grid = _grid(g, q, _length(g, k, 2, "two_k"), starts, rule)
        cols = g.op("And", [image_cols, grid.k_real])
        k_mean, k_tot = _block_means(g, k, g.op("Cast", [cols], to=1), _one_hot(g, grid.k_ids, grid.k_blocks, "k"), "k")
        return _dropped(g, q, k_mean, k_tot, text_rows, cols, grid, rule)


def dropped_from_key_sums(g: GraphBuilder, q: str, key_sums: str, text_rows: str, image_cols: str, starts: str,
                          rule: SparseRule, hint: str = "sparse") -> str:
    """:func:`dropped_entries` from the image keys' block sums instead of the keys themselves.

    ``key_sums`` [B, H, NB, d] (float32, KV heads repeated): per key block of the row's own grid,
    the sum of its image keys, for the first NB blocks (blocks past NB hold no image key). The
    block means, and so the layout, are those of :func:`dropped_entries` on the keys that produced
    the sums.
    """
    with g.scope(hint):
        grid = _grid(g, q, _length(g, image_cols, 1, "one_t"), starts, rule)
        cols = g.op("And", [image_cols, grid.k_real])
        member = g.op("Mul", [g.op("Unsqueeze", [g.op("Cast", [cols], to=1), g.ints("k.ax2", [2])]),
                              _one_hot(g, grid.k_ids, grid.k_blocks, "k")])
        k_tot = g.op("ReduceSum", [member, g.ints("k.ax1r", [1])], keepdims=0)  # [B, NK] image keys per block
        sums = pad_blocks(g, key_sums, grid.k_blocks, "k")
        safe = g.op("Max", [k_tot, g.const("k.one", np.float32(1.0), keep_dtype=True)])
        k_mean = g.op("Div", [sums, g.op("Unsqueeze", [safe, g.ints("k.ax13", [1, 3])])])
        return _dropped(g, q, k_mean, k_tot, text_rows, cols, grid, rule)


def pad_blocks(g: GraphBuilder, x: str, blocks: str, hint: str) -> str:
    """x [B, H, n, d] zero-padded along axis 2 to ``blocks`` (int64 scalar, >= n)."""
    missing = g.op("Sub", [blocks, _length(g, x, 2, f"{hint}.two_p")])
    # Pad's pads: every axis's begin, then every axis's end; only the end of axis 2 grows
    end = g.op("Unsqueeze", [missing, g.ints(f"{hint}.pax", [0])])
    pads = g.op("Concat", [g.ints(f"{hint}.pad_lead", [0] * 6), end, g.ints(f"{hint}.pad_last", [0])], axis=0)
    return g.op("Pad", [x, pads], hint=f"{hint}.pad")


def repeat_kv_heads(g: GraphBuilder, x: str, heads: int, kv_heads: int, dim: int) -> str:
    """[B, kv_heads, L, D] -> [B, heads, L, D], KV head j serving query heads j*g .. j*g+g-1 (repeat_interleave)."""
    group = g.op("Expand", [g.op("Unsqueeze", [x, g.ints("ax2", [2])]),
                            g.ints("group", [1, 1, heads // kv_heads, 1, 1])])
    return g.op("Reshape", [group, g.ints("heads_shape", [0, heads, -1, dim])])


def _dropped(g: GraphBuilder, q: str, k_mean: str, k_tot: str, text_rows: str, image_cols: str, grid: _Grid,
             rule: SparseRule) -> str:
    rows = g.op("And", [text_rows, grid.q_real])
    q_mean, q_tot = _block_means(g, q, g.op("Cast", [rows], to=1), _one_hot(g, grid.q_ids, grid.q_blocks, "q"), "q")
    scores = g.op("ReduceMean", [g.op("MatMul", [q_mean, g.op("Transpose", [k_mean], perm=[0, 1, 3, 2])]),
                                 g.ints("heads", [1])], keepdims=0)  # [B, NQ, NK], head mean
    keep = _top_blocks(g, scores, _visible(g, q_tot, k_tot, grid, rule), grid, rule.density)
    cross = g.op("And", [g.op("Unsqueeze", [rows, g.ints("ax2c", [2])]),
                         g.op("Unsqueeze", [image_cols, g.ints("ax1c", [1])])])  # [B, S, T]
    # each row's own grid: gather its query blocks, then its key blocks
    by_query = g.op("Concat", [g.op("Shape", [rows]), g.op("Reshape", [grid.k_blocks, g.ints("nk1", [1])])], axis=0)
    q_index = g.op("Expand", [g.op("Unsqueeze", [grid.q_ids, g.ints("ax2q", [2])]), by_query])  # [B, S, NK]
    per_query = g.op("GatherElements", [keep, q_index], axis=1)
    k_index = g.op("Expand", [g.op("Unsqueeze", [grid.k_ids, g.ints("ax1k", [1])]), g.op("Shape", [cross])])
    per_entry = g.op("GatherElements", [per_query, k_index], axis=2)  # [B, S, T]
    return g.op("Unsqueeze", [g.op("And", [cross, g.op("Not", [per_entry])]), g.ints("heads_ax", [1])],
                hint="dropped")
