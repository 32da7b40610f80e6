"""Untrained digit models of each family: real transformers classes from small configs, seeded.

``train_digits`` trains these; the trained weights ship as ``builtin:<family>-digits``. Every model
reads 48 px images and gives the decoder at least 64 image tokens (or, for the cross-attention
families, 64 patch states to attend to), so token-pruning passes have room to work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mmsdk.core.sources import LoadedModel
from mmsdk.models import digits
from mmsdk.models.family_processors import IdeficsProcessor, LlavaProcessor, QwenVLProcessor
from mmsdk.models.tokenizer import WordTokenizer

__all__ = ["FAMILIES", "build_untrained", "image_tokens"]

_QWEN_SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def _text_dims(tok: WordTokenizer, **overrides: Any) -> dict[str, Any]:
    dims = dict(
        vocab_size=len(tok),
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    dims.update(overrides)
    return dims


def _seeded(build: Callable[[], torch.nn.Module], seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _set_generation_ids(model: torch.nn.Module, tok: WordTokenizer) -> torch.nn.Module:
    # Greedy decoding must stop at </s> and pad with <pad>; the defaults know neither word id.
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    gen.do_sample = False
    return model


def build_llava(seed: int = 0) -> LoadedModel:
    """LlavaForConditionalGeneration: CLIP 48 px / 6 px patches (64 tokens) + 2-layer Llama."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tok = digits.build_tokenizer("<image>")
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=digits.IMAGE_SIZE,
        patch_size=6,
        projection_dim=64,
    )
    config = LlavaConfig(
        text_config=LlamaConfig(**_text_dims(tok)),
        vision_config=vision,
        image_token_id=tok.token_id("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    model = _seeded(lambda: LlavaForConditionalGeneration(config), seed)
    return LoadedModel(_set_generation_ids(model, tok), LlavaProcessor(tok, digits.IMAGE_SIZE, 6), "llava-digits")


def build_qwen2_vl(seed: int = 0) -> LoadedModel:
    """Qwen2VLForConditionalGeneration: 48 px / 3 px patches, 2x2 merge (64 tokens), M-RoPE [4,4,4]."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tok = digits.build_tokenizer(*_QWEN_SPECIALS)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]}
    # 256 patches per image make the tower the expensive part; keep it narrow and two blocks deep.
    vision = dict(
        depth=2,
        embed_dim=48,
        hidden_size=96,
        num_heads=3,
        mlp_ratio=2,
        patch_size=3,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    ids = dict(
        image_token_id=tok.token_id("<|image_pad|>"),
        video_token_id=tok.token_id("<|video_pad|>"),
        vision_start_token_id=tok.token_id("<|vision_start|>"),
        vision_end_token_id=tok.token_id("<|vision_end|>"),
    )
    config = Qwen2VLConfig(text_config=_text_dims(tok, rope_parameters=rope), vision_config=vision, **ids)
    model = _seeded(lambda: Qwen2VLForConditionalGeneration(config), seed)
    processor = QwenVLProcessor(tok, digits.IMAGE_SIZE, 3, merge_size=2, temporal_patch_size=2)
    return LoadedModel(_set_generation_ids(model, tok), processor, "qwen2-vl-digits")


def build_idefics(seed: int = 0) -> LoadedModel:
    """IdeficsForVisionText2Text: 48 px / 6 px patches (64 states), one gated cross-attention block (before layer 0)."""
    from transformers import IdeficsConfig, IdeficsForVisionText2Text

    tok = digits.build_tokenizer("<image>", "<fake_token_around_image>")
    dims = _text_dims(tok)
    dims.pop("num_key_value_heads")
    vision = dict(
        embed_dim=64,
        image_size=digits.IMAGE_SIZE,
        patch_size=6,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=192,
    )
    # Trained from scratch: nothing is frozen, and the tanh gates start open instead of at zero.
    config = IdeficsConfig(
        **dims,
        vision_config=vision,
        cross_layer_interval=2,
        alpha_type="float",
        alpha_initializer="ones",
        use_resampler=False,
        freeze_text_layers=False,
        freeze_vision_layers=False,
        freeze_lm_head=False,
    )
    model = _seeded(lambda: IdeficsForVisionText2Text(config), seed)
    return LoadedModel(_set_generation_ids(model, tok), IdeficsProcessor(tok, digits.IMAGE_SIZE, 6), "idefics-digits")


FAMILIES: dict[str, Callable[[int], LoadedModel]] = {
    "llava": build_llava,
    "qwen2-vl": build_qwen2_vl,
    "idefics": build_idefics,
}


def build_untrained(family: str, seed: int = 0) -> LoadedModel:
    """A freshly initialised digit model of ``family`` with its processor."""
    return FAMILIES[family](seed)


def image_tokens(processor: Any) -> int:
    """Image tokens per image in the decoder's sequence, or patch states for cross-attention families."""
    per_image = getattr(processor, "tokens_per_image", None)
    return per_image() if per_image else (processor.image_size // processor.patch_size) ** 2
