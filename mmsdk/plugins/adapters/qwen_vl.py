"""Adapter for the Qwen-VL family: Qwen2-VL and Qwen2.5-VL (M-RoPE); Qwen-VL v1 is refused clearly."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Mapping

import torch
from torch import nn

import mmsdk
from mmsdk.core.adapter import AttentionProjections, ImageTokenLayout, MLPProjections, ModelAdapter, VisionBlock
from mmsdk.core.registry import Registrar


class QwenVLAdapter(ModelAdapter):
    """Native-resolution ViT with a 2x2 patch merger -> Qwen2 decoder with 3-D multimodal RoPE."""

    name = "qwen-vl"
    family = "qwen-vl"
    architectures: ClassVar[frozenset[str]] = frozenset(
        {"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"}
    )
    summary = "Qwen2-VL and Qwen2.5-VL (ViT + patch merger + Qwen2 decoder, M-RoPE)"
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    default_prompt = "<|im_start|>user\n{image}{question}<|im_end|>\n<|im_start|>assistant\n"

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.visual

    def projector(self, model: nn.Module) -> nn.Module:
        return model.model.visual.merger

    def language_model(self, model: nn.Module) -> nn.Module:
        return model.model.language_model

    def vision_blocks(self, model: nn.Module) -> list[VisionBlock]:
        blocks = []
        heads = model.config.vision_config.num_heads
        for block in self.vision_tower(model).blocks:
            mlp = block.mlp
            gated = hasattr(mlp, "gate_proj")
            blocks.append(
                VisionBlock(
                    module=block,
                    attention=block.attn,
                    projections=AttentionProjections(q=None, k=None, v=None, o="proj", qkv="qkv"),
                    mlp=mlp,
                    mlp_projections=MLPProjections(gate="gate_proj", up="up_proj", down="down_proj")
                    if gated
                    else MLPProjections(up="fc1", down="fc2"),
                    num_heads=heads,
                    head_dim=block.attn.qkv.in_features // heads,
                )
            )
        return blocks

    def rotary_kind(self, model: nn.Module) -> Literal["rope", "mrope"]:
        return "mrope"

    def image_tokens(self, model: nn.Module) -> ImageTokenLayout:
        return ImageTokenLayout(mode="inline", image_token_id=model.config.image_token_id)

    def rope_sections(self, model: nn.Module) -> tuple[int, ...] | None:
        cfg = self.text_config(model)
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        return tuple(params.get("mrope_section", (16, 24, 24)))

    def image_input_names(self, model: nn.Module) -> tuple[str, ...]:
        return ("pixel_values", "image_grid_thw")

    def image_features(self, model: nn.Module, images: Mapping[str, Any]) -> torch.Tensor:
        grid = torch.as_tensor(images["image_grid_thw"], dtype=torch.long)
        out = model.model.get_image_features(images["pixel_values"], grid, return_dict=True)
        return torch.stack(list(out.pooler_output))


class QwenVLv1Adapter(ModelAdapter):
    """Recognises the original Qwen-VL (remote code) only to explain why it is not supported."""

    name = "qwen-vl-v1"
    family = "qwen-vl"
    architectures: ClassVar[frozenset[str]] = frozenset({"QWenLMHeadModel"})
    summary = "original Qwen-VL (trust_remote_code): recognised and refused with a migration path"

    def matches(self, model: nn.Module) -> bool:
        return super().matches(model) and hasattr(getattr(model, "transformer", None), "visual")

    def refuse(self, model: nn.Module) -> str | None:
        return (
            "the original Qwen-VL ships as remote code whose modules (fused c_attn, attn_pool resampler, "
            "its own KV cache) change between revisions, and mmsdk cannot test against it without the "
            "code. Fix: use Qwen2-VL or Qwen2.5-VL (transformers classes, fully supported), or write an "
            "adapter plugin for the exact revision you deploy (docs/adapters.md)."
        )


@mmsdk.hookimpl
def mmsdk_register_adapters(register: Registrar[ModelAdapter]) -> None:
    register(QwenVLAdapter())
    register(QwenVLv1Adapter())
