"""Adapter for the LLaVA family: LlavaForConditionalGeneration and LlavaNextForConditionalGeneration."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import nn

import mmsdk
from mmsdk.core.adapter import ImageTokenLayout, ModelAdapter, VisionBlock
from mmsdk.core.registry import Registrar
from mmsdk.plugins.adapters._common import clip_like_blocks, first_attr


class LlavaAdapter(ModelAdapter):
    """CLIP/SigLIP vision tower -> MLP projector -> Llama/Mistral/Qwen decoder; image tokens inline."""

    name = "llava"
    family = "llava"
    architectures: ClassVar[frozenset[str]] = frozenset(
        {"LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration"}
    )
    summary = "LLaVA-1.5 and LLaVA-NeXT (CLIP + MLP projector + Llama-family decoder)"
    default_prompt = "USER: {image}\n{question} ASSISTANT:"

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.vision_tower

    def projector(self, model: nn.Module) -> nn.Module:
        return model.model.multi_modal_projector

    def language_model(self, model: nn.Module) -> nn.Module:
        return model.model.language_model

    def vision_blocks(self, model: nn.Module) -> list[VisionBlock]:
        tower = self.vision_tower(model)
        layers = first_attr(tower, ("encoder.layers", "vision_model.encoder.layers"))
        return clip_like_blocks(layers, model.config.vision_config.num_attention_heads)

    def image_tokens(self, model: nn.Module) -> ImageTokenLayout:
        return ImageTokenLayout(mode="inline", image_token_id=model.config.image_token_id)

    def image_input_names(self, model: nn.Module) -> tuple[str, ...]:
        any_res = getattr(model.config, "image_grid_pinpoints", None) is not None
        return ("pixel_values", "image_sizes") if any_res else ("pixel_values",)

    def image_features(self, model: nn.Module, images: Mapping[str, Any]) -> torch.Tensor:
        extra = {"image_sizes": images["image_sizes"]} if "image_sizes" in images else {}
        out = model.model.get_image_features(pixel_values=images["pixel_values"], return_dict=True, **extra)
        features = out.pooler_output
        return torch.stack(list(features)) if isinstance(features, (list, tuple)) else features


@mmsdk.hookimpl
def mmsdk_register_adapters(register: Registrar[ModelAdapter]) -> None:
    register(LlavaAdapter())
