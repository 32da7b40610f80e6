"""Two decode-kernel questions on the GPU, one section each (CUDA only).

* ``fixup``: does summing a batch-1 GEMV's K slices inside the launch (the last program of each column
  block does it) beat the second epilogue kernel? Both forms on the LLaVA-1.5-7B / Qwen2-VL-7B
  shapes, for the tuner's pick and for wider tiles (more weight bytes in flight per thread), plus the
  paired gate/up GEMV.
* ``gqa``: which block configuration of the int4 KV decode kernels suits grouped-query heads
  (Qwen2-VL-7B: 28 query / 4 KV heads), against SDPA on the bf16 cache.

Times are medians of CUDA-graph replays (20 calls per graph), as in gpu_tune.py; errors are relative
to the fp32 product of the dequantized weights (or the fp64 attention reference).

    python benchmarks/gpu_kernel_sweeps.py --sections fixup,gqa --out sweeps.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from typing import Any

import torch

from benchmarks.gpu_tune import gtime, rel

SHAPES = {"qkv": (12288, 4096), "gate+up": (22016, 4096), "down": (4096, 11008), "o_proj": (4096, 4096),
          "qwen gate+up": (37888, 3584)}
# (BLOCK_N, BLOCK_C quads, warps, 1, "quad", target programs): the default order's first entry, then tiles with
# 2-4x the weight bytes per thread and step
TILES = [(32, 16, 4, 1, "quad", t) for t in (264, 528, 1056)] + [
    (64, 16, 4, 1, "quad", t) for t in (264, 528, 1056)] + [
    (32, 32, 4, 1, "quad", t) for t in (264, 528)] + [
    (128, 16, 8, 1, "quad", t) for t in (264, 528)] + [(64, 32, 8, 1, "quad", 528)]


def fixup() -> list[dict[str, Any]]:
    """Fix-up (one launch) against split-sum (two launches) per shape and tile."""
    from mmsdk.kernels.w4a16 import _tuning, w4a16_gemv
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    rows = []
    for name, (n, k) in SHAPES.items():
        p = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128, scale_dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        expected = x.float() @ dequantize_int4(p, torch.float32).T
        row: dict[str, Any] = {"shape": name, "bf16_us": gtime(lambda: torch.nn.functional.linear(x, dense))}
        for fix in (True, False):
            out = w4a16_gemv(x, p.qweight, p.scales, None, 128, fixup=fix)
            row[f"tuned_{'fixup' if fix else 'split_sum'}"] = {
                "us": gtime(lambda: w4a16_gemv(x, p.qweight, p.scales, None, 128, fixup=fix)),
                "rel_err": rel(out, expected),
                "cfg": _tuning().chosen.get(("gemv", 1, n, k // 128, 128, torch.bfloat16, False, False, fix))}
        tiles = []
        for cfg in TILES:
            try:
                out = w4a16_gemv(x, p.qweight, p.scales, None, 128, config=cfg)
                t = gtime(lambda: w4a16_gemv(x, p.qweight, p.scales, None, 128, config=cfg))
            except Exception as error:
                tiles.append({"cfg": cfg, "error": f"{type(error).__name__}: {str(error)[:120]}"})
                continue
            tiles.append({"cfg": cfg, "us": t, "rel_err": rel(out, expected)})
        row["tiles"] = tiles
        good = [t for t in tiles if "us" in t]
        row["best_tile"] = min(good, key=lambda t: t["us"]) if good else None
        row["TBps_best"] = (p.qweight.numel() + p.scales.numel() * 2) / min(
            [row["tuned_fixup"]["us"]] + [t["us"] for t in good]) / 1e6
        print({k: v for k, v in row.items() if k != "tiles"}, flush=True)
        rows.append(row)
    rows.append(_gated_rows())
    return rows


def _gated_rows() -> dict[str, Any]:
    """The paired gate/up GEMV + SiLU*mul, fix-up against its separate epilogue kernel."""
    from mmsdk.kernels.w4a16 import w4a16_gated_silu
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    out: dict[str, Any] = {}
    for label, n, k in (("llava 11008x4096", 11008, 4096), ("qwen2-vl 18944x3584", 18944, 3584)):
        gate, up = (quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128, scale_dtype=torch.bfloat16)
                    for _ in range(2))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        parts = [(w.qweight, w.scales, w.zero_points) for w in (gate, up)]
        expected = torch.nn.functional.silu(x.float() @ dequantize_int4(gate, torch.float32).T) * (
            x.float() @ dequantize_int4(up, torch.float32).T)
        for fix in (True, False):
            got = w4a16_gated_silu(x, parts[0], parts[1], k, 128, fixup=fix)
            out[f"{label} {'fixup' if fix else 'split epilogue'}"] = {
                "us": gtime(lambda: w4a16_gated_silu(x, parts[0], parts[1], k, 128, fixup=fix)),
                "rel_err": rel(got, expected)}
    print(out, flush=True)
    return {"gated": out}


GQA_SPACE = {  # (BLOCK_T, warps, target programs[, stages]) per variant
    "generic": [None] + [(bt, w, t, s) for bt in (64, 128) for w in (4, 8) for t in (132, 264, 528) for s in (2, 3)]
    + [(256, 8, t, s) for t in (132, 264) for s in (2, 3)],
    "magic": [(bt, w, t) for bt in (64, 128) for w in (4, 8) for t in (132, 264, 528)],
}


def gqa() -> list[dict[str, Any]]:
    """The int4 KV decode kernels' configurations on Qwen2-VL-7B heads (28/4, head_dim 128), 4k and 16k."""
    from benchmarks.gpu_suite import kv_problem
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention
    from mmsdk.plugins.quantizers.quantized_cache import Packed

    rows = []
    for ctx in (4096, 16384):
        d = 128
        scale, codec, q, kbf, vbf, kc, vc, length = kv_problem(28, 4, ctx, d)
        reference = reference_decode_attention(q, codec.decode(Packed(kc), torch.float32, d),
                                               codec.decode(Packed(vc), torch.float32, d), d**-0.5)
        sdpa = gtime(lambda: torch.nn.functional.scaled_dot_product_attention(q, kbf, vbf, enable_gqa=True))
        results = []
        for variant, space in GQA_SPACE.items():
            for cfg in space:
                try:
                    out = decode_attention(q, kc, vc, scale, scale, length, "int4", d**-0.5, config=cfg,
                                           variant=variant)
                    t = gtime(lambda: decode_attention(q, kc, vc, scale, scale, length, "int4", d**-0.5,
                                                       config=cfg, variant=variant))
                except Exception as error:
                    print("skip", variant, cfg, type(error).__name__, str(error)[:100], flush=True)
                    continue
                results.append({"variant": variant, "cfg": cfg, "us": t, "ratio": t / sdpa,
                                "rel_err": rel(out, reference)})
        results.sort(key=lambda r: r["us"])
        rows.append({"ctx": ctx, "sdpa_us": sdpa, "default": next(r for r in results if r["cfg"] is None),
                     "best": results[:5], "all": results})
        print({k: v for k, v in rows[-1].items() if k != "all"}, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sweeps.json")
    parser.add_argument("--sections", default="fixup,gqa")
    args = parser.parse_args()
    results: dict[str, Any] = {"command": "python benchmarks/gpu_kernel_sweeps.py --sections " + args.sections}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            results[name] = {"fixup": fixup, "gqa": gqa}[name]()
        except Exception as error:
            traceback.print_exc()
            results[name] = {"error": repr(error)[:1000]}
        results.setdefault("seconds", {})[name] = time.perf_counter() - t0
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"== {name} {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
