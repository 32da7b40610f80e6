"""Decode-kernel questions on the GPU, one section each (CUDA only).

* ``tiles``: which "quad" GEMV tiles (rows x quads x warps, K-slice target) and whether prefetching the
  next step's weights ("quadp") reach more bandwidth at batch 1 on the LLaVA-1.5-7B / Qwen2-VL-7B shapes,
  against bf16 cuBLAS and the tuner's pick. (An earlier section, ``fixup``, summed the K slices inside the
  launch instead of in a second kernel: no faster, 0-5% slower on every shape, so that code was removed;
  its results are benchmarks/results/h200_kernel_sweeps_fixup.json, made at commit 575927b. The quad arithmetic
  over a K loop software-pipelined 2-4 deep through shared memory, weights by cp.async or TMA, and the gated
  kernel pipelined 2-3 deep, read 1.3-2x slower than the unpipelined tiles on every shape, so that code was removed
  too: benchmarks/results/h200_kernel_sweeps_tiles_staged.json, made at commit 703eff2.)
* ``step_gemvs``: the decode step's own batch-1 GEMVs (LLaVA-1.5-7B at g32, Qwen2-VL-7B at g128, with their bias
  and residual, and the gated MLP) over tiles x K-slice targets: what the tuner picks against the best config.
* ``step_norms``: two down projections' configs timed alone and each call followed by an add + RMSNorm.
* ``step_folds``: the step's GEMVs that read a norm (the fused qkv and the gated MLP, LLaVA-1.5-7B g32 and
  Qwen2-VL-7B g128) with the norm folded in (mmsdk/kernels/norm_fold.py) against an add + RMSNorm launch followed
  by the plain GEMV, per config: where the folded kernels' time goes (rmsnorm-rope-fusion's ``norm_in_gemv``).
* ``step_left_norm``: a decode step's o_proj -> post-attention norm -> gated MLP (LLaVA-1.5-7B g32, Qwen2-VL-7B
  g128): the add + RMSNorm as a launch of its own, against o_proj's store leaving the norm's statistics for the
  gated GEMV (mmsdk.kernels.norm_fold.NormRequest), and each kernel alone with and without its part.
* ``mma``: the tensor-core GEMV (kind "mma") at 1, 4 and 16 rows and groups of 128 and 32, against the "quad"
  tiles, the fused kernel and bf16 cuBLAS on the same shapes.
* ``many_rows``: 17-64 activation rows (w4a16_matmul): the fused kernel's configs against the tensor-core GEMV over
  blocks of 16 rows (``_MMA_MANY_ROWS``) and bf16 cuBLAS, groups of 128 and 32.
* ``pdl``: what programmatic dependent launch buys the tuned batch-1 GEMVs (their first weight tiles load
  while the previous kernel still runs), alone and after an add + RMSNorm.
* ``gqa``: which block configuration of the int4 KV decode kernels suits grouped-query heads
  (Qwen2-VL-7B: 28 query / 4 KV heads), against SDPA on the bf16 cache, the default without PDL, and a kernel that
  only reads the codes (``read_floor``: the floor under any decode kernel in this harness).
* ``idot``: the integer-dot GEMV's tiles (kind "idot", the rounding launch included) against the "quad" tiles, the
  tuner's pick and bf16 cuBLAS at batch 1, g128; ``idotr`` adds the tiles of kind "idotr" (no rounding launch: each
  program rounds its own quads).
* ``gated``: the decode step's gated MLP GEMV (LLaVA-1.5-7B g32, Qwen2-VL-7B g128, reading the post-attention norm's
  statistics): the step's config and every "gated" and "idot" tile of mmsdk.kernels.w4a16_gated, against bf16.
* ``rope``: the RoPE kernel's blocks of heads per program (mmsdk.kernels.norm_rope_gpu.rope_tile) at 1, 16 and
  4096 tokens, against Liger's RoPE and eager.
* ``gemv_floor``: per batch-1 GEMV shape, a kernel that only reads the packed weight and its scales (``read_floor``),
  against the tuner's pick and bf16 cuBLAS: how far each GEMV is from the bytes it must read, and what the 3x-bf16
  goal leaves for everything but the reads.
* ``mha``: the same as ``gqa`` for LLaVA-1.5-7B's 32 MHA heads. (A first merge of the splits in the partial
  kernel's last program measured slower than the combine kernel at 1k-16k tokens and was removed:
  benchmarks/results/h200_kernel_sweeps_merge.json, commit e1d71cb. The thirtieth pass's merge, launched under PDL,
  is faster and the MHA default; ``gpu_suite.py --sections kv_merge`` times it.)

Times are medians of CUDA-graph replays (20 calls per graph), as in gpu_tune.py; weights and caches are read
from HBM as in a model (copies timed in turn, gpu_tune.cold; ``pdl`` times one copy, as before the ninth pass);
errors are relative to the fp32 product of the dequantized weights (or the fp64 attention reference).

    python benchmarks/gpu_kernel_sweeps.py --sections tiles,gqa --out sweeps.json
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks.gpu_tune import cold, gtime, pdl_setting, rel, run_sections

SHAPES = {"qkv": (12288, 4096), "gate+up": (22016, 4096), "down": (4096, 11008), "o_proj": (4096, 4096),
          "qwen gate+up": (37888, 3584)}
# (BLOCK_N, BLOCK_C quads, warps, 1, kind, target programs): wider steps (more weight bytes in flight per thread)
# and the prefetching kind
# The second run's list (benchmarks/results/h200_kernel_sweeps_tiles_pdl.json) led with 8 x 128 x 4 warps, 16 x 64 x 2
# and 8 x 64 x 2; the first run's (h200_kernel_sweeps_tiles.json) with 16 x 64 x 4 and 16 x 32 x 2. Offline sm_90
# builds (Triton 3.6) show why narrow tiles win: 32 x 16 x 4 converts the activations through shared memory with 23
# barriers per program, 8 x 128 x 4 with 5, and one-warp tiles with at most 1 (4 x 64, 8 x 32: 80-118 registers),
# so this list adds one-warp tiles next to the best so far.
TILES = [(8, 128, 4, 1, "quad", 528), (16, 64, 2, 1, "quad", 528), (8, 64, 2, 1, "quad", 528),
         (4, 64, 1, 1, "quad", 528), (4, 64, 1, 1, "quad", 1056), (4, 128, 1, 1, "quad", 528),
         (8, 32, 1, 1, "quad", 528), (8, 32, 1, 1, "quad", 1056), (8, 64, 1, 1, "quad", 528),
         (2, 128, 1, 1, "quad", 528), (4, 32, 1, 1, "quad", 1056), (4, 128, 2, 1, "quad", 528),
         (8, 128, 2, 1, "quad", 528), (4, 64, 1, 1, "quadp", 528), (8, 32, 1, 1, "quadp", 528)]


def _one_row_problem(name: str) -> tuple[Any, torch.Tensor, torch.Tensor, float]:
    """Shape ``name`` of SHAPES at g128, random: (packed weight, one bf16 activation row, their fp32 product, bf16
    cuBLAS µs on a weight of that shape read from HBM)."""
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    n, k = SHAPES[name]
    packed = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128, scale_dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dequantize_int4(packed, torch.float32).T
    return packed, x, expected, gtime(cold(lambda w: torch.nn.functional.linear(x, w), dense))


def tiles(shapes: list[str] | None = None) -> list[dict[str, Any]]:
    """The tuner's pick and every tile of TILES per shape: time, error, packed bytes per second (``shapes``: keys of
    SHAPES, all by default; when given, the three leading tiles at 264, 528, 1056 and 1584 programs and two "idot" tiles
    instead, and the gated rows are left out)."""
    from mmsdk.kernels.w4a16 import w4a16_gemv
    from mmsdk.kernels.w4a16_tuning import tuning

    configs = TILES
    if shapes:  # the three leading tiles and two "idot" tiles at more K-slice targets
        configs = [(*tile[:5], target) for tile in TILES[:3] for target in (264, 528, 1056, 1584)]
        configs += [(*tile[:3], 1, "idot", target) for tile in IDOT_TILES[:2] for target in (528, 1056)]
    rows = []
    for name in shapes or SHAPES:
        n, k = SHAPES[name]
        p, x, expected, bf16_us = _one_row_problem(name)
        out = w4a16_gemv(x, p.qweight, p.scales, None, 128)
        row: dict[str, Any] = {
            "shape": name, "bf16_us": bf16_us,
            "tuned": {"us": gtime(cold(lambda q, s: w4a16_gemv(x, q, s, None, 128), p.qweight, p.scales)),
                      "rel_err": rel(out, expected),
                      "cfg": tuning().chosen.get(("gemv", 1, n, k // 128, 128, torch.bfloat16, False, False,
                                                  False))}}
        measured = _timed_gemv_configs(list(dict.fromkeys(configs)), x, p, expected)
        row["tiles"] = measured
        good = [t for t in measured if "us" in t]
        row["best_tile"] = min(good, key=lambda t: t["us"]) if good else None
        print({k: v for k, v in row.items() if k != "tiles"}, flush=True)
        rows.append(row)
    if not shapes:
        rows.append(_gated_rows())
    return rows


def _timed_gemv_configs(configs: list[Any], x: torch.Tensor, packed: Any, expected: torch.Tensor) -> list[Any]:
    """Each one-row GEMV config on ``packed`` (g128): time (weights from HBM), error against ``expected``, packed
    bytes per second; a config that fails is recorded with its error."""
    from mmsdk.kernels.w4a16 import w4a16_gemv

    packed_bytes = packed.qweight.numel() + packed.scales.numel() * 2
    measured: list[Any] = []
    for cfg in configs:
        try:
            out = w4a16_gemv(x, packed.qweight, packed.scales, None, 128, config=cfg)
            t = gtime(cold(lambda q, s, c=cfg: w4a16_gemv(x, q, s, None, 128, config=c), packed.qweight,
                           packed.scales))
        except Exception as error:
            measured.append({"cfg": cfg, "error": f"{type(error).__name__}: {str(error)[:160]}"})
            continue
        measured.append({"cfg": cfg, "us": t, "rel_err": rel(out, expected), "TBps": packed_bytes / t / 1e6})
    return measured


# (BLOCK_N, quads, warps, target programs) of the integer-dot GEMV (kind "idot"): offline sm_90 builds with PDL
# (benchmarks/sm90_gemv_builds.py --kernels idot, Triton 3.9) put 16 x 64 x 4 at 12.5 SASS instructions per weight word
# (128 registers) and the 256-byte tiles at 11.0-11.4 (255 registers), against 25.6 for the "quad" kernel's
# 8 x 128 x 4. A first sweep (h200_kernel_sweeps_idot.json, without PDL) also ran 8-row tiles (1.5-2x slower: the
# rounded activations' split costs more than the rows share) and 16-quad steps (slower on every shape).
IDOT_TILES = [(16, 64, 4, 528), (16, 32, 2, 528), (16, 32, 2, 1056), (32, 32, 4, 528), (16, 64, 2, 528),
              (64, 32, 4, 528), (32, 16, 2, 528), (16, 128, 4, 528), (32, 32, 2, 528), (32, 64, 8, 528)]


# (BLOCK_N, quads, warps, target programs) of kind "idotr" (the integer-dot GEMV rounding its own quads): every program
# rounds the quads of its steps, so taller tiles share that work among more rows (offline sm_90 builds,
# benchmarks/sm90_gemv_builds.py --kernels idot,idotr: 16 x 64 x 4 at 15.3 instructions per word against 10.7 for
# "idot", 32 x 32 x 4 at 12.8 against 10.3)
IDOTR_TILES = [(16, 64, 4, 528), (16, 32, 2, 528), (32, 32, 4, 528), (32, 32, 4, 1056), (32, 64, 8, 528),
               (64, 32, 4, 528), (64, 16, 4, 1056), (32, 16, 2, 1056), (32, 32, 2, 528)]


def idot(shapes: list[str] | None = None, self_round: bool = False) -> list[dict[str, Any]]:
    """The integer-dot GEMV's tiles per shape (rounding launch included; it alone as ``rounding_us``) against the
    tuner's pick, the best "quad" tiles of earlier sweeps and bf16 cuBLAS, g128, one row (``shapes``: keys of SHAPES,
    all by default; when given, the first four tiles are also timed at 1056 and 2112 programs; ``self_round``: the
    tiles of IDOTR_TILES as kind "idotr" too, no rounding launch)."""
    from mmsdk.kernels.gemv_idot import quantize_row_activations
    from mmsdk.kernels.w4a16 import w4a16_gemv

    rows = []
    for name in shapes or SHAPES:
        k = SHAPES[name][1]
        p, x, expected, bf16_us = _one_row_problem(name)
        row: dict[str, Any] = {
            "shape": name, "bf16_us": bf16_us,
            "tuned_us": gtime(cold(lambda q, s: w4a16_gemv(x, q, s, None, 128), p.qweight, p.scales)),
            "rounding_us": gtime(lambda: quantize_row_activations(x, k // 8))}
        tiles = IDOT_TILES
        if shapes:
            tiles = tiles + [(bn, bc, w, t) for bn, bc, w, _ in IDOT_TILES[:4] for t in (1056, 2112)
                             if (bn, bc, w, t) not in IDOT_TILES]
        configs = [(8, 128, 4, 1, "quad", 528), (8, 64, 2, 1, "quadp", 528), (8, 32, 1, 1, "quadp", 528)] + [
            (bn, bc, w, 1, "idot", t) for bn, bc, w, t in tiles]
        if self_round:
            configs += [(bn, bc, w, 1, "idotr", t) for bn, bc, w, t in IDOTR_TILES]
        measured = _timed_gemv_configs(configs, x, p, expected)
        for tile in measured:
            if "us" in tile:
                tile["vs_bf16"] = row["bf16_us"] / tile["us"]
        row["tiles"] = measured
        good = [t for t in measured if "us" in t]
        row["best"] = sorted(good, key=lambda t: t["us"])[:4]
        print({k: v for k, v in row.items() if k != "tiles"}, flush=True)
        rows.append(row)
    return rows


# The decode step's batch-1 GEMVs as the step runs them: (group size, per-weight shapes (N, K, bias, residual), the
# gated MLP's N x K) for the two measured stacks, LLaVA-1.5-7B at g32 and Qwen2-VL-7B at g128.
STEP_GEMVS = {
    "llava g32": (32, {"qkv": (12288, 4096, False, False), "o_proj": (4096, 4096, False, True),
                       "down": (4096, 11008, False, True)}, (11008, 4096)),
    "qwen2-vl g128": (128, {"qkv": (4608, 3584, True, False), "o_proj": (3584, 3584, False, True),
                            "down": (3584, 18944, False, True)}, (18944, 3584)),
}
# (rows, quads, warps, kind) per-weight tiles: the tile sweeps' leaders (g128) and their neighbours
STEP_TILES = ((8, 128, 4, "quad"), (16, 64, 2, "quad"), (8, 64, 2, "quad"), (8, 32, 1, "quad"), (4, 64, 1, "quad"),
              (8, 128, 2, "quad"), (16, 32, 2, "quad"), (16, 64, 4, "quad"), (8, 64, 2, "quadp"),
              (8, 32, 1, "quadp"), (4, 64, 1, "quadp"),
              # 16 quads (64 words) per row and step: Qwen2-VL's K = 3584 (448 words per row) in 7 whole steps, where
              # 128 quads take one step with 64 of its 512 words masked off and 64 quads take 1.75 steps (not yet run)
              (16, 16, 1, "quad"), (32, 16, 2, "quad"), (16, 16, 2, "quad"))
# the same for the gated kernel (rows, quads, warps), next to its own tiles (mmsdk.kernels.w4a16_gated._GATED_TILES,
# the same four tiles for every group size)
STEP_WHOLE_STEP_GATED_TILES = ((16, 16, 1), (8, 16, 1), (32, 16, 2))
STEP_TARGETS = (264, 528, 1056, 2112)


def step_gemvs() -> list[dict[str, Any]]:
    """Every decode-step GEMV of STEP_GEMVS (with its bias and residual) over STEP_TILES x STEP_TARGETS, and the gated
    MLP over its tiles x targets: the tuner's pick, the best config and each config's time and K slices.

    A target program count only matters through the K slices it gives (``k_slices``), so configs that launch the
    same slices are timed once. For groups above 32 the shapes run a second time with K slices rounded to whole
    steps (``_step_slices``) instead of whole multiples of BLOCK_C groups, which for the quad kinds is 4x coarser
    than a step at g128 (rows marked "step slices").
    """
    from mmsdk.plugins.quantizers.packing import quantize_int4

    rows = []
    for stack, (group, shapes, (gated_n, gated_k)) in STEP_GEMVS.items():
        weights = {name: quantize_int4(torch.randn(n, k, device="cuda") * 0.02, group, scale_dtype=torch.bfloat16)
                   for name, (n, k, _, _) in shapes.items()}
        gated = [quantize_int4(torch.randn(gated_n, gated_k, device="cuda") * 0.02, group, scale_dtype=torch.bfloat16)
                 for _ in range(2)]
        for step_slices in (False, True) if group > 32 else (False,):
            with _step_slices(group, step_slices):
                label = f"{stack}{' step slices' if step_slices else ''}"
                for name, (n, k, has_bias, has_residual) in shapes.items():
                    rows.append(_step_gemv_row(f"{label} {name} {n}x{k}", weights[name], group, n, k, has_bias,
                                               has_residual))
                rows.append(_step_gated_row(f"{label} gated {gated_n}x{gated_k}", gated, group, gated_n, gated_k))
    return rows


# (label, N, K, group, configs) for step_norms: the down projections whose one-slice config won in one stack's step and
# lost in the other's (benchmarks/results/h200_decode_reuse_down_slices.json, h200_decode_reuse_one_slice_pinned.json)
STEP_NORM_CASES = (("llava g32 down", 4096, 11008, 32, ((8, 128, 4, 1, "quad", 264), (8, 128, 4, 1, "quad", 528),
                                                        (8, 64, 2, 1, "quad", 528))),
                   ("qwen2-vl g128 down", 3584, 18944, 128, ((8, 128, 4, 1, "quad", 264),
                                                             (8, 128, 4, 1, "quad", 528))))


def step_norms() -> list[dict[str, Any]]:
    """The down projections of STEP_NORM_CASES timed alone (back-to-back calls, as the tuner times) and with an add +
    RMSNorm of the output after every call (as in a decoder layer, where a norm follows the down projection and
    precedes the next GEMV): does the second order of the configs follow the step's?"""
    from mmsdk.kernels.norm_rope_gpu import add_rms_norm
    from mmsdk.kernels.w4a16 import w4a16_gemv
    from mmsdk.plugins.quantizers.packing import quantize_int4

    rows = []
    for label, n, k, group, configs in STEP_NORM_CASES:
        p = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, group, scale_dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
        norm_weight = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
        row: dict[str, Any] = {"shape": label}
        for cfg in configs:
            def alone(q: Any, s: Any, c: Any = cfg, x: Any = x, group: int = group, residual: Any = residual) -> Any:
                return w4a16_gemv(x, q, s, None, group, config=c, residual=residual)

            def then_norm(q: Any, s: Any, c: Any = cfg, residual: Any = residual, norm_weight: Any = norm_weight,
                          alone: Any = alone) -> Any:
                return add_rms_norm(alone(q, s, c), residual, norm_weight, 1e-6)

            row[str(cfg)] = {"alone_us": gtime(cold(alone, p.qweight, p.scales)),
                             "with_norm_us": gtime(cold(then_norm, p.qweight, p.scales))}
        print(row, flush=True)
        rows.append(row)
    return rows


