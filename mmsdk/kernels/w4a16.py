"""W4A16 matmul that reads mmsdk's packed INT4 weights (ONNX MatMulNBits layout) directly.

The layout (see mmsdk/plugins/quantizers/packing.py): ``qweight`` uint8 ``[N, K/G, G/2]`` (even k
in the low nibble), ``scales`` ``[N, K/G]``, optional ``zero_points`` uint8 ``[N, ceil(K/G / 2)]``
(block ``2j`` in the low nibble of byte ``j``; absent means 8). ``w = (q - zero_point) * scale``.

* Up to ``GEMV_MAX_M`` rows (decode): a split-K GEMV. Each program owns ``BLOCK_N`` output columns
  and one slice of K, reads the packed bytes as int32 words (8 nibbles each; the MatMulNBits layout
  is K-contiguous per output row, so these loads coalesce without any reordering), loads each
  group's scale once and multiplies in registers (or on the tensor cores for more rows); with
  several K slices a small second kernel sums the fp32 partials. Splitting K keeps enough programs
  in flight to reach memory bandwidth on a chip with 132 multiprocessors.
* Up to ``FUSED_MAX_M`` rows: a tensor-core GEMV over blocks of 16 rows (kind "mma", group sizes >= 32), else one
  fused kernel. The fused kernel's programs each own ``BLOCK_N`` output columns, walk K in ``BLOCK_K`` steps,
  dequantize the even and odd nibbles in registers and multiply them with the even and odd activation columns on
  the tensor cores. Nothing but the packed bytes, the scales and the activations is read; no weight copy exists
  outside registers.
* More rows (prefill): the weight is dequantized once per call into a transient bf16/fp16 tensor
  by a Triton kernel and multiplied by cuBLAS (the tensor cores' best kernel; the copy lives only for that call).
  At 64 rows this is faster on the GPU too (H200, Llama-3.2-11B's shapes, g32, benchmarks/gpu_prefill_linear.py:
  gate_proj 81 µs against the tuned GEMV's 97, q_proj 21 against 35; 33-63 rows were not measured, at 32 the GEMV
  is faster on the large shapes, 58 against 79 µs), and it is one Triton launch where the GEMV takes two: an eager
  call (a short prompt's prefill) costs 40-70 µs of host time against 105-180.

For 2-16 rows (batched decode) the fastest candidates are the tensor-core GEMV (kind "mma", _gemv_mma_triton.py: the
packed bytes converted to bf16/fp16 in the tensor cores' operand layout, one lop3 per two nibbles).

For one row the GEMV candidates are mostly the quad kernel (``gemv_quad`` in _gemv_quad_triton.py:
16-byte weight and activation loads, and a nibble masked in place and read as an fp32 bit pattern is
an exact subnormal, so each nibble costs one AND and one FMA) and its integer-dot twin (kind "idot",
mmsdk.kernels.gemv_idot: the activation row rounded to 16-bit integers per 32 channels by a small kernel, then four
``dp2a`` per word of 8 codes). A gated MLP's gate and up projections
run together with ``silu(gate) * up`` applied in the same launch (mmsdk.kernels.w4a16_gated).

Inside a captured CUDA graph on sm_90+ the batch-1 GEMVs use programmatic dependent launch: each program loads its
first step's weights while the kernel before it still runs (mmsdk/kernels/_pdl_triton.py).

Block configurations are chosen per shape by timing the candidates on first use (mmsdk.kernels.w4a16_tuning), each
replayed from a CUDA graph (a decode-sized kernel is shorter than its Python launch) over copies of the weights that
together overflow L2 (a model reads each layer's weights from HBM), one-row GEMVs each followed by an add + RMSNorm as
in a decoder layer (``w4a16_tuning.followed_by_norm``); CUDA only, and during CUDA-graph capture or under the
interpreter the first candidate is taken.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from mmsdk.kernels import note_fallback, triton_ready
from mmsdk.kernels.gemv_launch import IDOT_KINDS, QUAD_KINDS, GemvConfig, PackedWeight, launch_gemv, triton_kernels
from mmsdk.kernels.norm_fold import InputNorm, NormRequest, NormStatistics
from mmsdk.kernels.split_k import TARGET_PROGRAMS, finish_splits, gemv_splits, k_slices
from mmsdk.kernels.w4a16_tuning import fit_config, followed_by_norm, tuned_config

__all__ = ["FUSED_MAX_M", "GEMV_MAX_M", "QUAD_KINDS", "TARGET_PROGRAMS", "GemvConfig", "PackedWeight",
           "check_columns", "dequantize_packed", "finish_splits", "gemv_candidates", "gemv_ready", "gemv_row_bucket",
           "gemv_splits", "int4_linear", "k_slices", "launch_gemv", "triton_kernels", "tuned_config",
           "unsupported_reason", "w4a16_gemv", "w4a16_matmul"]

FUSED_MAX_M = 32
GEMV_MAX_M = 16
# GEMV (BLOCK_N, BLOCK_G, num_warps, BLOCK_M, KIND[, target programs]) candidates per row bucket. KIND:
# "quad" (gemv_quad: 16-byte weight and activation loads, subnormal-nibble arithmetic; BLOCK_G counts quads of
# 4 words; one row per program; group sizes >= 32), "quadp" (the same, prefetching the next step's weights), "idot"
# (the quads' tiles on integer dot products with the activations rounded to 16-bit integers per 32 channels by a
# launch of its own: mmsdk.kernels.gemv_idot; H200, benchmarks/gpu_kernel_sweeps.py idot: 15.5 against 16.6 µs for
# the best "quad" tile on a 22016 x 4096 weight, 21.7 against 24.8 on 37888 x 3584, slower on the 4096-row weights),
# "idotr" (the same with no rounding launch: each program rounds the quads it reads; on an H100,
# gpu_kernel_sweeps.py idotr, the same tile 0.4-1.3 µs faster than "idot", the best of it 4-6% faster than any other
# kind on the 12288 x 4096, 22016 x 4096 and 4096 x 11008 weights, slower than "quad" on 4096 x 4096),
# "fma" (gemv: shift-and-mask nibbles, any group size), "dot" (gemv on the tensor cores, for several rows) or "mma"
# (gemv_mma: up to 16 rows on the tensor cores, nibbles made 16-bit floats with one lop3 per pair; BLOCK_G is the
# K channels per step; group sizes >= 32).
# 4-tuples are fused-kernel configs (BLOCK_N, BLOCK_K, warps, stages). Whichever candidate times fastest for
# the shape runs. The K split count is derived from the shape: about the config's target number of programs
# (default TARGET_PROGRAMS). The first applicable entry is taken without timing (CUDA-graph capture,
# interpreter); the order follows H200 sweeps (benchmarks/gpu_kernel_sweeps.py tiles: few rows and long K
# steps, 128-256 weight bytes per thread and step, read fastest). The paired gate/up GEMV of a gated MLP
# (mmsdk.kernels.w4a16_gated) also takes kind "gated", and "idot" there: both weights' rows in one program.
# "mma" configs: (BLOCK_N, K channels per step, warps, BLOCK_M, "mma", target programs, num_stages); a program takes
# min(BLOCK_M, M rounded up to a power of two) activation rows, the accumulator's columns. Offline sm_90 builds of these
# tiles (Triton 3.6, benchmarks/sm90_gemv_builds.py --kernels mma), 64 weight rows per warp, take 17-18 loop
# instructions per weight word for groups of 128, 20-21 for 64 and 23-25 for 32 at up to 8 rows (against 27 for
# "quad" at one row), 20-38 at 16 rows, where 64 x 256 x 1 (g128) and 128 x 256 x 2 (g128, 8 rows) spill a few
# registers. On the H200 (benchmarks/gpu_kernel_sweeps.py mma) they run 4 and 16 rows 1.5-5.7x faster than the fused
# and "dot" kernels, and one row 1.16-3x slower than "quad" (fewer instructions, yet not faster: one row is not bound
# by instruction issue alone), so the one-row bucket does not time them (each candidate adds to the first call).
_MMA_CANDIDATES = ((256, 128, 4, 16, "mma", 528, 2), (64, 128, 1, 16, "mma", 1056, 2), (128, 128, 2, 16, "mma", 528, 2),
                   (128, 256, 2, 16, "mma", 528, 2), (64, 256, 1, 16, "mma", 1056, 2), (512, 128, 8, 16, "mma", 264, 2),
                   (128, 128, 2, 16, "mma", 1056, 2))
# One row: the 264-program tiles keep a 7B shape's K in one slice (8-row tiles); timed as the step runs them (each call
# followed by a norm: followed_by_norm), one slice won for LLaVA-1.5-7B's g32 down projection and lost for Qwen2-VL-7B's
# g128 one (benchmarks/gpu_kernel_sweeps.py step_norms).
_GEMV_CANDIDATES: dict[int, tuple[tuple[Any, ...], ...]] = {
    1: ((8, 128, 4, 1, "quad", 528), (16, 64, 2, 1, "quad", 528), (8, 64, 2, 1, "quad", 528),
        (8, 128, 4, 1, "quad", 264), (8, 128, 2, 1, "quad", 264),
        (16, 32, 2, 1, "quad", 528), (16, 64, 4, 1, "quad", 528), (32, 16, 4, 1, "quad", 264),
        (8, 64, 2, 1, "quadp", 528), (32, 16, 4, 1, "quadp", 528),
        (16, 64, 4, 1, "idot", 528), (16, 128, 4, 1, "idot", 528), (16, 32, 2, 1, "idot", 528),
        (16, 32, 2, 1, "idotr", 528), (16, 64, 4, 1, "idotr", 528), (32, 32, 4, 1, "idotr", 528),
        (16, 2, 4, 1, "fma"), (32, 2, 4, 1, "fma")),
    # the fused kernel and "fma" / "dot" stay for groups of 16, which "mma" cannot take
    4: (*_MMA_CANDIDATES, (64, 256, 4, 3), (16, 2, 4, 4, "fma")),
    16: (*_MMA_CANDIDATES, (64, 256, 4, 3), (32, 1, 4, 16, "dot")),
}
DTYPES = (torch.bfloat16, torch.float16)
# (BLOCK_N, BLOCK_K, num_warps, num_stages) candidates per row bucket; BLOCK_K is raised to the group size.
_CANDIDATES: dict[int, tuple[tuple[int, int, int, int], ...]] = {
    16: ((32, 256, 4, 4), (16, 512, 4, 3), (32, 512, 4, 3), (64, 256, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3)),
    32: ((64, 128, 4, 3), (32, 256, 4, 3), (128, 128, 8, 3)),
    64: ((64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4)),
}
# Tensor-core GEMV configs for 17-64 rows of w4a16_matmul (int4_linear sends it 17-32; blocks of 16 rows, each block
# reading the weights again; 32- and 64-row blocks spill in offline sm_90 builds). On the H200
# (benchmarks/gpu_kernel_sweeps.py many_rows) the best of them runs the 7B shapes 1.3-13x faster than the best fused
# config at 32 and 64 rows, so the fused configs are timed only where these cannot run (groups of 16, weights not
# readable as int32 words).
_MMA_MANY_ROWS = ((64, 128, 1, 16, "mma", 1056, 2), (128, 128, 2, 16, "mma", 528, 2), (64, 256, 1, 16, "mma", 1056, 2))


def unsupported_reason(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block_size: int) -> str | None:
    """Why the Triton path cannot take these inputs (None when it can)."""
    if not triton_ready(x, qweight, scales):
        return "inputs are not CUDA tensors on one device, or Triton is missing"
    if x.dtype not in DTYPES:
        return f"activation dtype {x.dtype} (the kernel takes bfloat16 or float16)"
    if block_size < 16 or block_size & (block_size - 1):
        return f"group size {block_size} (the kernel takes powers of two >= 16)"
    if qweight.dtype != torch.uint8 or qweight.dim() != 3 or qweight.shape[-1] * 2 != block_size:
        return f"qweight {tuple(qweight.shape)} {qweight.dtype} is not uint8 [N, K/{block_size}, {block_size // 2}]"
    return None


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    in_features: int,
    block_size: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    input_norm: InputNorm | None = None,
    leave: NormRequest | None = None,
    input_statistics: NormStatistics | None = None,
) -> torch.Tensor | None:
    """``x @ W.T + bias`` on the GPU, or None when the Triton path cannot run (the caller falls back).

    With ``residual`` (the output's shape): ``residual + (x @ W.T + bias)``, bitwise what torch gives for the
    two steps; the batch-1 GEMVs add it in their last store instead of a separate kernel. With ``input_norm``
    ``x`` is that norm's input: the product is ``input_norm.normalize(x) @ W.T + bias``, the norm folded into the
    batch-1 GEMV (mmsdk.kernels.norm_fold) and run as its own kernel before the others. ``leave`` asks the GEMVs'
    store (with a residual folded into it) to leave the statistics of the RMSNorm that reads the output
    (:class:`~mmsdk.kernels.norm_fold.NormRequest`; its ``statistics`` stay None where the kernel run cannot).
    ``input_statistics`` (with ``input_norm``, one row): what the store of ``x`` left for that norm; a batch-1 GEMV of
    kind "idot" / "idotr" then reads ``input_statistics.scaled`` and scales its sums, the others fold ``input_norm``.
    """
    reason = unsupported_reason(x, qweight, scales, block_size)
    if reason is not None:
        note_fallback("w4a16", reason)
        return None
    flat = x.reshape(-1, in_features)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    shape = (*x.shape[:-1], qweight.shape[0])
    foldable = residual is not None and residual.shape == shape and residual.dtype == x.dtype
    if flat.shape[0] <= GEMV_MAX_M and gemv_ready(qweight):
        rows = residual.reshape(flat.shape[0], -1).contiguous() if foldable else None  # type: ignore[union-attr]
        out = w4a16_gemv(flat, qweight, scales, zero_points, block_size, bias, residual=rows, norm=input_norm,
                         leave=leave if rows is not None else None, statistics=input_statistics)
        if rows is not None:
            return out.reshape(shape)
    elif flat.shape[0] <= FUSED_MAX_M:
        flat = flat if input_norm is None else input_norm.normalize(flat)
        out = w4a16_matmul(flat, qweight, scales, zero_points, block_size, bias)
    else:
        flat = flat if input_norm is None else input_norm.normalize(flat)
        weight = dequantize_packed(qweight, scales, zero_points, in_features, block_size, x.dtype)
        out = torch.nn.functional.linear(flat, weight, None if bias is None else bias.to(x.dtype))
    out = out.reshape(shape)
    return out if residual is None else residual + out


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    block_size: int,
    bias: torch.Tensor | None = None,
    config: tuple[Any, ...] | None = None,
) -> torch.Tensor:
    """Fused kernel: ``x`` [M, K] (bf16/fp16, contiguous) times the packed weight, ``[M, N]`` in x's dtype.

    ``config`` is a fused-kernel config (BLOCK_N, BLOCK_K, warps, stages) or, for 17-64 rows, a kind "mma" GEMV config
    (see ``_MMA_MANY_ROWS``); None lets the tuner choose among both.
    """
    m, k_in = x.shape
    n, k_blocks, _ = qweight.shape
    kp = k_blocks * block_size
    check_columns(k_in, kp)
    bucket = 16 if m <= 16 else (32 if m <= 32 else 64)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    # whether the tensor-core candidates apply is part of the problem: a choice made for a contiguous weight must not
    # be replayed on one whose bytes cannot be read as rows of K/2
    many_rows_mma = bucket > 16 and block_size >= 32 and gemv_ready(qweight)
    key = (bucket, n, kp, block_size, x.dtype, zero_points is not None, bias is not None, many_rows_mma)

    def launch(cfg: tuple[Any, ...], weight: PackedWeight) -> None:
        if len(cfg) > 4:  # a tensor-core GEMV over blocks of 16 rows
            launch_gemv(x, *weight, bias, out, block_size, cfg, None)
        else:
            _launch_fused(x, *weight, bias, out, block_size, bucket, cfg)

    weight = (qweight, scales, zero_points)
    candidates = _MMA_MANY_ROWS if many_rows_mma else _CANDIDATES[bucket]
    launch(config or tuned_config(key, launch, candidates, block_size, weight), weight)
    return out


def check_columns(k_in: int, packed_k: int) -> None:
    """Refuse activations wider than the packed weight (which holds K rounded up to whole groups)."""
    if k_in > packed_k:
        raise ValueError(f"x has {k_in} columns but the packed weight holds only {packed_k}: pass activations with "
                         "the layer's in_features columns.")


def gemv_ready(qweight: torch.Tensor) -> bool:
    """True when the packed bytes can be read as int32 words in place (contiguous, 4-byte aligned)."""
    return qweight.is_contiguous() and qweight.data_ptr() % 4 == 0 and qweight.shape[-1] % 4 == 0


def w4a16_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    block_size: int,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    splits: int | None = None,
    residual: torch.Tensor | None = None,
    norm: InputNorm | None = None,
    leave: NormRequest | None = None,
    statistics: NormStatistics | None = None,
) -> torch.Tensor:
    """Split-K GEMV: ``x`` [M <= 16, K] (bf16/fp16, contiguous) times the packed weight, ``[M, N]``.

    ``config`` is (BLOCK_N, BLOCK_G, num_warps, BLOCK_M, KIND[, target programs]) with KIND "quad",
    "fma" or "dot" (see ``_GEMV_CANDIDATES``); ``splits`` the number of K slices (derived from the
    shape when None). ``residual`` (contiguous ``[M, N]``, x's dtype) is added to the product and ``norm``
    applied to ``x`` first, and ``leave`` asked for, as :func:`int4_linear` describes. ``statistics`` (with ``norm``):
    what the store of ``x`` left for that norm, read by the "idot" / "idotr" configs instead of ``x`` and the norm
    (the others fold ``norm``; ``statistics.read`` says which ran). Such a GEMV has a tuning key of its own (its last
    item "statistics" instead of True).
    """
    m, k_in = x.shape
    if statistics is not None:
        _check_statistics(statistics, norm, x)
    n, k_blocks, _ = qweight.shape
    check_columns(k_in, k_blocks * block_size)
    bucket = gemv_row_bucket(m)
    key = ("gemv", bucket, n, k_blocks, block_size, x.dtype, zero_points is not None, bias is not None,
           "statistics" if statistics is not None else norm is not None)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)

    def launch(cfg: tuple[Any, ...], weight: PackedWeight) -> None:
        if len(cfg) == 4:  # a fused-kernel candidate
            _launch_fused(x if norm is None else norm.normalize(x), *weight, bias, out, block_size, 16, cfg)
            if residual is not None:
                out.add_(residual)  # bf16 + bf16 in fp32, rounded once: the same as residual + out
        elif statistics is not None and cfg[4] in IDOT_KINDS:
            launch_gemv(statistics.scaled, *weight, bias, out, block_size, cfg, splits, residual=residual, leave=leave,
                        row_scale=statistics)
        else:
            launch_gemv(x, *weight, bias, out, block_size, cfg, splits, residual=residual, norm=norm, leave=leave)

    weight = (qweight, scales, zero_points)
    timed = followed_by_norm(launch, out) if bucket == 1 else launch
    chosen = config or tuned_config(key, timed, gemv_candidates(bucket, block_size), block_size, weight)
    if leave is not None:
        leave.statistics = None  # the tuner's trial launches (on copies of the weight) may have set them
    if statistics is not None:  # q, k and v as three GEMVs get the same statistics: any one reading them counts
        statistics.read = statistics.read or (len(chosen) > 4 and chosen[4] in IDOT_KINDS)
    launch(chosen, weight)
    return out


def _check_statistics(statistics: NormStatistics, norm: InputNorm | None, x: torch.Tensor) -> None:
    """Statistics stand in for a folded norm on one row: the norm itself must come too (for the kinds that cannot
    read them), and they must be of ``x``."""
    if norm is None or norm.prequant is not None:
        raise ValueError("norm statistics stand in for a folded RMSNorm without an AWQ pre-scale: pass that norm as "
                         "well (norm=), for the GEMV kinds that cannot read the statistics, or no statistics.")
    if x.shape[0] != 1 or statistics.scaled.shape != x.shape or statistics.scaled.device != x.device:
        raise ValueError(f"norm statistics of {tuple(statistics.scaled.shape)} on {statistics.scaled.device} are not "
                         f"those of an activation row {tuple(x.shape)} on {x.device}: a store leaves them for one row, "
                         "pass them with that row.")


def gemv_row_bucket(rows: int) -> int:
    """The candidate list (and tuning key) a GEMV of ``rows`` activation rows (at most ``GEMV_MAX_M``) uses."""
    return 1 if rows == 1 else (4 if rows <= 4 else 16)


@cache
def gemv_candidates(bucket: int, group: int) -> tuple[tuple[Any, ...], ...]:
    """The bucket's candidates that take this group size (the quad and integer-dot kinds read whole 4-word quads,
    "mma" needs 16 channels per half group: groups >= 32)."""
    return tuple(c for c in _GEMV_CANDIDATES[bucket]
                 if len(c) == 4 or c[4] not in (*QUAD_KINDS, *IDOT_KINDS, "mma") or group >= 32)


def _launch_fused(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                  bias: torch.Tensor | None, out: torch.Tensor, group: int, block_m: int,
                  cfg: tuple[int, int, int, int]) -> None:
    import triton

    block_n, block_k, warps, stages = fit_config(cfg, group)
    m, k_in = x.shape
    n, k_blocks, _ = qweight.shape
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    triton_kernels().fused[grid](
        x, qweight, scales, zero_points if zero_points is not None else scales, bias if bias is not None else scales,
        out, m, n, k_in, k_blocks * group, x.stride(0), out.stride(0),
        zero_points.stride(0) if zero_points is not None else 0,
        GROUP=group, HAS_ZP=zero_points is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, enable_fp_fusion=True,
    )


def dequantize_packed(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    in_features: int,
    block_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The ``[N, in_features]`` weight in ``dtype``, unpacked by one Triton kernel (transient, for prefill)."""
    import triton

    n, k_blocks, _ = qweight.shape
    out = torch.empty(n, in_features, device=qweight.device, dtype=dtype)
    block_n, block_k = 32, max(256, block_size)
    grid = (triton.cdiv(n, block_n), triton.cdiv(in_features, block_k))
    triton_kernels().dequant[grid](
        qweight, scales, zero_points if zero_points is not None else scales, out, n, in_features,
        k_blocks * block_size, zero_points.stride(0) if zero_points is not None else 0,
        GROUP=block_size, HAS_ZP=zero_points is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        enable_fp_fusion=True,
    )
    return out
