"""Tiny random-weight models of every supported family, built in-process from small odd-sized configs.

Odd sizes (hidden 48, 3 heads over 1 KV head, vision width 40, vocab 101) catch shape bugs that
round numbers hide. Weights are random but seeded, so two builds are identical.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from mmsdk.core.sources import LoadedModel
from mmsdk.models.family_processors import (
    IdeficsProcessor,
    LlavaNextProcessor,
    LlavaProcessor,
    MllamaProcessor,
    QwenVLProcessor,
)
from mmsdk.models.tokenizer import WordTokenizer

__all__ = ["TINY_BUILDERS", "build_tiny", "TINY_WORDS", "text_dims", "TP_TEXT_DIMS"]

VOCAB_SIZE = 101
TINY_WORDS = (
    "what digit is this ? is it even odd yes no how many strokes the answer a an of image "
    "0 1 2 3 4 5 6 7 8 9 zero one two three four five six seven eight nine"
).split()


def text_dims(**overrides: Any) -> dict[str, Any]:
    """The tiny language model's dimensions (shared by every family)."""
    dims = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=48,
        intermediate_size=74,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    dims.update(overrides)
    return dims


# The "-tp" variants: head counts and widths that tensor parallelism of 1, 2 and 4 divides (4 query
# heads over 2 KV heads, so tp 4 replicates KV heads), and widths that are multiples of 256 so INT4
# layers with group size 64 fit TensorRT-LLM's padding rule (max(64, group) * tp) at tp 4.
TP_TEXT_DIMS: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                    num_key_value_heads=2)


def _tokenizer(*specials: str) -> WordTokenizer:
    return WordTokenizer.build(TINY_WORDS, specials)


def _seeded(build: Callable[[], torch.nn.Module], seed: int = 0) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def _open_gates(model: torch.nn.Module, suffixes: tuple[str, ...]) -> torch.nn.Module:
    # transformers initialises tanh gates closed (0); open them so the image matters in a random model.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(suffixes):
                param.uniform_(0.3, 0.9)
    return model


def _clip_vision(**overrides: Any) -> Any:
    from transformers import CLIPVisionConfig

    dims = dict(hidden_size=40, intermediate_size=54, num_hidden_layers=2, num_attention_heads=2,
                image_size=30, patch_size=6, projection_dim=40)
    dims.update(overrides)
    return CLIPVisionConfig(**dims)


