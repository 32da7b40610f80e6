"""Triton kernels against the torch reference ops, on fresh random inputs.

On CPU the kernels run under Triton's interpreter (fp16/fp32: the interpreter mishandles bf16),
which checks their indexing and arithmetic; on CUDA the compiled kernels run in bf16.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

from mmsdk.kernels import norm_rope as ref
from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4
from mmsdk.plugins.quantizers.quantized_cache import Packed, StaticCodec
from mmsdk.plugins.quantizers.static_kv import CODE_DTYPES

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # must be set before Triton first compiles anything


@pytest.fixture(params=["interpreter", "cuda"])
def target(request):
    """(device, dtype, tolerance) for one kernel backend, skipping where it cannot run."""
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    if request.param == "cuda":
        if not CUDA:
            pytest.skip("needs an NVIDIA GPU")
        return "cuda", torch.bfloat16, 1e-2  # bf16 rounding of outputs: ~4e-3 relative
    if CUDA or not INTERPRETING:
        pytest.skip("interpreter checks run in their own process (test_kernels_under_the_interpreter)")
    from tests import _interpreter

    _interpreter.patch()
    return "cpu", torch.float16, 2e-3  # fp16 rounding: ~3e-4 relative measured


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _cases_here(cases: tuple, symmetric: bool, device: str) -> tuple:
    """The cases of a list that run in this zero-point mode. On a GPU every case runs in both. Triton's interpreter
    runs a kernel's programs one by one in Python (a minute or more for these tests in both modes), so there cases 0-1,
    4-5, ... run with symmetric weights and 2-3, 6-7, ... with zero points: every case still runs once, and a case's
    place among those kept is as odd or even as in the whole list (the tests vary the bias that way)."""
    if device != "cpu":
        return cases
    return tuple(case for index, case in enumerate(cases) if (index // 2) % 2 == (not symmetric))


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_matches_dequantized_matmul(target, symmetric):
    from mmsdk.kernels.w4a16 import dequantize_packed, int4_linear, w4a16_matmul

    device, dtype, tol = target
    for m, n, k, group in ((1, 48, 256, 128), (5, 40, 200, 64), (17, 33, 96, 32)):
        packed = quantize_int4(torch.randn(n, k, device=device), group, symmetric=symmetric, scale_dtype=dtype)
        x = torch.randn(m, k, device=device).to(dtype)
        bias = torch.randn(n, device=device).to(dtype)
        weight = dequantize_int4(packed, torch.float32)
        expected = x.float() @ weight.T + bias.float()
        config = (32, 128, 4, 1) if device == "cpu" else None
        out = w4a16_matmul(x, packed.qweight, packed.scales, packed.zero_points, group, bias, config=config)
        assert _rel(out, expected) < tol  # interpreter fp16 ~3e-4, H200 bf16 ~3e-3
        if m > 16:  # the tensor-core GEMV the tuner also times for 17-64 rows: two blocks of 16 rows
            out = w4a16_matmul(x, packed.qweight, packed.scales, packed.zero_points, group, bias,
                               config=(16, 64, 1, 16, "mma", 64, 2))
            assert _rel(out, expected) < tol
        dense = dequantize_packed(packed.qweight, packed.scales, packed.zero_points,
                                  k, group, dtype)
        assert _rel(dense, weight) < tol
        if device == "cuda":  # prefill rows go through the transient dequantized weight
            rows = torch.randn(80, k, device=device).to(dtype)
            got = int4_linear(rows, packed.qweight, packed.scales, packed.zero_points, k, group, bias)
            assert _rel(got, rows.float() @ weight.T + bias.float()) < tol


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_split_k_gemv_matches_dequantized_matmul(target, symmetric):
    from mmsdk.kernels.w4a16 import w4a16_gemv

    device, dtype, tol = target
    # (m, n, k, group, (BLOCK_N, BLOCK_G, warps, BLOCK_M, KIND[, programs]), K splits): shift-and-mask rows, tensor-core
    # rows, and the quad kernel (16-byte activation loads, subnormal nibbles) for one and two rows, split and not,
    # with K not a multiple of the group (padded layers), also with the next step's weights prefetched ("quadp") and on
    # integer dots with rounded activations ("idot"); the "mma" kernel (16-bit nibbles on the tensor cores) for 1, 5
    # and 16 rows, several groups per step or one
    cases = ((1, 40, 512, 64, (8, 4, 4, 1, "fma"), 3),
             (3, 33, 200, 32, (16, 2, 4, 4, "fma"), 2),
             (5, 24, 256, 16, (16, 2, 4, 16, "dot"), 1),
             (1, 40, 512, 64, (16, 4, 4, 1, "quad"), 2),
             (1, 33, 296, 128, (16, 8, 4, 1, "quad", 64), None),
             (2, 24, 296, 32, (8, 8, 2, 1, "quad", 64), None),
             (1, 40, 512, 64, (16, 2, 4, 1, "quadp"), 2),
             (2, 33, 296, 32, (16, 1, 4, 1, "quadp", 64), None),
             (1, 40, 512, 64, (16, 4, 4, 1, "idot"), 2),
             (1, 33, 296, 128, (16, 8, 4, 1, "idot", 64), None),
             (2, 24, 296, 32, (8, 8, 2, 1, "idot", 64), None),
             (1, 40, 512, 64, (32, 128, 4, 16, "mma"), 3),
             (5, 33, 296, 32, (16, 64, 2, 16, "mma", 64, 2), None),
             (16, 24, 256, 128, (16, 256, 1, 16, "mma"), 1))
    for m, n, k, group, config, splits in _cases_here(cases, symmetric, device):
        packed = quantize_int4(torch.randn(n, k, device=device), group, symmetric=symmetric, scale_dtype=dtype)
        x = torch.randn(m, k, device=device).to(dtype)
        bias = torch.randn(n, device=device).to(dtype)
        expected = x.float() @ dequantize_int4(packed, torch.float32).T + bias.float()
        out = w4a16_gemv(x, packed.qweight, packed.scales, packed.zero_points, group, bias, config=config,
                         splits=splits)
        assert _rel(out, expected) < tol  # interpreter fp16 ~2-3e-4, H200 bf16 ~2e-3


@pytest.mark.skipif(not CUDA or not HAS_TRITON, reason="needs an NVIDIA GPU and Triton")
def test_w4a16_mma_takes_fp16_activations():
    """The tensor-core GEMV's fp16 path (nibbles made fp16 by the 1024.0 pattern) on the compiled kernel."""
    from mmsdk.kernels.w4a16 import w4a16_gemv

    for m, group, symmetric in ((1, 32, True), (4, 128, False), (16, 64, True)):
        packed = quantize_int4(torch.randn(96, 512, device="cuda"), group, symmetric=symmetric,
                               scale_dtype=torch.float16)
        x = torch.randn(m, 512, device="cuda", dtype=torch.float16)
        expected = x.float() @ dequantize_int4(packed, torch.float32).T
        out = w4a16_gemv(x, packed.qweight, packed.scales, packed.zero_points, group,
                         config=(32, 128, 1, 16, "mma", 64, 2))
        assert out.dtype == torch.float16 and _rel(out, expected) < 2e-3, (m, group, symmetric)


