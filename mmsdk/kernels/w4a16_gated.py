"""A gated MLP's INT4 gate and up projections for one token: ``silu(x @ Wg.T) * (x @ Wu.T)`` in one GEMV launch.

For 2-16 tokens too (batched decode): kind ``"mma"``, the tensor-core GEMV of few rows with each program the same
rows of both weights (``MMSDK_PAIRED_ROWS=0`` turns that off: two GEMVs, their K-slice sums, a SiLU and a multiply).

Three kinds of configuration (GEMV configs as in mmsdk.kernels.w4a16, ``(BLOCK_N, BLOCK_C quads, warps, 1,
KIND[, target programs])``); the tuner times every kind per shape (key ``("gated", ...)``) and keeps the first, in
candidate order, within ``GATED_WITHIN`` of the fastest (on a GPU with step-measured configs,
mmsdk.kernels.step_configs answers for the shapes it covers):

* ``"gated"`` (``gemv_quad_gated``): each program computes the same output rows of both weights (two
  accumulators; a step's activations are loaded and split by nibble once for both weights' words). The
  K slices are counted from N rows, and with one slice (LLaVA-7B and Qwen2-VL-7B MLPs at every gated tile:
  688-2368 row blocks against a 528-program target) the program stores ``silu(gate) * up`` itself: one
  launch, no fp32 partials. Several slices store both partials and :func:`split_gated` finishes.
* ``"idot"`` (``gemv_idot_gated``, mmsdk.kernels.gemv_idot): the "gated" layout on integer dot products: the
  activation row rounded to 16-bit integers per 32 channels by a small kernel of its own (PDL-launched; the GEMV
  loads both weights' first step before waiting for it), then a ``dp2a`` chain per weight and quad. With the
  statistics o_proj's store left (``statistics``) the rounded row is the norm's input times its weight and both
  products are scaled by ``1 / rms`` at the end, as in the "gated" kind; a norm to fold (``norm``) is applied by
  the rounding kernel. Two launches (the rounding kernel and the GEMV). On the H200 it ran both 7B decode steps
  faster than the "gated" kind (LLaVA-1.5-7B g32 1.768 against 1.804 ms, Qwen2-VL-7B g128 1.883 against 2.001;
  docs/benchmarks.md, twenty-first pass), where alone it was level on LLaVA's MLP and 9% faster on Qwen2-VL's.
* ``"quad"`` / ``"quadp"`` (``gemv_quad`` with ``PAIRED``): programs split between the two weights, so each
  holds one product and the launch always ends with the ``split_gated`` epilogue (two launches). Kept as a
  candidate because on paper it may still win where the gated kind is weak: a gated tile holds two word
  tiles per step (more registers than the same per-weight tile: benchmarks/sm90_gemv_builds.py), and at one
  slice it launches half as many programs, each twice as long, so its last wave of programs is coarser;
  where K must be split anyway (small N) it needs twice the slices for the same program count, with twice
  the partials to write and sum. On the H200 the "gated" kind won on both 7B MLPs (LLaVA 11008x4096:
  16.7 against 18.6 µs for the tuned per-weight kernel and its epilogue; Qwen2-VL 18944x3584: 25.7 against
  28.4; benchmarks/results/h200_kernel_sweeps_merge.json, tiles section).

SiLU and the product run in fp32 and are rounded once (transformers rounds the SiLU output and the product to
the model dtype separately: the difference is one bf16 rounding).
"""

from __future__ import annotations

from functools import cache

import torch

from mmsdk.kernels import note_fallback, paired_rows_enabled, pdl_preload_ready
from mmsdk.kernels.gemv_idot import launch_idot_gated
from mmsdk.kernels.gemv_launch import IDOT_KINDS, launch_paired_mma
from mmsdk.kernels.norm_fold import InputNorm, NormStatistics, norm_arguments, row_scale_arguments
from mmsdk.kernels.w4a16 import (
    GEMV_MAX_M,
    QUAD_KINDS,
    TARGET_PROGRAMS,
    GemvConfig,
    PackedWeight,
    check_columns,
    finish_splits,
    gemv_candidates,
    gemv_row_bucket,
    gemv_ready,
    k_slices,
    launch_gemv,
    triton_kernels,
    tuned_config,
    unsupported_reason,
)

__all__ = ["PAIRED_KINDS", "gated_key", "gated_silu_reason", "w4a16_gated_silu"]

