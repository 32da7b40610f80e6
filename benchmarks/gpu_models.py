"""Real-size models for the H200 benchmarks, built on the GPU from published configurations (random bf16 weights).

LLaVA-1.5-7B (CLIP ViT-L/14-336 + Llama-2-7B shapes) and Qwen2-VL-7B, the inputs the benchmarks feed them, mmsdk's
passes applied with int4-kv ranges set directly (calibration needs data), and the bytes one decode step must read.
"""

from __future__ import annotations

from typing import Any

import torch


def llava_config() -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu")
    text = LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, pad_token_id=0)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=32000,
                         vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu")
    config._attn_implementation = "sdpa"
    config.text_config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    return config


def cross_attention_model(model_class: Any, config: Any, gates: tuple[str, ...], pad_token_id: int,
                          device: str = "cuda") -> Any:
    """A Flamingo-style model from :func:`bf16_model` with its cross-attention gates (parameters named ending in one
    of ``gates``) set to 0.5, as a random model's are 0 (every cross-attention layer a no-op; trained ones are not),
    and generation set to run the full length (random weights have no reason to end)."""
    model = bf16_model(model_class, config, device)
    with torch.no_grad():
        for name, gate in model.named_parameters():
            if name.endswith(gates):
                gate.fill_(0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad_token_id
    return model


def bf16_model(model_class: Any, config: Any, device: str = "cuda") -> Any:
    """``model_class(config)`` with random bf16 weights made on ``device`` (seed 0), in eval mode."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return model_class(config).eval()
    finally:
        torch.set_default_dtype(default)


def build_llava() -> Any:
    from transformers import LlavaForConditionalGeneration

    model = bf16_model(LlavaForConditionalGeneration, llava_config())
    model.generation_config.eos_token_id = None  # random weights: decode the full length every time
    model.generation_config.pad_token_id = 0
    return model


def llava_inputs(batch: int, length: int, images: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(1, 32000, (batch, length), device="cuda", generator=gen)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        ids[:, 5:5 + 576] = 32000
        out["pixel_values"] = torch.randn(batch, 3, 336, 336, device="cuda", dtype=torch.bfloat16, generator=gen)
    return out


def attach_int4_kv(model: Any, adapter: Any, amax: float = 4.0) -> None:
    """The int4-kv runtime with static ranges set directly (calibration needs a processor and data)."""
    attach_kv(model, adapter, "int4-kv", amax)


def attach_kv(model: Any, adapter: Any, name: str, amax: float = 4.0) -> None:
    """The runtime of KV-cache pass ``name`` (int4-kv, int8-kv, fp8-kv) with static ranges set directly."""
    from mmsdk.plugins.quantizers.kv_cache import KV_FORMATS, _state
    from mmsdk.plugins.quantizers.kv_runtime import LayerRanges, install

    fmt, config_cls = KV_FORMATS[name]
    state = _state(model, adapter, fmt, config_cls())
    layout = adapter.kv_layout(model)
    shape = (layout.num_kv_heads, layout.head_dim)
    for index, ranges in list(state.layers.items()):  # "self", or "cross" for Mllama's cached image K/V
        state.layers[index] = LayerRanges(ranges.kind, torch.full(shape, amax), torch.full(shape, amax))
    install(model, state, adapter)


def optimized(model: Any, passes: tuple[Any, ...], kv: bool) -> Any:
    from mmsdk import Optimizer

    opt = Optimizer(model, None)
    if passes:
        opt.apply(*passes)
    out = opt.model
    if kv:
        attach_int4_kv(out, opt.adapter)
    return out


def lm_bytes(model: Any, kv_bytes_per_token: float, ctx: int) -> float:
    """Bytes one decode step must read: decoder + head weights (not the embedding table) and the KV."""
    lm = model.model.language_model if hasattr(model.model, "language_model") else model.model
    total = sum(t.numel() * t.element_size() for n, t in list(lm.named_parameters()) + list(lm.named_buffers())
                if "embed_tokens" not in n)
    head = model.lm_head
    total += sum(t.numel() * t.element_size() for t in list(head.parameters()) + list(head.buffers()))
    return total + kv_bytes_per_token * ctx


KV_BF16 = 32 * 2 * 32 * 128 * 2  # bytes of K and V per token, 32 layers x 32 heads x 128
KV_INT4 = 32 * 2 * 32 * 128 * 0.5


def memory_floor(model: Any, batch: int, tokens: int, kv_int4: bool) -> tuple[float, float]:
    """(bytes of every parameter and buffer, bytes of LLaVA-7B's K/V for ``batch`` rows of ``tokens``)."""
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    return weights, batch * tokens * (KV_INT4 if kv_int4 else KV_BF16)


def qwen2_vl_config(layers: int = 28, vision_depth: int = 32) -> Any:
    """Qwen2-VL-7B's published configuration (28 layers, 28 query / 4 KV heads, M-RoPE [16, 24, 24])."""
    from transformers import Qwen2VLConfig

    text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                tie_word_embeddings=False, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
    vision = dict(depth=vision_depth, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
                           vision_start_token_id=151652, vision_end_token_id=151653)
    for part in (config, config.text_config, config.vision_config):
        part._attn_implementation = "sdpa"
    return config


def build_qwen2_vl(config: Any = None, device: str = "cuda") -> Any:
    from transformers import Qwen2VLForConditionalGeneration

    model = bf16_model(Qwen2VLForConditionalGeneration, config or qwen2_vl_config(), device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
