"""Adapters for the Flamingo family (gated cross-attention): IDEFICS and Mllama."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import nn

import mmsdk
from mmsdk.core.adapter import AttentionProjections, CrossAttentionBlock, ImageTokenLayout, ModelAdapter, VisionBlock
from mmsdk.core.registry import Registrar
from mmsdk.plugins.adapters._common import clip_like_blocks


class IdeficsAdapter(ModelAdapter):
    """IDEFICS: CLIP tower (+ optional perceiver) feeding a tanh-gated cross-attention layer before
    every ``cross_layer_interval``-th decoder layer."""

    name = "idefics"
    family = "flamingo"
    architectures: ClassVar[frozenset[str]] = frozenset({"IdeficsForVisionText2Text"})
    summary = "IDEFICS (Flamingo-style gated cross-attention every N decoder layers)"
    image_placeholder = "<fake_token_around_image><image><fake_token_around_image>"
    default_prompt = "User:{image}{question}<end_of_utterance>\nAssistant:"

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.vision_model

    def projector(self, model: nn.Module) -> nn.Module | None:
        return getattr(model.model, "perceiver_resampler", None)

    def language_model(self, model: nn.Module) -> nn.Module:
        return model.model

    def vision_blocks(self, model: nn.Module) -> list[VisionBlock]:
        layers = self.vision_tower(model).encoder.layers
        return clip_like_blocks(layers, model.config.vision_config.num_attention_heads)

    def cross_attention_blocks(self, model: nn.Module) -> list[CrossAttentionBlock]:
        interval = model.model.cross_layer_interval
        return [
            CrossAttentionBlock(
                decoder_index=index * interval,
                module=layer,
                attention=layer.cross_attn,
                gate_names=("alpha_cross_attn", "alpha_dense"),
                projections=AttentionProjections(),
                kv_cached=False,  # IdeficsModel passes no cache to its cross-attention layers
            )
            for index, layer in enumerate(model.model.gated_cross_attn_layers)
        ]

    def image_tokens(self, model: nn.Module) -> ImageTokenLayout:
        return ImageTokenLayout(mode="cross-attention", image_token_id=None)

    def rotary_embedding(self, model: nn.Module) -> nn.Module:
        return model.model.layers[0].self_attn.rotary_emb  # IDEFICS keeps one per attention module

    def image_features(self, model: nn.Module, images: Mapping[str, Any]) -> torch.Tensor:
        pixels = images["pixel_values"]
        states = model.model.vision_model(pixel_values=pixels.flatten(0, 1)).last_hidden_state
        if model.config.use_resampler:
            states = model.model.perceiver_resampler(states)
        return states.reshape(pixels.shape[0], -1, states.shape[-1])


class MllamaAdapter(ModelAdapter):
    """Mllama (Llama 3.2 Vision): tiled ViT -> linear projector -> decoder whose listed layers are
    tanh-gated cross-attention layers instead of self-attention ones."""

    name = "mllama"
    family = "flamingo"
    architectures: ClassVar[frozenset[str]] = frozenset({"MllamaForConditionalGeneration"})
    summary = "Mllama / Llama-3.2-Vision (gated cross-attention decoder layers)"
    image_placeholder = "<|image|>"
    default_prompt = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{image}{question}<|eot_id|>"

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.vision_model

    def projector(self, model: nn.Module) -> nn.Module:
        return model.model.multi_modal_projector

    def language_model(self, model: nn.Module) -> nn.Module:
        return model.model.language_model

    def vision_blocks(self, model: nn.Module) -> list[VisionBlock]:
        tower = self.vision_tower(model)
        heads = model.config.vision_config.attention_heads
        layers = [*tower.transformer.layers, *tower.global_transformer.layers]
        return clip_like_blocks(layers, heads)

    def cross_attention_blocks(self, model: nn.Module) -> list[CrossAttentionBlock]:
        layers = self.decoder_layers(model)
        return [
            CrossAttentionBlock(
                decoder_index=index,
                module=layers[index],
                attention=layers[index].cross_attn,
                gate_names=("cross_attn_attn_gate", "cross_attn_mlp_gate"),
                projections=AttentionProjections(),
            )
            for index in self.text_config(model).cross_attention_layers
        ]

    def image_tokens(self, model: nn.Module) -> ImageTokenLayout:
        return ImageTokenLayout(mode="cross-attention", image_token_id=model.config.image_token_index)

    def image_input_names(self, model: nn.Module) -> tuple[str, ...]:
        return ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")

    def image_features(self, model: nn.Module, images: Mapping[str, Any]) -> torch.Tensor:
        states = model.model.vision_model(
            pixel_values=images["pixel_values"],
            aspect_ratio_ids=images["aspect_ratio_ids"],
            aspect_ratio_mask=images["aspect_ratio_mask"],
        ).last_hidden_state
        projected = model.model.multi_modal_projector(states)
        return projected.reshape(images["pixel_values"].shape[0], -1, projected.shape[-1])


@mmsdk.hookimpl
def mmsdk_register_adapters(register: Registrar[ModelAdapter]) -> None:
    register(IdeficsAdapter())
    register(MllamaAdapter())
