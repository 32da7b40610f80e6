"""Decode-step attention of grouped-query heads over unquantized K/V with a mask: transformers' SDPA call (which
copies every KV head for each of its query heads when there is a mask) against mmsdk's flash-decoding kernel on the
K/V as they are (mmsdk.kernels.grouped_decode), alone (with a few other launch configurations and the read floor of
the slots in use) and in fast generate (CUDA only, random bf16 weights).

Part 1, the attention call alone (CUDA graph of calls over 4 copies of the inputs, so K/V come from HBM):
Llama-3.2-11B-Vision's cross-attention (32 / 8 heads over one 4-tile image, 6404 tokens), its self-attention over a
static cache of 256 slots, and Qwen2-VL-7B's (28 / 4 heads) over 1280 and 4352 slots, a quarter of them empty; at
batch 1, and the cross-attention and Qwen2-VL-7B's at batch 4 (and 8 at 4352 slots).
Part 2, batch-1 decode steps of fast generate with the kernel and without it (the decode steps' attention left to
SDPA): Mllama-11B in bf16 and with int4-weight (benchmarks/gpu_cross_attention_decode.py's prompt and image), and
Qwen2-VL-7B in bf16 at a 1k-token text prompt. Each pair's first 32 new tokens are compared.

    python benchmarks/gpu_grouped_decode.py --out grouped_decode.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

CONFIGS = ((32, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (64, 8, 2))  # (BLOCK_T, warps, stages) besides the default
ATTENTION_CASES = {  # name -> (query heads, KV heads, K/V slots, slots in use, batch)
    "mllama cross-attention 32/8, 6404 image tokens": (32, 8, 6404, 6404, 1),
    "mllama self-attention 32/8, 256 slots (192 used)": (32, 8, 256, 192, 1),
    "qwen2-vl self-attention 28/4, 1280 slots (960 used)": (28, 4, 1280, 960, 1),
    "qwen2-vl self-attention 28/4, 4352 slots (3264 used)": (28, 4, 4352, 3264, 1),
    # more batch rows x KV heads: the packed-KV kernel's tiles had to follow them (kv_decode_choice.generic_config)
    "mllama cross-attention 32/8, 6404 image tokens, batch 4": (32, 8, 6404, 6404, 4),
    "qwen2-vl self-attention 28/4, 1280 slots (960 used), batch 4": (28, 4, 1280, 960, 4),
    "qwen2-vl self-attention 28/4, 4352 slots (3264 used), batch 4": (28, 4, 4352, 3264, 4),
    "qwen2-vl self-attention 28/4, 4352 slots (3264 used), batch 8": (28, 4, 4352, 3264, 8),
}


def attention_rows() -> list[dict[str, Any]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from benchmarks.gpu_suite import gbench, rel, speed_limit
    from mmsdk.kernels.grouped_decode import attention_implementation, decode_attention
    from mmsdk.kernels.kv_decode import reference_decode_attention

    kernel = ALL_ATTENTION_FUNCTIONS[attention_implementation("sdpa")]
    rows = []
    for name, (heads, kv_heads, slots, used, batch) in ATTENTION_CASES.items():
        module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=False, training=False)
        copies = []
        for _ in range(4):
            query = torch.randn(batch, heads, 1, 128, device="cuda", dtype=torch.bfloat16)
            key, value = (torch.randn(batch, kv_heads, slots, 128, device="cuda", dtype=torch.bfloat16)
                          for _ in range(2))
            mask = torch.zeros(batch, 1, 1, slots, dtype=torch.bool, device="cuda")
            mask[..., :used] = True
            copies.append((query, key, value, mask))
        row: dict[str, Any] = {"case": name, "batch": batch, "kv_bytes": 2 * batch * kv_heads * slots * 128 * 2}
        for label, attention in (("sdpa", sdpa_attention_forward), ("kernel", kernel)):
            calls = [lambda c=c, a=attention: a(module, *c, scaling=128**-0.5) for c in copies]
            row[f"{label}_us"] = gbench(calls) * 1e3
        for block_t, warps, stages in CONFIGS:  # the kernel alone, other launch configurations
            calls = [lambda c=c: decode_attention(c[0], c[1], c[2], 128**-0.5, c[3][:, 0, 0], block_t, warps, stages)
                     for c in copies]
            row[f"kernel_{block_t}t_{warps}w_{stages}s_us"] = gbench(calls) * 1e3
        row["read_floor_us"] = row["kv_bytes"] * used / slots / speed_limit() * 1e6
        query, key, value, mask = copies[0]
        expected = reference_decode_attention(query, key, value, 128**-0.5, mask[:, 0, 0])
        row["sdpa_rel_err"] = rel(sdpa_attention_forward(module, *copies[0], scaling=128**-0.5)[0], expected)
        row["kernel_rel_err"] = rel(kernel(module, *copies[0], scaling=128**-0.5)[0], expected)
        row["kernel_over_sdpa"] = row["kernel_us"] / row["sdpa_us"]
        rows.append(row)
        print(row, flush=True)
    return rows


@contextlib.contextmanager
def sdpa_decode_steps() -> Iterator[None]:
    """Fast generate with its decode steps' attention left to SDPA (how it ran before the kernel took them)."""
    from mmsdk.kernels import grouped_decode

    original = grouped_decode.attention_implementation
    grouped_decode.attention_implementation = lambda base: None
    try:
        yield
    finally:
        grouped_decode.attention_implementation = original


