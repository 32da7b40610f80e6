"""Adapters for the Flamingo family (gated cross-attention): IDEFICS and Mllama."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch
from torch import nn

import mmsdk
from mmsdk.core.adapter import (
    AttentionProjections,
    CrossAttentionBlock,
    ImageStateReducer,
    ImageTokenLayout,
    ImageTokenScorer,
    ModelAdapter,
    VisionBlock,
)
from mmsdk.core.recipes import Recipe
from mmsdk.core.registry import Registrar
from mmsdk.plugins._forward import (
    add_forward_wrapper,
    body_function,
    innermost_override,
    rebind_global,
    referenced_global,
    set_forward_body,
)
from mmsdk.plugins.adapters._common import clip_like_blocks
from mmsdk.plugins.adapters._recipes import family_recipes
from mmsdk.plugins.adapters._scoring import ClsAttentionScorer


def _decoupled_embedding_without_sync(module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``IdeficsDecoupledEmbedding.forward`` without its host sync: rows of the base table for ids below its size,
    of the extra table for the others."""
    extra = input_ids >= module.num_embeddings
    base = nn.functional.embedding(input_ids.masked_fill(extra, 0), module.weight)
    extra_ids = (input_ids - module.num_embeddings).clamp(0, module.num_additional_embeddings - 1)
    added = module.additional_embedding(extra_ids)
    return torch.where(extra[..., None], added, base)


class IdeficsAdapter(ModelAdapter):
    """IDEFICS: CLIP tower (+ optional perceiver) feeding a tanh-gated cross-attention layer before
    every ``cross_layer_interval``-th decoder layer."""

    name = "idefics"
    family = "flamingo"
    architectures: ClassVar[frozenset[str]] = frozenset({"IdeficsForVisionText2Text"})
    summary = "IDEFICS (Flamingo-style gated cross-attention every N decoder layers)"
    image_placeholder = "<fake_token_around_image><image><fake_token_around_image>"
    default_prompt = "User:{image}{question}<end_of_utterance>\nAssistant:"

    def recipes(self, model: nn.Module) -> dict[str, Recipe]:
        return family_recipes(model, self)

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

    def decode_step_inputs(self, model: nn.Module, prompt_inputs: Mapping[str, Any],
                           prefill_output: Any) -> dict[str, Any]:
        """The prefill's image states (the vision tower does not run again) and the image mask's last row, as
        transformers' generate passes them on (``IdeficsForVisionText2Text._update_model_kwargs_for_generation`` and
        ``prepare_inputs_for_generation``, which changed between transformers releases: both are followed)."""
        encoded = getattr(prefill_output, "image_outputs", None)
        if encoded is not None and model.config.use_resampler:
            # transformers hands every step the encoder's states, and the model runs its perceiver on them at every
            # step; the resampled states are the same all call long: resampled once here (as the model would), the
            # steps get what their cross-attention reads
            states = encoded.last_hidden_state
            inputs = {"perceiver_embeddings": model.model.perceiver_resampler(
                states.flatten(0, 1) if states.dim() == 4 else states)}
        elif encoded is not None:  # the encoder's states are what the cross-attention reads
            inputs = {"image_encoder_embeddings": encoded.last_hidden_state}
        else:  # releases whose output carries the states the cross-attention read
            states = getattr(prefill_output, "image_hidden_states", None)
            if states is None:
                return {}
            inputs = {"perceiver_embeddings" if model.config.use_resampler else "image_encoder_embeddings": states}
        mask = prompt_inputs.get("image_attention_mask")
        if isinstance(mask, torch.Tensor):
            inputs["image_attention_mask"] = mask[:, -1:]
        return inputs

    def needs_decode_mask_over_cache(self, model: nn.Module) -> bool:
        return True  # IdeficsModel makes torch.ones((batch, length + cache.get_seq_length())) without a mask

    def decode_step_scope(self, model: nn.Module) -> AbstractContextManager[None]:
        """IDEFICS's token embedding with extra tokens (IDEFICS-9B / 80B have 2) looks up the ids past its base
        vocabulary with ``torch.where(ids >= n)``, a host sync that a CUDA-graph capture refuses: in decode steps it
        selects between both tables' rows on the device instead (the same rows)."""
        embedding = model.model.embed_tokens
        if getattr(embedding, "num_additional_embeddings", 0) == 0:
            return nullcontext()
        return innermost_override(embedding, lambda forward: functools.partial(_decoupled_embedding_without_sync,
                                                                               embedding))

    def rotary_embedding(self, model: nn.Module) -> nn.Module:
        return model.model.layers[0].self_attn.rotary_emb  # IDEFICS keeps one per attention module

    def image_features(self, model: nn.Module, images: Mapping[str, Any]) -> torch.Tensor:
        pixels = images["pixel_values"]
        states = model.model.vision_model(pixel_values=pixels.flatten(0, 1)).last_hidden_state
        if model.config.use_resampler:
            states = model.model.perceiver_resampler(states)
        return states.reshape(pixels.shape[0], -1, states.shape[-1])

    def image_token_scorer(self, model: nn.Module, rule: str = "auto") -> ImageTokenScorer | None:
        """Attention in the last vision layer; None with a perceiver (its latents are not vision tokens)."""
        if self.projector(model) is not None:
            return None
        rule = "cls" if rule == "auto" else rule
        return ClsAttentionScorer(self.vision_blocks(model)[-1], keep_cls=True, rule=rule)

    def install_image_state_reducer(
        self,
        model: nn.Module,
        reducer: ImageStateReducer,
        kept: Callable[[int], int],
        scores: Callable[[], torch.Tensor | None],
    ) -> bool:
        # IDEFICS sizes its image mask from the states it is given, so reducing them where they are
        # produced is enough; decode steps reuse the reduced states (image_encoder_embeddings).
        resampler = self.projector(model)
        target = resampler if resampler is not None else self.vision_tower(model)

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            states = output.last_hidden_state if hasattr(output, "last_hidden_state") else output
            reduced = reducer(states, None if resampler is not None else scores())
            if hasattr(output, "last_hidden_state"):
                output.last_hidden_state = reduced
                return output
            return reduced

        target.register_forward_hook(hook)
        return True


