"""Gated cross-attention (Flamingo family) in the decoder: MultiHeadAttention on precomputed vision K/V.

The vision graph projects the image states into each open block's K/V once per image
(``cross_key_values.{i}.key/value``, BNSH, KV heads repeated to the query heads because
MultiHeadAttention has one head count). The decoder reads them on every step; they never grow.
Gates are constants ``tanh(alpha)``; a branch whose gate is exactly 0 is not emitted at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.onnxruntime import names as N
from mmsdk.plugins.backends.onnxruntime.graph import FLOAT, INT64
from mmsdk.plugins.backends.onnxruntime.ops import MS, float_min, linear
from mmsdk.plugins.backends.onnxruntime.plan import CrossPlan, CrossRecipe

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import CrossAttentionBlock, ModelAdapter
    from mmsdk.plugins.backends.onnxruntime.decoder import DecoderBuilder, Stream

__all__ = ["RECIPES", "recipe_for", "gate_values", "cross_plans", "declare_cross_inputs", "emit_block", "cross_dims"]

# Keyed by adapter name: how each family's block treats tokens that see no image, and its q/k norms.
RECIPES: dict[str, CrossRecipe] = {
    "idefics": CrossRecipe(row_mask="attention", mask_input="image_attention_mask", q_norm="q_layer_norm",
                           k_norm="k_layer_norm"),
    "mllama": CrossRecipe(row_mask="mlp", mask_input="cross_attention_mask", q_norm="q_norm", k_norm="k_norm"),
}


def recipe_for(adapter: ModelAdapter) -> CrossRecipe:
    """The recipe of ``adapter``'s family, or an ExportError naming the known ones."""
    if adapter.name not in RECIPES:
        raise ExportError(
            f"the onnxruntime backend has no cross-attention recipe for adapter {adapter.name!r} "
            f"(known: {', '.join(sorted(RECIPES))}).",
            fix="export to the 'torch' backend, or contribute a CrossRecipe for this family.",
        )
    return RECIPES[adapter.name]


def gate_values(block: CrossAttentionBlock) -> tuple[np.ndarray, np.ndarray]:
    """tanh of the (attention, MLP) gates as float32 arrays."""
    attn, mlp = (getattr(block.module, name) for name in block.gate_names)
    return (attn.detach().float().tanh().cpu().numpy(), mlp.detach().float().tanh().cpu().numpy())


def cross_plans(model: nn.Module, adapter: ModelAdapter, skipped: frozenset[int] = frozenset()) -> tuple[CrossPlan, ...]:
    """One CrossPlan per block; ``skipped`` decoder indices (closed by a pass) drop out entirely."""
    plans = []
    for index, block in enumerate(adapter.cross_attention_blocks(model)):
        if block.decoder_index in skipped:
            continue
        attn_gate, mlp_gate = gate_values(block)
        plan = CrossPlan(block.decoder_index, index, bool(np.any(attn_gate != 0)), bool(np.any(mlp_gate != 0)))
        if plan.attention_open or plan.mlp_open:
            plans.append(plan)
    return tuple(plans)


def cross_dims(builder: DecoderBuilder) -> tuple[int, int]:
    """(query heads, head dim) of the cross-attention layers."""
    return builder.layout.num_heads, builder.layout.head_dim


def declare_cross_inputs(builder: DecoderBuilder) -> None:
    g = builder.g
    heads, dim = cross_dims(builder)
    for plan in builder.plan.cross_with_kv():
        for name in (N.cross_key(plan.decoder_index), N.cross_value(plan.decoder_index)):
            # the vision graph computes in float32; a float16 decoder casts once per step
            g.input(name, FLOAT, [N.BATCH, heads, "vision_sequence_length", dim])
            builder.shared[name] = name if g.float_type == FLOAT else g.op("Cast", [name], to=g.float_type)
    g.input(N.CROSS_ATTENTION_MASK, INT64, [N.BATCH, N.SEQUENCE, "vision_groups"])
    with g.scope("cross_inputs", stage="cross_attention", modality="multimodal"):
        mask = g.op("Cast", [N.CROSS_ATTENTION_MASK], to=g.float_type)  # [B, S, G]
        row = g.op("ReduceMax", [mask, g.ints("axis_last", [-1])], keepdims=1, hint="row_sees_image")  # [B, S, 1]
        builder.shared["cross_row"] = row
        builder.shared["cross_mask"] = mask


def _key_bias(builder: DecoderBuilder, key: str) -> str:
    """[B, 1, S, L] additive bias: vision groups a row may not see; all-zero for masked-out Mllama rows."""
    g = builder.g
    if "cross_bias" in builder.shared:
        return builder.shared["cross_bias"]
    mask = builder.shared["cross_mask"]
    groups = g.op("Gather", [g.op("Shape", [mask]), g.const("two", 2, keep_dtype=True)], axis=0)
    keys = g.op("Gather", [g.op("Shape", [key]), g.const("two_b", 2, keep_dtype=True)], axis=0)
    per_group = g.op("Unsqueeze", [g.op("Div", [keys, groups]), g.ints("ax0", [0])])
    # [B, S, G] -> [B, S, G, 1] -> tiled [B, S, G, L / G] -> [B, S, L]: each group covers its tokens
    repeats = g.op("Concat", [g.ints("ones3", [1, 1, 1]), per_group], axis=0)
    tiled = g.op("Tile", [g.op("Unsqueeze", [mask, g.ints("ax3", [3])]), repeats])
    flat = g.op("Reshape", [tiled, g.ints("bsl", [0, 0, -1])])
    bias = g.op("Mul", [g.op("Sub", [g.const("one_f", 1.0), flat]), g.const("neg", float_min(g))])
    # Rows that see no image attend to every vision token unmasked (Mllama's rule; for IDEFICS their
    # output is zeroed anyway, and an unmasked row cannot turn into NaN).
    bias = g.op("Mul", [bias, builder.shared["cross_row"]])
    bias = g.op("Unsqueeze", [bias, g.ints("ax1", [1])], hint="cross_attention_bias")
    builder.shared["cross_bias"] = bias
    return bias


