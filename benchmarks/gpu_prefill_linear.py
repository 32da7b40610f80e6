"""Prefill-sized INT4 linears: what one call costs on the GPU and on the host, by rows, against bf16 (CUDA only).

A short prompt (a chat turn; Mllama's text beside its image) runs the language model's linears at 17-256 rows, where
mmsdk's int4 path picks a tensor-core GEMV (up to 32 rows since this script's first run; 64 before) or dequantizes
the weight and calls cuBLAS (more rows).
Prefill is not replayed from a CUDA graph, so each call also costs its Python and launches. For each shape of
Llama-3.2-11B-Vision's language model and each row count this script reports:

* ``gpu_us``: one call's GPU time, replayed from a CUDA graph over copies of the weights that overflow L2 (a model
  reads every layer's weights from HBM): bf16 ``F.linear``; the int4 layer as it runs (``Int4Linear``, g32, its
  tuner's pick); the weight dequantized by mmsdk's kernel, then cuBLAS.
* ``host_us``: one eager call's time on the host (200 calls issued back to back, then one wait; 200 calls fit in the
  launch queue, so this is the time to issue them, not the GPU's).

    python benchmarks/gpu_prefill_linear.py --out prefill_linear.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

# Llama-3.2-11B-Vision's language model: (name, out_features, in_features)
SHAPES = (("q_proj / o_proj", 4096, 4096), ("k_proj / v_proj", 1024, 4096), ("gate_proj / up_proj", 14336, 4096),
          ("down_proj", 4096, 14336))
ROWS = (1, 16, 17, 32, 64, 128, 256, 1024)


def host_us(call: Callable[[], Any], calls: int = 200) -> float:
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / calls * 1e6


def shape_rows(name: str, n: int, k: int, rows: list[int], group: int, gen: torch.Generator) -> list[dict[str, Any]]:
    """The rows of one weight shape: each row count's GPU and host time per call, three ways."""
    from mmsdk.kernels import graph_time_ms, l2_spill_copies
    from mmsdk.kernels.w4a16 import dequantize_packed
    from mmsdk.plugins.quantizers.int4_linear import Int4Linear

    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5)
    int4 = Int4Linear.from_linear(linear, block_size=group)
    bf16_copies = [w for (w,) in l2_spill_copies([linear.weight])]
    int4_copies = [(q, s) for q, s in l2_spill_copies([int4.qweight, int4.scales])]

    def as_int4(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        int4.qweight, int4.scales = q, s  # the layer over one copy of its weights
        return int4(x)

    def dequantized(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, dequantize_packed(q, s, None, k, group, x.dtype))

    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        with torch.inference_mode():
            reference = torch.nn.functional.linear(x, int4.dequantize(torch.bfloat16))
            err = float((int4(x).float() - reference.float()).norm() / reference.float().norm())
            gpu = {"bf16": graph_time_ms([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16_copies]),
                   "int4": graph_time_ms([lambda q=q, s=s: as_int4(x, q, s) for q, s in int4_copies]),
                   "dequant+cublas": graph_time_ms([lambda q=q, s=s: dequantized(x, q, s) for q, s in int4_copies])}
            int4.qweight, int4.scales = int4_copies[0]
            host = {"bf16": host_us(lambda: torch.nn.functional.linear(x, linear.weight)),
                    "int4": host_us(lambda: int4(x)),
                    "dequant+cublas": host_us(lambda: dequantized(x, *int4_copies[0]))}
        row = {"shape": name, "n": n, "k": k, "rows": m, "int4_rel_err_vs_dequantized": err,
               "gpu_us": {kind: ms * 1e3 for kind, ms in gpu.items()}, "host_us": host}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="prefill_linear.json")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--group", type=int, default=32)
    args = parser.parse_args()
    results: dict[str, Any] = {"command": f"python benchmarks/gpu_prefill_linear.py --rows {args.rows} --group "
                               f"{args.group}", "torch": torch.__version__, "rows": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in SHAPES:
        results["rows"] += shape_rows(name, n, k, [int(r) for r in args.rows.split(",")], args.group, gen)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
