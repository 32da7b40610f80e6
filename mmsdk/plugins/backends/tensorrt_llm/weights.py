"""Read the optimized language model into one neutral description both checkpoint writers share."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.tensorrt_llm.lowering import DenseLinear, Int4Linear, LinearWeights, resolve_linear
from mmsdk.plugins.backends.tensorrt_llm.sharding import Heads

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.backend import ExportContext

__all__ = ["LanguageModelWeights", "LayerWeights", "read_language_model", "rope_settings", "split_rows"]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer in Hugging Face roles (q/k/v/o, gate/up/down) with its two norms."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q: LinearWeights
    k: LinearWeights
    v: LinearWeights
    o: LinearWeights
    gate: LinearWeights  # HF gate_proj: the activated branch (TensorRT-LLM mlp.fc)
    up: LinearWeights  # HF up_proj: the linear branch (TensorRT-LLM mlp.gate)
    down: LinearWeights

    def linears(self) -> dict[str, LinearWeights]:
        """Role -> weights of the seven projections."""
        return {"q": self.q, "k": self.k, "v": self.v, "o": self.o, "gate": self.gate, "up": self.up,
                "down": self.down}


@dataclass(frozen=True)
class LanguageModelWeights:
    """The decoder of a VLM: dimensions, rotary settings and every tensor TensorRT-LLM needs."""

    heads: Heads
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    rope: dict[str, Any]
    tie_word_embeddings: bool
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: LinearWeights
    layers: list[LayerWeights] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def attn_bias(self) -> bool:
        """True when q/k/v carry a bias (Qwen2)."""
        return self.layers[0].q.bias is not None

    def group_size(self) -> int | None:
        """The INT4 group size shared by every INT4 linear, None when there is none; mixed sizes raise."""
        sizes = {lin.group_size for layer in self.layers for lin in layer.linears().values()
                 if isinstance(lin, Int4Linear)}
        if len(sizes) > 1:
            raise ExportError(
                f"INT4 layers use different group sizes {sorted(sizes)}; a TensorRT-LLM checkpoint has one.",
                fix="quantize every layer with the same group size (int4-weight's group/block size).",
            )
        return next(iter(sizes), None)


def read_language_model(context: ExportContext) -> LanguageModelWeights:
    """Collect the language model of ``context.model`` through its adapter."""
    model, adapter = context.model, context.adapter
    cfg = adapter.text_config(model)
    kv = adapter.kv_layout(model)
    heads = Heads(kv.num_heads, kv.num_kv_heads, kv.head_dim)
    names = {id(m): n for n, m in model.named_modules()}
    session = context.session
    embed = adapter.embed_tokens(model).weight.detach()
    head_module = adapter.lm_head(model)
    layers = [_read_layer(layer, adapter, names, session, heads) for layer in adapter.decoder_layers(model)]
    return LanguageModelWeights(
        heads=heads,
        hidden_size=kv.hidden_size,
        intermediate_size=layers[0].gate.out_features,
        vocab_size=embed.shape[0],
        norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        hidden_act=str(getattr(cfg, "hidden_act", "silu")),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
        rope=rope_settings(cfg),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        embed=embed,
        final_norm=_norm_weight(adapter.language_model(model), "norm"),
        lm_head=resolve_linear(head_module, names.get(id(head_module), "lm_head"), session),
        layers=layers,
    )


def rope_settings(cfg: Any) -> dict[str, Any]:
    """theta, scaling and M-RoPE sections from a text config (transformers 5 ``rope_parameters`` or older keys)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = getattr(cfg, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    section = params.get("mrope_section") or scaling.get("mrope_section")
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return {"theta": float(theta), "type": rope_type, "mrope_section": list(section) if section else None,
            "factor": params.get("factor", scaling.get("factor"))}


def _norm_weight(owner: nn.Module, attr: str) -> torch.Tensor:
    norm = getattr(owner, attr, None)
    weight = getattr(norm, "weight", None)
    if weight is None:
        raise ExportError(
            f"{type(owner).__name__}.{attr} has no weight; the TensorRT-LLM exporter expects RMSNorm layers.",
            fix="export before any pass that replaces the decoder's norms without keeping a .weight, or "
            "give the replacement a .weight parameter.",
        )
    return weight.detach()


def _read_layer(layer: nn.Module, adapter: Any, names: dict[int, str], session: Any, heads: Heads) -> LayerWeights:
    attention = adapter.self_attention(layer)
    if attention is None:
        raise ExportError(
            f"decoder layer {names.get(id(layer))} has no self-attention (a cross-attention layer); the "
            "TensorRT-LLM exporter writes LLaMA- and Qwen2-style decoders only.",
            fix="export this model to ONNX Runtime instead.",
        )
    q, k, v = _read_qkv(attention, adapter.attention_projections(attention), names, session, heads)
    o_name = adapter.attention_projections(attention).o
    mlp = adapter.mlp(layer)
    mp = adapter.mlp_projections(mlp)
    if mp.gate is None:
        raise ExportError(
            f"{names.get(id(mlp))} is not a gated MLP; TensorRT-LLM's LLaMA/Qwen2 checkpoint needs gate/up/down.",
            fix="export this model to ONNX Runtime instead.",
        )

    def lin(owner: nn.Module, attr: str) -> LinearWeights:
        module = getattr(owner, attr)
        return resolve_linear(module, names.get(id(module), attr), session)

    return LayerWeights(
        input_norm=_norm_weight(layer, "input_layernorm"),
        post_norm=_norm_weight(layer, "post_attention_layernorm"),
        q=q, k=k, v=v, o=lin(attention, o_name),
        gate=lin(mlp, mp.gate), up=lin(mlp, mp.up), down=lin(mlp, mp.down),
    )


def _read_qkv(attention: nn.Module, proj: Any, names: dict[int, str], session: Any,
              heads: Heads) -> tuple[LinearWeights, LinearWeights, LinearWeights]:
    from mmsdk.plugins.attention.qkv_fuse import FusedSlice

    sizes = [heads.num_heads * heads.head_dim, heads.num_kv_heads * heads.head_dim,
             heads.num_kv_heads * heads.head_dim]
    fused_module = None
    if proj.qkv is not None:
        fused_module = getattr(attention, proj.qkv)
    elif isinstance(getattr(attention, proj.q, None), FusedSlice):
        fused_module = getattr(attention, proj.q).fused  # qkv-fuse: rows are [q; k; v]
    if fused_module is not None:
        fused = resolve_linear(fused_module, names.get(id(fused_module), "qkv"), session)
        q, k, v = split_rows(fused, sizes)
        return q, k, v
    parts = []
    for attr in (proj.q, proj.k, proj.v):
        module = getattr(attention, attr)
        parts.append(resolve_linear(module, names.get(id(module), attr), session))
    return parts[0], parts[1], parts[2]


def split_rows(linear: LinearWeights, sizes: list[int]) -> list[LinearWeights]:
    """Split a fused linear's output rows into parts of ``sizes`` (biases and scales follow)."""
    bias_parts = list(linear.bias.split(sizes)) if linear.bias is not None else [None] * len(sizes)
    if isinstance(linear, DenseLinear):
        return [DenseLinear(w, b) for w, b in zip(linear.weight.split(sizes), bias_parts, strict=True)]
    return [replace(linear, q=q, scales=s, bias=b)
            for q, s, b in zip(linear.q.split(sizes), linear.scales.split(sizes), bias_parts, strict=True)]