@pytest.mark.parametrize("group, symmetric", [(32, True), (128, False)])
def test_integer_dot_gemv_only_rounds_the_activations(target, group, symmetric):
    """Kind "idot": the product equals the fp32 product with the activations rounded as documented (16-bit integers,
    one scale per 32 channels) and stays within the rounding's reach of the exact product, outlier channels too."""
    from mmsdk.kernels.gemv_idot import launch_idot, quantize_row_activations
    from mmsdk.kernels.w4a16 import k_slices, w4a16_gemv

    device, dtype, _ = target
    n, k = 40, 296  # K not a multiple of the group: the packed weight's last group is padded
    packed = quantize_int4(torch.randn(n, k, device=device), group, symmetric=symmetric, scale_dtype=dtype)
    x = torch.randn(1, k, device=device)
    x[:, ::37] *= 30.0  # a few outlier channels, as in a decoder's activations
    x = x.to(dtype)
    weight = dequantize_int4(packed, torch.float64)
    k_blocks = packed.qweight.shape[1]
    quads = x.double().new_zeros(1, k_blocks * group).index_copy(1, torch.arange(k, device=device), x.double())
    quads = quads.view(1, -1, 32)
    exact_levels = (quads / (quads.abs().amax(-1, keepdim=True) / 32767.0)).nan_to_num(0.0)  # padded quads: 0
    # the rounding kernel's integers (decoded from its int16 pairs) are the nearest ones, up to its fp32 unit: a
    # channel within ~1e-3 of a half may round the other way, so the product is checked against these integers
    activations = quantize_row_activations(x, k_blocks * group // 8)
    levels = _integer_levels(activations.pairs).view(1, -1, 32)
    assert (levels - exact_levels).abs().max() < 0.51
    assert torch.equal(levels.sum(-1).long(), activations.sums.view(1, -1).long())
    rounded = (levels * 16 * activations.scales.double()[..., None]).view(1, -1)[:, :k]
    for splits in (1, 2):
        out = torch.empty(1, n, device=device, dtype=torch.float32)
        per_split, n_splits = k_slices(n, k_blocks, 16, 1, 64, splits)
        launch_idot(x, packed.qweight, packed.scales, packed.zero_points, None, out, group, (16, 1, 4, 1, "idot"),
                    per_split, n_splits)
        assert _rel(out, rounded @ weight.T) < 1e-6, splits  # fp32 sums of exact integer dots: ~1e-7
        # the rounding, <= 1.5e-5 of a quad's largest activation per channel: ~5e-5 of the product with these
        # outliers (bf16's own rounding of the output: ~2e-3)
        assert _rel(out, x.double() @ weight.T) < 2e-4, splits
    small = quantize_int4(torch.randn(8, 64, device=device), 16, scale_dtype=dtype)
    with pytest.raises(ValueError, match="group size 16 < 32; use kind 'fma'"):
        w4a16_gemv(x[:, :64].contiguous(), small.qweight, small.scales, None, 16, config=(16, 1, 4, 1, "idot"))


def _integer_levels(pairs: torch.Tensor) -> torch.Tensor:
    """The rounded activations (float64 ``[M, 8 words]``) from the rounding kernel's int16 pairs: per word four int32,
    channels (0, 2), (4, 6), (1, 3), (5, 7), low half first."""
    low = (pairs << 16) >> 16  # arithmetic shifts: the halves' signs
    high = pairs >> 16
    halves = torch.stack([low, high], -1).view(pairs.shape[0], -1, 4, 2)  # [M, words, pair, half]
    order = [(0, 0), (2, 0), (0, 1), (2, 1), (1, 0), (3, 0), (1, 1), (3, 1)]  # channel j's (pair, half)
    return torch.stack([halves[:, :, p, h] for p, h in order], -1).reshape(pairs.shape[0], -1).double()


@pytest.mark.parametrize("symmetric", [True, False])
def test_self_rounding_integer_dot_gemv_gives_the_rounding_kernels_output(target, symmetric):
    """Kind "idotr" rounds each quad inside the GEMV's programs as "idot"'s rounding kernel does: without a norm the
    same output, bit for bit, for one row and two, one K slice and several, K padded past in_features, bias and
    residual. With an RMSNorm folded in (with and without an AWQ pre-scale; its 1 / rms over one pass of the row and
    three) each kernel sums the squares over its own thread layout, so on a GPU 1 / rms may differ in its last bit and
    a rare activation round the other way: the outputs agree to far below bf16's rounding."""
    from mmsdk.kernels.norm_fold import InputNorm, quad_factors
    from mmsdk.kernels.w4a16 import w4a16_gemv

    device, dtype, tol = target
    eps = 1e-5
    differing = []
    cases = ((1, 40, 512, 64, (16, 4, 4), 1, False, False), (1, 40, 512, 64, (8, 2, 2), 3, False, False),
             (2, 33, 296, 128, (16, 8, 4), None, False, False), (1, 33, 296, 32, (8, 4, 2), 2, True, False),
             (2, 40, 512, 64, (16, 4, 4), 1, True, True), (1, 24, 4352, 128, (8, 8, 2), 1, True, False))
    for m, n, k, group, tile, splits, with_norm, with_prequant in _cases_here(cases, symmetric, device):
        packed = quantize_int4(torch.randn(n, k, device=device), group, symmetric=symmetric, scale_dtype=dtype)
        x = (torch.randn(m, k, device=device) * 3 + 1).to(dtype)
        x[:, ::37] *= 30.0  # outlier channels: quads with very different units
        bias = torch.randn(n, device=device).to(dtype)
        residual = torch.randn(m, n, device=device).to(dtype)
        norm = None
        if with_norm:
            weight = (torch.rand(k, device=device) + 0.5).to(dtype)
            prequant = (torch.rand(k, device=device) + 0.5).to(dtype) if with_prequant else None
            norm = InputNorm(weight, eps, quad_factors(weight, prequant), prequant)
        outputs = [w4a16_gemv(x, packed.qweight, packed.scales, packed.zero_points, group, bias,
                              config=(*tile, 1, kind, 64), splits=splits, residual=residual, norm=norm)
                   for kind in ("idot", "idotr")]
        case = (m, k, group, tile, splits, with_norm, with_prequant)
        if not torch.equal(*outputs):
            differing.append((case, _rel(outputs[1], outputs[0])))
        expected = x.float() if norm is None else _rms_normalized(x, norm.weight, eps)
        if norm is not None and norm.prequant is not None:
            expected = expected * norm.prequant.float()
        expected = residual.float() + expected @ dequantize_int4(packed, torch.float32).T + bias.float()
        assert _rel(outputs[1], expected) < tol, case  # interpreter fp16 ~3e-4, H100 bf16 ~2.2e-3
    # the gated MLP's paired GEMV (zero points or not: the same rounding, so one of the two runs it): plain, scaled
    # by a store's norm statistics (applied after the dots: bitwise too), and with an RMSNorm folded in
    from mmsdk.kernels.norm_fold import NormStatistics
    from mmsdk.kernels.w4a16_gated import w4a16_gated_silu

    for n, k, group, tile, splits, fold in ((40, 512, 64, (8, 4, 4), 1, None), (33, 296, 32, (8, 2, 2), 3, None),
                                            (40, 512, 64, (8, 4, 4), 1, "statistics"),
                                            (33, 296, 32, (4, 4, 2), 1, "norm")) if not symmetric else ():
        x, parts, _ = _gated_problem(n, k, group, symmetric, device, dtype)
        weight = (torch.rand(k, device=device) + 0.5).to(dtype)
        extra = {}
        if fold == "statistics":  # x is then the norm's input times its weight, as the store leaves it
            squares = (x.float()[0] ** 2).view(1, 4, -1).sum(-1)  # four column blocks
            extra = {"statistics": NormStatistics((x[0] * weight).contiguous(), squares, eps)}
            x = extra["statistics"].scaled.view(1, 1, k)
        elif fold == "norm":
            extra = {"norm": InputNorm(weight, eps, quad_factors(weight))}
        outputs = [w4a16_gated_silu(x, parts[0], parts[1], k, group, config=(*tile, 1, kind, 64), splits=splits,
                                    **extra) for kind in ("idot", "idotr")]
        case = ("gated", k, group, tile, splits, fold == "norm", fold)
        if not torch.equal(*outputs):
            differing.append((case, _rel(outputs[1], outputs[0])))
    # every case is listed, so one run on a GPU shows which differ and by how much
    assert all(case[5] and rel < 1e-4 for case, rel in differing), differing


@pytest.mark.skipif(not CUDA or not HAS_TRITON, reason="needs an NVIDIA GPU and Triton")
def test_integer_dot_gemv_replays_in_a_cuda_graph():
    """Kind "idot" captured in a CUDA graph (on sm_90+ with PDL: the GEMV loads its first weights before it waits for
    the rounding kernel, which waits for the kernel before it): a GEMV, a gated MLP's paired GEMV reading its output
    and a GEMV reading that, replay to the eager results bitwise, with fresh inputs each time."""
    from mmsdk.kernels.w4a16 import w4a16_gemv
    from mmsdk.kernels.w4a16_gated import w4a16_gated_silu

    first = quantize_int4(torch.randn(512, 1024, device="cuda"), 128, scale_dtype=torch.bfloat16)
    gate, up = (quantize_int4(torch.randn(256, 512, device="cuda"), 128, scale_dtype=torch.bfloat16)
                for _ in range(2))
    second = quantize_int4(torch.randn(1024, 256, device="cuda"), 128, scale_dtype=torch.bfloat16)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    config = (16, 8, 2, 1, "idot")  # 4 steps of 8 quads per row of the first weight, 2 of the gated pair, 1 of the last

    def chain() -> torch.Tensor:
        h = w4a16_gemv(x, first.qweight, first.scales, None, 128, config=config)
        g = w4a16_gated_silu(h, (gate.qweight, gate.scales, None), (up.qweight, up.scales, None), 512, 128,
                             config=config)
        return w4a16_gemv(g, second.qweight, second.scales, None, 128, config=config)

    chain()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = chain()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        expected = chain()
        graph.replay()
        assert torch.equal(replayed, expected)


def test_w4a16_gemv_adds_a_residual_as_torch_rounds_it(target):
    """``residual + x @ W.T`` in the GEMV's last store (direct) or its K slices' sum: bitwise torch's two steps."""
    from mmsdk.kernels.w4a16 import int4_linear, w4a16_gemv

    device, dtype, _ = target
    n, k, group = 40, 512, 64
    packed = quantize_int4(torch.randn(n, k, device=device), group, scale_dtype=dtype)
    for m, config, splits in ((1, (16, 4, 4, 1, "quad"), 1), (1, (16, 4, 4, 1, "quadp"), 2),
                              (1, (16, 4, 4, 1, "idot"), 1), (2, (8, 4, 4, 1, "idot"), 2),
                              (2, (8, 4, 4, 1, "fma"), 1), (2, (8, 4, 4, 1, "fma"), 3),
                              (3, (16, 128, 4, 16, "mma"), 1), (1, (16, 128, 4, 16, "mma"), 2)):
        x = torch.randn(m, k, device=device).to(dtype)
        residual = (torch.randn(m, n, device=device) * 4).to(dtype)
        product = w4a16_gemv(x, packed.qweight, packed.scales, None, group, config=config, splits=splits)
        got = w4a16_gemv(x, packed.qweight, packed.scales, None, group, config=config, splits=splits,
                         residual=residual)
        assert torch.equal(got, residual + product), (config, splits)
    with pytest.raises(ValueError, match="residual must be a contiguous tensor"):
        w4a16_gemv(x, packed.qweight, packed.scales, None, group, config=config, residual=residual.T)
    # int4_linear: folded for the GEMV's rows, added after the product for a residual of another dtype
    x = torch.randn(1, 1, k, device=device).to(dtype)
    residual = torch.randn(1, 1, n, device=device)
    plain = int4_linear(x, packed.qweight, packed.scales, None, k, group)
    assert torch.equal(int4_linear(x, packed.qweight, packed.scales, None, k, group, residual=residual),
                       residual + plain)
    assert torch.equal(int4_linear(x, packed.qweight, packed.scales, None, k, group, residual=residual.to(dtype)),
                       residual.to(dtype) + plain)


def _rms_normalized(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` in fp32, unrounded (what a GEMV with the norm folded in multiplies)."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_gemvs_fold_an_rmsnorm_into_their_input(target, symmetric):
    """With an InputNorm the GEMVs take the norm's input and multiply its normalized rows: the quad kinds inside their
    programs (one K slice or several, one row or two, K padded past in_features, prefetching, bias, an AWQ pre-scale),
    "idot" in its rounding kernel, the other kinds after the norm kernel; the gated MLP's paired GEMV likewise (both
    products scaled)."""
    from mmsdk.kernels.norm_fold import InputNorm, quad_factors
    from mmsdk.kernels.w4a16 import int4_linear, w4a16_gemv
    from mmsdk.kernels.w4a16_gated import w4a16_gated_silu

    device, dtype, tol = target
    eps = 1e-5
    cases = ((1, 40, 512, 64, (16, 4, 4, 1, "quad"), 1),
             (1, 40, 512, 64, (8, 2, 2, 1, "quad"), 3),
             (2, 33, 296, 128, (16, 8, 4, 1, "quad", 64), None),
             (1, 40, 512, 32, (16, 2, 4, 1, "quadp"), 2),
             (2, 40, 512, 64, (16, 2, 4, 4, "fma"), 2),
             (3, 33, 296, 32, (16, 64, 2, 16, "mma", 64, 2), None),
             (1, 40, 512, 64, (16, 4, 4, 1, "idot"), 1),
             (2, 33, 296, 128, (8, 2, 2, 1, "idot"), 2),
             (1, 24, 4352, 128, (8, 8, 2, 1, "idot"), 1))  # rms over 3 passes
    for m, n, k, group, config, splits in _cases_here(cases, symmetric, device):
        packed = quantize_int4(torch.randn(n, k, device=device), group, symmetric=symmetric, scale_dtype=dtype)
        x = (torch.randn(m, k, device=device) * 3 + 1).to(dtype)  # un-normalized: rms ~3, not 1
        weight = (torch.rand(k, device=device) + 0.5).to(dtype)
        bias = torch.randn(n, device=device).to(dtype)
        norm = InputNorm(weight, eps, quad_factors(weight))
        expected = _rms_normalized(x, weight, eps) @ dequantize_int4(packed, torch.float32).T + bias.float()
        out = w4a16_gemv(x, packed.qweight, packed.scales, packed.zero_points, group, bias, config=config,
                         splits=splits, norm=norm)
        assert _rel(out, expected) < tol, (config, splits)  # interpreter fp16 ~3e-4
    # int4_linear with an AWQ pre-scale (folded into the factors; the norm kernel's path multiplies after it)
    prequant = (torch.rand(k, device=device) + 0.5).to(dtype)
    norm = InputNorm(weight, eps, quad_factors(weight, prequant), prequant)
    x = (torch.randn(1, 1, k, device=device) * 3).to(dtype)
    expected = (_rms_normalized(x, weight, eps) * prequant.float()) @ dequantize_int4(packed, torch.float32).T
    for rows in (x, x.expand(20, 1, k)):  # one row (the folded GEMV) and 20 (the fused kernel after the norm kernel)
        out = int4_linear(rows, packed.qweight, packed.scales, packed.zero_points, k, group, input_norm=norm)
        assert out.shape == (*rows.shape[:-1], n) and _rel(out, expected.expand(*out.shape)) < tol
    out = w4a16_gemv(x[0], packed.qweight, packed.scales, packed.zero_points, group, config=(8, 2, 2, 1, "idot"),
                     norm=norm)  # the pre-scale in the rounding kernel
    assert _rel(out, expected[0]) < tol
    with pytest.raises(ValueError, match="factors must be fp32 or bf16"):
        w4a16_gemv(x[0], packed.qweight, packed.scales, packed.zero_points, group, config=(16, 8, 4, 1, "quad"),
                   norm=InputNorm(weight, eps, quad_factors(weight)[:8]))
    # the gated MLP's paired GEMV: the "gated" kind with one K slice and with three, the per-weight "quad" kind, and
    # the "idot" kind (the norm applied by its rounding kernel)
    gated_cases = ((40, 512, 64, (16, 4, 4, 1, "gated"), 1), (33, 296, 32, (8, 2, 2, 1, "gated"), 3),
                   (40, 512, 64, (16, 4, 4, 1, "quad"), 2), (33, 296, 32, (8, 4, 2, 1, "idot"), 1),
                   (40, 512, 64, (8, 1, 2, 1, "idot"), 3))
    for n, k, group, config, splits in _cases_here(gated_cases, symmetric, device):
        gate, up = (quantize_int4(torch.randn(n, k, device=device), group, symmetric=symmetric, scale_dtype=dtype)
                    for _ in range(2))
        x = (torch.randn(1, 1, k, device=device) * 3 + 1).to(dtype)
        weight = (torch.rand(k, device=device) + 0.5).to(dtype)
        h = _rms_normalized(x, weight, eps)
        expected = (torch.nn.functional.silu(h @ dequantize_int4(gate, torch.float32).T)
                    * (h @ dequantize_int4(up, torch.float32).T))
        out = w4a16_gated_silu(x, (gate.qweight, gate.scales, gate.zero_points), (up.qweight, up.scales,
                               up.zero_points), k, group, config=config, splits=splits,
                               norm=InputNorm(weight, eps, quad_factors(weight)))
        assert _rel(out, expected) < tol, (config, splits)


@pytest.mark.parametrize("symmetric", [True, False])
def test_gemv_store_leaves_rmsnorm_statistics_the_gated_gemv_scales_by(target, symmetric):
    """o_proj's GEMV with the residual in its store leaves, for the RMSNorm that reads the sum, ``weight * sum`` and
    partial sums of squares (its direct store, or the K slices' sum); the gated MLP's paired GEMV reads the scaled
    input with the plain K loop and scales its products by ``1 / rms`` (every paired kind, one slice or several)."""
    from mmsdk.kernels.norm_fold import NormRequest
    from mmsdk.kernels.w4a16 import w4a16_gemv
    from mmsdk.kernels.w4a16_gated import w4a16_gated_silu

    device, dtype, tol = target
    eps = 1e-6
    k = 296  # the norm's width: o_proj's N, the gated GEMV's K (padded past it in the packed weights)
    cases = (((8, 4, 2, 1, "quad"), 1, (16, 4, 4, 1, "gated"), 1), ((16, 2, 4, 1, "quad"), 3, (8, 2, 2, 1, "gated"), 3),
             ((8, 8, 2, 1, "quadp"), 1, (16, 4, 4, 1, "quad"), 2), ((8, 2, 2, 1, "quad"), 2, (16, 2, 4, 1, "quadp"), 1),
             ((8, 4, 2, 1, "quad"), 1, (16, 4, 4, 1, "idot"), 1), ((16, 2, 4, 1, "quad"), 2, (8, 2, 2, 1, "idot"), 3))
    for case, (o_config, o_splits, gated_config, gated_splits) in enumerate(_cases_here(cases, symmetric, device)):
        o_proj = quantize_int4(torch.randn(k, 256, device=device), 32, symmetric=symmetric, scale_dtype=dtype)
        attention = torch.randn(1, 256, device=device).to(dtype)
        residual = (torch.randn(1, k, device=device) * 3 + 1).to(dtype)
        weight = (torch.rand(k, device=device) + 0.5).to(dtype)
        bias = torch.randn(k, device=device).to(dtype) if case % 2 else None  # added before the residual
        request = NormRequest(weight, eps)
        total = w4a16_gemv(attention, o_proj.qweight, o_proj.scales, o_proj.zero_points, 32, bias, config=o_config,
                           splits=o_splits, residual=residual, leave=request)
        plain = w4a16_gemv(attention, o_proj.qweight, o_proj.scales, o_proj.zero_points, 32, bias, config=o_config,
                           splits=o_splits)
        assert torch.equal(total, residual + plain)
        statistics = request.statistics
        assert statistics is not None and torch.equal(statistics.scaled, (total.float() * weight.float()).to(dtype))
        assert torch.allclose(statistics.squares.sum(1), total.float().pow(2).sum(1), rtol=1e-5)
        h = _rms_normalized(total, weight, eps)
        inverse_rms = torch.rsqrt(statistics.squares.sum(1, keepdim=True) / k + eps)  # what the reader scales by
        assert _rel(statistics.scaled.float() * inverse_rms, h) < tol
        gate, up = (quantize_int4(torch.randn(40, k, device=device), 32, symmetric=symmetric, scale_dtype=dtype)
                    for _ in range(2))
        expected = (torch.nn.functional.silu(h @ dequantize_int4(gate, torch.float32).T)
                    * (h @ dequantize_int4(up, torch.float32).T))
        out = w4a16_gated_silu(statistics.scaled, (gate.qweight, gate.scales, gate.zero_points),
                               (up.qweight, up.scales, up.zero_points), k, 32, config=gated_config,
                               splits=gated_splits, statistics=statistics)
        assert _rel(out, expected) < tol, (o_config, gated_config)
    # kinds that cannot leave them (several rows; the one-slice store of a "fma" GEMV) leave none, and the reader
    # runs the norm itself
    for rows, config in ((2, (8, 4, 2, 1, "quad")), (1, (16, 2, 4, 4, "fma"))):
        request = NormRequest(weight, eps)
        total = w4a16_gemv(attention.expand(rows, 256).contiguous(), o_proj.qweight, o_proj.scales,
                           o_proj.zero_points, 32, config=config, splits=1,
                           residual=residual.expand(rows, k).contiguous(), leave=request)
        assert request.statistics is None and total.shape == (rows, k)
    with pytest.raises(ValueError, match="request the statistics of the norm that reads this output"):
        w4a16_gemv(attention, o_proj.qweight, o_proj.scales, o_proj.zero_points, 32, config=(8, 4, 2, 1, "quad"),
                   residual=residual, leave=NormRequest(weight[:8], eps))
    with pytest.raises(ValueError, match="not both"):
        w4a16_gated_silu(statistics.scaled, (gate.qweight, gate.scales, gate.zero_points),
                         (up.qweight, up.scales, up.zero_points), k, 32, statistics=statistics,
                         norm=object())


@pytest.mark.parametrize("symmetric", [True, False])
def test_gemv_store_leaves_rmsnorm_statistics_the_integer_dot_gemv_scales_by(target, symmetric):
    """A layer's down projection with the residual in its store leaves the next layer's input-norm statistics (the K
    slices' sum of every kind, the one-slice store of the "quad" and integer-dot kinds); the next q/k/v GEMV, of kind
    "idot" or "idotr", reads ``weight * sum`` with the plain K loop and scales its sums by ``1 / rms`` before the bias
    (one slice or several, K padded past in_features): both kinds give the same output bit for bit, the normalized
    product to the dtype's rounding. Other kinds fold the norm the statistics stand in for (and leave them marked
    unread); statistics without that norm, with an AWQ pre-scale, or of another row are refused."""
    from mmsdk.kernels.gemv_launch import launch_gemv
    from mmsdk.kernels.norm_fold import InputNorm, NormRequest, quad_factors
    from mmsdk.kernels.w4a16 import w4a16_gemv

    device, dtype, tol = target
    eps = 1e-6
    k, group = 296, 32  # the norm's width: down's N, the q/k/v GEMV's K (padded past it in the packed weight)
    cases = (((8, 4, 2, 1, "quad"), 1, (16, 4, 4, 1, "idot"), 1), ((16, 2, 4, 1, "idotr"), 3, (8, 2, 2, 1, "idotr"), 3),
             ((8, 2, 2, 1, "idot"), 2, (16, 4, 4, 1, "idotr"), 1), ((16, 2, 4, 1, "fma"), 2, (8, 2, 2, 1, "idot"), 2),
             ((8, 4, 2, 1, "idotr"), 1, (16, 4, 4, 1, "idot"), 2), ((16, 2, 4, 1, "idot"), 1, (8, 2, 2, 1, "idot"), 1))
    for case, (down_config, down_splits, qkv_config, qkv_splits) in enumerate(_cases_here(cases, symmetric, device)):
        down = quantize_int4(torch.randn(k, 256, device=device), group, symmetric=symmetric, scale_dtype=dtype)
        hidden = torch.randn(1, 256, device=device).to(dtype)
        residual = (torch.randn(1, k, device=device) * 3 + 1).to(dtype)
        residual[:, ::37] *= 30.0  # outlier channels of the residual stream
        weight = (torch.rand(k, device=device) + 0.5).to(dtype)
        request = NormRequest(weight, eps)
        total = w4a16_gemv(hidden, down.qweight, down.scales, down.zero_points, group, config=down_config,
                           splits=down_splits, residual=residual, leave=request)
        statistics = request.statistics
        assert statistics is not None, down_config
        assert torch.equal(statistics.scaled, (total.float() * weight.float()).to(dtype))
        assert torch.allclose(statistics.squares.sum(1), total.float().pow(2).sum(1), rtol=1e-5)
        qkv = quantize_int4(torch.randn(48, k, device=device), group, symmetric=symmetric, scale_dtype=dtype)
        bias = torch.randn(48, device=device).to(dtype) if case % 2 else None
        expected = _rms_normalized(total, weight, eps) @ dequantize_int4(qkv, torch.float32).T
        expected = expected if bias is None else expected + bias.float()
        norm = InputNorm(weight, eps, quad_factors(weight))
        outputs = [w4a16_gemv(total, qkv.qweight, qkv.scales, qkv.zero_points, group, bias,
                              config=(*qkv_config[:4], kind), splits=qkv_splits, norm=norm, statistics=statistics)
                   for kind in ("idot", "idotr")]
        assert torch.equal(*outputs), qkv_config
        assert _rel(outputs[0], expected) < tol, (down_config, qkv_config)
        assert statistics.read  # what the writer learns: they are worth leaving
        statistics.read = False
        folded = w4a16_gemv(total, qkv.qweight, qkv.scales, qkv.zero_points, group, bias, config=(8, 4, 2, 1, "quad"),
                            norm=norm, statistics=statistics)  # a kind that cannot read them folds the norm
        assert _rel(folded, expected) < tol and not statistics.read
    with pytest.raises(ValueError, match="pass that norm as well"):
        w4a16_gemv(total, qkv.qweight, qkv.scales, qkv.zero_points, group, config=qkv_config, statistics=statistics)
    with pytest.raises(ValueError, match="pass that norm as well"):
        w4a16_gemv(total, qkv.qweight, qkv.scales, qkv.zero_points, group, config=qkv_config, statistics=statistics,
                   norm=InputNorm(weight, eps, quad_factors(weight, weight), weight))
    with pytest.raises(ValueError, match="pass them with that row"):
        w4a16_gemv(total.expand(2, k).contiguous(), qkv.qweight, qkv.scales, qkv.zero_points, group,
                   config=qkv_config, statistics=statistics, norm=norm)
    with pytest.raises(ValueError, match="cannot apply norm statistics"):
        launch_gemv(statistics.scaled, qkv.qweight, qkv.scales, qkv.zero_points, None, torch.empty_like(outputs[0]),
                    group, (8, 4, 2, 1, "quad"), None, row_scale=statistics)


def _gated_problem(n: int, k: int, group: int, symmetric: bool, device: str, dtype: torch.dtype) -> tuple:
    """(x [1, 1, k], gate and up as (qweight, scales, zero_points), silu(x Wg^T) * (x Wu^T) from the dequantized
    weights in fp32)."""
    gate, up = (quantize_int4(torch.randn(n, k, device=device), group, symmetric=symmetric, scale_dtype=dtype)
                for _ in range(2))
    x = torch.randn(1, 1, k, device=device).to(dtype)
    g = x.float() @ dequantize_int4(gate, torch.float32).T
    expected = torch.nn.functional.silu(g) * (x.float() @ dequantize_int4(up, torch.float32).T)
    return x, [(p.qweight, p.scales, p.zero_points) for p in (gate, up)], expected


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_gated_silu_matches_two_matmuls(target, symmetric):
    from mmsdk.kernels.w4a16_gated import gated_silu_reason, w4a16_gated_silu

    device, dtype, tol = target
    # per-weight programs ("quad" kinds: always partials + epilogue): one split and several, N not a multiple of
    # BLOCK_N, K padded past in_features
    for n, k, group, config, splits in ((40, 512, 64, (16, 4, 4, 1, "quad"), 3),
                                        (33, 296, 128, (16, 8, 4, 1, "quad"), 1),
                                        (24, 256, 32, (8, 8, 2, 1, "quad", 64), None),
                                        (40, 512, 64, (16, 2, 4, 1, "quadp"), 2)):
        x, parts, expected = _gated_problem(n, k, group, symmetric, device, dtype)
        out = w4a16_gated_silu(x, parts[0], parts[1], k, group, config=config, splits=splits)
        assert out.shape == (1, 1, n) and out.dtype == dtype
        assert _rel(out, expected) < tol  # interpreter fp16 ~3e-4
    # what the paired kernel refuses (the caller then runs the two linears): returns None and says why
    gate = quantize_int4(torch.randn(16, 64, device=device), 32, symmetric=symmetric, scale_dtype=dtype)
    other = quantize_int4(torch.randn(8, 64, device=device), 32, symmetric=symmetric, scale_dtype=dtype)
    small = quantize_int4(torch.randn(16, 64, device=device), 16, symmetric=symmetric, scale_dtype=dtype)
    x = torch.randn(1, 64, device=device).to(dtype)
    parts = {name: (p.qweight, p.scales, p.zero_points) for name, p in (("gate", gate), ("other", other),
                                                                       ("small", small))}
    assert "differ" in gated_silu_reason(x, parts["gate"], parts["other"], 32)
    assert "more than 16 activation rows" in gated_silu_reason(x.expand(17, 64), parts["gate"], parts["gate"], 32)
    assert gated_silu_reason(x.expand(2, 64), parts["gate"], parts["gate"], 32) is None  # 2-16 rows: kind "mma"
    assert "group size 16" in gated_silu_reason(x, parts["small"], parts["small"], 16)
    assert w4a16_gated_silu(x, parts["gate"], parts["other"], 64, 32) is None


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_gated_kind_stores_silu_itself_with_one_k_slice(target, symmetric, monkeypatch):
    """Kinds "gated" and "idot" (each program both weights' rows): one K slice stores silu(gate) * up with no second
    kernel; several slices store both partials and finish with the epilogue."""
    from mmsdk.kernels import gemv_idot, w4a16_gated

    device, dtype, tol = target
    epilogues = []
    finish = w4a16_gated.finish_splits
    for module in (w4a16_gated, gemv_idot):
        monkeypatch.setattr(module, "finish_splits", lambda *a: (epilogues.append(a[3]), finish(*a)))
    # (n, k, group, config, K splits, epilogue's slices or None): N odd / not a multiple of BLOCK_N, K padded past
    # in_features (296 of 384 or 320), slices given or derived from the target programs (counted from N rows: 33 rows
    # in 8-row blocks are 5 programs, target 1 -> one slice, target 64 -> two)
    # kind "idot" the same, its activations rounded by a launch of their own
    cases = ((40, 512, 64, (16, 4, 4, 1, "gated"), 1, None),
             (33, 296, 128, (8, 2, 2, 1, "gated", 1), None, None),
             (40, 512, 64, (16, 1, 4, 1, "gated"), 3, 3),
             (33, 296, 32, (8, 8, 2, 1, "gated", 64), None, 2),
             (40, 512, 64, (16, 4, 4, 1, "idot"), 1, None),
             (33, 296, 128, (8, 1, 2, 1, "idot"), 3, 3),
             (33, 296, 32, (8, 8, 2, 1, "idot", 64), None, 2))
    for n, k, group, config, splits, sliced in _cases_here(cases, symmetric, device):
        x, parts, expected = _gated_problem(n, k, group, symmetric, device, dtype)
        epilogues.clear()
        out = w4a16_gated.w4a16_gated_silu(x, parts[0], parts[1], k, group, config=config, splits=splits)
        assert out.shape == (1, 1, n) and out.dtype == dtype
        assert epilogues == ([] if sliced is None else [sliced])
        assert _rel(out, expected) < tol  # interpreter fp16 1.0-3.1e-4 measured


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_paired_rows_gemv_matches_two_matmuls(target, symmetric, monkeypatch):
    """By default (MMSDK_PAIRED_ROWS=1) the gated MLP's gate and up GEMVs of 2-16 rows run as one tensor-core launch
    (kind "mma", each program the same rows of both weights): one K slice stores silu(gate) * up itself, several store
    both partials for the gated epilogue; a norm to fold runs first as its own kernel. Switched off or above 16 rows
    the caller falls back."""
    from mmsdk.kernels import w4a16_gated
    from mmsdk.kernels.norm_fold import InputNorm, quad_factors

    device, dtype, tol = target
    epilogues = []
    finish = w4a16_gated.finish_splits
    monkeypatch.setattr("mmsdk.kernels.gemv_launch.finish_splits", lambda *a: (epilogues.append(a[3]), finish(*a)))
    monkeypatch.setenv("MMSDK_PAIRED_ROWS", "1")
    # (rows, n, k, group, config, K splits, epilogue's slices or None): N not a multiple of BLOCK_N, K padded past
    # in_features, slices given or derived from the target programs (33 rows in 16-row blocks, 10 groups of 32 two
    # per step: 5 slices for a 64-program target); None: the tuner's first candidate (untimed under the interpreter)
    for m, n, k, group, config, splits, sliced in ((3, 40, 512, 64, (16, 64, 2, 16, "mma", 64, 2), 1, None),
                                                   (5, 33, 296, 32, (16, 64, 2, 16, "mma", 64, 2), None, 5),
                                                   (4, 24, 256, 128, (16, 128, 4, 16, "mma"), 2, 2),
                                                   (16, 40, 256, 128, None, None, None)):
        gate, up = (quantize_int4(torch.randn(n, k, device=device), group, symmetric=symmetric, scale_dtype=dtype)
                    for _ in range(2))
        x = torch.randn(m, 1, k, device=device).to(dtype)
        expected = (torch.nn.functional.silu(x.float() @ dequantize_int4(gate, torch.float32).T)
                    * (x.float() @ dequantize_int4(up, torch.float32).T))
        parts = [(p.qweight, p.scales, p.zero_points) for p in (gate, up)]
        epilogues.clear()
        out = w4a16_gated.w4a16_gated_silu(x, parts[0], parts[1], k, group, config=config, splits=splits)
        assert out.shape == (m, 1, n) and out.dtype == dtype
        assert _rel(out, expected) < tol, (m, config)  # interpreter fp16 ~3e-4
        if config is not None:
            assert epilogues == ([] if sliced is None else [sliced])
    # an RMSNorm to fold: normalized by its own kernel first
    eps, weight = 1e-5, (torch.rand(k, device=device) + 0.5).to(dtype)
    x = (torch.randn(3, k, device=device) * 3 + 1).to(dtype)
    normed = _rms_normalized(x, weight, eps)
    expected = (torch.nn.functional.silu(normed @ dequantize_int4(gate, torch.float32).T)
                * (normed @ dequantize_int4(up, torch.float32).T))
    norm = InputNorm(weight, eps, quad_factors(weight))
    assert _rel(w4a16_gated.w4a16_gated_silu(x, parts[0], parts[1], k, group, norm=norm), expected) < tol
    # what falls back: more than 16 rows; 2-16 with the switch off; a one-row kind for several rows and "mma" for one
    assert w4a16_gated.w4a16_gated_silu(x[:1].expand(17, k), parts[0], parts[1], k, group) is None
    monkeypatch.setenv("MMSDK_PAIRED_ROWS", "0")
    assert "MMSDK_PAIRED_ROWS=0" in w4a16_gated.gated_silu_reason(x, parts[0], parts[1], group)
    assert w4a16_gated.w4a16_gated_silu(x, parts[0], parts[1], k, group) is None
    out = torch.empty(3, n, device=device, dtype=dtype)
    with pytest.raises(ValueError, match="kind 'mma' runs 2-16 rows"):
        w4a16_gated._launch_paired(x, parts[0], parts[1], out, group, (16, 4, 4, 1, "gated"), None)
    with pytest.raises(ValueError, match="kind 'mma' runs 2-16 rows"):
        w4a16_gated._launch_paired(x[:1], parts[0], parts[1], out[:1], group, (16, 128, 4, 16, "mma"), None)


def test_paired_gemv_configs_the_tuner_times_and_bad_ones():
    from mmsdk.kernels.w4a16 import w4a16_gemv
    from mmsdk.kernels.w4a16_gated import PAIRED_KINDS, _launch_paired, _paired_candidates

    for group in (32, 128):
        kinds = [c[4] for c in _paired_candidates(group)]
        # an "idot" tile leads (taken untimed under a capture or the interpreter); the per-weight kinds stay candidates
        assert kinds[:2] == ["idot", "gated"] and set(kinds) == set(PAIRED_KINDS) - {"mma"}
    gate = quantize_int4(torch.randn(16, 64), 32)
    parts = (gate.qweight, gate.scales, gate.zero_points)
    x, out = torch.randn(1, 64).half(), torch.empty(1, 16).half()
    for bad in ((8, 2, 2, 1, "fma"), (8, 2, 2, 1, "gatd"), (8, 2, 2)):
        with pytest.raises(ValueError, match="'gated', 'idot', 'idotr', 'quad', 'quadp'"):
            _launch_paired(x, parts, parts, out, 32, bad, None)
    with pytest.raises(ValueError, match="kind 'gated' is for the paired gate/up GEMV"):
        w4a16_gemv(x, *parts, 32, config=(8, 2, 2, 1, "gated"))


def test_argmax_rows_picks_what_torch_picks(target):
    """The greedy kernel's index per row equals torch.argmax: ties to the first, NaN as the maximum, rows of -inf,
    vocabularies of one tile, several tiles and a partial last tile."""
    from mmsdk.kernels.greedy import argmax_rows

    device, dtype, _ = target
    torch.manual_seed(3)
    for vocab, block in ((7, 16384), (1000, 16384), (1000, 128), (40000, 16384) if device == "cuda" else (300, 64)):
        logits = torch.randn(6, vocab, device=device).to(dtype)
        logits[1, vocab // 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first wins
        logits[2] = float("-inf")
        logits[3, vocab // 2] = float("nan")
        logits[4, [vocab // 4, vocab - 1]] = float("nan")  # two NaNs: the first
        logits[5] = logits[5].round()  # many ties at the maximum
        got = argmax_rows(logits, block)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1)), (vocab, block)
    with pytest.raises(ValueError, match="power of two"):
        argmax_rows(logits, 100)


def test_greedy_step_does_what_the_torch_ops_do(target):
    """greedy_step in one kernel: the same tokens, finished flags and token column as argmax, where(finished, pad),
    isin(eos) and the two copies, with and without end tokens and a column to write."""
    from mmsdk.kernels import greedy

    device, dtype, _ = target
    torch.manual_seed(4)
    for eos_ids, column in (([5, 17, 900], 3), ([], None), ([11], 0)):
        logits = torch.randn(5, 1000, device=device).to(dtype)
        logits[1, 17] = logits[2, 900] = 100.0  # rows that end now
        finished = torch.tensor([False, False, False, True, False], device=device)
        eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
        results = []
        for run in ("kernel", "torch"):
            done, token = finished.clone(), torch.full((5,), -7, dtype=torch.long, device=device)
            tokens = torch.zeros(5, 6, dtype=torch.long, device=device)
            where = None if column is None else torch.tensor([column], device=device)
            if run == "torch":  # the reference path: logits the kernel does not take (non-unit stride)
                logits = logits.t().contiguous().t()
            greedy.greedy_step(logits, done, eos, 2, token, tokens if column is not None else None, where, block=256)
            results.append((done, token, tokens))
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), (eos_ids, column)
        assert int(results[0][1][3]) == 2 and bool(results[0][0][1]) == (17 in eos_ids)


def test_tuning_off_takes_the_first_candidate_untimed(monkeypatch):
    """MMSDK_TUNE=0: the tuner neither launches nor times candidates, takes the first and keeps nothing, so turning
    timing on again later still times the problem."""
    from mmsdk.kernels import TUNE_ENV
    from mmsdk.kernels.w4a16_tuning import tuned_config, tuning

    launched = []
    key = ("test", "tuning off")
    monkeypatch.setenv(TUNE_ENV, "0")
    picked = tuned_config(key, lambda cfg, w: launched.append(cfg), ((8, 2, 2, 1, "quad"), (16, 2, 2, 1, "quad")), 32,
                          (torch.zeros(4),))
    assert picked == (8, 2, 2, 1, "quad") and launched == [] and key not in tuning().chosen


def test_a_weight_under_the_tuning_threshold_takes_its_first_candidate_untimed(monkeypatch):
    """A packed weight (scales and zero points counted) under MMSDK_TUNE_MIN_BYTES (256 KiB unset) takes the first
    candidate with nothing compiled or timed, and keeps it for the process; one at the threshold is timed, as is
    every weight with it 0 or in a step search's first tuning (times_small_weights). A bad value names the fix."""
    from mmsdk.kernels import w4a16_tuning
    from tests.tuner_fakes import fake_timings

    fake = fake_timings(monkeypatch, {"quad": 2.0, "idot": 1.0}, time_small_weights=False)
    process = {"tuning": w4a16_tuning.Tuning()}
    process["tuning"].use_kept_choices = False  # no choices file on this machine to read
    monkeypatch.setattr(w4a16_tuning, "tuning", lambda: process["tuning"])
    candidates = ((8, 128, 4, 1, "quad"), (16, 32, 2, 1, "idot"))

    def tune(name, *weights):
        return w4a16_tuning.tuned_config(("test", name), fake.launch, candidates, 32, weights)

    qweight = torch.zeros(128, 1024, dtype=torch.uint8)  # 128 KiB, and 1/16 of it as bf16 scales (g32)
    scales = torch.zeros(128, 32, dtype=torch.bfloat16)
    assert tune("small", qweight, scales, None) == candidates[0]
    assert fake.timed == [] and fake.compiled == [] and process["tuning"].chosen[("test", "small")] == candidates[0]
    at_threshold = torch.zeros(w4a16_tuning.DEFAULT_TUNE_MIN_BYTES - scales.numel() * 2, dtype=torch.uint8)
    assert tune("at the threshold", at_threshold, scales, None) == candidates[1] and fake.compiled == [2]

    monkeypatch.setenv(w4a16_tuning.TUNE_MIN_BYTES_ENV, "0")
    assert tune("small, every weight timed", qweight, scales) == candidates[1] and fake.compiled == [2, 2]
    monkeypatch.setenv(w4a16_tuning.TUNE_MIN_BYTES_ENV, str(10 << 20))
    assert tune("under a higher threshold", at_threshold, scales) == candidates[0] and fake.compiled == [2, 2]
    process["tuning"].times_small_weights = True
    assert tune("in a step search", qweight, scales) == candidates[1] and fake.compiled == [2, 2, 2]
    for bad in ("1MiB", "-1", "0.5"):
        monkeypatch.setenv(w4a16_tuning.TUNE_MIN_BYTES_ENV, bad)
        with pytest.raises(ValueError, match="whole number of bytes"):
            w4a16_tuning.tune_min_bytes()


def test_a_tuner_met_in_a_recorded_first_call_launches_every_candidate_and_keeps_nothing(monkeypatch):
    """Inside compile_before_first_call's dropped capture (a decode step compiled ahead), a shape met for the first
    time launches each candidate once (recorded there, so they compile with the step's other kernels), runs the first
    and keeps no choice; inside any other capture it launches none."""
    from mmsdk.kernels import parallel_compile, w4a16_tuning

    launched = []
    monkeypatch.setattr(w4a16_tuning, "timing_enabled", lambda: True)
    monkeypatch.setenv(w4a16_tuning.TUNE_MIN_BYTES_ENV, "0")  # the stand-in weight is tiny: timed all the same
    monkeypatch.setattr(w4a16_tuning, "step_measured_config", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    candidates = ((8, 64, 2, 1, "quad"), (16, 32, 2, 1, "idot"), (8, 64, 2, 1, "quad"))

    def launch(cfg, weights):
        launched.append(cfg)
        if cfg[4] == "idot":
            raise RuntimeError("a candidate that cannot run here")

    def tune(key):
        return w4a16_tuning.tuned_config(key, launch, candidates, 32, (torch.zeros(4),))

    assert tune(("test", "captured")) == candidates[0] and launched == []
    recorded = {}

    def call():
        recorded["inside"] = parallel_compile.recording_a_first_call()
        recorded["pick"] = tune(("test", "recorded"))

    monkeypatch.setattr(parallel_compile, "_call_in_dropped_capture", lambda step, stream: step())
    monkeypatch.setattr(parallel_compile, "_recorded_kernels", lambda run: run() or {})
    parallel_compile.compile_before_first_call(call, None, threads=2)
    assert recorded == {"inside": True, "pick": candidates[0]} and not parallel_compile.recording_a_first_call()
    assert launched == list(candidates[:2])  # each once, a failing one too
    assert ("test", "recorded") not in w4a16_tuning.tuning().chosen


def test_tuner_keeps_the_first_candidate_within_its_margin(monkeypatch):
    """``within``: the first candidate in the given order that times within that fraction of the fastest is kept
    (the gated tiles, listed in the decode step's order); without it the fastest."""
    from mmsdk.kernels import w4a16_gated, w4a16_tuning
    from tests.tuner_fakes import fake_timings

    times = {"a": 10.4, "b": 10.1, "c": 10.0, "d": 9.0}
    fake = fake_timings(monkeypatch, times, label=lambda cfg: cfg[0])
    timed, warm_ups = fake.timed, fake.warm_ups
    candidates = tuple((name,) for name in times)
    pick = {}
    for within, key in ((0.0, "fastest"), (0.03, "3%"), (0.2, "20%")):
        pick[key] = w4a16_tuning.tuned_config(("test", "within", key), fake.launch, candidates, 32, (torch.zeros(4),),
                                              within)
    assert pick == {"fastest": ("d",), "3%": ("d",), "20%": ("a",)}
    # each tuning: its candidates compiled as they are then run, the first called once eagerly (its lazily made
    # buffers hold values), each timed with its warm-up inside a capture (only the GEMVs' captured variants compile)
    assert timed[:5] == ["a", "a", "b", "c", "d"] and set(warm_ups) == {"captured"} and len(warm_ups) == 3 * 5
    timed.clear()
    warm_ups.clear()
    w4a16_tuning.tuning().warm_up = "eager"  # a step search's first tuning
    try:
        w4a16_tuning.tuned_config(("test", "within", "eager"), fake.launch, candidates, 32, (torch.zeros(4),))
    finally:
        w4a16_tuning.tuning().warm_up = "captured"
    assert timed == ["a", "b", "c", "d"] and warm_ups == ["eager"] * 5  # each warmed up eagerly as it is timed
    fake.times.update(d=10.2)
    assert w4a16_tuning.tuned_config(("test", "within", "close"), fake.launch, candidates, 32, (torch.zeros(4),),
                                     0.03) == ("b",)
    # the step's best "idot" tile leads; the gated tiles' order follows the group size (the step's ranking); the tuner
    # takes them with that margin
    assert [c[:5] for c in w4a16_gated._paired_candidates(128)[:4]] == [
        (8, 64, 4, 1, "idot"), (8, 128, 4, 1, "gated"), (8, 64, 2, 1, "gated"), (8, 32, 1, 1, "gated")]
    assert [c[:5] for c in w4a16_gated._paired_candidates(32)[:4]] == [
        (8, 64, 4, 1, "idot"), (8, 32, 1, 1, "gated"), (8, 64, 2, 1, "gated"), (8, 128, 4, 1, "gated")]
    assert 0 < w4a16_gated.GATED_WITHIN < 0.1


class _OnDevice:
    """Stands in for a packed weight on a CUDA device (the tuner reads only its ``device``)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def test_step_measured_configs_answer_for_their_gpu_untimed(monkeypatch):
    """On the GPU a decode-step config was measured on, the tuner keeps it without timing anything (also under a
    capture); another GPU, a CPU tensor, ``MMSDK_STEP_CONFIGS=0`` or an entry no longer among the candidates fall back
    to timing."""
    from mmsdk.kernels import step_configs, w4a16_tuning
    from mmsdk.kernels.w4a16 import gemv_candidates

    key = ("gemv", 1, 4608, 28, 128, torch.bfloat16, False, True, True)  # Qwen2-VL-7B's q/k/v, g128
    measured = step_configs._measured()["NVIDIA H200"][key]
    candidates = gemv_candidates(1, 128)
    assert measured in candidates and measured != candidates[0]
    gpu_name = {"name": "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: gpu_name["name"])
    cuda = _OnDevice("cuda")
    assert step_configs.step_measured_config(key, cuda.device, candidates) == measured
    assert step_configs.step_measured_config(key, torch.device("cpu"), candidates) is None
    assert step_configs.step_measured_config(key, cuda.device, candidates[:1]) is None
    assert step_configs.step_measured_config(("gemv", 1, 4608, 28, 128, torch.float16, False, True, True),
                                             cuda.device, candidates) is None
    monkeypatch.setenv(step_configs.STEP_CONFIGS_ENV, "0")
    assert step_configs.step_measured_config(key, cuda.device, candidates) is None
    monkeypatch.delenv(step_configs.STEP_CONFIGS_ENV)
    gpu_name["name"] = "NVIDIA H100 80GB HBM3"  # a GPU with entries of its own (measured there)
    assert step_configs.step_measured_config(key, cuda.device, candidates) == step_configs._measured()[
        "NVIDIA H100 80GB HBM3"][key] != measured
    # handed its input norm's statistics: the H100's entry of its own, the H200's folded-norm entry (none of its own)
    handed = (*key[:-1], "statistics")
    assert step_configs.step_measured_config(handed, cuda.device, candidates) == step_configs._measured()[
        "NVIDIA H100 80GB HBM3"][handed] != step_configs._measured()["NVIDIA H100 80GB HBM3"][key]
    gpu_name["name"] = "NVIDIA A100-SXM4-80GB"  # a GPU without entries
    assert step_configs.step_measured_config(key, cuda.device, candidates) is None
    gpu_name["name"] = "NVIDIA H200"
    assert handed not in step_configs._measured()["NVIDIA H200"]
    assert step_configs.step_measured_config(handed, cuda.device, candidates) == measured

    def never_timed(*args):
        raise AssertionError("a step-measured config is taken untimed")

    monkeypatch.setattr(w4a16_tuning, "graph_time_ms", never_timed)
    monkeypatch.setattr(w4a16_tuning, "timing_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    launched = []
    w4a16_tuning.tuning().chosen.pop(key, None)
    try:
        assert w4a16_tuning.tuned_config(key, lambda cfg, w: launched.append(cfg), candidates, 128, (cuda,)) == measured
        assert launched == [] and w4a16_tuning.tuning().chosen[key] == measured
    finally:
        w4a16_tuning.tuning().chosen.pop(key, None)
    # the paired GEMV builds its one-row keys as the table has them (a changed key would silently retire an entry)
    from mmsdk.kernels.w4a16_gated import gated_key

    for table_key in (k for table in step_configs._measured().values() for k in table if k[0] == "gated"):
        assert gated_key(*table_key[1:], rows=1) == table_key
        assert gated_key(*table_key[1:], rows=4) != table_key
    # every entry is a candidate of the kernels it names (a changed candidate list would silently retire it)
    from mmsdk.kernels.w4a16_gated import _paired_candidates

    for table in step_configs._measured().values():
        for entry_key, config in table.items():
            group = entry_key[4] if entry_key[0] == "gemv" else entry_key[3]
            pool = gemv_candidates(entry_key[1], group) if entry_key[0] == "gemv" else _paired_candidates(group)
            assert config in pool, (entry_key, config)


def test_one_row_tuner_times_each_candidate_followed_by_a_norm(monkeypatch):
    """The one-row GEMV's timed launch runs the candidate, then an add + RMSNorm of its output (buffers made once),
    as a decoder layer's step runs a GEMV between norms; an output wider than NORMED_MAX_N is timed alone."""
    import mmsdk.kernels.norm_rope_gpu as norm_rope_gpu
    from mmsdk.kernels.w4a16_tuning import NORMED_MAX_N, followed_by_norm

    order, residuals = [], []
    out = torch.zeros(1, 8, dtype=torch.bfloat16)

    def norm(x, residual, weight, eps):
        order.append("norm")
        residuals.append(residual)
        assert x is out and residual.shape == out.shape and weight.shape == (8,) and bool((weight == 1).all())
        return x, x

    monkeypatch.setattr(norm_rope_gpu, "add_rms_norm", norm)
    timed = followed_by_norm(lambda cfg, weights: order.append((cfg, weights)), out)
    timed("a", ("w",))
    timed("b", ("w",))
    assert order == [("a", ("w",)), "norm", ("b", ("w",)), "norm"] and residuals[0] is residuals[1]
    head = torch.zeros(1, NORMED_MAX_N + 1, dtype=torch.bfloat16)  # a vocabulary head: no norm follows it
    assert followed_by_norm(timed, head) is timed


@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_cuda_every_paired_candidate_compiles_and_matches():
    """Every configuration the tuner times for the paired GEMV builds on this GPU and is right (the tuner itself
    skips a config the compiler rejects, which would hide a broken tile)."""
    from mmsdk.kernels.w4a16_gated import _paired_candidates, w4a16_gated_silu

    for n, k, group, symmetric in ((704, 256, 64, True), (1000, 4096, 128, False), (3000, 1000, 32, True)):
        x, parts, expected = _gated_problem(n, k, group, symmetric, "cuda", torch.bfloat16)
        for config in _paired_candidates(group):
            out = w4a16_gated_silu(x, parts[0], parts[1], k, group, config=config)
            assert _rel(out, expected) < 1e-2, config  # bf16 output rounding: ~2e-3 on the H200 (paired kinds)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_packed_kv_append_and_decode_attention(target, fmt):
    from mmsdk.kernels.kv_decode import append_kv, decode_attention, reference_decode_attention

    device, dtype, tol = target
    if fmt == "fp8" and device == "cpu":
        pytest.skip("Triton's interpreter has no float8 loads")
    for batch, hq, hkv, dim, t_max, length in ((2, 4, 1, 16, 100, 37), (1, 6, 2, 32, 160, 130), (2, 2, 2, 32, 90, 77)):
        scales = [(torch.rand(hkv, dim, device=device) * 0.3 + 0.05) for _ in range(2)]
        codecs = [StaticCodec(fmt, s) for s in scales]
        width = (dim + 1) // 2 if fmt == "int4" else dim
        codes = [torch.zeros(batch, hkv, t_max, width, device=device, dtype=CODE_DTYPES[fmt]) for _ in range(2)]
        keys, values = (torch.randn(batch, hkv, length, dim, device=device).to(dtype) for _ in range(2))
        count = torch.zeros(1, dtype=torch.int64, device=device)
        for lo, hi in ((0, length - 1), (length - 1, length)):  # a prefill, then one decode token
            append_kv(keys[:, :, lo:hi], values[:, :, lo:hi], *codes, *scales, count, fmt)
            count.add_(hi - lo)
        assert torch.equal(codes[0][:, :, :length], codecs[0].encode(keys).data)
        assert torch.equal(codes[1][:, :, :length], codecs[1].encode(values).data)
        k_deq = codecs[0].decode(Packed(codes[0][:, :, :length]), torch.float32, dim)
        v_deq = codecs[1].decode(Packed(codes[1][:, :, :length]), torch.float32, dim)
        query = torch.randn(batch, hq, 1, dim, device=device).to(dtype)
        mask = torch.rand(batch, length + 3, device=device) > 0.3
        for m in (None, mask):
            out = decode_attention(query, *codes, *scales, count, fmt, dim**-0.5, m)
            assert _rel(out, reference_decode_attention(query, k_deq, v_deq, dim**-0.5, m)) < tol


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_code_dequantization_is_bitwise_the_torch_decode(target, fmt):
    """The one-launch dequantization of a packed code buffer equals StaticCodec.decode bit for bit."""
    from mmsdk.kernels.kv_decode import dequantize_codes

    device, dtype, _ = target
    # (batch, heads, head_dim, t_max, length): an odd head_dim (the last byte's high nibble is padding; int8 / fp8
    # codes read byte by byte, not as channel pairs), lengths that are no multiple of the 64-token tile (one tile,
    # several), an empty prefix
    for batch, heads, dim, t_max, length in ((2, 3, 15, 40, 37), (1, 2, 32, 64, 64), (2, 2, 128, 160, 131),
                                             (1, 1, 16, 8, 0)):
        if fmt == "fp8" and device == "cpu" and dim % 2:
            continue  # Triton's interpreter has no float8 loads (channel pairs load as int16)
        scale = torch.rand(heads, dim, device=device) * 0.3 + 0.05
        codec = StaticCodec(fmt, scale)
        codes = codec.encode(torch.randn(batch, heads, t_max, dim, device=device) * 0.5).data.contiguous()
        got = dequantize_codes(codes, scale, fmt, length, dim, dtype)
        expected = codec.decode(Packed(codes[:, :, :length]), dtype, dim)
        assert torch.equal(got, expected)
        last = dequantize_codes(codes[:, heads - 1:], scale[heads - 1:], fmt, length, dim, dtype)  # a run of heads
        assert torch.equal(last, expected[:, heads - 1:])
    with pytest.raises(ValueError, match="run of its heads"):
        dequantize_codes(codes.transpose(1, 2), scale, fmt, 4, dim, dtype)


def test_fused_norm_and_rope_kernels(target):
    from mmsdk.kernels import norm_rope_gpu as gpu

    device, dtype, tol = target
    x, residual = (torch.randn(3, 5, 80, device=device).to(dtype) for _ in range(2))
    weight = (torch.rand(80, device=device) + 0.5).to(dtype)
    pairs = zip(gpu.add_rms_norm(x, residual, weight, 1e-6), ref.add_rms_norm(x, residual, weight, 1e-6), strict=True)
    for got, expected in pairs:
        assert _rel(got, expected) < tol
    assert _rel(gpu.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6)) < tol
    q, k = torch.randn(2, 3, 7, 32, device=device).to(dtype), torch.randn(2, 1, 7, 32, device=device).to(dtype)
    angles = torch.randn(2, 7, 16, device=device) * 50
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    for got, expected in zip(gpu.rope_qk(q, k, cos, sin), ref.rope_qk(q, k, cos, sin), strict=True):
        assert _rel(got, expected) < tol
    q_t, k_t = q.transpose(1, 2), k.transpose(1, 2)  # [B, L, H, D] views, rotated with unsqueeze_dim=2
    for got, expected in zip(gpu.rope_qk(q_t, k_t, cos, sin, 2), ref.rope_qk(q_t, k_t, cos, sin, 2), strict=True):
        assert _rel(got, expected) < tol
    qw, kw = ((torch.rand(32, device=device) + 0.5).to(dtype) for _ in range(2))
    got = gpu.rms_norm_rope_qk(q, k, qw, kw, (1e-6, 1e-5), cos, sin)
    for a, b in zip(got, ref.rms_norm_rope_qk(q, k, qw, kw, (1e-6, 1e-5), cos, sin), strict=True):
        assert _rel(a, b) < tol
    # the blocks the launcher picks: LLaVA-1.5-7B's 32 + 32 heads of 128, Qwen2-VL-7B's 28 + 4 (as measured)
    assert gpu.rope_tile(1, 32, 32, 64) == gpu.rope_tile(64, 32, 32, 64) == (16, 4)
    assert gpu.rope_tile(132, 32, 32, 64) == gpu.rope_tile(4096, 28, 4, 64) == (32, 4)
    # blocks of heads per program: one head, a block past q's 3 heads, a block wider than k's one head; with the norm
    for tile in ((1, 1), (2, 1), (4, 2)):
        for weights, reference in ((None, ref.rope_qk(q, k, cos, sin)),
                                   ((qw, kw), ref.rms_norm_rope_qk(q, k, qw, kw, (1e-6, 1e-5), cos, sin))):
            got = gpu._rope(q, k, cos, sin, 1, weights, (1e-6, 1e-5), tile)
            for a, b in zip(got, reference, strict=True):
                assert _rel(a, b) < tol
    positions = torch.randint(0, 8000, (3, 2, 9), device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, device=device).float() / 16))
    streams = ref.mrope_streams([2, 3, 3])
    for a, b in zip(gpu.mrope_cos_sin(positions, inv_freq, streams, 1.0, dtype),
                    ref.mrope_cos_sin(positions, inv_freq, streams, 1.0, dtype), strict=True):
        assert _rel(a, b) < tol
    # plain RoPE (FusedRoPEEmbedding): one stream, [1, B, L] positions, a device slot map, attention scaling
    one, zeros = positions[:1], torch.zeros(8, dtype=torch.int32, device=device)
    for a, b in zip(gpu.mrope_cos_sin(one, inv_freq, zeros, 0.7, dtype),
                    ref.mrope_cos_sin(one, inv_freq, zeros, 0.7, dtype), strict=True):
        assert _rel(a, b) < tol


@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_bad_inputs_fall_back_or_refuse():
    from mmsdk.kernels.w4a16 import int4_linear, unsupported_reason

    packed = quantize_int4(torch.randn(64, 128, device="cuda"), 32, scale_dtype=torch.float32)
    x = torch.randn(2, 128, device="cuda")  # fp32 activations: the kernel takes bf16/fp16 only
    assert "dtype" in unsupported_reason(x, packed.qweight, packed.scales, 32)
    assert int4_linear(x, packed.qweight, packed.scales, None, 128, 32) is None  # caller dequantizes instead
    assert "group size" in unsupported_reason(x.half(), packed.qweight, packed.scales, 24)


# The interpreter checks run in three processes (2-4 min each on two busy cores), so that a run over two workers
# (the README's `pytest -n 2 --maxschedchunk 1`) spreads them. As one process they were the suite's longest test by
# far: 5.3 of the 9.6 minutes of a run without workers on two cores. The self-rounding checks (which fold a norm too)
# share the norm-fold process, which keeps the three about even.
_NORM_STORE = "gemv_store_leaves_rmsnorm_statistics"
_NORM_FOLD = "(gemvs_fold_an_rmsnorm or self_rounding_integer_dot)"


@pytest.mark.skipif(not HAS_TRITON or CUDA or INTERPRETING, reason="needs Triton, on a machine without a GPU")
@pytest.mark.parametrize("select,expected", [(f"interpreter and {_NORM_STORE}", 4),
                                             (f"interpreter and {_NORM_FOLD}", 4),
                                             (f"interpreter and not ({_NORM_STORE} or {_NORM_FOLD})", 21)],
                         ids=["norm_store", "norm_fold", "other_kernels"])
def test_kernels_under_the_interpreter(select, expected):
    """Runs this file's kernel checks (those ``select`` picks) in a process where TRITON_INTERPRET=1 is set from the
    start."""
    from tests import _interpreter

    result = _interpreter.run_file(str(Path(__file__)), select)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(rf"(?<!\d){expected} passed", result.stdout), result.stdout[-2000:]


def test_programmatic_dependent_launch_only_where_it_exists(monkeypatch):
    """PDL only for CUDA tensors on sm_90+; kernels that load weights before waiting only inside a graph capture."""
    from mmsdk.kernels import PDL_ENV, pdl_preload_ready, pdl_ready

    assert not pdl_ready(torch.zeros(1)) and not pdl_preload_ready(torch.zeros(1))  # CPU and the interpreter
    if CUDA:
        on_gpu = torch.zeros(1, device="cuda")
        hopper = torch.cuda.get_device_capability() >= (9, 0)
        assert pdl_ready(on_gpu) == hopper
        assert not pdl_preload_ready(on_gpu)  # an eager launch could follow the kernel that wrote the weights
        graph = torch.cuda.CUDAGraph()
        seen = []
        with torch.cuda.graph(graph):
            on_gpu.add_(1)  # a graph needs at least one kernel
            seen.append(pdl_preload_ready(on_gpu))
        assert seen == [hopper]
        monkeypatch.setenv(PDL_ENV, "0")
        assert not pdl_ready(on_gpu)


def test_settled_weights_let_eager_launches_load_weights_before_they_wait_on_their_thread_only(monkeypatch):
    """Inside weights_settled (fast generate's warm-up step) a kernel that loads weights before it waits launches so
    eagerly too, where PDL runs at all; on this thread only, and not after the scope ends, error or not."""
    import threading

    import mmsdk.kernels as kernels

    monkeypatch.setattr(kernels, "pdl_ready", lambda tensor: True)  # as on sm_90, without one
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # eager
    x = torch.zeros(1)
    assert not kernels.pdl_preload_ready(x)
    elsewhere = []
    with kernels.weights_settled():
        with kernels.weights_settled():
            assert kernels.pdl_preload_ready(x)
        assert kernels.pdl_preload_ready(x)
        thread = threading.Thread(target=lambda: elsewhere.append(kernels.pdl_preload_ready(x)))
        thread.start()
        thread.join()
    assert elsewhere == [False] and not kernels.pdl_preload_ready(x)
    with pytest.raises(RuntimeError), kernels.weights_settled():
        raise RuntimeError("a step that fails")
    assert not kernels.pdl_preload_ready(x)
    monkeypatch.setattr(kernels, "pdl_ready", lambda tensor: False)  # no PDL (CPU, older GPUs, MMSDK_PDL=0): never
    with kernels.weights_settled():
        assert not kernels.pdl_preload_ready(x)


def test_timing_copies_overflow_the_l2_cache():
    """The tuner times candidates over weight copies that together hold 3x L2, so each call reads HBM."""
    from mmsdk.kernels import l2_spill_copies

    weight, scales = torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1)
    assert l2_spill_copies((weight, scales, None)) == [(weight, scales, None)]  # CPU: nothing to spill
    if CUDA:
        from mmsdk.kernels import graph_time_ms

        weight = torch.randint(0, 255, (1024, 1024), dtype=torch.uint8, device="cuda")  # 1 MiB
        copies = l2_spill_copies((weight, None))
        l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
        assert copies[0][0] is weight and all(c[1] is None for c in copies)
        assert len(copies) * weight.numel() >= 3 * l2 or len(copies) == 64
        assert len({c[0].data_ptr() for c in copies}) == len(copies)
        assert all(torch.equal(c[0], weight) for c in copies)
        seen = []
        assert graph_time_ms([lambda c=c: seen.append(c[0].sum()) for c in copies[:3]], calls=4) > 0
        assert len(seen) == 3 + 6  # each once outside the capture, then two whole rounds captured
        capturing = []
        assert graph_time_ms([lambda: capturing.append(torch.cuda.is_current_stream_capturing())] * 3, calls=4,
                             warm_up="captured") > 0
        assert capturing == [True] * (3 + 6)  # warmed up inside a capture of their own, then captured
    with pytest.raises(ValueError, match="warm_up='twice': use one of eager, captured"):
        from mmsdk.kernels import captured_calls

        captured_calls(lambda: None, 2, warm_up="twice")


@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
def test_timing_copies_stop_at_the_memory_limit(monkeypatch, caplog):
    """No memory for the copies: fewer of them (at least the inputs themselves) and a warning, never an error."""
    from mmsdk.kernels import l2_spill_copies

    weight = torch.zeros(1024, device="cuda")

    class Full(torch.Tensor):
        def clone(self, *args, **kwargs):
            raise torch.cuda.OutOfMemoryError("no memory")

    full = weight.as_subclass(Full)
    with caplog.at_level("WARNING", logger="mmsdk.kernels"):
        copies = l2_spill_copies((full,))
    assert copies == [(full,)] and "copies of a kernel's inputs fit" in caplog.text
