"""The decode attention kernels compile for an H100 / H200 (sm_90), checked without a GPU.

Triton's interpreter (the CPU tests' other check) runs a kernel's Python, not its compiler: a kernel the compiler
refuses (e.g. two return types behind a constexpr branch) passes there and fails on the GPU. Here each kernel and
the constexpr choices the library launches are compiled to a cubin for sm_90 with the ptxas that Triton ships.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs Triton, not its interpreter")


def _compile(kernel: Any, pointers: dict[str, str], constexprs: dict[str, Any], floats: tuple[str, ...] = ()) -> None:
    """Compile ``kernel`` for sm_90: pointer arguments typed by ``pointers``, ``floats`` fp32, other arguments i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks._aot import aot_signature

    names = list(inspect.signature(kernel.fn).parameters)
    signature, constexprs = aot_signature(kernel, constexprs, {**{name: "fp32" for name in floats}, **pointers})
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": True})
    except RuntimeError as error:  # no ptxas for this Triton build: nothing to check against
        if "ptxas" in str(error).lower():
            pytest.skip(f"Triton cannot compile for sm_90 here: {error}")
        raise


@pytest.mark.parametrize("dim,block_g,mask", [(128, 16, True), (128, 16, False), (16, 16, True)])
def test_grouped_decode_kernel_compiles(dim, block_g, mask):
    from mmsdk.kernels import _grouped_decode_triton

    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "mask_ptr": "*i1", "po_ptr": "*fp32",
                "pl_ptr": "*fp32"}
    _compile(_grouped_decode_triton.decode_partial_grouped, pointers,
             {"D": dim, "HAS_MASK": mask, "BLOCK_G": block_g, "BLOCK_T": 64, "PDL": True}, floats=("qk_scale",))


# int8 / fp8 codes as the library launches them (channel pairs, even head_dim) and byte by byte (odd head_dim)
@pytest.mark.parametrize("fmt,codes,use_dot,pairs", [(0, "*u8", True, False), (0, "*u8", False, False),
                                                     (1, "*i8", True, True), (1, "*i8", False, True),
                                                     (1, "*i8", True, False), (2, "*fp8e4nv", True, True),
                                                     (2, "*fp8e4nv", False, True), (2, "*fp8e4nv", True, False)])
def test_packed_decode_kernel_compiles(fmt, codes, use_dot, pairs):
    from mmsdk.kernels import _kv_grouped_triton

    pointers = {"q_ptr": "*bf16", "kc_ptr": codes, "vc_ptr": codes, "ks_ptr": "*fp32", "len_ptr": "*i64",
                "mask_ptr": "*i1", "po_ptr": "*fp32", "pl_ptr": "*fp32", "kn_ptr": "*bf16", "vn_ptr": "*bf16",
                "vs_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16"}
    constexprs = {"FMT": fmt, "HAS_MASK": True, "USE_DOT": use_dot, "BLOCK_G": 16 if use_dot else 2, "BLOCK_T": 128,
                  "BLOCK_HD": 64, "APPEND": True, "ROPE": True, "V_AHEAD": use_dot, "ASM": True, "PDL": True,
                  "PAIRS": pairs}
    _compile(_kv_grouped_triton.decode_partial, pointers, constexprs, floats=("qk_scale",))


@pytest.mark.parametrize("fmt,codes,pairs", [(1, "*i8", True), (2, "*fp8e4nv", True), (1, "*i8", False)])
def test_code_dequantization_kernel_compiles(fmt, codes, pairs):
    from mmsdk.kernels import _kv_triton

    pointers = {"c_ptr": codes, "s_ptr": "*fp32", "out_ptr": "*bf16"}
    _compile(_kv_triton.dequantize, pointers, {"FMT": fmt, "BLOCK_T": 64, "BLOCK_HD": 64, "PAIRS": pairs})


@pytest.mark.parametrize("merge", [False, True])
def test_mha_decode_kernel_compiles(merge):
    """The int4 MHA kernel of a decode step (appends and rotates its token), merging its own splits or not."""
    from mmsdk.kernels import _kv_subnormal_triton

    pointers = {"q_ptr": "*bf16", "kc_ptr": "*i32", "vc_ptr": "*i32", "ks_ptr": "*fp32", "len_ptr": "*i64",
                "mask_ptr": "*i1", "po_ptr": "*fp32", "pl_ptr": "*fp32", "kn_ptr": "*bf16", "vn_ptr": "*bf16",
                "vs_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16", "cnt_ptr": "*i32"}
    constexprs = {"HAS_MASK": True, "BLOCK_T": 64, "W": 16, "APPEND": True, "ROPE": True, "FOLD": True, "KDOT": True,
                  "ASM": True, "STAGES": 3, "MERGE": merge, "BLOCK_S": 16, "PDL": True}
    _compile(_kv_subnormal_triton.decode_partial_int4_subnormal_mha, pointers, constexprs, floats=("qk_scale",))