PAIRED_KINDS = ("gated", *IDOT_KINDS, *QUAD_KINDS, "mma")
# "gated" tiles (rows, quads, warps): the per-weight tiles that read fastest on the H200 and a one-warp tile, here
# with twice their weight bytes per thread and step, in the order they measured on the 7B MLPs (H200: 8x64x2 within
# 2% of the best on both, 8x32x1 best on LLaVA, 16x64x2 30-40% slower). Offline sm_90 builds (g128, Triton 3.6,
# benchmarks/sm90_gemv_builds.py, with each quad's nibbles as one FMA chain): 8x128x4, 8x64x2 and 8x32x1 166-168
# registers, 16x64x2 255, none spill (4x128x1 spills; 4x64x1, 168 registers for 8x32x1's bytes, left out untimed);
# Triton 3.9 gives all of them 255 registers (16x64x2 and 4x128x1 spilling).
# The 528-program target leaves the 7B MLPs one K slice (direct store). The per-weight "quad" candidates follow (see
# the module docstring).
# Alone the three small tiles time within a few percent of each other, and which one the tuner kept changed from one
# process to the next, while in the decode step they rank by group size (H200, benchmarks/gpu_decode_reuse.py
# --search, each tile pinned in the replayed step): LLaVA-1.5-7B g32 8x32x1 1.816 ms, 8x64x2 1.846, 8x128x4 1.872;
# Qwen2-VL-7B g128 8x128x4 2.107, 8x64x2 2.165, 8x32x1 2.204 (16x64x2 2.50 / 2.92). So the tiles are listed in the
# step's order for the group size, and the tuner keeps the first that times within GATED_WITHIN of the fastest
# (after the "idot" tile below, which beat them all in the step).
_GATED_TILES = {32: ((8, 32, 1), (8, 64, 2), (8, 128, 4), (16, 64, 2)),
                128: ((8, 128, 4), (8, 64, 2), (8, 32, 1), (16, 64, 2))}
GATED_WITHIN = 0.03
# Kind "idot" tiles (rows, quads, warps) for both weights: 128 weight bytes per thread and step, 128 registers, no
# spills in offline sm_90 builds (Triton 3.9, g128, the norm's statistics applied: benchmarks/sm90_gemv_builds.py
# --kernels idot_gated), 10.3-11.5 SASS instructions per weight word against 22.5-22.6 for the "gated" tiles above
# (an "idot" tile of 256 bytes per thread, 8 x 64 x 2, takes all 255 registers). In the decode step (H200, each tile
# pinned in the replayed step, gpu_decode_reuse.py --search --projections gated, two processes) 8 x 64 x 4 led both
# 7B MLPs in the first and LLaVA's in the second, where Qwen2-VL's 4 x 64 x 2 was 7 µs ahead, within the spread:
# LLaVA-1.5-7B g32 1.764-1.768 ms against 1.804 for the best "gated" tile (4 x 32 x 1 1.797, 8 x 32 x 2 1.817-1.824,
# 4 x 64 x 2 1.845, 16 x 32 x 4 1.871), Qwen2-VL-7B g128 1.883-1.894 against 2.001 (4 x 64 x 2 1.887, 4 x 32 x 1
# 1.895, 16 x 32 x 4 1.921-1.929, 8 x 32 x 2 1.927-1.935); 32 x 32 x 8, 8 x 128 x 8 and 8 x 64 x 8 ran 1.86-2.18 ms
# and were dropped. So 8 x 64 x 4 leads the candidates (taken untimed under a capture, and kept by the tuner when it
# times within GATED_WITHIN of the fastest); the other "idot" tiles follow the "gated" ones.
# The first two also run as kind "idotr" (no rounding launch). In the H100's decode step (forty-first pass,
# h100_step_search_gated_idotr_41.json) they were level with the step's picks, not faster: LLaVA-1.5-7B g32 4 x 64 x 2
# 2.035 ms against 2.008 for "gated" 8 x 32 x 1; Qwen2-VL-7B g128 4 x 64 x 2 2.161 against 2.161 for "idot" 4 x 64 x 2.
_IDOT_GATED_TILES = ((8, 64, 4), (4, 64, 2), (4, 32, 1), (16, 32, 4), (8, 32, 2))


