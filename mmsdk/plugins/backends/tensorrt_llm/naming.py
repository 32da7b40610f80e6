"""Tensor names of TensorRT-LLM's checkpoint (specs/tensorrt-llm.md 1.3 and 8).

The classic bug is swapping the MLP branches: TensorRT-LLM's GatedMLP computes
``proj(act(fc(x)) * gate(x))``, so ``mlp.fc`` is Hugging Face's ``gate_proj`` (the activated branch)
and ``mlp.gate`` is ``up_proj`` (the linear one).
"""

from __future__ import annotations

__all__ = [
    "COLUMN_PARALLEL",
    "EMBEDDING",
    "FINAL_NORM",
    "HF_TO_TRTLLM",
    "INPUT_NORM",
    "KV_RCP_SCALE",
    "KV_SCALE",
    "LINEAR_ROLES",
    "LM_HEAD",
    "POST_NORM",
    "QUANT_SUFFIXES",
    "layer_prefix",
    "linear_name",
]

EMBEDDING = "transformer.vocab_embedding.weight"
FINAL_NORM = "transformer.ln_f.weight"
LM_HEAD = "lm_head.weight"
KV_SCALE = "attention.kv_cache_scaling_factor"
KV_RCP_SCALE = "attention.kv_cache_rcp_scaling_factor"
INPUT_NORM = "input_layernorm.weight"
POST_NORM = "post_layernorm.weight"

# TensorRT-LLM linear (relative to a layer) -> the Hugging Face roles it is made of.
LINEAR_ROLES: dict[str, tuple[str, ...]] = {
    "attention.qkv": ("q", "k", "v"),
    "attention.dense": ("o",),
    "mlp.fc": ("gate",),
    "mlp.gate": ("up",),
    "mlp.proj": ("down",),
}
COLUMN_PARALLEL = frozenset({"attention.qkv", "mlp.fc", "mlp.gate"})

# Extra tensors of a W4A16_AWQ linear, next to its packed int8 ``weight``.
QUANT_SUFFIXES = ("weights_scaling_factor", "prequant_scaling_factor")

HF_TO_TRTLLM: dict[str, str] = {
    "model.embed_tokens.weight": EMBEDDING,
    "model.layers.{i}.input_layernorm.weight": "transformer.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.self_attn.{q,k,v}_proj.weight": "transformer.layers.{i}.attention.qkv.weight",
    "model.layers.{i}.self_attn.{q,k,v}_proj.bias": "transformer.layers.{i}.attention.qkv.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "transformer.layers.{i}.attention.dense.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "transformer.layers.{i}.post_layernorm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "transformer.layers.{i}.mlp.fc.weight",
    "model.layers.{i}.mlp.up_proj.weight": "transformer.layers.{i}.mlp.gate.weight",
    "model.layers.{i}.mlp.down_proj.weight": "transformer.layers.{i}.mlp.proj.weight",
    "model.norm.weight": FINAL_NORM,
    "lm_head.weight": LM_HEAD,
}


def layer_prefix(local_index: int) -> str:
    """``transformer.layers.{i}`` (indices restart at 0 in every pipeline rank's file)."""
    return f"transformer.layers.{local_index}"


def linear_name(local_index: int, linear: str) -> str:
    """Module name of a layer's linear, e.g. ``transformer.layers.0.mlp.fc``."""
    return f"{layer_prefix(local_index)}.{linear}"
