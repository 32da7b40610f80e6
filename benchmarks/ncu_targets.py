"""Launches the kernels worth profiling with Nsight Compute, a few times each, on real-size shapes (no timing here).

The int4 KV decode kernels on LLaVA-1.5-7B heads (MHA 32/32) and Qwen2-VL-7B heads (GQA 28/4) at 4k and 16k tokens,
and the batch-1 W4A16 GEMV on LLaVA's q/k/v weight (12288 x 4096, g128), each call on its own copy of the cache or
weight so that it reads HBM as in a model. Run under ``ncu`` (see docs/benchmarks.md for the command); alone it only
checks that everything launches. ``--gemv`` instead launches only GEMVs, each ``SHAPE:CONFIG`` with a shape of
benchmarks/gpu_kernel_sweeps.SHAPES and a config as mmsdk.kernels.w4a16.w4a16_gemv takes it, e.g. the tuned down
projection ``down:16,32,2,1,idot,528`` (under ``MMSDK_TUNE=0`` a config is needed to profile the tuner's pick).

    python benchmarks/ncu_targets.py [--gemv down:16,32,2,1,idot,528 qkv:16,64,2,1,quad,528]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.gpu_suite import kv_problem


def kv_calls(hq: int, hkv: int, ctx: int, copies: int = 3) -> None:
    """``copies`` decode-attention calls over different int4 caches of ``ctx`` tokens."""
    from mmsdk.kernels.kv_decode import decode_attention

    for _ in range(copies):
        scale, _, q, _, _, kc, vc, length = kv_problem(hq, hkv, ctx, 128)
        decode_attention(q, kc, vc, scale, scale, length, "int4", 128**-0.5)


def gemv_calls(n: int = 12288, k: int = 4096, copies: int = 3, config: tuple[Any, ...] | None = None) -> None:
    """``copies`` one-row W4A16 GEMVs over different packed weights (``config`` None: the tuner's pick, whose first
    timing runs before them, or the default under ``MMSDK_TUNE=0``)."""
    from mmsdk.kernels.w4a16 import w4a16_gemv
    from mmsdk.plugins.quantizers.packing import quantize_int4

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(copies):
        w = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128, scale_dtype=torch.bfloat16)
        w4a16_gemv(x, w.qweight, w.scales, None, 128, config=config)


def parse_gemv(text: str) -> tuple[tuple[int, int], tuple[Any, ...]]:
    """``SHAPE:CONFIG`` -> ((N, K), config), numbers as ints and the kind as text."""
    from benchmarks.gpu_kernel_sweeps import SHAPES

    shape, _, config = text.partition(":")
    if shape not in SHAPES or not config:
        raise SystemExit(f"--gemv {text!r}: expected SHAPE:CONFIG with SHAPE one of {sorted(SHAPES)}, "
                         "e.g. down:16,32,2,1,idot,528")
    return SHAPES[shape], tuple(int(v) if v.isdigit() else v for v in config.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gemv", nargs="+", default=None, help="only these GEMVs, SHAPE:CONFIG each")
    args = parser.parse_args()
    if args.gemv is None:
        for ctx in (4096, 16384):
            kv_calls(32, 32, ctx)
            kv_calls(28, 4, ctx)
        gemv_calls()
    for (n, k), config in map(parse_gemv, args.gemv or []):
        gemv_calls(n, k, config=config)
    torch.cuda.synchronize()
    print("launched")


if __name__ == "__main__":
    main()