# (label, N, K, group, bias, gated, configs): the first config of each is what the tuner takes untimed
STEP_FOLD_CASES = (
    ("LLaVA qkv g32", 12288, 4096, 32, False, False,
     [(8, 128, 4, 1, "quad", 528), (16, 64, 2, 1, "quad", 528), (16, 32, 2, 1, "quad", 528),
      (8, 64, 2, 1, "quad", 528)]),
    ("LLaVA gate+up g32", 11008, 4096, 32, False, True,
     [(8, 64, 2, 1, "gated", 528), (8, 32, 1, 1, "gated", 528), (8, 128, 4, 1, "gated", 528)]),
    ("Qwen2-VL qkv g128", 4608, 3584, 128, True, False,
     [(8, 128, 4, 1, "quad", 528), (8, 64, 2, 1, "quad", 528), (8, 128, 2, 1, "quad", 264)]),
    ("Qwen2-VL gate+up g128", 18944, 3584, 128, False, True,
     [(8, 64, 2, 1, "gated", 528), (8, 128, 4, 1, "gated", 528), (8, 32, 1, 1, "gated", 528)]),
)


def step_folds() -> list[dict[str, Any]]:
    """STEP_FOLD_CASES per config: ``norm_then_gemv_us`` (an add + RMSNorm launch, then the GEMV on its output: the
    unfolded step), ``folded_us`` (the GEMV reading the norm's input, the norm inside it), ``gemv_us`` (the GEMV
    alone on normalized input: what the fold could reach), and the folded output's error against the fp32 product
    of the normalized input."""
    from mmsdk.kernels.norm_fold import InputNorm, quad_factors
    from mmsdk.kernels.norm_rope_gpu import add_rms_norm
    from mmsdk.kernels.w4a16 import w4a16_gemv
    from mmsdk.kernels.w4a16_gated import w4a16_gated_silu
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    rows = []
    for label, n, k, group, has_bias, gated, configs in STEP_FOLD_CASES:
        weights = [quantize_int4(torch.randn(n, k, device="cuda") * 0.02, group, scale_dtype=torch.bfloat16)
                   for _ in range(2 if gated else 1)]
        tensors = tuple(t for p in weights for t in (p.qweight, p.scales))
        x, residual = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(2))
        norm_weight = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        total = (x.float() + residual.float()).to(torch.bfloat16)
        norm = InputNorm(norm_weight, 1e-6, quad_factors(norm_weight))
        normalized = total.float() * torch.rsqrt(total.float().pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
        products = [normalized @ dequantize_int4(p, torch.float32).T for p in weights]
        expected = (torch.nn.functional.silu(products[0]) * products[1] if gated
                    else products[0] + (bias.float() if has_bias else 0))
        row: dict[str, Any] = {"shape": label}
        for cfg in configs:
            def gemv(a: Any, *t: Any, c: Any = cfg, fold: Any = None) -> Any:
                if gated:
                    return w4a16_gated_silu(a, (t[0], t[1], None), (t[2], t[3], None), k, group, config=c, norm=fold)
                return w4a16_gemv(a, t[0], t[1], None, group, bias, config=c, norm=fold)

            def unfolded(*t: Any, gemv: Any = gemv) -> Any:
                return gemv(add_rms_norm(x, residual, norm_weight, 1e-6)[0], *t)

            def folded(*t: Any, gemv: Any = gemv) -> Any:
                return gemv(total, *t, fold=norm)

            prenormalized = add_rms_norm(x, residual, norm_weight, 1e-6)[0]
            row[str(cfg)] = {"norm_then_gemv_us": gtime(cold(unfolded, *tensors)),
                             "folded_us": gtime(cold(folded, *tensors)),
                             "gemv_us": gtime(cold(lambda *t, gemv=gemv: gemv(prenormalized, *t), *tensors)),
                             "folded_rel_err": rel(folded(*tensors).reshape(expected.shape), expected)}
        print(row, flush=True)
        rows.append(row)
    return rows


# (label, hidden, MLP width, group, o_proj config, gated configs)
STEP_LEFT_NORM_CASES = (
    ("LLaVA g32", 4096, 11008, 32, (8, 128, 4, 1, "quad", 264),
     [(8, 128, 4, 1, "gated", 528), (8, 64, 2, 1, "gated", 528)]),
    ("Qwen2-VL g128", 3584, 18944, 128, (8, 128, 4, 1, "quad", 264),
     [(8, 64, 2, 1, "gated", 528), (8, 128, 4, 1, "gated", 528)]),
)


def step_left_norm() -> list[dict[str, Any]]:
    """STEP_LEFT_NORM_CASES per gated config (µs, weights from HBM): ``launch_step`` (o_proj, add + RMSNorm, gated
    GEMV), ``left_step`` (o_proj adding the residual and leaving the norm's statistics, the gated GEMV scaling by
    them), then o_proj alone without / with the residual and statistics, the gated GEMV alone without / with the
    scale, and the left step's error against the fp32 reference of the normalized sum."""
    from mmsdk.kernels.norm_fold import NormRequest
    from mmsdk.kernels.norm_rope_gpu import add_rms_norm
    from mmsdk.kernels.w4a16 import w4a16_gemv
    from mmsdk.kernels.w4a16_gated import w4a16_gated_silu
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    rows = []
    for label, hidden, width, group, o_cfg, gated_cfgs in STEP_LEFT_NORM_CASES:
        o_proj = quantize_int4(torch.randn(hidden, hidden, device="cuda") * 0.02, group, scale_dtype=torch.bfloat16)
        gate, up = (quantize_int4(torch.randn(width, hidden, device="cuda") * 0.02, group, scale_dtype=torch.bfloat16)
                    for _ in range(2))
        tensors = (o_proj.qweight, o_proj.scales, gate.qweight, gate.scales, up.qweight, up.scales)
        x, residual = (torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
        total = (residual.float() + (x.float() @ dequantize_int4(o_proj, torch.float32).T).to(torch.bfloat16)
                 .float()).to(torch.bfloat16)
        normalized = total.float() * torch.rsqrt(total.float().pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
        expected = (torch.nn.functional.silu(normalized @ dequantize_int4(gate, torch.float32).T)
                    * (normalized @ dequantize_int4(up, torch.float32).T))
        request = NormRequest(weight, 1e-6)
        w4a16_gemv(x, o_proj.qweight, o_proj.scales, None, group, config=o_cfg, residual=residual, leave=request)
        statistics = request.statistics
        row: dict[str, Any] = {"shape": label, "o_proj_config": str(o_cfg)}
        row["o_proj_us"] = gtime(cold(lambda q, s, *_: w4a16_gemv(x, q, s, None, group, config=o_cfg), *tensors))
        row["o_proj_leaving_us"] = gtime(cold(
            lambda q, s, *_: w4a16_gemv(x, q, s, None, group, config=o_cfg, residual=residual,
                                        leave=NormRequest(weight, 1e-6)), *tensors))
        for cfg in gated_cfgs:
            def gated(a: Any, t: Any, c: Any = cfg, statistics: Any = None) -> Any:
                return w4a16_gated_silu(a, (t[2], t[3], None), (t[4], t[5], None), hidden, group, config=c,
                                        statistics=statistics)

            def launch_step(*t: Any, gated: Any = gated) -> Any:
                out = w4a16_gemv(x, t[0], t[1], None, group, config=o_cfg)
                return gated(add_rms_norm(out, residual, weight, 1e-6)[0], t)

            def left_step(*t: Any, gated: Any = gated) -> Any:
                leave = NormRequest(weight, 1e-6)
                w4a16_gemv(x, t[0], t[1], None, group, config=o_cfg, residual=residual, leave=leave)
                return gated(leave.statistics.scaled, t, statistics=leave.statistics)

            row[str(cfg)] = {"launch_step_us": gtime(cold(launch_step, *tensors)),
                             "left_step_us": gtime(cold(left_step, *tensors)),
                             "gated_us": gtime(cold(lambda *t, g=gated: g(statistics.scaled, t), *tensors)),
                             "gated_scaled_us": gtime(cold(
                                 lambda *t, g=gated: g(statistics.scaled, t, statistics=statistics), *tensors)),
                             "left_step_rel_err": rel(left_step(*tensors).reshape(expected.shape), expected)}
        print(row, flush=True)
        rows.append(row)
    return rows


@contextmanager
def _step_slices(group: int, on: bool) -> Iterator[None]:
    """With ``on``, K slices of the quad kinds rounded to whole steps (BLOCK_C quads = BLOCK_C * 32 / group groups)
    for the length of the block: this process only, for the sweep to compare the two roundings."""
    import mmsdk.kernels.w4a16 as w4a16
    import mmsdk.kernels.w4a16_gated as w4a16_gated

    original = w4a16.k_slices
    if on:
        def by_steps(rows: int, k_blocks: int, block_n: int, block_g: int, target: int,
                     splits: int | None) -> tuple[int, int]:
            return original(rows, k_blocks, block_n, max(1, block_g * 32 // group), target, splits)

        w4a16.k_slices = w4a16_gated.k_slices = by_steps
    try:
        yield
    finally:
        w4a16.k_slices = w4a16_gated.k_slices = original


def _step_gemv_row(label: str, p: Any, group: int, n: int, k: int, has_bias: bool,
                   has_residual: bool) -> dict[str, Any]:
    """One per-weight GEMV of the step over STEP_TILES x STEP_TARGETS (configs giving the same K slices once)."""
    import mmsdk.kernels.w4a16 as w4a16
    from mmsdk.kernels.w4a16_tuning import tuning
    from mmsdk.plugins.quantizers.packing import dequantize_int4

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16) if has_residual else None
    expected = x.float() @ dequantize_int4(p, torch.float32).T
    expected = expected + (bias.float() if has_bias else 0) + (residual.float() if has_residual else 0)

    def run(q: Any, s: Any, cfg: Any = None) -> Any:
        return w4a16.w4a16_gemv(x, q, s, None, group, bias=bias, config=cfg, residual=residual)

    configs: list[Any] = [None]
    seen = set()
    for block_n, block_c, warps, kind in STEP_TILES:
        for target in STEP_TARGETS:
            slices = w4a16.k_slices(n, k // group, block_n, block_c, target, None)
            if (block_n, block_c, warps, kind, slices) not in seen:
                seen.add((block_n, block_c, warps, kind, slices))
                configs.append((block_n, block_c, warps, 1, kind, target))
    key = ("gemv", 1, n, k // group, group, torch.bfloat16, False, has_bias, False)  # no norm folded
    tuning().chosen.pop(key, None)  # the tuner chooses again (the slices may have changed)
    return _step_row(label, configs, run, (p.qweight, p.scales), expected, p.qweight.numel() + p.scales.numel() * 2,
                     lambda: tuning().chosen.get(key), lambda cfg: w4a16.k_slices(n, k // group, cfg[0], cfg[1],
                                                                                  cfg[5], None))


def _step_gated_row(label: str, weights: list[Any], group: int, n: int, k: int) -> dict[str, Any]:
    """The step's gated MLP (gate and up) over its "gated" tiles and STEP_WHOLE_STEP_GATED_TILES x STEP_TARGETS, and
    two per-weight tiles."""
    import mmsdk.kernels.w4a16_gated as w4a16_gated
    from mmsdk.kernels.w4a16_tuning import tuning
    from mmsdk.plugins.quantizers.packing import dequantize_int4

    gate, up = weights
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    expected = torch.nn.functional.silu(x.float() @ dequantize_int4(gate, torch.float32).T) * (
        x.float() @ dequantize_int4(up, torch.float32).T)
    configs: list[Any] = [None]
    seen = set()
    for block_n, block_c, warps in (*w4a16_gated._GATED_TILES[128], *STEP_WHOLE_STEP_GATED_TILES):
        for target in STEP_TARGETS:
            slices = w4a16_gated.k_slices(n, k // group, block_n, block_c, target, None)
            if (block_n, block_c, warps, slices) not in seen:
                seen.add((block_n, block_c, warps, slices))
                configs.append((block_n, block_c, warps, 1, "gated", target))
    configs += [(8, 64, 2, 1, "quad", 528), (8, 32, 1, 1, "quadp", 528)]

    def run(gq: Any, gs: Any, uq: Any, us: Any, cfg: Any = None) -> Any:
        return w4a16_gated.w4a16_gated_silu(x, (gq, gs, None), (uq, us, None), k, group, config=cfg)

    key = ("gated", n, k // group, group, torch.bfloat16, False, False)  # no norm folded
    tuning().chosen.pop(key, None)
    return _step_row(label, configs, run, (gate.qweight, gate.scales, up.qweight, up.scales), expected,
                     2 * (gate.qweight.numel() + gate.scales.numel() * 2), lambda: tuning().chosen.get(key),
                     lambda cfg: w4a16_gated.k_slices(n if cfg[4] == "gated" else 2 * n, k // group, cfg[0], cfg[1],
                                                      cfg[5], None))


def _step_row(label: str, configs: list[Any], run: Any, tensors: tuple[Any, ...], expected: torch.Tensor,
              packed_bytes: int, chosen: Any, slices: Any) -> dict[str, Any]:
    """One step_gemvs row: each config's time (cold weights), error, packed bytes per second and K slices
    (groups per slice, slices); the tuner's pick (config None, timed first so the tuner has chosen) and the fastest
    config."""
    measured = []
    for cfg in configs:
        try:
            out = run(*tensors, cfg=cfg)
            t = gtime(cold(lambda *w, c=cfg: run(*w, cfg=c), *tensors))
        except Exception as error:
            measured.append({"cfg": cfg, "error": f"{type(error).__name__}: {str(error)[:120]}"})
            continue
        picked = cfg or chosen()
        measured.append({"cfg": cfg or ["tuned", picked], "us": t, "rel_err": rel(out, expected),
                         "TBps": packed_bytes / t / 1e6,
                         "slices": slices(picked) if picked and len(picked) > 5 else None})
    good = [c for c in measured[1:] if "us" in c]
    row = {"shape": label, "tuned": measured[0], "best": min(good, key=lambda c: c["us"]) if good else None}
    print(row, flush=True)
    row["configs"] = measured
    return row


# the best "quad" tiles of the ninth pass and the fused kernel / "dot" GEMV the tuner chose for 4 and 16 rows before
# the "mma" kind existed
MMA_BASELINES = {1: [(8, 128, 4, 1, "quad", 528), (16, 64, 2, 1, "quad", 528), (8, 64, 2, 1, "quad", 528),
                     (8, 64, 2, 1, "quadp", 528)],
                 4: [(64, 256, 4, 3), (16, 2, 4, 4, "fma"), (32, 1, 4, 16, "dot")],
                 16: [(64, 256, 4, 3), (32, 1, 4, 16, "dot")]}


def _problems(row_counts: tuple[int, ...]) -> Any:
    """Per shape of SHAPES, group size (128, 32) and row count: (shape name, N, K, group, packed random weight, a bf16
    weight of the same shape for cuBLAS, rows, bf16 activations, their fp32 product with the dequantized weight)."""
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    for name, (n, k) in SHAPES.items():
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for group in (128, 32):
            p = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, group, scale_dtype=torch.bfloat16)
            weight = dequantize_int4(p, torch.float32)
            for m in row_counts:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                yield name, n, k, group, p, dense, m, x, x.float() @ weight.T


def mma() -> list[dict[str, Any]]:
    """The tensor-core GEMV ("mma": nibbles made bf16 by lop3, weights as the dot's left operand) at 1, 4 and 16 rows,
    groups of 128 and 32, against the kinds it may replace (MMA_BASELINES), bf16 cuBLAS and the tuner's pick over every
    candidate."""
    from mmsdk.kernels.w4a16 import _MMA_CANDIDATES, w4a16_gemv
    from mmsdk.kernels.w4a16_tuning import tuning

    rows = []
    for name, n, k, group, p, dense, m, x, expected in _problems((1, 4, 16)):
        packed_bytes = p.qweight.numel() + p.scales.numel() * 2
        out = w4a16_gemv(x, p.qweight, p.scales, None, group)
        bucket = 1 if m == 1 else (4 if m <= 4 else 16)
        row: dict[str, Any] = {
            "shape": name, "group": group, "M": m,
            "bf16_us": gtime(cold(lambda w, x=x: torch.nn.functional.linear(x, w), dense)),
            "tuned": {"us": gtime(cold(lambda q, s, x=x, g=group: w4a16_gemv(x, q, s, None, g), p.qweight,
                                           p.scales)),
                      "rel_err": rel(out, expected),
                      "cfg": tuning().chosen.get(("gemv", bucket, n, k // group, group, torch.bfloat16, False,
                                                   False, False))}}
        measured = []
        for cfg in (*MMA_BASELINES[bucket], *_MMA_CANDIDATES):
            try:
                out = w4a16_gemv(x, p.qweight, p.scales, None, group, config=cfg)
                t = gtime(cold(lambda q, s, c=cfg, x=x, g=group: w4a16_gemv(x, q, s, None, g, config=c),
                               p.qweight, p.scales))
            except Exception as error:
                measured.append({"cfg": cfg, "error": f"{type(error).__name__}: {str(error)[:120]}"})
                continue
            measured.append({"cfg": cfg, "us": t, "rel_err": rel(out, expected),
                             "TBps": packed_bytes / t / 1e6})
        row["configs"] = measured
        good = [c for c in measured if "us" in c]
        for kind, label in (("mma", "best_mma"), (None, "best_other")):
            pick = [c for c in good if (len(c["cfg"]) > 4 and c["cfg"][4] == "mma") == (kind == "mma")]
            row[label] = min(pick, key=lambda c: c["us"]) if pick else None
        print({key: v for key, v in row.items() if key != "configs"}, flush=True)
        rows.append(row)
    return rows


def many_rows() -> list[dict[str, Any]]:
    """w4a16_matmul at 32 and 64 rows: every fused and tensor-core config, the tuner's pick and bf16 cuBLAS."""
    from mmsdk.kernels.w4a16 import _CANDIDATES, _MMA_MANY_ROWS, w4a16_matmul

    rows = []
    for name, _, _, group, p, dense, m, x, expected in _problems((32, 64)):
        row: dict[str, Any] = {
            "shape": name, "group": group, "M": m,
            "bf16_us": gtime(cold(lambda w, x=x: torch.nn.functional.linear(x, w), dense))}
        measured = []
        for cfg in (None, *_CANDIDATES[m], *_MMA_MANY_ROWS):
            out = w4a16_matmul(x, p.qweight, p.scales, None, group, config=cfg)
            t = gtime(cold(lambda q, s, c=cfg, x=x, g=group: w4a16_matmul(x, q, s, None, g, config=c),
                           p.qweight, p.scales))
            measured.append({"cfg": cfg or "tuned", "us": t, "rel_err": rel(out, expected)})
        row["configs"] = measured
        for kind, label in ((True, "best_mma"), (False, "best_fused")):
            pick = [c for c in measured if c["cfg"] != "tuned" and (len(c["cfg"]) > 4) == kind]
            row[label] = min(pick, key=lambda c: c["us"])
        row["tuned"] = measured[0]
        print({key: v for key, v in row.items() if key != "configs"}, flush=True)
        rows.append(row)
    return rows


def _gated_rows() -> dict[str, Any]:
    """The paired gate/up GEMV + SiLU*mul with the tuner's pick, every "gated" tile (both weights' rows per program,
    silu(gate) * up stored directly at one K slice) and a few per-weight tiles (partials + epilogue)."""
    from mmsdk.kernels.w4a16_gated import _GATED_TILES, w4a16_gated_silu
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    out: dict[str, Any] = {}
    for label, n, k in (("llava 11008x4096", 11008, 4096), ("qwen2-vl 18944x3584", 18944, 3584)):
        gate, up = (quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128, scale_dtype=torch.bfloat16)
                    for _ in range(2))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        parts = [(w.qweight, w.scales, w.zero_points) for w in (gate, up)]
        expected = torch.nn.functional.silu(x.float() @ dequantize_int4(gate, torch.float32).T) * (
            x.float() @ dequantize_int4(up, torch.float32).T)
        for cfg in (None, *[(*tile, 1, "gated", 528) for tile in _GATED_TILES[128]], (8, 128, 4, 1, "quad", 528),
                    (16, 64, 2, 1, "quad", 528), (8, 64, 2, 1, "quad", 528), (32, 16, 4, 1, "quad", 1056),
                    (16, 64, 4, 1, "quadp", 528)):
            got = w4a16_gated_silu(x, parts[0], parts[1], k, 128, config=cfg)
            out[f"{label} {cfg or 'tuned'}"] = {
                "us": gtime(cold(lambda gq, gs, uq, us, c=cfg: w4a16_gated_silu(x, (gq, gs, None), (uq, us, None), k,
                                                                                128, config=c),
                                 gate.qweight, gate.scales, up.qweight, up.scales)),
                "rel_err": rel(got, expected)}
    print(out, flush=True)
    return {"gated": out}


def gated() -> list[dict[str, Any]]:
    """The decode step's gated MLP GEMV (gate and up of one row, ``silu(gate) * up`` stored directly) as the step runs
    it, LLaVA-1.5-7B with groups of 32 and Qwen2-VL-7B with groups of 128, both reading the post-attention norm's
    statistics: the step table's config (mmsdk.kernels.step_configs), every "gated" tile and every "idot" tile
    (activations rounded by a launch of their own, included), each once, against bf16 cuBLAS on the two weights
    stacked (plus SiLU and the product)."""
    from mmsdk.kernels.norm_fold import NormStatistics
    from mmsdk.kernels.step_configs import _measured
    from mmsdk.kernels.w4a16_gated import _GATED_TILES, _IDOT_GATED_TILES, w4a16_gated_silu
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    step_table = _measured()["NVIDIA H200"]
    rows = []
    for label, n, k, group in (("llava 11008x4096 g32", 11008, 4096, 32), ("qwen2-vl 18944x3584 g128", 18944, 3584,
                                                                           128)):
        gate, up = (quantize_int4(torch.randn(n, k, device="cuda") * 0.02, group, scale_dtype=torch.bfloat16)
                    for _ in range(2))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        squares = (x.float().pow(2).sum(1, keepdim=True) / 4).expand(1, 4).contiguous()  # 4 parts, as o_proj leaves
        statistics = NormStatistics(x, squares, 1e-6)
        h = x.float() * torch.rsqrt(squares.sum(1, keepdim=True) / k + 1e-6)
        expected = torch.nn.functional.silu(h @ dequantize_int4(gate, torch.float32).T) * (
            h @ dequantize_int4(up, torch.float32).T)
        stacked = torch.cat([dequantize_int4(w, torch.bfloat16) for w in (gate, up)])

        def dense(w: torch.Tensor) -> torch.Tensor:
            both = torch.nn.functional.linear(x, w)
            return torch.nn.functional.silu(both[:, :n]) * both[:, n:]

        row: dict[str, Any] = {"shape": label, "bf16_us": gtime(cold(dense, stacked))}
        del stacked
        step_cfg = step_table[("gated", n, k // group, group, torch.bfloat16, False, False)]
        configs = [step_cfg, *[(*t, 1, "gated", 528) for t in _GATED_TILES[group]],
                   *[(*t, 1, "idot", target) for t in _IDOT_GATED_TILES for target in (528, 1056)]]
        configs = list(dict.fromkeys(configs))
        measured = []
        for cfg in configs:
            try:
                got = w4a16_gated_silu(x, (gate.qweight, gate.scales, None), (up.qweight, up.scales, None), k, group,
                                       config=cfg, statistics=statistics)
                t = gtime(cold(lambda gq, gs, uq, us, c=cfg: w4a16_gated_silu(
                    x, (gq, gs, None), (uq, us, None), k, group, config=c, statistics=statistics),
                    gate.qweight, gate.scales, up.qweight, up.scales))
            except Exception as error:
                measured.append({"cfg": cfg, "error": f"{type(error).__name__}: {str(error)[:160]}"})
                continue
            measured.append({"cfg": cfg, "us": t, "vs_bf16": row["bf16_us"] / t, "rel_err": rel(got, expected)})
        row["step_config"] = step_cfg
        row["configs"] = measured
        rows.append(row)
        print(row, flush=True)
    return rows


def pdl() -> list[dict[str, Any]]:
    """The tuned batch-1 GEMVs with programmatic dependent launch on and off (``MMSDK_PDL``), same configuration.

    Alone (a graph of 20 back-to-back calls: each call's first weight tiles load while the previous call ends)
    and after an add + RMSNorm (the decode step's order: norm, then qkv or gate/up GEMV; ``pair_us`` is one norm
    and one GEMV), bf16 cuBLAS as the reference.
    """
    cases = [(name, n, k, False) for name, (n, k) in SHAPES.items()]
    cases += [("llava gated 11008x4096", 11008, 4096, True), ("qwen2-vl gated 18944x3584", 18944, 3584, True)]
    rows = []
    for case in cases:
        rows.append(_pdl_row(*case))
        print(rows[-1], flush=True)
    return rows


def _pdl_row(name: str, n: int, k: int, gated: bool) -> dict[str, Any]:
    """One shape of :func:`pdl` (a gated MLP's gate and up with ``gated``)."""
    from mmsdk.kernels.norm_rope_gpu import add_rms_norm
    from mmsdk.kernels.w4a16 import w4a16_gemv
    from mmsdk.kernels.w4a16_gated import w4a16_gated_silu
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    weights = [quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128, scale_dtype=torch.bfloat16)
               for _ in range(2 if gated else 1)]
    parts = [(w.qweight, w.scales, w.zero_points) for w in weights]
    dense = [dequantize_int4(w, torch.bfloat16) for w in weights]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    residual, norm_weight = torch.randn_like(x), torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    products = [x.float() @ w.float().T for w in dense]
    expected = torch.nn.functional.silu(products[0]) * products[1] if gated else products[0]

    def gemv(a: torch.Tensor) -> torch.Tensor:
        if gated:
            return w4a16_gated_silu(a, parts[0], parts[1], k, 128)
        return w4a16_gemv(a, parts[0][0], parts[0][1], None, 128)

    def pair() -> torch.Tensor:
        return gemv(add_rms_norm(x, residual, norm_weight, 1e-6)[0])

    row: dict[str, Any] = {"shape": name, "bf16_us": sum(gtime(lambda w=w: torch.nn.functional.linear(x, w))
                                                          for w in dense),
                           "norm_us": gtime(lambda: add_rms_norm(x, residual, norm_weight, 1e-6))}
    gemv(x)  # tune once (PDL on), so both settings run the same configuration
    for on, key in ((True, "pdl"), (False, "no_pdl")):
        with pdl_setting(on):
            row[key] = {"us": gtime(lambda: gemv(x)), "pair_us": gtime(pair), "rel_err": rel(gemv(x), expected)}
    row["gain_alone"] = row["no_pdl"]["us"] / row["pdl"]["us"]
    row["vs_bf16"] = {key: row["bf16_us"] / row[key]["us"] for key in ("pdl", "no_pdl")}
    return row


GQA_SPACE = {  # (BLOCK_T, warps, target programs, stages, V loaded with K) of the generic kernel, fp16 operands:
    # tiles of 32 to 512 tokens over 132 to 1056 programs, V with K (and the short-cache leader with V after the
    # softmax), 2 stages, and some with 3 and 4. Earlier sweeps: h200_kernel_sweeps_gqa_v_ahead.json (tf32
    # operands), h200_kernel_sweeps_tiles.json.
    "generic": [None, (128, 8, 264, 2, False)] + [(bt, w, t, 2, True) for bt, w, t in (
        (32, 2, 1056), (32, 4, 528), (64, 2, 528), (64, 4, 528), (64, 4, 1056), (128, 4, 264), (128, 4, 528),
        (128, 8, 264), (128, 8, 528), (128, 4, 132), (256, 8, 132), (256, 8, 264), (256, 4, 132), (512, 8, 132))]
    # deeper pipelines: 2 or 3 tiles loaded ahead through shared memory
    + [(bt, w, t, stages, True) for stages in (3, 4) for bt, w, t in (
        (64, 2, 528), (64, 4, 264), (64, 4, 528), (128, 4, 132), (128, 4, 264), (128, 8, 132))],
}


def gqa() -> list[dict[str, Any]]:
    """The int4 KV decode kernel's configurations on Qwen2-VL-7B heads (28/4, head_dim 128): 1280 tokens (the
    decode-step benchmark's cache), 4k and 16k."""
    return _kv_sweep(28, 4, GQA_SPACE, (1280, 4096, 16384))


# more programs for more rows: ``target programs`` counts every (row, KV head, split) program
GQA_BATCH_SPACE = {"generic": GQA_SPACE["generic"] + [(bt, w, t, 2, True) for bt, w, t in (
    (64, 4, 2112), (128, 4, 1056), (128, 4, 2112), (128, 8, 1056), (256, 8, 528), (256, 8, 1056), (64, 2, 2112))]}


def gqa_batch(batch: int) -> list[dict[str, Any]]:
    """The grouped-query sweep at ``batch`` rows of 4k and 16k tokens, where the batch-1 defaults measured no faster
    than SDPA on the bf16 cache at batch 4 and 8 (h200_suite_kv_batch_34.json)."""
    return [{"batch": batch, **row} for row in _kv_sweep(28, 4, GQA_BATCH_SPACE, (4096, 16384), batch)]


# int8 / fp8 codes (a byte per channel, read as channel pairs) hold twice int4's bytes per token: the default
# halves each tile (kv_decode_choice.generic_config, fmt int8 / fp8); these set the halved many-row tiles against
# int4's own, the batch-1 tiles and a few between
GQA_BYTES_SPACE = {"generic": [None] + [(bt, w, t, stages, True) for bt, w, t, stages in (
    (32, 2, 528, 2), (32, 2, 528, 3), (32, 2, 1056, 2), (64, 2, 528, 2), (64, 2, 528, 3), (64, 4, 528, 2),
    (64, 4, 264, 2), (128, 4, 264, 2), (128, 8, 264, 2), (128, 4, 528, 2), (32, 4, 528, 2))]}


def gqa_bytes_batch() -> list[dict[str, Any]]:
    """int8 and fp8 codes on Qwen2-VL-7B heads at batch 1, 4 and 8, 4k and 16k tokens: the many-row tiles were
    chosen on int4 codes only."""
    return [{"batch": batch, "fmt": fmt, **row} for fmt in ("int8", "fp8") for batch in (1, 4, 8)
            for row in _kv_sweep(28, 4, GQA_BYTES_SPACE, (4096, 16384), batch, fmt)]


MHA_SPACE = {  # (BLOCK_T, warps, target programs, stages, prefetch, fold, kdot) of the subnormal kernel. Earlier
    # passes swept tiles of 16-64 tokens on 1-2 warps over 132-2112 programs, with and without the next tile loaded
    # ahead and V's sums folded (h200_kernel_sweeps_mha_fold.json): (32, 1, 1056, prefetch, fold) won from 4k tokens
    # on. This one weighs the scores as integer dots (kdot) against float ones, and the tile loop pipelined by
    # Triton (stages: tiles loaded ahead through shared memory) against the next tile loaded ahead in registers
    # (prefetch). The tensor-core kernel of grouped heads (fp16 operands, PDL) on one query per KV head was 2.3-5x
    # slower than the subnormal default on the H200 (its best 18.7 / 40.0 / 142.5 against 8.1 / 12.0 / 28.2 µs at
    # 1280 / 4k / 16k tokens, h200_kernel_sweeps_mha_generic.json), so it is no longer swept.
    "subnormal": [None] + [(32, 1, t, None, True, True, kdot) for kdot in (False, True) for t in (528, 1056, 2112)]
    + [(32, 1, t, stages, False, True, True) for stages in (2, 3, 4) for t in (528, 1056, 2112)]
    + [(16, 1, t, 4, False, True, True) for t in (1056, 2112)]
    + [(64, 2, t, 3, False, True, True) for t in (528, 1056)],
}


def mha() -> list[dict[str, Any]]:
    """The MHA int4 KV decode kernels' configurations on LLaVA-1.5-7B heads (32/32, head_dim 128): 1280 tokens (the
    decode-step benchmark's cache: a 1k prompt and 128 new), 4k and 16k."""
    return _kv_sweep(32, 32, MHA_SPACE, (1280, 4096, 16384))


def _kv_sweep(hq: int, hkv: int, space: dict[str, list[Any]],
              contexts: tuple[int, ...] = (4096, 16384), batch: int = 1, fmt: str = "int4") -> list[dict[str, Any]]:
    """Every (variant, config) of ``space`` at each context against SDPA on the bf16 cache, fastest first; the
    "subnormal" kernel's with its splits merged by a combine kernel and by the partial kernel itself
    (``merge_counters``), since the merge changes which tiles and how many splits pay. (The other kernels leave
    their splits to the combine kernel: the grouped-query kernel's own merge, timed both ways here on Qwen2-VL-7B's
    heads, won at no tile and was removed: benchmarks/results/h200_gqa_sweep_merged_32.json.)"""
    from benchmarks.gpu_suite import kv_problem
    from mmsdk.kernels import l2_spill_copies
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention
    from mmsdk.plugins.quantizers.quantized_cache import Packed

    rows = []
    for ctx in contexts:
        d = 128
        scale, codec, q, kbf, vbf, kc, vc, length = kv_problem(hq, hkv, ctx, d, fmt=fmt, batch=batch)
        reference = reference_decode_attention(q, codec.decode(Packed(kc), torch.float32, d),
                                               codec.decode(Packed(vc), torch.float32, d), d**-0.5)
        sdpa = gtime(cold(lambda k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv),
                          kbf, vbf))
        codes = l2_spill_copies((kc, vc))  # each layer reads its own cache: a 4k-token int4 cache fits in L2
        results = []
        counters = torch.zeros(batch * hkv + 1, dtype=torch.int32, device="cuda")
        for (variant, configs), merged in itertools.product(space.items(), (False, True)):
            if merged and variant != "subnormal":
                continue
            for cfg in configs:
                def run(cfg: Any = cfg, variant: str = variant, k_codes: Any = kc, v_codes: Any = vc,
                        merged: bool = merged) -> torch.Tensor:
                    return decode_attention(q, k_codes, v_codes, scale, scale, length, fmt, d**-0.5, config=cfg,
                                            variant=variant, merge_counters=counters if merged else None)

                try:
                    out = run()
                    t = gtime([lambda c=cfg, v=variant, kv=kv: run(c, v, *kv) for kv in codes])
                except Exception as error:
                    print("skip", variant, cfg, merged, type(error).__name__, str(error)[:100], flush=True)
                    continue
                results.append({"variant": variant, "cfg": cfg, "merged": merged, "us": t, "ratio": t / sdpa,
                                "rel_err": rel(out, reference), "counters_left": int(counters.abs().sum())})
        results.sort(key=lambda r: r["us"])
        with pdl_setting(False):  # the default without programmatic dependent launch, its splits combined
            no_pdl = gtime([lambda kv=kv: run(None, next(iter(space)), *kv, merged=False) for kv in codes])
        floor = read_floor(codes)
        defaults = [r for r in results if r["cfg"] is None]
        rows.append({"ctx": ctx, "sdpa_us": sdpa, "default": next(r for r in defaults if not r["merged"]),
                     "default_merged": next((r for r in defaults if r["merged"]), None),
                     "default_without_pdl_us": no_pdl, "read_floor": floor,
                     "read_floor_ratio": floor["read_us"] / sdpa,
                     "best": results[:6], "all": results})
        print({k: v for k, v in rows[-1].items() if k != "all"}, flush=True)
    return rows


def read_floor(codes: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """The fastest of a few grids of one kernel that only reads the K and V codes (each call its own copy, as the
    decode kernels are timed), and the same launch reading nothing: the floor under any decode kernel in this
    harness, in µs."""
    from benchmarks._read_floor_triton import read_words

    n_words = codes[0][0].numel() // 4
    out = torch.empty(2112, dtype=torch.int32, device=codes[0][0].device)

    def launch(k: torch.Tensor, v: torch.Tensor, programs: int, block: int, empty: bool = False) -> None:
        read_words[(programs,)](k.view(torch.int32), v.view(torch.int32), out, n_words, BLOCK=block, EMPTY=empty,
                                num_warps=4, enable_fp_fusion=True)

    grids = {(p, b): gtime([lambda p=p, b=b, kv=kv: launch(*kv, p, b) for kv in codes])
             for p in (132, 264, 528, 1056, 2112) for b in (512, 1024)}
    (programs, block), best = min(grids.items(), key=lambda item: item[1])
    empty = gtime([lambda kv=kv: launch(*kv, 132, 512, True) for kv in codes])
    return {"read_us": best, "programs": programs, "block_words": block, "empty_launch_us": empty,
            "read_tb_s": 8 * n_words / best / 1e6}


def gemv_floor(shapes: list[str] | None = None) -> list[dict[str, Any]]:
    """Per shape of SHAPES (g128, one row, weights from HBM): bf16 cuBLAS, the tuner's pick, and the read floor of
    the packed weight + scales (their bytes as one buffer split in two halves for :func:`read_floor`)."""
    from mmsdk.kernels import l2_spill_copies
    from mmsdk.kernels.w4a16 import w4a16_gemv

    rows = []
    for name in shapes or SHAPES:
        p, x, _, bf16_us = _one_row_problem(name)
        tuned = gtime(cold(lambda q, s: w4a16_gemv(x, q, s, None, 128), p.qweight, p.scales))
        data = torch.cat([p.qweight.reshape(-1).view(torch.uint8), p.scales.reshape(-1).view(torch.uint8)])
        half = -(-data.numel() // 32) * 16  # two halves, each 16-byte aligned (the floor reads int32 words of both)
        data = torch.nn.functional.pad(data, (0, 2 * half - data.numel()))
        floor = read_floor([tuple(copy.split(half)) for (copy,) in l2_spill_copies((data,))])
        rows.append({"shape": name, "bytes": data.numel(), "bf16_us": bf16_us, "tuned_us": tuned,
                     "floor": floor, "tuned_over_floor": tuned / floor["read_us"],
                     "bf16_over_floor": bf16_us / floor["read_us"], "goal_3x_us": bf16_us / 3})
        print(rows[-1], flush=True)
    return rows


# (heads per program, warps) of the RoPE kernel (mmsdk.kernels.norm_rope_gpu.rope_tile picks one per call)
ROPE_TILES = [(32, 4), (32, 8), (16, 2), (16, 4), (8, 1), (8, 2), (4, 1), (2, 1), (1, 1)]


def rope(rounds: int = 5) -> list[dict[str, Any]]:
    """RoPE on LLaVA-1.5-7B's 32 q + 32 k heads of 128 (bf16, [1, H, L, D]) at 1, 16 and 4096 tokens: every tile
    of ROPE_TILES and the default pick, against Liger's ``liger_rotary_pos_emb`` (in place) and the eager reference.
    At one token a launch takes ~1.5 µs and single timings move by ~0.2 µs, so every candidate is timed ``rounds``
    times, interleaved, and the median kept. Inputs are small enough at one token to stay in L2, as in
    gpu_suite.py's norm section."""
    import statistics

    from mmsdk.kernels import norm_rope as ref
    from mmsdk.kernels import norm_rope_gpu as gpu

    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception as error:  # liger missing: its column stays empty
        print("liger unavailable:", error)
        liger_rotary_pos_emb = None
    rows = []
    for tokens in (1, 16, 4096):
        q = torch.randn(1, 32, tokens, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 32, tokens, 128, device="cuda", dtype=torch.bfloat16)
        angles = torch.randn(1, tokens, 64, device="cuda") * 100
        cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
        expected = ref.rope_qk(q, k, cos, sin)
        calls = {"default": lambda: gpu.rope_qk(q, k, cos, sin), "eager": lambda: ref.rope_qk(q, k, cos, sin)}
        calls |= {tile: lambda t=tile: gpu._rope(q, k, cos, sin, 1, None, (0.0, 0.0), t) for tile in ROPE_TILES}
        if liger_rotary_pos_emb is not None:
            lq, lk = q.clone(), k.clone()
            calls["liger"] = lambda: liger_rotary_pos_emb(lq, lk, cos, sin)
        times: dict[Any, list[float]] = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                times[name].append(gtime(call))
        us = {name: statistics.median(t) for name, t in times.items()}
        row: dict[str, Any] = {"tokens": tokens, "default_tile": gpu.rope_tile(tokens, 32, 32, 64),
                               "default_us": us["default"], "eager_us": us["eager"], "liger_us": us.get("liger"),
                               "rounds": {str(name): t for name, t in times.items()}, "tiles": []}
        for tile in ROPE_TILES:
            got = gpu._rope(q, k, cos, sin, 1, None, (0.0, 0.0), tile)
            row["tiles"].append({"tile": tile, "us": us[tile],
                                 "rel_err": max(rel(got[0], expected[0]), rel(got[1], expected[1]))})
        row["best"] = min(row["tiles"], key=lambda t: t["us"])
        print({k: v for k, v in row.items() if k != "rounds"}, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sweeps.json")
    parser.add_argument("--shapes", default="", help="comma-separated keys of SHAPES for the tiles and idot sections "
                        "(all by default)")
    parser.add_argument("--sections", default="tiles,gqa", help="comma-separated: tiles, step_gemvs, step_norms, "
                        "step_folds, step_left_norm, mma, many_rows, pdl, gqa, gqa_batch4, gqa_batch8, "
                        "gqa_bytes_batch, mha, idot, idotr, gated, rope, gemv_floor")
    args = parser.parse_args()
    results: dict[str, Any] = {"command": "python benchmarks/gpu_kernel_sweeps.py --sections " + args.sections
                               + (f" --shapes {args.shapes}" if args.shapes else "")}
    shapes = [s for s in args.shapes.split(",") if s] or None
    sections = {"tiles": lambda: tiles(shapes), "step_gemvs": step_gemvs, "step_norms": step_norms,
                "step_folds": step_folds, "step_left_norm": step_left_norm,
                "mma": mma, "many_rows": many_rows, "pdl": pdl, "gqa": gqa, "gqa_batch4": lambda: gqa_batch(4),
                "gqa_batch8": lambda: gqa_batch(8), "gqa_bytes_batch": gqa_bytes_batch, "mha": mha,
                "idot": lambda: idot(shapes), "idotr": lambda: idot(shapes, True), "gated": gated, "rope": rope,
                "gemv_floor": lambda: gemv_floor(shapes)}
    run_sections(results, args.sections.split(","), lambda name, _: sections[name](), args.out)


if __name__ == "__main__":
    main()
