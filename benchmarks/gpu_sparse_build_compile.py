"""Does sparse-xattn's mask build compile on this machine as prompt sizes change, and what does FlexAttention cost
against SDPA's flash kernel on a plain causal mask? (CUDA; the CPU works too for the first question, slowly.)

The mask build (mmsdk.plugins.attention.sparse_xattn._flex_masks) is compiled three ways over five prompt shapes in
a row: torch's default (the first shape static, a size that changes then dynamic), ``dynamic=False`` (one compile
per shape) and ``dynamic=True``; each with inductor's defaults and with the options mmsdk compiles it with
(flex_blocks.build_compile_options). Each shape records ok / mismatch / the error's type, and the call's seconds
(compile included). Then LLaVA-1.5-7B's self-attention at 4096 tokens, 32 heads of 128, bf16: compiled FlexAttention
on a causal block mask, compiled for that shape alone and after a 640-token shape (dynamic), against causal SDPA.

    python benchmarks/gpu_sparse_build_compile.py --out sparse_build_compile.json [--device cpu] [--skip-flex]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

SHAPES = ((300, False), (357, True), (420, True), (300, True), (640, False))


def build_args(length: int, padded: bool, device: str, heads: int = 4, dim: int = 16) -> tuple[Any, ...]:
    """The mask build's arguments for a batch of two prompts of ``length`` tokens (image tokens 5..199, text after),
    the second left-padded by three tokens when ``padded``; random queries (``heads`` of ``dim``) and keys (half as
    many heads), fresh per shape. The CUDA and CPU tests of the compiled build use it too."""
    generator = torch.Generator(device=device).manual_seed(length)
    q = torch.randn(2, heads, length, dim, device=device, generator=generator)
    k = torch.randn(2, heads // 2, length, dim, device=device, generator=generator)
    text = torch.zeros(2, length, dtype=torch.bool, device=device)
    text[:, 200:] = True
    image = torch.zeros_like(text)
    image[:, 5:200] = True
    starts = torch.tensor([0, 3], device=device) if padded else None
    given = None
    if padded:
        given = torch.ones(length, length, device=device).tril().log()[None, None].repeat(2, 1, 1, 1)
        given[1, :, :, :3] = float("-inf")
    return q, k, text, image, starts, given, 16, 0.5, True


def build_rows(device: str) -> dict[str, list[list[Any]]]:
    from mmsdk.plugins.attention.flex_blocks import build_compile_options
    from mmsdk.plugins.attention.sparse_xattn import _flex_masks

    results = {}
    for options_name, options in (("inductor_defaults", {}), ("mmsdk_options", build_compile_options())):
        for mode, dynamic in (("default", None), ("static", False), ("dynamic", True)):
            torch._dynamo.reset()
            compiled = torch.compile(_flex_masks, dynamic=dynamic, options=options)
            log = []
            for length, padded in SHAPES:
                args = build_args(length, padded, device)
                start = time.perf_counter()
                try:
                    got = torch.utils._pytree.tree_leaves(compiled(*args))
                    want = torch.utils._pytree.tree_leaves(_flex_masks(*args))
                    state = "ok" if all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) else "mismatch"
                except Exception as error:  # torch.compile raises its backend's errors at the first call
                    state = type(error).__name__
                log.append([length, padded, state, round(time.perf_counter() - start, 2)])
            results[f"{options_name}/{mode}"] = log
            print(options_name, mode, log, flush=True)
    return results


def flex_rows() -> dict[str, float]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench

    def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx >= kv_idx

    results = {}
    for name in ("flex_causal_4096_static_ms", "flex_causal_4096_after_640_ms"):
        torch._dynamo.reset()
        kernel = torch.compile(flex_attention)
        if name.endswith("after_640_ms"):
            q = torch.randn(1, 32, 640, 128, device="cuda", dtype=torch.bfloat16)
            kernel(q, q, q, block_mask=create_block_mask(causal, None, None, 640, 640))
        q, k, v = (torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        mask = create_block_mask(causal, None, None, 4096, 4096)
        results[name] = float(do_bench(lambda: kernel(q, k, v, block_mask=mask), return_mode="median"))
    results["sdpa_causal_4096_ms"] = float(do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), return_mode="median"))
    print(results, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sparse_build_compile.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--skip-flex", action="store_true", help="the mask build's compiles alone")
    args = parser.parse_args()
    results: dict[str, Any] = {"command": "python benchmarks/gpu_sparse_build_compile.py"
                               + (" --device cpu" if args.device == "cpu" else "")
                               + (" --skip-flex" if args.skip_flex else ""),
                               "torch": torch.__version__, "build": build_rows(args.device)}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
        if not args.skip_flex:
            results["flex"] = flex_rows()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