def gated_silu_reason(x: torch.Tensor, gate: PackedWeight, up: PackedWeight, block_size: int) -> str | None:
    """Why :func:`w4a16_gated_silu` cannot take these inputs (None when it can)."""
    reason = unsupported_reason(x, gate[0], gate[1], block_size) or unsupported_reason(x, up[0], up[1], block_size)
    if reason is not None:
        return reason
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    if rows > GEMV_MAX_M or (rows > 1 and not paired_rows_enabled()):
        # one message for every row count: the fallback log says each reason once
        return (f"more than {GEMV_MAX_M} activation rows, or 2-{GEMV_MAX_M} with MMSDK_PAIRED_ROWS=0 (the paired "
                f"GEMV is the decode kernel; unset MMSDK_PAIRED_ROWS to pair 2-{GEMV_MAX_M} rows)")
    if block_size < 32:
        return f"group size {block_size} (the paired GEMV reads 4-word quads: groups >= 32)"
    if gate[0].shape != up[0].shape or gate[1].shape != up[1].shape or gate[1].dtype != up[1].dtype:
        return "gate and up weights differ in shape or scale dtype"
    if (gate[2] is None) != (up[2] is None) or not (gemv_ready(gate[0]) and gemv_ready(up[0])):
        return "one weight has zero points and the other not, or a weight is not contiguous and 4-byte aligned"
    if gate[2] is not None and up[2] is not None and gate[2].stride() != up[2].stride():
        return "gate and up zero points are laid out differently (the kernel reads both with one row stride)"
    return None


def w4a16_gated_silu(x: torch.Tensor, gate: PackedWeight, up: PackedWeight, in_features: int, block_size: int,
                     config: GemvConfig | None = None, splits: int | None = None,
                     norm: InputNorm | None = None, statistics: NormStatistics | None = None) -> torch.Tensor | None:
    """``silu(x @ Wg.T) * (x @ Wu.T)`` for 1-16 activation rows (one with ``MMSDK_PAIRED_ROWS=0``), or None (the
    caller falls back).

    ``gate`` / ``up`` are (qweight, scales, zero_points) of two packed weights of the same shape (a gated
    MLP). One launch when the chosen configuration needs no K split (kind "gated" or "idotr"; kind "idot" adds its
    rounding launch), else a GEMV launch and a small epilogue, where transformers runs two GEMVs, two split sums, a
    SiLU and a multiply. ``config`` picks a configuration (kind one of ``PAIRED_KINDS``) instead of the tuner;
    ``splits`` the K slices. With ``norm`` ``x`` is that RMSNorm's input, normalized inside the GEMV's programs
    ("idot": by its rounding kernel, "idotr": by the GEMV's own programs; mmsdk.kernels.norm_fold); with
    ``statistics`` ``x`` is ``statistics.scaled``, an RMSNorm's input times its weight, and the products are scaled by
    its ``1 / rms`` at the end (what the kernel before left: mmsdk.kernels.norm_fold.NormStatistics).
    """
    if norm is not None and statistics is not None:
        raise ValueError("pass an RMSNorm to fold (norm=) or the statistics a store left for it (statistics=), "
                         "not both.")
    reason = gated_silu_reason(x, gate, up, block_size)
    if reason is None and statistics is not None and x.reshape(-1, x.shape[-1]).shape[0] > 1:
        reason = "norm statistics for more than one row (a store leaves them for one row only)"
    if reason is not None:
        note_fallback("w4a16 gated silu", reason)
        return None
    flat = x.reshape(-1, in_features)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    rows = flat.shape[0]
    if rows > 1 and norm is not None:  # kind "mma" does not fold a norm: one norm kernel first
        flat, norm = norm.normalize(flat), None
    n, k_blocks, _ = gate[0].shape
    check_columns(in_features, k_blocks * block_size)
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    key = gated_key(n, k_blocks, block_size, x.dtype, gate[2] is not None, norm is not None, rows)
    candidates = _paired_candidates(block_size) if rows == 1 else _paired_row_candidates(block_size)

    def launch(cfg: GemvConfig, weights: tuple[torch.Tensor | None, ...]) -> None:
        _launch_paired(flat, weights[:3], weights[3:], out, block_size, cfg, splits,  # type: ignore[arg-type]
                       norm, statistics)

    weights = (*gate, *up)
    launch(config or tuned_config(key, launch, candidates, block_size, weights, GATED_WITHIN), weights)
    return out.reshape(*x.shape[:-1], n)


@cache
def _paired_candidates(group: int) -> tuple[GemvConfig, ...]:
    """What the tuner times for a paired GEMV: the decode step's best "idot" tile (taken untimed under capture or the
    interpreter), the "gated" tiles in the step's order for the group size, the other "idot" tiles, the first two of
    them as kind "idotr" (no rounding launch), then the one-row "quad" kinds of the plain GEMV (groups >= 32
    throughout)."""
    per_weight = tuple(c for c in gemv_candidates(1, group) if len(c) > 4 and c[4] in QUAD_KINDS)
    tiles = _GATED_TILES[128 if group >= 128 else 32]  # groups of 64 (not measured in the step) take g32's order
    idot = tuple((*tile, 1, "idot", 528) for tile in _IDOT_GATED_TILES)
    self_rounding = tuple((*tile, 1, "idotr", 528) for tile in _IDOT_GATED_TILES[:2])
    return idot[:1] + tuple((*tile, 1, "gated", 528) for tile in tiles) + idot[1:] + self_rounding + per_weight


