"""Adapter for the Qwen-VL family: Qwen2-VL and Qwen2.5-VL (M-RoPE); Qwen-VL v1 is refused clearly."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Mapping

import torch
from torch import nn

import mmsdk
from mmsdk.core.adapter import (
    AttentionProjections,
    ImageTokenLayout,
    ImageTokenScorer,
    MLPProjections,
    ModelAdapter,
    VisionBlock,
)
from mmsdk.core.registry import Registrar
from mmsdk.plugins.adapters._scoring import ReceivedAttentionScorer


class QwenVLAdapter(ModelAdapter):
    """Native-resolution ViT with a 2x2 patch merger -> Qwen2 decoder with 3-D multimodal RoPE."""

    name = "qwen-vl"
    family = "qwen-vl"
    architectures: ClassVar[frozenset[str]] = frozenset(
        {"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"}
    )
    summary = "Qwen2-VL, Qwen2.5-VL and Qwen3-VL (ViT + patch merger + Qwen decoder, M-RoPE)"
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
            blocks.append(
                VisionBlock(
                    module=block,
                    attention=block.attn,
                    projections=AttentionProjections(q=None, k=None, v=None, o="proj", qkv="qkv"),
                    mlp=mlp,
                    mlp_projections=_vision_mlp_projections(mlp),
                    num_heads=getattr(block.attn, "num_heads", heads),  # fewer after vit-prune
                    head_dim=getattr(block.attn, "head_dim", block.attn.qkv.in_features // heads),
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

    def image_features_call(self, model: nn.Module) -> tuple[Any, str] | None:
        return model.model, "get_image_features"

    def image_token_scorer(self, model: nn.Module, rule: str = "auto") -> ImageTokenScorer | None:
        """Attention each merged token receives in the last full-attention vision block (no CLS token)."""
        if rule == "cls":
            return None
        tower = self.vision_tower(model)
        blocks = self.vision_blocks(model)
        full = getattr(tower, "fullatt_block_indexes", None)
        index = full[-1] if full else len(blocks) - 1
        order = _window_order(tower) if hasattr(tower, "window_size") else (lambda call: None)
        return ReceivedAttentionScorer(blocks[index], merge=tower.spatial_merge_size**2, order=order)


def _vision_mlp_projections(mlp: nn.Module) -> MLPProjections:
    if hasattr(mlp, "gate_proj"):
        return MLPProjections(gate="gate_proj", up="up_proj", down="down_proj")
    if hasattr(mlp, "linear_fc1"):
        return MLPProjections(up="linear_fc1", down="linear_fc2")
    return MLPProjections(up="fc1", down="fc2")


def _window_order(tower: nn.Module) -> Any:
    """Qwen2.5-VL runs its blocks on window-ordered tokens; this gives that order for a call's images."""
    from transformers.vision_utils import get_vision_window_index

    def order(call: Mapping[str, Any]) -> torch.Tensor:
        index, _ = get_vision_window_index(call["image_grid_thw"], spatial_merge_size=tower.spatial_merge_size,
                                           window_size=tower.window_size, patch_size=tower.patch_size)
        return index

    return order


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
