"""Adapter for the LLaVA family: LlavaForConditionalGeneration and LlavaNextForConditionalGeneration."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import nn

import mmsdk
from mmsdk.core.adapter import ImageTokenLayout, ImageTokenScorer, ModelAdapter, VisionBlock
from mmsdk.core.registry import Registrar
from mmsdk.plugins.adapters._common import clip_like_blocks, first_attr
from mmsdk.plugins.adapters._scoring import ClsAttentionScorer


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

    def image_features_call(self, model: nn.Module) -> tuple[Any, str] | None:
        return model.model, "get_image_features"

    def image_token_scorer(self, model: nn.Module, rule: str = "auto") -> ImageTokenScorer | None:
        """Attention in the layer whose output is the image feature (CLS row: VisionZip's rule)."""
        cfg = model.config
        layer = cfg.vision_feature_layer if isinstance(cfg.vision_feature_layer, int) else cfg.vision_feature_layer[-1]
        blocks = self.vision_blocks(model)
        index = layer % (len(blocks) + 1) - 1  # hidden_states[i] is the output of encoder layer i - 1
        if index < 0:
            return None
        keep_cls = cfg.vision_feature_select_strategy == "full"
        packs = hasattr(model.model, "pack_image_features")  # LLaVA-NeXT tiles and image newlines
        finish = _next_packer(model) if packs else None
        rule = "cls" if rule == "auto" else rule
        return ClsAttentionScorer(blocks[index], keep_cls=keep_cls, rule=rule, finish=finish)


def _next_packer(model: nn.Module) -> Any:
    """Map per-tile scores to LLaVA-NeXT's packed order, through the model's own packing code."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    inner, cfg = model.model, model.config

    def finish(scores: torch.Tensor, call: Mapping[str, Any]) -> torch.Tensor:
        sizes = call["image_sizes"]
        counts = [image_size_to_num_patches(image_size=s, grid_pinpoints=cfg.image_grid_pinpoints,
                                            patch_size=cfg.vision_config.image_size) for s in sizes]
        tiles = torch.split(scores[..., None], counts, dim=0)
        # image newlines are layout markers, not content: rank them last
        newline = torch.full((1,), float("-inf"), dtype=scores.dtype, device=scores.device)
        packed, _ = inner.pack_image_features(tiles, sizes, cfg.vision_feature_select_strategy, image_newline=newline)
        return torch.cat(packed).reshape(-1)

    return finish


@mmsdk.hookimpl
def mmsdk_register_adapters(register: Registrar[ModelAdapter]) -> None:
    register(LlavaAdapter())
