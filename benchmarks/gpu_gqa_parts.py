"""Where a grouped-query INT4-KV decode call's time goes: the partial kernel alone, the combine kernel alone, the whole
call with and without programmatic dependent launch (PDL), next to an empty launch, a kernel that only reads the codes,
and SDPA on the bf16 cache. Qwen2-VL-7B's heads (28 query / 4 KV heads, head_dim 128), batch 1, the kernel's default
tiles, at 1280, 4k and 16k cached tokens.

Each time is the median of replays of a CUDA graph of 20 calls (benchmarks.gpu_tune.gtime), every call reading its own
copy of the cache from HBM, as the kernel sweeps time it. A kernel "alone" is the same call with the other kernel's
launch left out of the graph (its inputs are then stale memory: the timing, not the output, is what counts there);
both are timed without PDL, which would overlap a kernel with its own next call.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_gqa_parts.py --out gqa_parts.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks.gpu_tune import NoLaunch, gtime, pdl_setting, rel


@contextmanager
def launch_left_out(module: Any, kernel: str) -> Iterator[None]:
    """Inside the block, ``module.<kernel>[grid](...)`` launches nothing."""
    original = getattr(module, kernel)
    setattr(module, kernel, NoLaunch())
    try:
        yield
    finally:
        setattr(module, kernel, original)


def parts(ctx: int, hq: int = 28, hkv: int = 4, d: int = 128) -> dict[str, Any]:
    """One context's row: the call's launch settings, its error against fp32, and the times in µs."""
    from benchmarks.gpu_kernel_sweeps import read_floor
    from benchmarks.gpu_suite import kv_problem
    from mmsdk.kernels import _kv_grouped_triton, _split_merge_triton, l2_spill_copies
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention
    from mmsdk.kernels.kv_decode_choice import generic_config, splits
    from mmsdk.plugins.quantizers.quantized_cache import Packed

    scale, codec, q, kbf, vbf, kc, vc, length = kv_problem(hq, hkv, ctx, d)
    reference = reference_decode_attention(q, codec.decode(Packed(kc), torch.float32, d),
                                           codec.decode(Packed(vc), torch.float32, d), d**-0.5)
    (block_t, warps, target, stages), v_ahead = generic_config(None, True, False, ctx, rows=hkv)  # batch 1
    n_splits, split_t = splits(hkv, ctx, block_t, target)
    codes = l2_spill_copies((kc, vc))
    calls = [lambda kv=kv: decode_attention(q, *kv, scale, scale, length, "int4", d**-0.5) for kv in codes]
    sdpa_inputs = l2_spill_copies((kbf, vbf))
    sdpa = [lambda kv=kv: torch.nn.functional.scaled_dot_product_attention(q, *kv, enable_gqa=True)
            for kv in sdpa_inputs]
    row: dict[str, Any] = {
        "ctx": ctx, "block_t": block_t, "warps": warps, "stages": stages, "v_ahead": v_ahead,
        "splits_per_kv_head": n_splits, "tokens_per_split": split_t, "partial_programs": hkv * n_splits,
        "combine_programs": hq, "rel_err": rel(calls[0](), reference),
        "sdpa_us": gtime(sdpa), "whole_us": gtime(calls),
    }
    with pdl_setting(False):
        row["whole_without_pdl_us"] = gtime(calls)
        with launch_left_out(_split_merge_triton, "decode_combine"):
            row["partial_alone_us"] = gtime(calls)
        with launch_left_out(_kv_grouped_triton, "decode_partial"):
            row["combine_alone_us"] = gtime(calls)
    row["read_floor"] = read_floor(codes)
    row["ratio"] = row["whole_us"] / row["sdpa_us"]
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gqa_parts.json")
    parser.add_argument("--contexts", default="1280,4096,16384")
    args = parser.parse_args()
    from benchmarks.gpu_suite import section_env

    result = {"command": "python3 benchmarks/gpu_gqa_parts.py", "env": section_env(),
              "rows": [parts(int(ctx)) for ctx in args.contexts.split(",")]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
