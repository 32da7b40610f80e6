"""decoder.onnx, written node by node from the model's weights (through its adapter).

Contract (ORT GenAI's): ``inputs_embeds`` [B, S, hidden], ``attention_mask`` int64 [B, T],
``position_ids`` int64 [3, B, S] (M-RoPE only), ``past_key_values.{i}.key/value``
[B, kv_heads, P, D] -> ``logits`` [B, S, vocab], ``present.{i}.key/value`` [B, kv_heads, T, D].
Flamingo-family decoders also take ``cross_key_values.{i}.key/value`` [B, heads, L, D] from the
vision graph and ``cross_attention_mask`` int64 [B, S, groups].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.onnxruntime import names as N
from mmsdk.plugins.backends.onnxruntime.graph import FLOAT, INT32, INT64, GraphBuilder, float_type_of
from mmsdk.plugins.backends.onnxruntime.kvcache import cache_last_dim, cache_type
from mmsdk.plugins.backends.onnxruntime.lowering import LinearWeights, concat_rows, linear_weights
from mmsdk.plugins.backends.onnxruntime.ops import (
    MS,
    NormSpec,
    activation,
    float_min,
    linear,
    linear_group,
    norm_spec,
    rms_norm,
    skip_rms_norm,
)
from mmsdk.plugins.backends.onnxruntime.rope import RopeCache, add_rope_cache, apply_rope, rope_spec

if TYPE_CHECKING:
    import onnx
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.session import Session
    from mmsdk.plugins.backends.onnxruntime.plan import ExportPlan

__all__ = ["DecoderBuilder", "Stream"]


class Stream:
    """The residual stream: a materialized sum plus at most one delta waiting to be added.

    Keeping the delta pending lets the next norm fuse the add (SkipSimplifiedLayerNormalization).
    """

    def __init__(self, hidden: str) -> None:
        self.hidden = hidden
        self.pending: str | None = None

    def norm(self, g: GraphBuilder, spec: NormSpec, hint: str) -> str:
        if self.pending is None:
            return rms_norm(g, self.hidden, spec, hint)
        normed, self.hidden = skip_rms_norm(g, self.pending, self.hidden, spec, hint)
        self.pending = None
        return normed

    def add(self, g: GraphBuilder, delta: str) -> None:
        if self.pending is not None:
            self.hidden = g.op("Add", [self.hidden, self.pending], hint="residual")
        self.pending = delta


class DecoderBuilder:
    """Builds decoder.onnx for one model; every module it cannot read raises before anything is written."""

    def __init__(self, model: nn.Module, adapter: ModelAdapter, session: Session, plan: ExportPlan) -> None:
        self.model, self.adapter, self.session, self.plan = model, adapter, session, plan
        self.layout = adapter.kv_layout(model)
        self.text = adapter.text_config(model)
        self.g = GraphBuilder("decoder", modality="text", stage="decoder", float_type=float_type_of(plan.dtype))
        self.qualnames = {id(m): name for name, m in model.named_modules()}
        self.rope: RopeCache | None = None
        self.shared: dict[str, str] = {}

    # --- reading the model -------------------------------------------------------------------
    def where(self, module: nn.Module) -> str:
        return self.qualnames.get(id(module), type(module).__name__)

    def linear_of(self, module: nn.Module) -> LinearWeights:
        return linear_weights(module, self.session, self.plan.target, self.where(module))

    def norm_of(self, module: nn.Module) -> NormSpec:
        return norm_spec(module, self.session, self.plan.target, self.where(module))

    def qkv_weights(self, attention: nn.Module) -> list[LinearWeights]:
        """q|k|v as one linear (the model's fused projection, qkv-fuse's, or rows stacked here) or three."""
        from mmsdk.plugins.attention.qkv_fuse import FusedSlice

        names = self.adapter.attention_projections(attention).linears()
        if "qkv" in names:
            return [self.linear_of(getattr(attention, names["qkv"]))]
        parts = [getattr(attention, names[role]) for role in ("q", "k", "v")]
        if all(isinstance(p, FusedSlice) for p in parts) and parts[0].roles == ("q", "k", "v"):
            return [self.linear_of(parts[0].fused)]
        return self.fused_or_apart([self.linear_of(p) for p in parts], attention)

    def fused_or_apart(self, parts: list[LinearWeights], owner: nn.Module) -> list[LinearWeights]:
        fused = concat_rows(parts, self.where(owner))
        return [fused] if fused is not None else parts

    def mlp_weights(self, mlp: nn.Module) -> tuple[list[LinearWeights], LinearWeights, bool]:
        """(gate|up as one or two linears, or up alone; down; gated?)."""
        proj = self.adapter.mlp_projections(mlp)
        up, down = self.linear_of(getattr(mlp, proj.up)), self.linear_of(getattr(mlp, proj.down))
        if proj.gate is None:
            return [up], down, False
        gate = self.linear_of(getattr(mlp, proj.gate))
        return self.fused_or_apart([gate, up], mlp), down, True

    # --- graph -------------------------------------------------------------------------------
    def build(self) -> onnx.ModelProto:
        """The whole decoder graph."""
        from mmsdk.plugins.backends.onnxruntime import xattn

        g, layout = self.g, self.layout
        embeds = self.declare_inputs()
        self.shared.update(self.attention_inputs())
        spec = rope_spec(self.model, self.adapter, self.plan.max_positions, layout.head_dim)
        self.rope = add_rope_cache(g, spec)
        stream = Stream(embeds)
        layers = self.adapter.decoder_layers(self.model)
        cross = {c.decoder_index: c for c in self.plan.cross}
        blocks = self.adapter.cross_attention_blocks(self.model)
        for index, layer in enumerate(layers):
            with g.scope(f"layers.{index}", module=self.where(layer)):
                if index in cross:
                    block = blocks[cross[index].block_index]
                    with g.scope("cross", stage="cross_attention", modality="multimodal", module=self.where(block.module)):
                        xattn.emit_block(self, stream, block, cross[index])
                attention = self.adapter.self_attention(layer)
                if attention is not None:
                    self.emit_self_attention_layer(stream, layer, attention, index)
        with g.scope("norm", module=self.where(self.adapter.final_norm(self.model))):
            hidden = stream.norm(g, self.norm_of(self.adapter.final_norm(self.model)), "final_norm")
        head = self.adapter.lm_head(self.model)
        with g.scope("lm_head", stage="lm_head", module=self.where(head)):
            logits = linear(g, hidden, self.linear_of(head), "lm_head", accuracy_level=self.plan.accuracy_level)
        g.output(logits, N.LOGITS, g.float_type, [N.BATCH, N.SEQUENCE, self.linear_of(head).out_features])
        return g.model()

    def declare_inputs(self) -> str:
        g, layout = self.g, self.layout
        embeds = g.input(N.INPUTS_EMBEDS, g.float_type, [N.BATCH, N.SEQUENCE, layout.hidden_size])
        g.input(N.ATTENTION_MASK, INT64, [N.BATCH, N.TOTAL])
        if self.adapter.rope_sections(self.model) is not None:
            g.input(N.POSITION_IDS, INT64, [3, N.BATCH, N.SEQUENCE])
        elif self.plan.explicit_positions:  # see projected_qkv
            g.input(N.POSITION_IDS, INT64, [N.BATCH, N.SEQUENCE])
        if self.plan.sparse is not None and self.plan.sparse.kind == "self":
            g.input(N.IMAGE_TOKEN_MASK, INT64, [N.BATCH, N.TOTAL])
        ctype, last = cache_type(self.plan.kv, g.float_type), cache_last_dim(self.plan.kv, layout.head_dim)
        for i in layout.self_attention_layers:
            for name in (N.past_key(i), N.past_value(i)):
                g.input(name, ctype, [N.BATCH, layout.num_kv_heads, N.PAST, last])
        if self.plan.sparse_key_state:
            from mmsdk.plugins.backends.onnxruntime.sparse_cache import declare_image_key_state

            declare_image_key_state(g, layout.self_attention_layers, layout.num_kv_heads, layout.head_dim)
        if self.plan.cross:
            from mmsdk.plugins.backends.onnxruntime.xattn import declare_cross_inputs

            declare_cross_inputs(self)
        return embeds

    def attention_inputs(self) -> dict[str, str]:
        """seqlens_k / total_sequence_length for GQA and the additive padding bias [B, 1, S, T]."""
        g = self.g
        with g.scope("attention_inputs", stage="decoder"):
            mask_shape = g.op("Shape", [N.ATTENTION_MASK])
            total64 = g.op("Gather", [mask_shape, g.const("one", 1, keep_dtype=True)], axis=0)
            total = g.op("Cast", [total64], to=INT32)
            batch = g.op("Gather", [mask_shape, g.const("zero", 0, keep_dtype=True)], axis=0)
            batch1 = g.op("Unsqueeze", [batch, g.ints("axes0", [0])])
            last = g.op("Sub", [total, g.const("one_i32", np.int32(1))])
            seqlens = g.op("Expand", [last, batch1], hint="seqlens_k")
            valid = g.op("Cast", [N.ATTENTION_MASK], to=9)  # bool
            zero = g.const("zero_f", 0.0)
            neg = g.const("neg_f", float_min(g))
            bias = g.op("Where", [valid, zero, neg])  # [B, T]
            bias4 = g.op("Unsqueeze", [bias, g.ints("axes12", [1, 2])])  # [B, 1, 1, T]
            embeds_shape = g.op("Shape", [N.INPUTS_EMBEDS])
            seq = g.op("Slice", [embeds_shape, g.ints("s1", [1]), g.ints("s2", [2])])
            target = g.op("Concat", [batch1, g.ints("one1", [1]), seq, g.op("Unsqueeze", [total64, g.ints("axes0b", [0])])],
                          axis=0)
            full = g.op("Expand", [bias4, target], hint="attention_bias")
        return {"seqlens_k": seqlens, "total": total, "bias": full}

    def emit_self_attention_layer(self, stream: Stream, layer: nn.Module, attention: nn.Module, index: int) -> None:
        g, acc = self.g, self.plan.accuracy_level
        norm_in, norm_post = (self.norm_of(n) for n in self.adapter.layer_norms(layer))
        with g.scope("self_attn", module=self.where(attention)):
            x = stream.norm(g, norm_in, "input_layernorm")
            attn = self.self_attention(x, attention, index)
            stream.add(g, linear(g, attn, self.linear_of(self._o_proj(attention)), "o_proj", accuracy_level=acc))
        mlp = self.adapter.mlp(layer)
        with g.scope("mlp", module=self.where(mlp)):
            x = stream.norm(g, norm_post, "post_attention_layernorm")
            stream.add(g, self.mlp(x, mlp))

    def _o_proj(self, attention: nn.Module) -> nn.Module:
        name = self.adapter.attention_projections(attention).o
        if name is None:
            raise ExportError(f"{self.where(attention)} has no output projection the adapter can name.",
                              fix="fix the adapter's attention_projections().")
        return getattr(attention, name)

    def self_attention(self, x: str, attention: nn.Module, index: int) -> str:
        g, layout, kv = self.g, self.layout, self.plan.kv
        assert self.rope is not None  # set in build()
        heads, kv_heads, dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
        qkv, rotary = self.projected_qkv(x, attention)
        bias = self.shared["bias"]
        if self.plan.sparse is not None and self.plan.sparse.kind == "self":
            bias = self.sparse_bias(qkv[0], qkv[1], index, bias)
        inputs = [*qkv, N.past_key(index), N.past_value(index), self.shared["seqlens_k"], self.shared["total"],
                  *rotary, "", bias]
        attrs: dict[str, object] = {"num_heads": heads, "kv_num_heads": kv_heads, "do_rotary": int(rotary[0] != "")}
        scaling = getattr(attention, "scaling", None)
        if isinstance(scaling, float):
            attrs["scale"] = scaling
        if kv is not None:
            ks, vs = kv.k_scales[index], kv.v_scales[index]
            if ks.size != vs.size:  # ORT's CPU kernel needs one quant type for K and V: widen the per-tensor one
                ks, vs = (np.full(max(ks.size, vs.size), a.item(), np.float32) if a.size == 1 else a for a in (ks, vs))
            inputs += ["", g.const(f"k_scale.{index}", ks, keep_dtype=True), g.const(f"v_scale.{index}", vs, keep_dtype=True)]
            attrs.update(k_quant_type=kv.quant_type(ks), v_quant_type=kv.quant_type(vs), kv_cache_bit_width=kv.bits)
        outs = g.op("GroupQueryAttention", inputs, domain=MS, hint="GroupQueryAttention",
                    outputs=[g.fresh("attn_out"), N.present_key(index), N.present_value(index)], **attrs)
        ctype, last = cache_type(kv, g.float_type), cache_last_dim(kv, dim)
        for name in outs[1:]:
            g.output(name, name, ctype, [N.BATCH, kv_heads, N.TOTAL, last])
        return outs[0]

    def sparse_bias(self, q: str, k: str, index: int, bias: str) -> str:
        """The padding bias with sparse-xattn's dropped text-to-image entries set to the mask value."""
        from mmsdk.plugins.backends.onnxruntime import sparse

        g, layout, rule = self.g, self.layout, self.plan.sparse
        assert rule is not None  # only called for sparse-xattn
        heads, kv_heads, dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
        with g.scope("sparse_xattn"):
            q4 = g.op("Transpose", [g.op("Reshape", [q, g.ints("q_shape", [0, 0, heads, dim])])], perm=[0, 2, 1, 3])
            k_new = g.op("Transpose", [g.op("Reshape", [k, g.ints("k_shape", [0, 0, kv_heads, dim])])], perm=[0, 2, 1, 3])
            if g.float_type != FLOAT:
                q4, k_new = (g.op("Cast", [t], to=FLOAT) for t in (q4, k_new))
            text_rows, image_cols = self.image_masks()
            if "row_starts" not in self.shared:  # the block grid of every row starts at its first real token
                self.shared["row_starts"] = sparse.first_real(g, N.ATTENTION_MASK)
            starts = self.shared["row_starts"]
            if self.plan.sparse_key_state:  # quantized cache: rank by the carried image-key block sums
                from mmsdk.plugins.backends.onnxruntime.sparse_cache import image_key_sums

                assert self.plan.kv is not None  # sparse_key_state says so
                sums = image_key_sums(g, k_new, image_cols, starts, self.plan.kv, index, rule, kv_heads, dim)
                sums = sparse.repeat_kv_heads(g, sums, heads, kv_heads, dim)
                dropped = sparse.dropped_from_key_sums(g, q4, sums, text_rows, image_cols, starts, rule)
            else:
                past = N.past_key(index) if g.float_type == FLOAT else g.op("Cast", [N.past_key(index)], to=FLOAT)
                keys = g.op("Concat", [past, k_new], axis=2)  # [B, kv_heads, T, D]: cache + this call
                keys = sparse.repeat_kv_heads(g, keys, heads, kv_heads, dim)
                dropped = sparse.dropped_entries(g, q4, keys, text_rows, image_cols, starts, rule)
            return g.op("Where", [dropped, g.const("neg", float_min(g)), bias], hint="sparse_bias")

    def image_masks(self) -> tuple[str, str]:
        """(text_rows [B, S], image_cols [B, T]) as bool, from ``image_token_mask``; made once per graph."""
        g = self.g
        if "image_cols" not in self.shared:
            images = g.op("Cast", [N.IMAGE_TOKEN_MASK], to=9)
            seq = g.op("Gather", [g.op("Shape", [N.INPUTS_EMBEDS]), g.const("one", np.int64(1))], axis=0)
            start = g.op("Unsqueeze", [g.op("Neg", [seq]), g.ints("ax0", [0])])
            self.shared["image_cols"] = images
            self.shared["text_rows"] = g.op("Not", [g.op("Slice", [images, start, g.ints("end", [2**62]),
                                                                   g.ints("axis", [1])])])
        return self.shared["text_rows"], self.shared["image_cols"]

    def projected_qkv(self, x: str, attention: nn.Module) -> tuple[list[str], list[str]]:
        """(query, key, value) for GQA and its (cos_cache, sin_cache) inputs.

        1-D RoPE: GroupQueryAttention rotates q and k itself (``do_rotary``), taking the packed
        q|k|v as it is. It numbers positions 0.. over the whole row, left padding included; RoPE
        scores depend only on position differences, so a row shifted by its padding attends exactly
        as with transformers' positions. M-RoPE, and 1-D RoPE after token reduction (positions with
        gaps): RotaryEmbedding / MRotaryEmbedding from the ``position_ids`` input first.
        """
        g, layout, acc = self.g, self.layout, self.plan.accuracy_level
        assert self.rope is not None  # set in build()
        heads, kv_heads, dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
        parts, sizes = self.qkv_weights(attention), [heads * dim, kv_heads * dim, kv_heads * dim]
        # GQA's built-in rotary wants head_dim % 16 == 0 (ORT 1.32 CPU); else rotate here, same positions
        if self.rope.sections is None and not self.plan.explicit_positions and dim % 16 == 0:
            if len(parts) == 1:
                return [linear(g, x, parts[0], "qkv_proj", accuracy_level=acc), "", ""], [self.rope.cos, self.rope.sin]
            return linear_group(g, x, parts, sizes, "qkv_proj", accuracy_level=acc), [self.rope.cos, self.rope.sin]
        q, k, v = linear_group(g, x, parts, sizes, "qkv_proj", accuracy_level=acc)
        positions = N.POSITION_IDS if N.POSITION_IDS in {i.name for i in g.inputs} else self.row_positions()
        q = apply_rope(g, q, self.rope, positions, heads, "q_rotary")
        k = apply_rope(g, k, self.rope, positions, kv_heads, "k_rotary")
        return [q, k, v], ["", ""]

    def row_positions(self) -> str:
        """[B, S] positions P .. P+S-1 over the whole row (GQA's own numbering; see projected_qkv)."""
        g = self.g
        if "row_positions" not in self.shared:
            with g.scope("row_positions"):
                total = g.op("Gather", [g.op("Shape", [N.ATTENTION_MASK]), g.const("one", np.int64(1))], axis=0)
                shape = g.op("Shape", [N.INPUTS_EMBEDS])
                seq = g.op("Gather", [shape, g.const("one_s", np.int64(1))], axis=0)
                start = g.op("Sub", [total, seq])
                row = g.op("Range", [start, total, g.const("step", np.int64(1))])
                batch_seq = g.op("Slice", [shape, g.ints("s0", [0]), g.ints("s2", [2])])
                self.shared["row_positions"] = g.op("Expand", [row, batch_seq], hint="positions")
        return self.shared["row_positions"]

    def mlp(self, x: str, mlp: nn.Module) -> str:
        g, acc = self.g, self.plan.accuracy_level
        first, down, gated = self.mlp_weights(mlp)
        act = str(getattr(self.text, "hidden_act", "silu"))
        if gated:
            gate, up = linear_group(g, x, first, [down.in_features, down.in_features], "gate_up_proj",
                                    accuracy_level=acc)
            hidden = g.op("Mul", [activation(g, gate, act, "act"), up], hint="gate_mul")
        else:
            hidden = activation(g, linear(g, x, first[0], "up_proj", accuracy_level=acc), act, "act")
        return linear(g, hidden, down, "down_proj", accuracy_level=acc)
