"""Profile a LLaVA-1.5-7B-shaped model (random bf16 weights) on CUDA and check the profiler against
the allocator and against hand-computed weight and KV bytes.

    python benchmarks/profile_real_size.py --out results.json [--layers 32] [--new-tokens 16]

Builds CLIP ViT-L/14-336 + Llama-2-7B shapes directly on the GPU (no download), profiles one greedy
generation with mmsdk.profiling.measure_run, and prints a table and a JSON record: weights and KV
from the profiler next to the same numbers computed from the config, the allocator's peak next to the
tensor-accounting peak, and every stage's peak and time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def build(layers: int, device: str = "cuda"):
    """LlavaForConditionalGeneration with LLaVA-1.5-7B shapes (``layers`` decoder layers), bf16 on cuda."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from mmsdk.models.family_processors import LlavaProcessor
    from mmsdk.models.tiny import TINY_WORDS
    from mmsdk.models.tokenizer import WordTokenizer

    tok = WordTokenizer.build(TINY_WORDS, ("<image>",))
    text = LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                       pad_token_id=tok.pad_token_id)
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, projection_dim=768)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=tok.token_id("<image>"),
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlavaForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model, LlavaProcessor(tok, 336, 14), config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("profile_real_size.json"))
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only to try the script")
    parser.add_argument("--apply", default="", help="passes to profile as a waterfall after the check, e.g. a,b")
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    import transformers

    from mmsdk.core.session import Session
    from mmsdk.profiling import ProfileSample, measure_run

    started = time.perf_counter()
    model, processor, config = build(args.layers, args.device)
    adapter = Session.create().adapt(model)
    image = (np.random.RandomState(0).rand(336, 336, 3) * 255).astype(np.uint8)
    sample = ProfileSample(image, "what digit is this ?", args.new_tokens)
    measure_run(model, processor, adapter, ProfileSample(image, "is it even ?", 2), device=args.device, modules=False)
    run = measure_run(model, processor, adapter, sample, device=args.device)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    text = config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    kv_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 2  # K and V, bf16
    tokens = run.prompt_tokens + run.new_tokens - 1  # the last token is generated but never cached
    record = {
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "layers": args.layers, "prompt_tokens": run.prompt_tokens, "new_tokens": run.new_tokens,
        "weights_profiled": run.weights_bytes, "weights_counted": params + buffers,
        "kv_profiled": run.kv_bytes, "kv_computed": kv_per_token * tokens,
        "kv_prefill_profiled": run.kv_prefill_bytes, "kv_prefill_computed": kv_per_token * run.prompt_tokens,
        "peak_activation": run.peak_activation_bytes, "allocator": run.allocator,
        "stages": [vars(s) for s in run.stages], "seconds_total": time.perf_counter() - started,
        "top_modules": [(m.name, m.weights_bytes, m.activation_peak_bytes) for m in
                        sorted(run.modules, key=lambda m: m.activation_peak_bytes, reverse=True)[:8]],
    }
    passes = [name for name in args.apply.split(",") if name]
    if passes:
        record["waterfall"] = waterfall(model, processor, passes, sample, args.device)
    args.out.write_text(json.dumps(record, indent=1))
    gib = 2**30
    print(f"weights   profiled {run.weights_bytes / gib:.4f} GiB   counted {(params + buffers) / gib:.4f} GiB")
    print(f"KV        profiled {run.kv_bytes / gib:.4f} GiB   computed {kv_per_token * tokens / gib:.4f} GiB")
    alloc = run.allocator
    if alloc:
        print(f"peak      allocator {alloc['max_allocated'] / gib:.4f} GiB   accounting "
              f"{alloc['tensor_accounting_peak'] / gib:.4f} GiB   reserved {alloc['reserved'] / gib:.4f} GiB")
    print(f"peak      total {run.peak_bytes / gib:.4f} GiB   activation {run.peak_activation_bytes / 2**20:.1f} MiB")
    for stage in run.stages:
        print(f"  {stage.name:14s} peak {stage.peak_bytes / gib:8.4f} GiB  activation "
              f"{stage.activation_bytes / 2**20:9.1f} MiB  {stage.seconds * 1000:8.1f} ms  x{stage.calls}")
    for row in record.get("waterfall", []):
        print(f"{row['label']:16s} weights {row['weights'] / gib:.4f} GiB  KV {row['kv'] / 2**20:8.2f} MiB  "
              f"activation {row['activation'] / 2**20:8.1f} MiB  peak {row['peak'] / gib:.4f} GiB")
    return 0


def waterfall(model, processor, passes: list[str], sample, device: str) -> list[dict]:
    """Apply ``passes`` through the Optimizer (calibrating on 8 random images if one needs data)."""
    import numpy as np

    from mmsdk.core.optimizer import Optimizer

    opt = Optimizer(model, processor).apply(*passes)
    if any(opt.session.passes.get(name).needs_calibration for name in passes):
        rng = np.random.RandomState(1)
        opt.calibrate([((rng.rand(336, 336, 3) * 255).astype(np.uint8), "what digit is this ?") for _ in range(8)])
    profile = opt.profile(sample, device=device, modules=False)
    return [{"label": r.label, "weights": r.weights_bytes, "kv": r.kv_bytes, "activation": r.peak_activation_bytes,
             "peak": r.peak_bytes, "allocator": r.allocator,
             "stages": {s.name: [s.peak_bytes, s.activation_bytes, round(s.seconds, 4)] for s in r.stages}}
            for r in profile.runs]


if __name__ == "__main__":
    sys.exit(main())
