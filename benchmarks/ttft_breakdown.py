"""Where the time to the first token goes: transformers' generate against mmsdk's on LLaVA-1.5-7B (bf16, CUDA only).

At batch 4 x 4096-token prompts transformers' one-pass prefill is bound by the GPU. This script profiles one
one-new-token call of each generate (after a warm call) on the same model and sums the GPU kernels' time by kind
(matmuls, attention, elementwise and copies by their names; everything else, Triton kernels included, as other), the
host's waits for the GPU, and the GPU's idle gaps with what the host ran meanwhile, so a gap between the two generates
shows up as the kernels or the launches that make it. mmsdk's generate is profiled at each prefill chunk in
``--chunks`` (tokens over all batch rows; ``MMSDK_PREFILL_TOKENS``).

    python benchmarks/ttft_breakdown.py --out ttft_breakdown.json

``--model mllama`` profiles mmsdk's generate on Llama-3.2-11B-Vision shapes instead, once per ``--variants`` entry
(bf16, int4 weights, int4 K/V): where the first token's time goes when the passes make it slower.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

# (kind, substrings of a kernel's name) in the order they are tried; the first match names the kind
KINDS = (
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("matmul", ("nvjet", "gemm", "cutlass", "sm90_xmma", "cublas")),
    ("elementwise", ("elementwise", "reduce_kernel", "CatArray", "copy_kernel", "index")),
)
# host calls that wait for the GPU or the driver: where the GPU can go idle between a chunk's kernels
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense", "cudaMemcpyAsync",
              "cudaMalloc", "cudaFree", "aten::nonzero", "cudaEventSynchronize")


def kind_of(kernel: str) -> str:
    for kind, parts in KINDS:
        if any(part in kernel for part in parts):
            return kind
    return "other"


def idle_gaps(events: Any, least_us: float = 300.0, top: int = 12) -> dict[str, Any]:
    """Stretches of ``least_us`` or more with no GPU kernel running, and what the host ran meanwhile: the total idle
    time, and the longest gaps each with its offset from the first kernel, the next kernel and the host ops that
    started inside it (by name, with the stack of the first)."""
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    host = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: e.time_range.start)
    if not kernels:
        return {"idle_ms": 0.0, "gaps": []}
    origin, busy_until, gaps = kernels[0].time_range.start, kernels[0].time_range.end, []
    for kernel in kernels[1:]:
        if kernel.time_range.start - busy_until >= least_us:
            gaps.append((busy_until, kernel.time_range.start, kernel.name))
        busy_until = max(busy_until, kernel.time_range.end)
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    rows = []
    for begin, end, following in longest:
        inside = [e for e in host if begin <= e.time_range.start < end]
        names: dict[str, int] = defaultdict(int)
        for e in inside:
            names[e.name] += 1
        rows.append({"at_ms": (begin - origin) / 1e3, "gap_ms": (end - begin) / 1e3, "next_kernel": following[:80],
                     "host_ops": dict(sorted(names.items(), key=lambda n: -n[1])[:8]),
                     "first_stack": list(inside[0].stack[:8]) if inside else []})
    return {"idle_ms": sum(end - begin for begin, end, _ in gaps) / 1e3, "gaps_over_least": len(gaps), "gaps": rows}


def profiled_call(run: Callable[..., Any], inputs: dict[str, torch.Tensor], top: int) -> dict[str, Any]:
    """One warm call of ``run`` then one under torch.profiler: wall time, GPU kernel time by kind, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    run(**inputs, max_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        start = time.perf_counter()
        run(**inputs, max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    by_kind: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in kernels:
        by_kind[kind_of(e.key)] += e.self_device_time_total / 1e3
        calls[kind_of(e.key)] += e.count
    gaps = idle_gaps(prof.events())
    waits = [{"op": e.key, "calls": e.count, "host_ms": e.self_cpu_time_total / 1e3, "stack": e.stack[:6]}
             for e in prof.key_averages(group_by_stack_n=6) if e.key in HOST_WAITS]
    waits.sort(key=lambda w: -w["host_ms"])
    return {"wall_ms_profiled": wall * 1e3, "gpu_kernels_ms": sum(by_kind.values()), "host_waits": waits[:12],
            "idle": gaps,
            "by_kind_ms": dict(sorted(by_kind.items())), "calls_by_kind": dict(sorted(calls.items())),
            "top": [{"kernel": e.key[:100], "ms": e.self_device_time_total / 1e3, "calls": e.count}
                    for e in kernels[:top]]}


def host_profile(run: Callable[..., Any], inputs: dict[str, torch.Tensor], top: int) -> dict[str, Any]:
    """One one-new-token call of ``run`` under cProfile (after the torch profiler's calls): the host's Python, the
    ``top`` functions by own time and by cumulative time (file:line(function), calls, ms)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run(**inputs, max_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, function): (primitive calls, calls, own s, cumulative s, _)}

    def rows(column: int) -> list[dict[str, Any]]:
        ranked = sorted(stats.items(), key=lambda item: -item[1][column])[:top]
        return [{"function": f"{file.rsplit('site-packages/', 1)[-1]}:{line}({func})", "calls": calls,
                 "own_ms": own * 1e3, "cumulative_ms": cumulative * 1e3}
                for (file, line, func), (_, calls, own, cumulative, _) in ranked]

    return {"by_own_time": rows(2), "by_cumulative_time": rows(3)}


def llava_runs(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """transformers' generate, then mmsdk's at each prefill chunk, on one bf16 LLaVA-1.5-7B."""
    from benchmarks.gpu_models import build_llava, llava_inputs, optimized
    from benchmarks.gpu_tune import prefill_setting

    model = optimized(build_llava(), (), kv=False)
    inputs = llava_inputs(args.batch, args.length, images=True)
    record(results, "transformers", profiled_call(type(model).generate.__get__(model), inputs, args.top))
    for chunk in (int(c) for c in args.chunks.split(",")):
        with prefill_setting(chunk):
            record(results, f"mmsdk chunk {chunk}", profiled_call(model.generate, inputs, args.top))


def mllama_runs(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """mmsdk's generate on Llama-3.2-11B-Vision shapes (one 4-tile image, 64-token prompt) for each variant: passes
    joined by "+", "int4-kv" meaning int4 K/V with static ranges (benchmarks/gpu_models.attach_int4_kv); "bf16" alone
    is the unoptimized model, also profiled under transformers' generate."""
    from benchmarks.gpu_cross_attention_decode import build_mllama, mllama_config, mllama_inputs
    from benchmarks.gpu_models import optimized
    from benchmarks.gpu_suite import release_memory

    config = mllama_config()
    inputs = mllama_inputs(config)
    for variant in args.variants.split(","):
        parts = tuple(p for p in variant.split("+") if p != "bf16")
        passes = tuple(p for p in parts if p != "int4-kv")
        release_memory()
        model = optimized(build_mllama(config), passes, kv="int4-kv" in parts)
        if not parts:
            record(results, "transformers bf16", profiled_call(type(model).generate.__get__(model), inputs, args.top))
        row = profiled_call(model.generate, inputs, args.top)
        if args.host_profile:
            row["host_profile"] = host_profile(model.generate, inputs, args.host_profile)
        record(results, f"mmsdk {variant}", row)
        del model


def record(results: dict[str, Any], name: str, row: dict[str, Any]) -> None:
    results["runs"][name] = row
    print(name, json.dumps(row, indent=1), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="ttft_breakdown.json")
    parser.add_argument("--model", choices=("llava", "mllama"), default="llava")
    parser.add_argument("--batch", type=int, default=4, help="LLaVA only")
    parser.add_argument("--length", type=int, default=4096, help="LLaVA only")
    parser.add_argument("--chunks", default="2048,4096", help="LLaVA only")
    parser.add_argument("--variants", default="bf16,int4-weight,int4-weight+int4-kv", help="Mllama only")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host-profile", type=int, default=0,
                        help="Mllama only: also profile mmsdk's call's Python (cProfile), this many top functions")
    args = parser.parse_args()
    command = (f"python benchmarks/ttft_breakdown.py --model llava --batch {args.batch} --length {args.length} "
               f"--chunks {args.chunks}" if args.model == "llava" else
               f"python benchmarks/ttft_breakdown.py --model mllama --variants {args.variants} --host-profile "
               f"{args.host_profile}")
    results: dict[str, Any] = {"command": command, "torch": torch.__version__, "runs": {}}
    with torch.inference_mode():
        (llava_runs if args.model == "llava" else mllama_runs)(args, results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
