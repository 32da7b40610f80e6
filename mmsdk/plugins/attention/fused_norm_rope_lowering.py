"""How rmsnorm-rope-fusion's fused modules lower to the runtimes: ONNX Runtime's contrib ops (SkipSimplified /
SimplifiedLayerNormalization, RotaryEmbedding, MRotaryEmbedding) and TensorRT-LLM's norm and position-embedding
settings."""

from __future__ import annotations

from typing import Any

from torch import nn

from mmsdk.plugins.attention._lowering import OnnxLowering, OnnxNode, TrtLlmLowering
from mmsdk.plugins.attention.fused_norm_rope import (
    FusedAddRMSNorm,
    FusedMRoPEEmbedding,
    FusedRMSNormRoPE,
    FusedRoPE,
    FusedRoPEEmbedding,
)

__all__ = ["onnx_lowering", "trtllm_lowering"]


def onnx_lowering(module: nn.Module) -> OnnxLowering | None:
    """The ONNX Runtime contrib ops that compute ``module`` (a fused module of this package), or None."""
    rope_attrs: dict[str, Any] = {"interleaved": 0, "rotary_embedding_dim": 0}
    section = getattr(module, "mrope_section", None)
    rope_op = "MRotaryEmbedding" if section else "RotaryEmbedding"
    if section:
        rope_attrs.update(mrope_section=list(section), mrope_layout=int(getattr(module, "mrope_interleaved", False)))
    rope = OnnxNode(rope_op, "com.microsoft", rope_attrs, ("input", "position_ids", "cos_cache", "sin_cache"),
                    ("output",))
    if isinstance(module, FusedAddRMSNorm):
        node = OnnxNode("SkipSimplifiedLayerNormalization", "com.microsoft", {"epsilon": module.eps},
                        ("input", "skip", "gamma"), ("output", "", "", "input_skip_bias_sum"),
                        {"gamma": module.weight.detach()})
        return OnnxLowering((node,), note="input = attention output, skip = residual; output 3 is the next residual")
    if isinstance(module, FusedRoPE):
        return OnnxLowering((rope,), note="one node for q and one for k (set num_heads for 3-D inputs)")
    if isinstance(module, FusedRMSNormRoPE):
        qn, kn = module._norms
        norm = [OnnxNode("SimplifiedLayerNormalization", "", {"epsilon": n.eps, "axis": -1, "stash_type": 1},
                         ("X", "scale"), ("Y",), {"scale": n.weight.detach()}) for n in (qn, kn)]
        return OnnxLowering((norm[0], norm[1], rope), note="q: nodes 0 then 2; k: nodes 1 then 2")
    if isinstance(module, FusedRoPEEmbedding):
        return OnnxLowering((), note="folded into RotaryEmbedding, which takes the position_ids itself")
    if isinstance(module, FusedMRoPEEmbedding):
        return OnnxLowering((), note="folded into MRotaryEmbedding, which takes the 3-D position_ids itself")
    return None


def trtllm_lowering(module: nn.Module) -> TrtLlmLowering | None:
    """The TensorRT-LLM weights and config keys that stand for ``module``, or None."""
    if isinstance(module, FusedAddRMSNorm):
        return TrtLlmLowering({"weight": module.weight.detach()}, {"norm": "rms", "eps": module.eps})
    if isinstance(module, (FusedRoPE, FusedMRoPEEmbedding)):
        section = getattr(module, "mrope_section", None)
        return TrtLlmLowering(config={"position_embedding_type": "mrope" if section else "rope_gpt_neox",
                                      "mrope_section": section})
    if isinstance(module, FusedRMSNormRoPE):
        qn, kn = module._norms
        return TrtLlmLowering({"q_norm.weight": qn.weight.detach(), "k_norm.weight": kn.weight.detach()},
                              {"qk_layernorm": True, "position_embedding_type": "rope_gpt_neox"})
    return None
