"""What is alive at the peak of the memory waterfall's all-passes row, and how the prefill chunk moves it (CUDA only).

The waterfall (gpu_suite.py --sections memory) puts LLaVA-1.5-7B with int4-weight + int4-kv + token-prune 0.25 at batch
4 x 4096-token prompts, 128 new tokens, above its floor (packed weights + packed KV). This script runs that row with the
CUDA caching allocator's history recorded, replays the trace to the moment of the peak and lists the live
allocations there by the Python line that made them (the innermost mmsdk / transformers / torch frame). Then it runs the
row again for each prefill chunk in ``--chunks`` (tokens over all batch rows; ``MMSDK_PREFILL_TOKENS``) and
reports each peak against the floor, and the time to the first token at that chunk (one new token, median of
``--reps`` calls), of this row and of the same model in bf16 with no passes (mmsdk's generate either way): what the
chunk trades. Each chunk is one more pass of the language model through the host's kernel launches.

    python benchmarks/gpu_memory_peak.py --out peak.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from collections import defaultdict
from typing import Any

import torch

BATCH, LENGTH, NEW, KEEP = 4, 4096, 128, 0.25
OWN_CODE = ("/mmsdk/", "/transformers/", "/benchmarks/")


def where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in mmsdk, transformers or the benchmarks (else the innermost): 'file:line function'."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in OWN_CODE):
            tail = name.split("/site-packages/")[-1].split("/work/")[-1]
            return f"{tail}:{frame.get('line')} {frame.get('name')}"
    return f"{frames[0].get('filename')}:{frames[0].get('line')}" if frames else "?"


def live_at_peak(trace: list[dict[str, Any]], start_bytes: int) -> dict[str, Any]:
    """Replay allocator events: the peak of live bytes and what was live then, by allocation site."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = start_bytes
    peak_live: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            live[addr] = (size, where(event.get("frames", [])))
            total += size
            if total > peak:
                peak, peak_live = total, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:  # whichever comes first
            total -= live.pop(addr)[0]
    sites: dict[str, int] = defaultdict(int)
    for size, site in peak_live.values():
        sites[site] += size
    top = sorted(sites.items(), key=lambda item: -item[1])[:25]
    return {"peak_GB": peak / 1e9, "allocated_before_GB": start_bytes / 1e9,
            "live_at_peak": [{"site": site, "GB": size / 1e9} for site, size in top]}


def build() -> tuple[Any, dict[str, torch.Tensor], float]:
    """The all-passes model, its inputs and its floor in bytes (packed weights + packed KV)."""
    from benchmarks.gpu_models import build_llava, llava_inputs, memory_floor, optimized
    from mmsdk.plugins.encoders.token_prune import TokenPruneConfig

    model = optimized(build_llava(), ("int4-weight", TokenPruneConfig(keep_ratio=KEEP)), kv=True)
    weights, kv_bytes = memory_floor(model, BATCH, LENGTH - int(576 * (1 - KEEP)) + NEW, kv_int4=True)
    return model, llava_inputs(BATCH, LENGTH, images=True), weights + kv_bytes


def generate_peak(model: Any, inputs: dict[str, torch.Tensor], chunk: int) -> float:
    """Peak allocated bytes of one generate() call with prefill chunks of ``chunk`` tokens over all rows (fresh
    decode state)."""
    from benchmarks.gpu_tune import prefill_setting
    from mmsdk.kernels import fast_generate

    fast_generate.release(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode(), prefill_setting(chunk):
        model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def first_token_ms(model: Any, inputs: dict[str, torch.Tensor], chunk: int, reps: int) -> float:
    """Median milliseconds of a one-new-token generate() with prefill chunks of ``chunk`` tokens over all rows."""
    from benchmarks.gpu_suite import timed_calls
    from benchmarks.gpu_tune import prefill_setting

    with prefill_setting(chunk):
        return statistics.median(timed_calls(model.generate, inputs, 1, reps))


def profile_first_token(model: Any, inputs: dict[str, torch.Tensor], chunk: int, top: int = 20) -> dict[str, Any]:
    """One one-new-token generate() (after a warm one) under torch.profiler: the host's time, the GPU kernels' summed
    time, and the ``top`` kernels by GPU time (where the prefill goes at this chunk)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_tune import prefill_setting

    with prefill_setting(chunk):
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return {"chunk_tokens": chunk, "wall_ms_profiled": wall * 1e3,
            "gpu_kernels_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
            "top": [{"kernel": e.key[:90], "ms": e.self_device_time_total / 1e3, "calls": e.count}
                    for e in kernels[:top]]}


def workspace_per_stream() -> float:
    """Bytes that stay allocated after a first bf16 matmul on a new stream (cuBLAS's workspace for that stream)."""
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a @ a
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def main() -> None:
    from benchmarks.gpu_models import build_llava, optimized
    from mmsdk.kernels.chunked_prefill import prefill_tokens

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="peak.json")
    parser.add_argument("--chunks", default="4096,2048,1024")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="also profile one first-token call per chunk")
    args = parser.parse_args()
    workspace = workspace_per_stream()
    leftover = torch.cuda.memory_allocated()  # not the model's: the peaks below count from it
    model, inputs, floor = build()
    command = (f"python benchmarks/gpu_memory_peak.py --chunks {args.chunks} --reps {args.reps}"
               + (" --profile" if args.profile else ""))
    results: dict[str, Any] = {"command": command,
                               "floor_GB": floor / 1e9, "torch": torch.__version__,
                               "kept_after_a_matmul_on_a_new_stream_MB": workspace / 1e6}
    from mmsdk.kernels import fast_generate

    fast_generate.release(model)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        peak = generate_peak(model, inputs, prefill_tokens())
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    results["trace"] = live_at_peak(trace, start)
    results["trace"]["max_memory_allocated_GB"] = peak / 1e9
    results["trace"]["events"] = len(trace)
    print(json.dumps(results["trace"], indent=1), flush=True)
    results["chunks"] = []
    chunks = [int(c) for c in args.chunks.split(",")]
    for chunk in chunks:
        peak = generate_peak(model, inputs, chunk) - leftover
        results["chunks"].append({"chunk_tokens": chunk, "peak_GB": peak / 1e9, "peak_over_floor": peak / floor,
                                  "ttft_ms": first_token_ms(model, inputs, chunk, args.reps)})
        if args.profile:
            results["chunks"][-1]["profile"] = profile_first_token(model, inputs, chunk)
        print(results["chunks"][-1], flush=True)
    model = None
    gc.collect()  # an optimized model holds reference cycles
    plain = optimized(build_llava(), (), kv=False)
    for row in results["chunks"]:
        row["bf16_ttft_ms"] = first_token_ms(plain, inputs, row["chunk_tokens"], args.reps)
        print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