def tiny_llava(**text: Any) -> LoadedModel:
    """LlavaForConditionalGeneration: CLIP 30px/6px patches (25 tokens) + Llama 48x2."""
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tok = _tokenizer("<image>")
    config = LlavaConfig(text_config=LlamaConfig(**text_dims(pad_token_id=tok.pad_token_id, **text)),
                         vision_config=_clip_vision(), image_token_id=tok.token_id("<image>"),
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    model = _seeded(lambda: LlavaForConditionalGeneration(config))
    return LoadedModel(model, LlavaProcessor(tok, 30, 6), "tiny:llava-tp" if text else "tiny:llava")


def tiny_llava_next(**text: Any) -> LoadedModel:
    """LlavaNextForConditionalGeneration with one any-res tile (55 image tokens)."""
    from transformers import LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    tok = _tokenizer("<image>")
    config = LlavaNextConfig(text_config=LlamaConfig(**text_dims(pad_token_id=tok.pad_token_id, **text)),
                             vision_config=_clip_vision(), image_token_id=tok.token_id("<image>"),
                             image_grid_pinpoints=[[30, 30]], vision_feature_layer=-2,
                             vision_feature_select_strategy="default")
    model = _seeded(lambda: LlavaNextForConditionalGeneration(config))
    return LoadedModel(model, LlavaNextProcessor(tok, 30, 6), "tiny:llava-next-tp" if text else "tiny:llava-next")


_QWEN_SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def _qwen_ids(tok: WordTokenizer) -> dict[str, int]:
    return dict(image_token_id=tok.token_id("<|image_pad|>"), video_token_id=tok.token_id("<|video_pad|>"),
                vision_start_token_id=tok.token_id("<|vision_start|>"),
                vision_end_token_id=tok.token_id("<|vision_end|>"))


def _qwen_text(tok: WordTokenizer, text: dict[str, Any]) -> dict[str, Any]:
    dims = text_dims(**text)
    # M-RoPE sections (t, h, w) cover head_dim / 2 rotary frequencies: [2, 3, 3] at head_dim 16.
    half = dims["hidden_size"] // dims["num_attention_heads"] // 2
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    return text_dims(rope_parameters=rope, pad_token_id=tok.pad_token_id,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **text)


def tiny_qwen2_vl(**text: Any) -> LoadedModel:
    """Qwen2VLForConditionalGeneration: 36px image, 6px patches, 2x2 merge (9 tokens), M-RoPE [2,3,3]."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tok = _tokenizer(*_QWEN_SPECIALS)
    text_cfg = _qwen_text(tok, text)
    vision = dict(depth=2, embed_dim=40, hidden_size=text_cfg["hidden_size"], num_heads=2, mlp_ratio=2, patch_size=6,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text_cfg, vision_config=vision, **_qwen_ids(tok))
    model = _seeded(lambda: Qwen2VLForConditionalGeneration(config))
    name = "tiny:qwen2-vl-tp" if text else "tiny:qwen2-vl"
    return LoadedModel(model, QwenVLProcessor(tok, 36, 6, merge_size=2, temporal_patch_size=2), name)


def tiny_qwen2_5_vl(**text: Any) -> LoadedModel:
    """Qwen2_5_VLForConditionalGeneration: windowed vision attention (one full-attention block)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = _tokenizer(*_QWEN_SPECIALS)
    text_cfg = _qwen_text(tok, text)
    vision = dict(depth=2, hidden_size=40, intermediate_size=54, out_hidden_size=text_cfg["hidden_size"], num_heads=2,
                  patch_size=6, spatial_merge_size=2, temporal_patch_size=2, window_size=24,
                  fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=text_cfg, vision_config=vision, **_qwen_ids(tok))
    model = _seeded(lambda: Qwen2_5_VLForConditionalGeneration(config))
    name = "tiny:qwen2.5-vl-tp" if text else "tiny:qwen2.5-vl"
    return LoadedModel(model, QwenVLProcessor(tok, 36, 6, merge_size=2, temporal_patch_size=2), name)


def tiny_qwen3_vl() -> LoadedModel:
    """Qwen3VLForConditionalGeneration: q/k RMSNorm before interleaved M-RoPE, one deepstack layer."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = _tokenizer(*_QWEN_SPECIALS)
    text = _qwen_text(tok, {})
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
    text["head_dim"] = 16
    vision = dict(depth=2, hidden_size=40, intermediate_size=54, out_hidden_size=48, num_heads=2, patch_size=6,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=36,
                  deepstack_visual_indexes=[1])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **_qwen_ids(tok))
    model = _seeded(lambda: Qwen3VLForConditionalGeneration(config))
    return LoadedModel(model, QwenVLProcessor(tok, 36, 6, merge_size=2, temporal_patch_size=2), "tiny:qwen3-vl")


def tiny_idefics() -> LoadedModel:
    """IdeficsForVisionText2Text: a gated cross-attention layer before each of 2 decoder layers."""
    from transformers import IdeficsConfig, IdeficsForVisionText2Text

    tok = _tokenizer("<image>", "<fake_token_around_image>")
    dims = text_dims()
    for key in ("num_key_value_heads",):
        dims.pop(key)
    vision = dict(embed_dim=40, image_size=30, patch_size=6, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=54)
    config = IdeficsConfig(**dims, vision_config=vision, cross_layer_interval=1, alpha_type="float",
                           pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, use_resampler=False)
    model = _seeded(lambda: _open_gates(IdeficsForVisionText2Text(config), ("alpha_cross_attn", "alpha_dense")))
    return LoadedModel(model, IdeficsProcessor(tok, 30, 6), "tiny:idefics")


def tiny_mllama() -> LoadedModel:
    """MllamaForConditionalGeneration: 3 decoder layers, layer 1 is gated cross-attention."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    tok = _tokenizer("<|image|>")
    text = text_dims(num_hidden_layers=3, cross_attention_layers=[1], pad_token_id=tok.pad_token_id,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(hidden_size=40, attention_heads=2, num_hidden_layers=2, num_global_layers=1,
                  intermediate_layers_indices=[0], vision_output_dim=80, image_size=30, patch_size=6,
                  intermediate_size=54, max_num_tiles=1, supported_aspect_ratios=[[1, 1]])
    config = MllamaConfig(text_config=text, vision_config=vision, image_token_index=tok.token_id("<|image|>"))

    gates = ("cross_attn_attn_gate", "cross_attn_mlp_gate")
    model = _seeded(lambda: _open_gates(MllamaForConditionalGeneration(config), gates))
    return LoadedModel(model, MllamaProcessor(tok, 30, 6, max_num_tiles=1), "tiny:mllama")


def tiny_llava_tp() -> LoadedModel:
    """tiny:llava with a 256-wide decoder of 4 heads over 2 KV heads (tensor parallel 1/2/4)."""
    return tiny_llava(**TP_TEXT_DIMS)


def tiny_llava_next_tp() -> LoadedModel:
    """tiny:llava-next with a 256-wide decoder of 4 heads over 2 KV heads (tensor parallel 1/2/4)."""
    return tiny_llava_next(**TP_TEXT_DIMS)


def tiny_qwen2_vl_tp() -> LoadedModel:
    """tiny:qwen2-vl with a 256-wide decoder of 4 heads over 2 KV heads (tensor parallel 1/2/4)."""
    return tiny_qwen2_vl(**TP_TEXT_DIMS)


def tiny_qwen2_5_vl_tp() -> LoadedModel:
    """tiny:qwen2.5-vl with a 256-wide decoder of 4 heads over 2 KV heads (tensor parallel 1/2/4)."""
    return tiny_qwen2_5_vl(**TP_TEXT_DIMS)


TINY_BUILDERS: dict[str, Callable[[], LoadedModel]] = {
    "tiny:llava": tiny_llava,
    "tiny:llava-next": tiny_llava_next,
    "tiny:qwen2-vl": tiny_qwen2_vl,
    "tiny:qwen2.5-vl": tiny_qwen2_5_vl,
    "tiny:qwen3-vl": tiny_qwen3_vl,
    "tiny:idefics": tiny_idefics,
    "tiny:mllama": tiny_mllama,
    "tiny:llava-tp": tiny_llava_tp,
    "tiny:llava-next-tp": tiny_llava_next_tp,
    "tiny:qwen2-vl-tp": tiny_qwen2_vl_tp,
    "tiny:qwen2.5-vl-tp": tiny_qwen2_5_vl_tp,
}


def build_tiny(name: str) -> LoadedModel:
    """Build one tiny model by its source name (``tiny:llava``, ...)."""
    return TINY_BUILDERS[name]()