def _sparse_bias(builder: DecoderBuilder, q: str, key: str, bias: str) -> str:
    """sparse-xattn on a cross-attention layer: every real query row is text, every key an image state.

    The query grid starts at the call's first real query (left padding is in no block), as in the pass.
    """
    from onnx import helper

    from mmsdk.plugins.backends.onnxruntime.sparse import dropped_entries, first_real

    g = builder.g
    heads, dim = cross_dims(builder)
    with g.scope("sparse_xattn"):
        q4 = g.op("Transpose", [g.op("Reshape", [q, g.ints("q_shape", [0, 0, heads, dim])])], perm=[0, 2, 1, 3])
        keys = key
        if g.float_type != FLOAT:
            q4, keys = (g.op("Cast", [t], to=FLOAT) for t in (q4, keys))
        true = helper.make_tensor("true", 9, [1], [True])
        rows = g.op("ConstantOfShape", [g.op("Gather", [g.op("Shape", [q4]), g.ints("bs", [0, 2])], axis=0)], value=true)
        cols = g.op("ConstantOfShape", [g.op("Gather", [g.op("Shape", [keys]), g.ints("bl", [0, 2])], axis=0)], value=true)
        if "cross_row_starts" not in builder.shared:
            seq = g.op("Gather", [g.op("Shape", [q4]), g.const("two_s", 2, keep_dtype=True)], axis=0)
            builder.shared["cross_row_starts"] = first_real(g, N.ATTENTION_MASK, seq)
        dropped = dropped_entries(g, q4, keys, rows, cols, builder.shared["cross_row_starts"], builder.plan.sparse)
        expanded = g.op("Expand", [bias, g.op("Shape", [dropped])])
        return g.op("Where", [dropped, g.const("neg", float_min(g)), expanded], hint="sparse_bias")


def emit_block(builder: DecoderBuilder, stream: Stream, block: CrossAttentionBlock, plan: CrossPlan) -> None:
    """One gated block: x += tanh(a) * xattn(norm(x)); x += tanh(b) * mlp(norm(x)) (rows masked per recipe)."""
    g, recipe = builder.g, builder.plan.recipe
    assert recipe is not None  # set with the cross plans
    layer = block.module
    attn_gate, mlp_gate = gate_values(block)
    norm_in, norm_post = (builder.norm_of(n) for n in builder.adapter.layer_norms(layer))
    row = builder.shared["cross_row"]
    if plan.attention_open:
        x = stream.norm(g, norm_in, "input_layernorm")
        out = _cross_attention(builder, x, block, recipe)
        if recipe.row_mask == "attention":
            out = g.op("Mul", [out, row], hint="zero_rows_without_image")
        stream.add(g, g.op("Mul", [out, g.const("attn_gate", attn_gate.reshape(-1))], hint="attn_gate"))
    if plan.mlp_open:
        x = stream.norm(g, norm_post, "post_attention_layernorm")
        out = builder.mlp(x, builder.adapter.mlp(layer))
        if recipe.row_mask == "mlp":
            out = g.op("Mul", [out, row], hint="zero_rows_without_image")
        stream.add(g, g.op("Mul", [out, g.const("mlp_gate", mlp_gate.reshape(-1))], hint="mlp_gate"))


def _cross_attention(builder: DecoderBuilder, x: str, block: CrossAttentionBlock, recipe: CrossRecipe) -> str:
    g, attention = builder.g, block.attention
    heads, dim = cross_dims(builder)
    names = block.projections.linears()
    q = linear(g, x, builder.linear_of(getattr(attention, names["q"])), "q_proj",
               accuracy_level=builder.plan.accuracy_level)
    q_norm = getattr(attention, recipe.q_norm, None) if recipe.q_norm else None
    if q_norm is not None:
        spec = builder.norm_of(q_norm)
        per_head = g.op("Reshape", [q, g.ints("bshd", [0, 0, heads, dim])])
        normed = g.op("SimplifiedLayerNormalization", [per_head, g.const("q_norm.weight", spec.weight)], axis=-1,
                      epsilon=spec.eps, stash_type=1, hint="q_norm")
        q = g.op("Reshape", [normed, g.ints("bsh", [0, 0, heads * dim])])
    key, value = (builder.shared[n] for n in (N.cross_key(block.decoder_index), N.cross_value(block.decoder_index)))
    bias = _key_bias(builder, key)
    if builder.plan.sparse is not None:
        bias = _sparse_bias(builder, q, key, bias)
    attrs: dict[str, object] = {"num_heads": heads}
    scaling = getattr(attention, "scaling", None)
    if isinstance(scaling, float):
        attrs["scale"] = scaling
    out = g.op("MultiHeadAttention", [q, key, value, "", "", bias], domain=MS, hint="MultiHeadAttention", **attrs)
    o_name = names["o"]
    return linear(g, out, builder.linear_of(getattr(attention, o_name)), "o_proj",
                  accuracy_level=builder.plan.accuracy_level)