@pytest.mark.parametrize("scaled", [True, False])
def test_combine_kernels_compile(scaled):
    from mmsdk.kernels import _split_merge_triton

    pointers = {"po_ptr": "*fp32", "pl_ptr": "*fp32", "vs_ptr": "*fp32", "out_ptr": "*bf16", "len_ptr": "*i64"}
    _compile(_split_merge_triton.decode_combine_natural, pointers,
             {"BLOCK_S": 64, "D": 128, "PDL": True, "ADVANCE": False, "SCALED": scaled})
    if scaled:
        _compile(_split_merge_triton.decode_combine, pointers,
                 {"BLOCK_S": 64, "BLOCK_HD": 64, "ADVANCE": True, "PDL": True})


@pytest.mark.parametrize("self_round,norm,row_scale", [(False, False, False), (True, False, False),
                                                        (True, True, False), (True, False, True)])
def test_idot_gemv_compiles(self_round, norm, row_scale):
    """The batch-1 integer-dot GEMV split along K, storing fp32 partials for the epilogue kernel, with bias; also
    rounding its own activations (kind "idotr"), with and without a folded RMSNorm (and so its gated-MLP twin), or
    scaled by a store's norm statistics."""
    from mmsdk.kernels import _w4a16_triton as kernels

    rounded = ("*bf16", "*bf16", "*bf16") if self_round else ("*i32", "*fp32", "*i32")
    pointers = {**dict(zip(("xq_ptr", "xs_ptr", "xsum_ptr"), rounded, strict=True)), "w_ptr": "*i32",
                "s_ptr": "*bf16", "z_ptr": "*u8", "b_ptr": "*bf16", "out_ptr": "*fp32", "r_ptr": "*bf16",
                "x_ptr": "*bf16", "g_ptr": "*bf16", "pq_ptr": "*bf16", "sq_ptr": "*fp32"}
    constants = dict(GROUP=128, HAS_ZP=True, HAS_BIAS=True, DIRECT=False, HAS_RESIDUAL=False, BLOCK_N=16, BLOCK_C=64,
                     ROW_MASK=False, ASM=True, PDL=True, SELF_ROUND=self_round, NORM=norm, PREQUANT=norm, PARTS=4,
                     ROW_SCALE=row_scale)
    _compile(kernels.gemv_idot, pointers, constants, floats=("eps",))
    if self_round and not row_scale:  # the gated MLP's twin, scaled by a store's statistics or with the norm folded in
        gated = {**pointers, "w2_ptr": "*i32", "s2_ptr": "*bf16", "z2_ptr": "*u8", "sq_ptr": "*fp32"}
        _compile(kernels.gemv_idot_gated, gated, dict(GROUP=128, HAS_ZP=True, DIRECT=True, BLOCK_N=8, BLOCK_C=64,
                                                      ROW_MASK=False, ASM=True, PDL=True, PARTS=4, ROW_SCALE=not norm,
                                                      SELF_ROUND=True, NORM=norm, PREQUANT=norm), floats=("eps",))


def test_quad_gemv_compiles():
    """The batch-1 "quad" GEMV split along K, storing fp32 partials for the epilogue kernel, with bias."""
    from mmsdk.kernels import _w4a16_triton as kernels

    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "b_ptr": "*bf16",
                "out_ptr": "*fp32", "w2_ptr": "*i32", "s2_ptr": "*bf16", "z2_ptr": "*u8", "r_ptr": "*bf16",
                "f_ptr": "*bf16", "g_ptr": "*bf16", "scaled_ptr": "*bf16", "sq_ptr": "*fp32"}
    constants = dict(GROUP=128, HAS_ZP=True, HAS_BIAS=True, DIRECT=False, PAIRED=False, BLOCK_N=16, BLOCK_C=64,
                     PDL=True, HAS_RESIDUAL=False, ROW_MASK=False, LEAVE_NORM=False)
    _compile(kernels.gemv_quad, pointers, constants, floats=("eps",))
