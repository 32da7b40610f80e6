"""sparse-xattn's attention call on CUDA: masked SDPA against FlexAttention, eager and compiled (CUDA only).

One attention call of the pass, as its wrapper makes it (mmsdk.plugins.attention.sparse_xattn): the kept-block layout
of a random query / key pair at a given density, the per-entry mask from it, then the attention over that mask.
Shapes (bf16, head_dim 128):

- LLaVA-1.5-7B prefill, self-attention: 32 heads, 576 image tokens after a 5-token prefix and ``text`` text tokens,
  causal; at 640 tokens and at 4096 (the memory waterfall's prompt).
- Mllama (Llama-3.2-11B-Vision) prefill, cross-attention: 32 query heads over 8 KV heads, ``text`` text queries over
  the 6404 image tokens of a 4-tile image.

Each row times masked SDPA (the pass's CPU path), FlexAttention as called eagerly, FlexAttention under
torch.compile, and the block mask's build alone; medians of do_bench (whole calls, mask build included where the
pass builds it per call), and the compiled call's first-call (compile) seconds.

    python benchmarks/gpu_sparse_xattn.py --out sparse_xattn.json [--ttft]

``--ttft`` adds LLaVA-1.5-7B's time to the first token with the pass (:func:`ttft_rows`); ``--parts`` times the
stages of one call instead and profiles LLaVA's prefill with the pass (:func:`part_rows`, :func:`profile_prefill`).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from benchmarks import gpu_suite as suite


def problem(kind: str, text: int, density: float, block: int) -> tuple[torch.Tensor, ...]:
    """(q, k, v, the boolean mask the pass hands the kernel [B, 1, Q, K], text rows [B, Q], image columns [B, K]) for
    ``kind`` "llava" or "mllama"."""
    from mmsdk.plugins.attention._block_sparse import block_layout, combine_mask, drop_mask

    torch.manual_seed(0)
    if kind == "llava":
        image, prefix = 576, 5
        length = prefix + image + text
        q = torch.randn(1, 32, length, 128, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        text_rows = torch.zeros(1, length, dtype=torch.bool, device="cuda")
        text_rows[:, prefix + image:] = True
        image_cols = torch.zeros(1, length, dtype=torch.bool, device="cuda")
        image_cols[:, prefix:prefix + image] = True
        causal = True
    else:
        image = 6404
        q = torch.randn(1, 32, text, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, image, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        text_rows = torch.ones(1, text, dtype=torch.bool, device="cuda")
        image_cols = torch.ones(1, image, dtype=torch.bool, device="cuda")
        causal = False
    layout = block_layout(q, k, text_rows, image_cols, block=block,
                          density=density, causal=causal)
    allowed = combine_mask(None, drop_mask(layout, text_rows, image_cols), causal=causal, dtype=q.dtype)
    if allowed.dtype != torch.bool:
        allowed = allowed > torch.finfo(allowed.dtype).min / 2
    return q, k, v, allowed, text_rows, image_cols


def visited_share(block_mask: Any) -> float:
    """Share of the 128 x 128 tiles FlexAttention visits (partial and full) out of all of them (its index tensors hold
    one entry per tile)."""
    visited = block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum()
    return float(visited / block_mask.kv_indices.numel())


def row(kind: str, text: int, density: float, block: int) -> dict[str, Any]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from mmsdk.plugins.attention.flex_blocks import block_mask_from_dense, flex_attention_over
    from mmsdk.plugins.attention.sparse_xattn import BlockSparseSpec, SparseXAttnConfig, _CallMasks, _flex_attention

    q, k, v, allowed, text_rows, image_cols = problem(kind, text, density, block)
    rows = _CallMasks(text_rows, image_cols, None, True)
    gqa = k.shape[1] != q.shape[1]
    additive = torch.zeros(allowed.shape, device="cuda", dtype=q.dtype).masked_fill(~allowed, float("-inf"))

    def sdpa() -> Any:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=gqa)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return allowed[b, 0, q_idx, kv_idx]

    def build() -> Any:
        return create_block_mask(mask_mod, 1, None, q.shape[2], k.shape[2], device="cuda")

    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = build()
    start = time.perf_counter()
    out_compiled = compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    expected = sdpa()
    eager = flex_attention_over(flex_attention, q, k, v, allowed, None)
    spec = BlockSparseSpec(SparseXAttnConfig(block_size=block, density=density),
                           "self" if kind == "llava" else "cross")
    start = time.perf_counter()
    mmsdk_out = _flex_attention(spec, q, k, v, rows, None, None)[0]
    torch.cuda.synchronize()
    mmsdk_first_s = time.perf_counter() - start
    other = BlockSparseSpec(SparseXAttnConfig(block_size=block, density=density * 0.5), spec.kind, spec.flex)
    start = time.perf_counter()  # another layout of the same shape: no new compile
    _flex_attention(other, q, k, v, rows, None, None)
    torch.cuda.synchronize()
    mmsdk_second_s = time.perf_counter() - start
    result = {"kind": kind, "tokens_q": q.shape[2], "tokens_k": k.shape[2], "density": density, "block": block,
              "kept_entries": float(allowed.float().mean()),
              "visited_128_blocks": visited_share(block_mask_from_dense(allowed)),
              "rel_err_eager": suite.rel(eager.transpose(1, 2), expected),
              "rel_err_compiled": suite.rel(out_compiled, expected), "compile_s": compile_s,
              "rel_err_mmsdk": suite.rel(mmsdk_out.transpose(1, 2), expected), "mmsdk_first_call_s": mmsdk_first_s,
              "mmsdk_second_mask_s": mmsdk_second_s,
              "mmsdk_ms": suite.bench(lambda: _flex_attention(spec, q, k, v, rows, None, None)),
              "mmsdk_host_ms": wall_ms(lambda: _flex_attention(spec, q, k, v, rows, None, None)),
              "mmsdk_eager_parts": sorted(spec.flex.eager),
              "mmsdk_mask_build_ms": suite.bench(lambda: block_mask_from_dense(allowed)),
              "sdpa_ms": suite.bench(sdpa), "mask_build_ms": suite.bench(build),
              "flex_eager_ms": suite.bench(lambda: flex_attention_over(flex_attention, q, k, v, allowed, None)),
              "flex_compiled_ms": suite.bench(lambda: compiled(q, k, v, block_mask=build(), enable_gqa=gqa)),
              "flex_compiled_mask_kept_ms": suite.bench(lambda: compiled(q, k, v, block_mask=block_mask,
                                                                         enable_gqa=gqa))}
    print(result, flush=True)
    return result


def ttft_rows(reps: int = 5, quick: bool = False) -> list[dict[str, Any]]:
    """Time to the first token of LLaVA-1.5-7B (bf16, random weights) with and without sparse-xattn (density 0.5,
    layout blocks of 16 and 128 tokens), batch 1 of 640- and 4096-token prompts and batch 4 of 4096, one image
    each; a fresh model per row, medians of ``reps`` calls after one (which compiles FlexAttention). Every row runs
    transformers' generate (one prefill call): mmsdk's fast generate does not take sparse-xattn (its layout is per
    call), so the row without the pass runs it too, for a like-for-like prefill. Each row says whether every layer
    ran FlexAttention (no ``flex.failure``), whether any part ran eagerly, and the share of text-to-image score
    entries kept. ``quick``: batch 1 and 16-token blocks only."""
    import statistics

    from mmsdk.plugins.attention.sparse_xattn import SparseXAttnConfig

    rows = []
    for batch, length in ((1, 640), (1, 4096)) if quick else ((1, 640), (1, 4096), (4, 4096)):
        inputs = suite.llava_inputs(batch, length, images=True)
        for block in (None, 16) if quick else (None, 16, 128):
            suite.release_memory()
            passes = (SparseXAttnConfig(density=0.5, block_size=block),) if block else ()
            model = suite.optimized(suite.build_llava(), passes, False)
            times = suite.timed_calls(type(model).generate.__get__(model), inputs, 1, reps)
            specs = [m.sparse_xattn for m in model.modules() if hasattr(m, "sparse_xattn")]
            entries = [sum(spec.score_entries[i] for spec in specs) for i in (0, 1)]
            rows.append({"batch": batch, "prompt_tokens": length, "block": block, "ttft_ms": statistics.median(times),
                         "min_ms": min(times), "layers": len(specs),
                         "flex_failures": sorted({spec.flex.failure for spec in specs if spec.flex.failure}),
                         "eager_parts": sorted({name for spec in specs for name in spec.flex.eager}),
                         "kept_text_image_entries": entries[1] / entries[0] if entries[0] else None})
            print(rows[-1], flush=True)
            model = None
    return rows


def wall_ms(fn: Any, calls: int = 50) -> float:
    """Milliseconds per call of ``calls`` calls queued back to back, timed on the host (one sync at the end): where
    this exceeds the device time of :func:`suite.bench`, the call is bound by its launches and host reads."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def part_rows() -> list[dict[str, Any]]:
    """One LLaVA self-attention call of the pass taken apart (640 and 4096 tokens, batch 1, 16-token blocks, density
    0.5, no padding mask as with an all-ones attention mask): device ms (do_bench) and host ms per call of each stage
    the wrapper runs, against the causal SDPA the model runs without the pass."""
    from mmsdk.plugins.attention._block_sparse import block_layout, combine_mask, drop_mask, kept_pairs
    from mmsdk.plugins.attention.flex_blocks import block_mask_from_dense, compiled_flex_attention
    from mmsdk.plugins.attention.sparse_xattn import (BlockSparseSpec, SparseXAttnConfig, _CallMasks,
                                                      _flex_attention, _flex_masks)

    kernel = compiled_flex_attention()
    rows = []
    for text in (59, 3515):
        q, k, v, _, text_rows, image_cols = problem("llava", text, 0.5, 16)
        length = q.shape[2]
        call_masks = _CallMasks(text_rows, image_cols, None, True)
        spec = BlockSparseSpec(SparseXAttnConfig(block_size=16, density=0.5), "self")

        def layout() -> Any:
            return block_layout(q, k, text_rows, image_cols, block=16, density=0.5, causal=True)

        lay = layout()
        dropped = drop_mask(lay, text_rows, image_cols)
        allowed = combine_mask(None, dropped, causal=True, dtype=q.dtype)
        block_mask = block_mask_from_dense(allowed)
        # FlexAttention's floor on this shape: the causal mask alone, nothing dropped (no pass can make flex faster)
        causal_only = block_mask_from_dense(combine_mask(None, torch.zeros_like(dropped), causal=True, dtype=q.dtype))

        def eager_call() -> Any:  # the pass's call with its mask build run eagerly
            _, _, tiles = _flex_masks(q, k, text_rows, image_cols, None, None, 16, 0.5, True)
            return spec.flex.attend(q, k, v, tiles, None)

        _flex_attention(spec, q, k, v, call_masks, None, None)  # compiles the mask build (or records why not)
        stages = {
            "sdpa_causal": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            "block_layout": layout,
            "drop_mask": lambda: drop_mask(lay, text_rows, image_cols),
            "combine_mask": lambda: combine_mask(None, dropped, causal=True, dtype=q.dtype),
            "kept_pairs": lambda: kept_pairs(allowed, text_rows, image_cols),
            "block_mask_from_dense": lambda: block_mask_from_dense(allowed),
            "flex_compiled_prebuilt_mask": lambda: kernel(q, k, v, block_mask=block_mask),
            "flex_compiled_causal_only": lambda: kernel(q, k, v, block_mask=causal_only),
            "eager_build_call": eager_call,
            "mmsdk_call": lambda: _flex_attention(spec, q, k, v, call_masks, None, None),
        }
        row: dict[str, Any] = {"tokens": length, "mmsdk_eager_parts": sorted(spec.flex.eager)}
        for name, fn in stages.items():
            row[name] = {"device_ms": suite.bench(fn), "host_ms": wall_ms(fn)}
        rows.append(row)
        print(row, flush=True)
    return rows