HOLDS_KV_CHECK = "_has_cached_cross_attention_states"  # transformers 5.24+'s Mllama: does a cache layer hold K/V


def _holds_kv_by_host_length(original: Callable[[Any, int], bool], cache: Any, layer_idx: int) -> bool:
    """Mllama's ``_has_cached_cross_attention_states``, answered from the layer's length where the host knows it.

    transformers 5.24 and newer ask ``layer.is_initialized and layer.keys.numel() > 0`` of every layer, before running
    it. On mmsdk's packed KV layers ``keys`` dequantizes the whole layer (what a model that reads a layer directly
    gets): in transformers' loop a third of the tiny Mllama's dequantizations (21 of 69 over 8 tokens), in a captured
    decode step a dequantize kernel per self-attention layer, replayed at every token, its output unused. A layer
    whose ``get_seq_length()`` is a host int (mmsdk's packed and image layers, transformers' dynamic ones) holds K/V
    exactly when that is above 0; any other layer (a compileable static one answers with a device tensor) is asked as
    transformers asks it."""
    layers = getattr(cache, "layers", None)
    if layers is not None and 0 <= layer_idx < len(layers) and getattr(layers[layer_idx], "is_initialized", False):
        length = layers[layer_idx].get_seq_length()
        if isinstance(length, int):
            return length > 0
    return original(cache, layer_idx)


def _ask_cache_layers_by_host_length(text_model: nn.Module) -> None:
    """Rebind the global ``HOLDS_KV_CHECK`` that ``text_model``'s forward calls to :func:`_holds_kv_by_host_length`,
    for this module only (transformers' module is left as it is). Nothing changes on a transformers without that check
    (it asked ``get_seq_length(idx)`` before 5.24), or where it is rebound already."""
    function = body_function(text_model)
    original = referenced_global(function, HOLDS_KV_CHECK)
    if original is None or getattr(original, "by_host_length", False):
        return
    replacement = functools.partial(_holds_kv_by_host_length, original)
    replacement.by_host_length = True  # type: ignore[attr-defined]
    set_forward_body(text_model, types.MethodType(rebind_global(function, HOLDS_KV_CHECK, replacement), text_model))


