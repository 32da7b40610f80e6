"""sparse-xattn in ONNX: the block-sparse text-to-image mask computed in the graph, on every call.

The pass ranks, per text-query block, the visible image-key blocks by mean-pooled q.k (head mean)
and keeps the top ``ceil(density * visible)``; only text-row x image-column entries are dropped.
The layout depends on the input, so it is computed in-graph from the same q and k (after RoPE;
self-attention keys include the cache) and folded into the attention's additive bias:
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

__all__ = ["SparseRule", "dropped_entries", "dropped_from_key_sums", "pad_blocks", "repeat_kv_heads"]

BOOL = 9


@dataclass(frozen=True)
class SparseRule:
    """sparse-xattn's rule as recorded by the pass."""

    block: int
    density: float
    kind: str  # "self" (text-to-image part of self-attention) or "cross"


def _arange(g: GraphBuilder, length: str) -> str:
    return g.op("Range", [g.const("zero_i64", np.int64(0)), length, g.const("one_i64", np.int64(1))])


def _one_hot(g: GraphBuilder, ids: str, count: str, hint: str) -> str:
    """[n] block ids -> [n, count] float one-hot."""
    grid = _arange(g, count)
    hits = g.op("Equal", [g.op("Unsqueeze", [ids, g.ints(f"{hint}.ax1", [1])]), grid])
    return g.op("Cast", [hits], to=1)


def _block_means(g: GraphBuilder, x: str, weights: str, onehot: str, hint: str) -> tuple[str, str]:
    """x [B, H, n, d], weights [B, n] (0/1 float), onehot [n, NB] -> (means [B, H, NB, d], totals [B, NB])."""
    member = g.op("Mul", [g.op("Unsqueeze", [weights, g.ints(f"{hint}.ax2", [2])]),
                          g.op("Unsqueeze", [onehot, g.ints(f"{hint}.ax0", [0])])])  # [B, n, NB]
    totals = g.op("ReduceSum", [member, g.ints(f"{hint}.ax1r", [1])], keepdims=0)  # [B, NB]
    spread = g.op("Unsqueeze", [g.op("Transpose", [member], perm=[0, 2, 1]), g.ints(f"{hint}.axh", [1])])
    sums = g.op("MatMul", [spread, x])  # [B, 1, NB, n] @ [B, H, n, d] -> [B, H, NB, d]
    safe = g.op("Max", [totals, g.const(f"{hint}.one", np.float32(1.0), keep_dtype=True)])
    means = g.op("Div", [sums, g.op("Unsqueeze", [safe, g.ints(f"{hint}.ax13", [1, 3])])])
    return means, totals


@dataclass(frozen=True)
class _Grid:
    """Block ids of queries and keys, and block counts (graph values)."""

    t_len: str
    q_ids: str
    k_ids: str
    q_blocks: str
    k_blocks: str
    block: str


def _grid(g: GraphBuilder, q: str, t_len: str, rule: SparseRule) -> _Grid:
    """Block ids and counts for queries q [B, H, S, d] against ``t_len`` keys (int64 scalar)."""
    s_len = g.op("Gather", [g.op("Shape", [q]), g.const("two", np.int64(2))], axis=0)
    block, one = g.const("block", np.int64(rule.block)), g.const("one", np.int64(1))
    offset = g.op("Sub", [t_len, s_len]) if rule.kind == "self" else g.const("no_offset", np.int64(0))

    def count(length: str) -> str:
        return g.op("Add", [g.op("Div", [g.op("Sub", [length, one]), block]), one])

    k_blocks = count(t_len)
    return _Grid(t_len, g.op("Div", [g.op("Add", [_arange(g, s_len), offset]), block]),
                 g.op("Div", [_arange(g, t_len), block]), k_blocks if rule.kind == "self" else count(s_len),
                 k_blocks, block)


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
    last_row = g.op("Min", [ends, g.op("Sub", [grid.t_len, one])])
    starts = g.op("Mul", [_arange(g, grid.k_blocks), grid.block])
    causal = g.op("LessOrEqual", [g.op("Unsqueeze", [starts, g.ints("ax0", [0])]),
                                  g.op("Unsqueeze", [last_row, g.ints("ax1b", [1])])])
    return g.op("And", [valid, g.op("Unsqueeze", [causal, g.ints("ax0b", [0])])])


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


