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

__all__ = ["SparseRule", "dropped_entries"]

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


def dropped_entries(g: GraphBuilder, q: str, k: str, text_rows: str, image_cols: str, rule: SparseRule,
                    hint: str = "sparse") -> str:
    """bool [B, 1, S, T]: text-row x image-column entries outside the kept blocks.

    ``q`` [B, H, S, d] and ``k`` [B, H, T, d] (KV heads already repeated) in float32; ``text_rows``
    [B, S] and ``image_cols`` [B, T] bool. Self-attention queries are the last S of the T
    positions (causal, absolute block grid); cross-attention blocks count from the first query.
    """
    with g.scope(hint, stage=None):
        s_len = g.op("Gather", [g.op("Shape", [q]), g.const("two", np.int64(2))], axis=0)
        t_len = g.op("Gather", [g.op("Shape", [k]), g.const("two_k", np.int64(2))], axis=0)
        block = g.const("block", np.int64(rule.block))
        offset = g.op("Sub", [t_len, s_len]) if rule.kind == "self" else g.const("no_offset", np.int64(0))
        k_ids = g.op("Div", [_arange(g, t_len), block])
        q_ids = g.op("Div", [g.op("Add", [_arange(g, s_len), offset]), block])
        k_blocks = g.op("Add", [g.op("Div", [g.op("Sub", [t_len, g.const("one", np.int64(1))]), block]),
                                g.const("one_b", np.int64(1))])
        q_blocks = k_blocks if rule.kind == "self" else g.op(
            "Add", [g.op("Div", [g.op("Sub", [s_len, g.const("one_q", np.int64(1))]), block]), g.const("one_c", np.int64(1))])
        q_rows_f = g.op("Cast", [text_rows], to=1)
        k_cols_f = g.op("Cast", [image_cols], to=1)
        q_mean, q_tot = _block_means(g, q, q_rows_f, _one_hot(g, q_ids, q_blocks, "q"), "q")
        k_mean, k_tot = _block_means(g, k, k_cols_f, _one_hot(g, k_ids, k_blocks, "k"), "k")
        scores = g.op("ReduceMean", [g.op("MatMul", [q_mean, g.op("Transpose", [k_mean], perm=[0, 1, 3, 2])]),
                                     g.ints("heads", [1])], keepdims=0)  # [B, NQ, NK]
        zero = g.const("zero_f", np.float32(0.0), keep_dtype=True)
        valid = g.op("And", [g.op("Greater", [g.op("Unsqueeze", [q_tot, g.ints("ax2", [2])]), zero]),
                             g.op("Greater", [g.op("Unsqueeze", [k_tot, g.ints("ax1", [1])]), zero])])
        if rule.kind == "self":  # a key block is visible if it starts at or before the query block's last row
            last_row = g.op("Min", [g.op("Sub", [g.op("Mul", [g.op("Add", [_arange(g, q_blocks), g.const("one_r", np.int64(1))]),
                                                               block]), g.const("one_s", np.int64(1))]),
                                    g.op("Sub", [t_len, g.const("one_t", np.int64(1))])])
            starts = g.op("Mul", [_arange(g, k_blocks), block])
            causal = g.op("LessOrEqual", [g.op("Unsqueeze", [starts, g.ints("ax0", [0])]),
                                          g.op("Unsqueeze", [last_row, g.ints("ax1b", [1])])])
            valid = g.op("And", [valid, g.op("Unsqueeze", [causal, g.ints("ax0b", [0])])])
        counts = g.op("ReduceSum", [g.op("Cast", [valid], to=1), g.ints("last", [-1])], keepdims=1)  # [B, NQ, 1]
        want = g.op("Max", [g.op("Ceil", [g.op("Mul", [counts, g.const("density", np.float32(rule.density),
                                                                          keep_dtype=True)])]),
                            g.const("one_f", np.float32(1.0), keep_dtype=True)])
        want = g.op("Where", [g.op("Greater", [counts, zero]), want, zero])
        masked = g.op("Where", [valid, scores, g.const("neg_inf", np.float32(-np.inf), keep_dtype=True)])
        order = g.op("TopK", [masked, g.op("Reshape", [k_blocks, g.ints("one_shape", [1])])], outputs=2, axis=-1,
                     largest=1, sorted=1)[1]  # [B, NQ, NK] key blocks best first
        from onnx import helper

        blank = g.op("ConstantOfShape", [g.op("Shape", [order])], value=helper.make_tensor("zero", INT64, [1], [0]))
        ranks = g.op("ScatterElements", [blank, order, g.op("Expand", [_arange(g, k_blocks), g.op("Shape", [order])])],
                     axis=-1)
        keep = g.op("And", [valid, g.op("Less", [g.op("Cast", [ranks], to=1), want])])
        per_row = g.op("Gather", [keep, q_ids], axis=1)  # [B, S, NK]
        per_entry = g.op("Gather", [per_row, k_ids], axis=2)  # [B, S, T]
        cross = g.op("And", [g.op("Unsqueeze", [text_rows, g.ints("ax2c", [2])]),
                             g.op("Unsqueeze", [image_cols, g.ints("ax1c", [1])])])
        dropped = g.op("And", [cross, g.op("Not", [per_entry])])
        return g.op("Unsqueeze", [dropped, g.ints("heads_ax", [1])], hint="dropped")