class MllamaAdapter(ModelAdapter):
    """Mllama (Llama 3.2 Vision): tiled ViT -> linear projector -> decoder whose listed layers are
    tanh-gated cross-attention layers instead of self-attention ones."""

    name = "mllama"
    family = "flamingo"
    architectures: ClassVar[frozenset[str]] = frozenset({"MllamaForConditionalGeneration"})
    summary = "Mllama / Llama-3.2-Vision (gated cross-attention decoder layers)"
    image_placeholder = "<|image|>"
    default_prompt = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{image}{question}<|eot_id|>"

    def recipes(self, model: nn.Module) -> dict[str, Recipe]:
        return family_recipes(model, self)

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

    def decode_step_inputs(self, model: nn.Module, prompt_inputs: Mapping[str, Any],
                           prefill_output: Any) -> dict[str, Any]:
        """The cross-attention mask over the prompt and one more token: transformers' generate repeats its last row
        for every new token (``MllamaForConditionalGeneration._update_model_kwargs_for_generation``), and the model
        takes the row at the token's position."""
        mask = prompt_inputs.get("cross_attention_mask")
        if not isinstance(mask, torch.Tensor):
            return {}
        return {"cross_attention_mask": torch.cat([mask, mask[:, -1:]], dim=1)}

    def install_packed_cache_queries(self, model: nn.Module) -> None:
        """Mllama's text model asks every cache layer whether it holds K/V by its length on the host, not by the size of
        its ``keys`` (:func:`_holds_kv_by_host_length`), which on a packed KV cache dequantized each self-attention
        layer at every token, in transformers' loop and inside fast generate's captured step."""
        _ask_cache_layers_by_host_length(self.language_model(model))

    def image_token_scorer(self, model: nn.Module, rule: str = "auto") -> ImageTokenScorer | None:
        """Attention in each tile of the last local vision layer (tiles are padded to a multiple of 8)."""
        tower = self.vision_tower(model)
        per_tile = tower.num_patches
        padded = per_tile + (8 - per_tile % 8) % 8
        last_local = self.vision_blocks(model)[len(tower.transformer.layers) - 1]
        rule = "cls" if rule == "auto" else rule
        return ClsAttentionScorer(last_local, keep_cls=True, rule=rule, group=lambda hidden: (padded, per_tile))

    def install_image_state_reducer(
        self,
        model: nn.Module,
        reducer: ImageStateReducer,
        kept: Callable[[int], int],
        scores: Callable[[], torch.Tensor | None],
    ) -> bool:
        # The text model gets states [B, tiles * P, H] and a mask expanded P columns per tile; every
        # column of a tile carries the same value, so the mask keeps the first kept(P) of each tile.
        per_tile = self.vision_tower(model).num_patches

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            states = kwargs.get("cross_attention_states")
            if states is not None:
                batch, length, hidden = states.shape
                reduced = reducer(states.reshape(-1, per_tile, hidden), scores())
                kwargs["cross_attention_states"] = reduced.reshape(batch, -1, hidden)
            mask = kwargs.get("cross_attention_mask")
            if mask is not None and mask.shape[-1] % per_tile == 0:
                head = mask.shape[:-1]
                mask = mask.reshape(*head, -1, per_tile)[..., : kept(per_tile)]
                kwargs["cross_attention_mask"] = mask.reshape(*head, -1)
            return original(*args, **kwargs)

        add_forward_wrapper(self.language_model(model), forward)
        return True


@mmsdk.hookimpl
def mmsdk_register_adapters(register: Registrar[ModelAdapter]) -> None:
    register(IdeficsAdapter())
    register(MllamaAdapter())