def dropped_entries(g: GraphBuilder, q: str, k: str, text_rows: str, image_cols: str, rule: SparseRule,
                    hint: str = "sparse") -> str:
    """bool [B, 1, S, T]: text-row x image-column entries outside the kept blocks.

    ``q`` [B, H, S, d] and ``k`` [B, H, T, d] (KV heads already repeated) in float32; ``text_rows``
    [B, S] and ``image_cols`` [B, T] bool. Self-attention queries are the last S of the T
    positions (causal, absolute block grid); cross-attention blocks count from the first query.
    """
    with g.scope(hint):
        grid = _grid(g, q, _length(g, k, 2, "two_k"), rule)
        k_mean, k_tot = _block_means(g, k, g.op("Cast", [image_cols], to=1),
                                     _one_hot(g, grid.k_ids, grid.k_blocks, "k"), "k")
        return _dropped(g, q, k_mean, k_tot, text_rows, image_cols, grid, rule)


def dropped_from_key_sums(g: GraphBuilder, q: str, key_sums: str, text_rows: str, image_cols: str, rule: SparseRule,
                          hint: str = "sparse") -> str:
    """:func:`dropped_entries` from the image keys' block sums instead of the keys themselves.

    ``key_sums`` [B, H, NB, d] (float32, KV heads repeated): per key block, the sum of its image
    keys, for the first NB blocks (blocks past NB hold no image key). The block means, and so the
    layout, are those of :func:`dropped_entries` on the keys that produced the sums.
    """
    with g.scope(hint):
        grid = _grid(g, q, _length(g, image_cols, 1, "one_t"), rule)
        weights = g.op("Cast", [image_cols], to=1)
        member = g.op("Mul", [g.op("Unsqueeze", [weights, g.ints("k.ax2", [2])]),
                              g.op("Unsqueeze", [_one_hot(g, grid.k_ids, grid.k_blocks, "k"), g.ints("k.ax0", [0])])])
        k_tot = g.op("ReduceSum", [member, g.ints("k.ax1r", [1])], keepdims=0)  # [B, NK] image keys per block
        sums = pad_blocks(g, key_sums, grid.k_blocks, "k")
        safe = g.op("Max", [k_tot, g.const("k.one", np.float32(1.0), keep_dtype=True)])
        k_mean = g.op("Div", [sums, g.op("Unsqueeze", [safe, g.ints("k.ax13", [1, 3])])])
        return _dropped(g, q, k_mean, k_tot, text_rows, image_cols, grid, rule)


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
    q_onehot = _one_hot(g, grid.q_ids, grid.q_blocks, "q")
    q_mean, q_tot = _block_means(g, q, g.op("Cast", [text_rows], to=1), q_onehot, "q")
    scores = g.op("ReduceMean", [g.op("MatMul", [q_mean, g.op("Transpose", [k_mean], perm=[0, 1, 3, 2])]),
                                 g.ints("heads", [1])], keepdims=0)  # [B, NQ, NK], head mean
    keep = _top_blocks(g, scores, _visible(g, q_tot, k_tot, grid, rule), grid, rule.density)
    per_entry = g.op("Gather", [g.op("Gather", [keep, grid.q_ids], axis=1), grid.k_ids], axis=2)  # [B, S, T]
    cross = g.op("And", [g.op("Unsqueeze", [text_rows, g.ints("ax2c", [2])]),
                         g.op("Unsqueeze", [image_cols, g.ints("ax1c", [1])])])
    return g.op("Unsqueeze", [g.op("And", [cross, g.op("Not", [per_entry])]), g.ints("heads_ax", [1])],
                hint="dropped")
