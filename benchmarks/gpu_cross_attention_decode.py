"""Batch-1 decode of a cross-attention model: Llama-3.2-11B-Vision shapes (Mllama), random bf16 weights (CUDA only).

The Flamingo-style models keep the image out of the token sequence: Mllama's 8 cross-attention layers attend to the
image's K/V (6404 tokens for one image of 4 tiles), written into the cache by the prefill and read by every decode
step. This script times transformers' generate against mmsdk's (``opt.model.generate``: static cache, image K/V in
fixed tensors, CUDA-graph decode steps), in bf16, with ``int4-weight`` and with int4 / int8 / fp8 K/V (the image's K/V
packed in the cache too; static ranges set directly, as benchmarks/gpu_models.attach_kv does), at a 64-token prompt with
one 4-tile image and 128 new tokens, and reports each step against the bytes it must read (at gpu_suite.speed_limit:
4.27 TB/s on an H200) and the K/V bytes the fast path's cache holds.

The cross-attention gates are set to 0.5 (a random model's are 0, which would make every cross-attention layer a
no-op; trained gates are not).

    python benchmarks/gpu_cross_attention_decode.py --out mllama_decode.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

PROMPT, IMAGE_TOKEN, TILES, TILE_TOKENS = 64, 128256, 4, 1601  # 1601 = (560 / 14)**2 patches + the class token


def mllama_config(layers: int = 40, vision_layers: int = 32, global_layers: int = 8) -> Any:
    """Llama-3.2-11B-Vision's published configuration (40 decoder layers, 8 of them cross-attention)."""
    from transformers import MllamaConfig

    cross = [3, 8, 13, 18, 23, 28, 33, 38] if layers == 40 else list(range(1, layers, 3))
    text = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                cross_attention_layers=cross, tie_word_embeddings=False, pad_token_id=128004,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
    vision = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=vision_layers,
                  num_global_layers=global_layers, attention_heads=16, image_size=560, patch_size=14, max_num_tiles=4,
                  vision_output_dim=7680, norm_eps=1e-5,  # 1280 x (5 intermediate layers + the last)
                  intermediate_layers_indices=[3, 7, 15, 23, 30] if vision_layers == 32 else list(range(5)),
                  supported_aspect_ratios=[[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]])
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    for part in (config, config.text_config, config.vision_config):
        part._attn_implementation = "sdpa"
    return config


def build_mllama(config: Any, device: str = "cuda") -> Any:
    from transformers import MllamaForConditionalGeneration

    from benchmarks.gpu_models import cross_attention_model

    return cross_attention_model(MllamaForConditionalGeneration, config, ("cross_attn_attn_gate",
                                                                          "cross_attn_mlp_gate"), 128004, device)


def mllama_inputs(config: Any, device: str = "cuda") -> dict[str, torch.Tensor]:
    """One prompt of PROMPT tokens (begin-of-text, the image token, random text) and one image of 4 tiles (2 x 2)."""
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(1, 128000, (1, PROMPT), device=device, generator=gen)
    ids[0, 0], ids[0, 1] = 128000, IMAGE_TOKEN
    size = config.vision_config.image_size
    cross = torch.ones(1, PROMPT, 1, TILES, dtype=torch.long, device=device)
    cross[:, 0] = 0  # the begin-of-text token comes before the image
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(1, 1, TILES, 3, size, size, device=device, dtype=torch.bfloat16, generator=gen),
            "aspect_ratio_ids": torch.tensor([[6]], device=device),  # [2, 2] in supported_aspect_ratios (1-based)
            "aspect_ratio_mask": torch.ones(1, 1, TILES, dtype=torch.long, device=device),
            "cross_attention_mask": cross}


def step_bytes(model: Any, context: int, kv_element_bytes: float = 2.0) -> float:
    """Bytes a decode step reads: the text decoder and head (not the embedding table), the self-attention K/V of
    ``context`` tokens and the cross-attention layers' image K/V (``kv_element_bytes`` each: 2 bf16, 0.5 int4)."""
    text = model.model.language_model
    config = model.config.text_config
    weights = sum(t.numel() * t.element_size() for n, t in [*text.named_parameters(), *text.named_buffers()]
                  if "embed_tokens" not in n)
    weights += sum(t.numel() * t.element_size() for t in [*model.lm_head.parameters(), *model.lm_head.buffers()])
    per_token = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * kv_element_bytes
    self_layers = config.num_hidden_layers - len(config.cross_attention_layers)
    return weights + per_token * (self_layers * context + len(config.cross_attention_layers) * TILES * TILE_TOKENS)


