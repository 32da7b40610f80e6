"""Does the batch-1 "stream" GEMV (programs walking several row blocks, the next block's weights loaded before this
block's arithmetic; mmsdk/kernels/_gemv_stream_triton.py) read faster than the tuned "quad" GEMV?

The 7B weights whose K fits one "quad" step (q/k/v, gate+up and o_proj of LLaVA-1.5-7B, Qwen2-VL-7B's gate+up; g128,
bf16 activations), each call reading its own copy of the weight from HBM (gpu_tune.cold): bf16 cuBLAS, the tuner's
"quad" pick, and the stream GEMV over its tiles and grid sizes, with the error against the fp32 product.

    python benchmarks/gpu_stream_gemv.py --out stream.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from benchmarks.gpu_tune import cold, gtime, rel

SHAPES = {"qkv": (12288, 4096), "gate+up": (22016, 4096), "o_proj": (4096, 4096), "qwen gate+up": (37888, 3584)}
PROGRAMS = (132, 264, 396, 528, 792, 1056)


def shape_row(name: str, n: int, k: int) -> dict[str, Any]:
    """One weight: bf16, the tuned quad GEMV and every stream configuration, µs and errors."""
    from mmsdk.kernels.w4a16 import w4a16_gemv
    from mmsdk.kernels.w4a16_stream import STREAM_TILES, w4a16_stream_gemv
    from mmsdk.kernels.w4a16_tuning import tuning
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    p = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128, scale_dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dequantize_int4(p, torch.float32).T
    packed_bytes = p.qweight.numel() + p.scales.numel() * 2
    quad = w4a16_gemv(x, p.qweight, p.scales, None, 128)
    row: dict[str, Any] = {
        "shape": name, "bf16_us": gtime(cold(lambda w: torch.nn.functional.linear(x, w), dense)),
        "quad": {"us": gtime(cold(lambda q, s: w4a16_gemv(x, q, s, None, 128), p.qweight, p.scales)),
                 "rel_err": rel(quad, expected),
                 "cfg": tuning().chosen.get(("gemv", 1, n, k // 128, 128, torch.bfloat16, False, False, False))}}
    stream = []
    for tile in STREAM_TILES:
        for programs in PROGRAMS:
            try:
                out = w4a16_stream_gemv(x, p.qweight, p.scales, None, 128, None, tile, programs)
                t = gtime(cold(lambda q, s, c=tile, g=programs: w4a16_stream_gemv(x, q, s, None, 128, None, c, g),
                               p.qweight, p.scales))
            except Exception as error:  # a tile whose K does not fit one step
                stream.append({"tile": tile, "programs": programs, "error": f"{type(error).__name__}: {error}"[:160]})
                continue
            stream.append({"tile": tile, "programs": programs, "us": t, "rel_err": rel(out, expected),
                           "TBps": packed_bytes / t / 1e6})
    good = sorted((s for s in stream if "us" in s), key=lambda s: s["us"])
    row["stream_best"] = good[:4]
    row["stream"] = stream
    row["vs_bf16"] = {"quad": row["bf16_us"] / row["quad"]["us"],
                      "stream_best": row["bf16_us"] / good[0]["us"] if good else None}
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="stream.json")
    args = parser.parse_args()
    from benchmarks.gpu_suite import section_env

    result: dict[str, Any] = {"command": "python benchmarks/gpu_stream_gemv.py", "env": section_env(), "rows": []}
    for name, (n, k) in SHAPES.items():
        row = shape_row(name, n, k)
        result["rows"].append(row)
        print({key: value for key, value in row.items() if key != "stream"}, flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