def profile_prefill(out_dir: str, length: int = 640) -> dict[str, Any]:
    """LLaVA-1.5-7B prefill with the pass (16-token blocks, density 0.5) under torch.profiler: the top ops by host and
    by device time (written to ``out_dir``/sparse_profile.txt) and how many times one forward waited on the device
    (torch.cuda's sync debug mode, counted)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    from mmsdk.plugins.attention.sparse_xattn import SparseXAttnConfig

    suite.release_memory()
    model = suite.optimized(suite.build_llava(), (SparseXAttnConfig(density=0.5, block_size=16),), False)
    inputs = suite.llava_inputs(1, length, images=True)
    with torch.no_grad():
        for _ in range(2):
            model(**inputs)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            model(**inputs)
            torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model(**inputs)
            torch.cuda.synchronize()
    table = prof.key_averages()
    with open(f"{out_dir}/sparse_profile.txt", "w") as f:
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=30))
        f.write(table.table(sort_by="self_cuda_time_total", row_limit=30))
    return {"tokens": length, "host_syncs_per_forward": len(syncs), "sync_kinds": sorted(set(syncs))[:10]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sparse_xattn.json")
    parser.add_argument("--ttft", action="store_true", help="also time LLaVA-1.5-7B's first token with the pass")
    parser.add_argument("--skip-rows", action="store_true", help="with --ttft: the first-token rows alone")
    parser.add_argument("--quick", action="store_true", help="with --ttft: batch 1 and 16-token blocks only")
    parser.add_argument("--parts", action="store_true",
                        help="only the stages of one call and a profile of LLaVA's prefill with the pass")
    args = parser.parse_args()
    if args.parts:
        import os

        results = {"command": "python benchmarks/gpu_sparse_xattn.py --parts", "env": suite.section_env(),
                   "parts": part_rows(), "profile": profile_prefill(os.path.dirname(os.path.abspath(args.out)))}
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        return
    shapes = (("llava", 59, 0.5, 16), ("llava", 3515, 0.5, 16), ("llava", 3515, 0.5, 128), ("mllama", 512, 0.5, 16),
              ("mllama", 512, 0.5, 128), ("mllama", 512, 0.25, 128))
    rows = [] if args.skip_rows and args.ttft else [row(*shape) for shape in shapes]
    flags = (" --ttft" if args.ttft else "") + (" --skip-rows" if args.skip_rows and args.ttft else "") + (
        " --quick" if args.quick and args.ttft else "")
    results = {"command": "python benchmarks/gpu_sparse_xattn.py" + flags,
               "env": suite.section_env(), "rows": rows}
    if args.ttft:
        results["ttft"] = ttft_rows(quick=args.quick)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