def gated_key(n: int, k_blocks: int, group: int, dtype: torch.dtype, zero_points: bool, norm: bool,
              rows: int) -> tuple[object, ...]:
    """The tuner's key for a paired GEMV: ``("gated", N, K groups, group, dtype, zero points, norm folded)`` for one
    row (the keys of mmsdk.kernels.step_configs' table), with the rows bucket appended for 2-16 rows."""
    key: tuple[object, ...] = ("gated", n, k_blocks, group, dtype, zero_points, norm)
    return key if rows == 1 else (*key, gemv_row_bucket(rows))


@cache
def _paired_row_candidates(group: int) -> tuple[GemvConfig, ...]:
    """What the tuner times for a paired GEMV of 2-16 rows: the plain GEMV's "mma" candidates for that many rows."""
    return tuple(c for c in gemv_candidates(16, group) if len(c) > 4 and c[4] == "mma")


def _launch_paired(x: torch.Tensor, gate: PackedWeight, up: PackedWeight, out: torch.Tensor, group: int,
                   cfg: GemvConfig, splits: int | None, norm: InputNorm | None = None,
                   statistics: NormStatistics | None = None) -> None:
    """Launch one paired configuration: ``out = silu(x @ Wg.T) * (x @ Wu.T)`` (``norm`` and ``statistics`` as
    :func:`w4a16_gated_silu` takes them)."""
    if len(cfg) < 5 or cfg[4] not in PAIRED_KINDS:
        raise ValueError(f"paired GEMV config {cfg!r}: use (BLOCK_N, BLOCK_C, warps, 1, KIND[, target programs]) "
                         f"with KIND one of {PAIRED_KINDS}.")
    if (cfg[4] == "mma") != (x.shape[0] > 1):
        raise ValueError(f"paired GEMV config {cfg!r} for {x.shape[0]} activation rows: kind 'mma' runs 2-{GEMV_MAX_M} "
                         "rows, the other kinds one.")
    if cfg[4] == "mma":
        if norm is not None or statistics is not None:
            raise ValueError("a paired 'mma' GEMV folds no norm: normalize its input first.")
        launch_paired_mma(x, gate, up, out, group, cfg, splits)
        return
    if cfg[4] in QUAD_KINDS:
        launch_gemv(x, *gate, None, out, group, cfg, splits, second=up, norm=norm, row_scale=statistics)
        return
    import triton

    block_n, block_c, warps = cfg[:3]
    (qweight, scales, zero_points), (qweight2, scales2, zero_points2) = gate, up
    m, k_in = x.shape
    n, k_blocks, _ = qweight.shape
    # one program covers rows rn of both weights: slices are counted from N rows, not the 2N of the quad kinds
    per_split, n_splits = k_slices(n, k_blocks, block_n, block_c, cfg[5] if len(cfg) > 5 else TARGET_PROGRAMS,
                                   splits)
    if cfg[4] in IDOT_KINDS:  # a norm to fold is applied by the rounding kernel ("idotr": by the GEMV's programs)
        launch_idot_gated(x, gate, up, out, group, cfg, per_split, n_splits, statistics, norm)
        return
    direct = n_splits == 1
    target = out if direct else torch.empty(n_splits, m, 2 * n, device=x.device, dtype=torch.float32)
    has_zp = zero_points is not None
    pdl = pdl_preload_ready(x)  # weights load before the wait
    triton_kernels().gemv_quad_gated[(triton.cdiv(n, block_n), n_splits, m)](
        x, qweight.view(torch.int32), scales, zero_points if has_zp else scales, qweight2.view(torch.int32), scales2,
        zero_points2 if has_zp else scales2, target, m, n, k_in, k_blocks * group // 8, per_split, x.stride(0),
        zero_points.stride(0) if has_zp else 0, GROUP=group, HAS_ZP=has_zp, DIRECT=direct, BLOCK_N=block_n,
        BLOCK_C=block_c, PDL=pdl, ROW_MASK=n % block_n != 0, launch_pdl=pdl, num_warps=warps,
        **norm_arguments(norm, x, warps, direct), **row_scale_arguments(statistics, k_in), enable_fp_fusion=True)
    if not direct:  # the partials are scaled already
        finish_splits(target, out, None, n_splits, True)