def qwen_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(1, 150000, (1, 1024), device="cuda", generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def generate_rows(new: int, reps: int) -> list[dict[str, Any]]:
    from benchmarks.gpu_cross_attention_decode import build_mllama, mllama_config, mllama_inputs
    from benchmarks.gpu_models import build_qwen2_vl
    from benchmarks.gpu_suite import decode_rate, release_memory
    from mmsdk import Optimizer
    from mmsdk.kernels.decode_state import kept, release

    config = mllama_config()
    models = {"mllama-11B bf16": (lambda: build_mllama(config), (), mllama_inputs(config)),
              "mllama-11B int4-weight": (lambda: build_mllama(config), ("int4-weight",), mllama_inputs(config)),
              "qwen2-vl-7B bf16, 1k prompt": (build_qwen2_vl, (), qwen_inputs())}
    rows = []
    for name, (build, passes, inputs) in models.items():
        release_memory()
        opt = Optimizer(build(), None)
        if passes:
            opt.apply(*passes)
        model = opt.model
        tokens = {}
        with torch.inference_mode():
            for label, scope in (("kernel", contextlib.nullcontext), ("sdpa", sdpa_decode_steps)):
                release(model)  # each variant captures its own step
                with scope():
                    row = {"model": name, "decode_attention": label, **decode_rate(model, inputs, new, reps)}
                    if kept(model) is None or kept(model).step is None:
                        raise RuntimeError(f"{name}: generate() did not take the fast path (see the mmsdk.kernels log)")
                    prompt = inputs["input_ids"].shape[1]
                    tokens[label] = model.generate(**inputs, max_new_tokens=32, do_sample=False)[:, prompt:]
                rows.append(row)
                print(row, flush=True)
        rows[-1]["new_tokens_agree_with_kernel_row"] = float((tokens["kernel"] == tokens["sdpa"]).float().mean())
        del opt, model
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="grouped_decode.json")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--parts", default="attention,generate")
    args = parser.parse_args()
    results: dict[str, Any] = {"command": f"python benchmarks/gpu_grouped_decode.py --new {args.new} --reps "
                               f"{args.reps} --parts {args.parts}", "torch": torch.__version__}
    parts = args.parts.split(",")
    if "attention" in parts:
        results["attention"] = attention_rows()
    if "generate" in parts:
        results["generate"] = generate_rows(args.new, args.reps)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