# rows: name -> (passes applied to a fresh bf16 model, the KV-cache pass attached or None, which generate: "mmsdk" =
# opt.model.generate, "hf" = transformers' generate on the same model, "hf-dequantizing" = transformers' generate on a
# cache that dequantizes the packed K/V for every attention call: how int4 K/V on Mllama ran before the fast path
# took it)
STACK = ("qkv-fuse", "int4-weight", "rmsnorm-rope-fusion")
ROWS = {
    "HF bf16 eager generate": ((), None, "hf"),
    "mmsdk bf16 (fast generate)": ((), None, "mmsdk"),
    "mmsdk int4-weight (fast generate)": (("int4-weight",), None, "mmsdk"),
    "mmsdk int4-weight (HF generate, no graphs)": (("int4-weight",), None, "hf"),
    "mmsdk qkv-fuse + int4-weight + rmsnorm-rope-fusion (fast generate)": (STACK, None, "mmsdk"),
    "mmsdk int4-weight + int4-kv (fast generate)": (("int4-weight",), "int4-kv", "mmsdk"),
    "mmsdk int4-weight + int4-kv (HF generate, dequantizing cache)":
        (("int4-weight",), "int4-kv", "hf-dequantizing"),
    "mmsdk qkv-fuse + int4-weight + rmsnorm-rope-fusion + int4-kv (fast generate)": (STACK, "int4-kv", "mmsdk"),
    "mmsdk bf16 + int4-kv (fast generate)": ((), "int4-kv", "mmsdk"),
    "mmsdk qkv-fuse + int4-weight + rmsnorm-rope-fusion + int8-kv (fast generate)": (STACK, "int8-kv", "mmsdk"),
    "mmsdk qkv-fuse + int4-weight + rmsnorm-rope-fusion + fp8-kv (fast generate)": (STACK, "fp8-kv", "mmsdk"),
}
KV_ELEMENT_BYTES = {None: 2.0, "int4-kv": 0.5, "int8-kv": 1.0, "fp8-kv": 1.0}


def main() -> None:
    from benchmarks.gpu_models import attach_kv
    from benchmarks.gpu_suite import decode_rate, release_memory, speed_limit
    from benchmarks.gpu_tune import generate_kernels
    from mmsdk import Optimizer
    from mmsdk.kernels.decode_state import kept, release
    from mmsdk.plugins.quantizers.kv_runtime import installed_state, kv_bytes

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="mllama_decode.json")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rows", default=",".join(str(i) for i in range(len(ROWS))),
                        help="comma-separated indices into ROWS (all by default)")
    parser.add_argument("--kernels", type=int, default=0,
                        help="also profile a 32-token generate of each fast row and keep its N largest kernels")
    args = parser.parse_args()
    config = mllama_config()
    results: dict[str, Any] = {"command": f"python benchmarks/gpu_cross_attention_decode.py --new {args.new} --reps "
                               f"{args.reps} --rows {args.rows} --kernels {args.kernels}", "torch": torch.__version__,
                               "rows": []}
    inputs = mllama_inputs(config)
    built: tuple[tuple[Any, ...], Any] | None = None  # ((passes, int4 K/V), optimizer) of the model built last
    for index in (int(i) for i in args.rows.split(",")):
        name, (passes, kv, which) = list(ROWS.items())[index]
        if built is None or built[0] != (passes, kv):
            built = None  # the last model is gone before the next one is built (two 11B models need not fit)
            release_memory()
            opt = Optimizer(build_mllama(config), None)
            if passes:
                opt.apply(*passes)
            if kv is not None:
                attach_kv(opt.model, opt.adapter, kv)
            built = ((passes, kv), opt)
            del opt
        model = built[1].model
        hf = type(model).generate.__get__(model)
        state = installed_state(model)
        generate = {"mmsdk": None, "hf": hf, "hf-dequantizing":
                    lambda _hf=hf, _state=state, **kw: _hf(**kw, past_key_values=_state.new_cache())}[which]
        if which != "mmsdk":  # a fast row before it on this model kept a cache and a graph: not this row's memory
            release(model)
        with torch.inference_mode():
            row = {"variant": name, **decode_rate(model, inputs, args.new, args.reps, generate)}
            if which == "mmsdk":  # it took the fast path; its new tokens against transformers' on the same model
                if kept(model) is None or kept(model).step is None:
                    raise RuntimeError(f"{name}: generate() did not take the fast path (see the mmsdk.kernels log)")
                row["kv_cache_bytes"] = kv_bytes(kept(model).cache, model)  # after the timed calls: 128 new tokens
                reference = hf(**inputs, max_new_tokens=32, do_sample=False)[:, PROMPT:]
                ours = model.generate(**inputs, max_new_tokens=32, do_sample=False)[:, PROMPT:]
                row["new_tokens_agree_with_hf"] = float((reference == ours).float().mean())
                differ = (reference != ours).nonzero()
                row["first_differing_new_token"] = int(differ[0, 1]) if len(differ) else None
                if args.kernels:  # where a step's time goes (e.g. int8 / fp8 K/V against int4)
                    row.update(generate_kernels(model, inputs, limit=args.kernels))
        row["bytes_per_step"] = step_bytes(model, PROMPT + args.new // 2, KV_ELEMENT_BYTES[kv])
        row["floor_ms"] = row["bytes_per_step"] / speed_limit() * 1e3
        row["fraction_of_limit"] = row["floor_ms"] / row["step_ms"]
        results["rows"].append(row)
        print(row, flush=True)
        del model, hf, generate, state
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
