"""Offline sm_90 builds (Triton's bundled ptxas, no GPU) of the kernels that run on integer dot products: each must
keep its edge over the float kernel it replaces in instructions per code word of its loop.

* benchmarks/sm90_kv_builds.py: the MHA int4 KV kernel's integer K dots against float ones (19.5 against 24.3
  instructions per word and 124 against 158 registers with Triton 3.9).
* benchmarks/sm90_gemv_builds.py: the batch-1 W4A16 GEMV on integer dots against the "quad" kernel, and the gated
  MLP's GEMV on integer dots against the "gated" quad kernel; the paired tensor-core GEMV of a few rows against the
  plain one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _tools_ready() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (tools / "ptxas").exists() and (tools / "cuobjdump").exists()


@pytest.mark.skipif(not _tools_ready(), reason="needs Triton with its CUDA backend tools (ptxas, cuobjdump)")
def test_integer_key_dots_take_fewer_instructions_per_word():
    from benchmarks.sm90_kv_builds import build

    floats = build(32, 1, True, None, True, False)
    integers = build(32, 1, True, None, True, True)
    assert integers["spill_stores"] == floats["spill_stores"] == 0
    assert integers["loop_instructions_per_word"] < 0.9 * floats["loop_instructions_per_word"]
    assert integers["registers"] < floats["registers"]
    assert "IDP" in integers["loop_top_opcodes"] and "IDP" not in floats["loop_top_opcodes"]


@pytest.mark.skipif(not _tools_ready(), reason="needs Triton with its CUDA backend tools (ptxas, cuobjdump)")
def test_integer_dot_gemv_takes_fewer_instructions_per_word():
    """benchmarks/sm90_gemv_builds.py: the batch-1 W4A16 GEMV on integer dots (kind "idot", 16 x 64 x 4) against the
    "quad" kernel's 8 x 128 x 4 (12.5 against 25.6 SASS instructions per weight word with Triton 3.9)."""
    from benchmarks.sm90_gemv_builds import build, build_idot

    quad = build(8, 128, 4)
    idot = build_idot(16, 64, 4)
    assert idot["spill_stores"] == quad["spill_stores"] == 0
    assert idot["loop_instructions_per_word"] < 0.6 * quad["loop_instructions_per_word"]
    assert "IDP" in idot["loop_top_opcodes"] and "IDP" not in quad["loop_top_opcodes"]


@pytest.mark.skipif(not _tools_ready(), reason="needs Triton with its CUDA backend tools (ptxas, cuobjdump)")
def test_gated_integer_dot_gemv_takes_fewer_instructions_per_word():
    """The gated MLP's GEMV on integer dots (kind "idot" of mmsdk.kernels.w4a16_gated, the decode step's 8 x 64 x 4)
    against the "gated" quad kernel's 8 x 128 x 4 (10.7 against 22.6 SASS instructions per weight word, 128 against
    255 registers with Triton 3.9); both build their one-slice program with its direct silu(gate) * up store."""
    from benchmarks.sm90_gemv_builds import build, build_idot

    quad = build(8, 128, 4, gated=True)
    idot = build_idot(8, 64, 4, gated=True)
    assert idot["spill_stores"] == quad["spill_stores"] == 0
    assert idot["loop_instructions_per_word"] < 0.6 * quad["loop_instructions_per_word"]
    assert idot["registers"] <= 128 < quad["registers"]
    assert "IDP" in idot["loop_top_opcodes"] and "IDP" not in quad["loop_top_opcodes"]


@pytest.mark.skipif(not _tools_ready(), reason="needs Triton with its CUDA backend tools (ptxas, cuobjdump)")
def test_paired_tensor_core_gemv_builds_like_the_plain_one():
    """The gated MLP's gate and up for 4 rows in one tensor-core GEMV (kind "mma" of mmsdk.kernels.w4a16_gated,
    the default for 2-16 rows) at one of the tuner's 4-row tiles (64 x 128 x 1), g128 and g32: no spills, and no more
    loop instructions per weight word than the plain kernel's (16.7 against 17.6 at g128 with Triton 3.6; 16.7 against
    17.2 with 3.9), the products on the tensor cores."""
    from benchmarks.sm90_gemv_builds import build_mma
    from mmsdk.kernels.w4a16 import gemv_candidates

    block_n, step_k, warps, _, kind, _, stages = gemv_candidates(4, 128)[1]
    assert kind == "mma"
    for group in (128, 32):
        plain = build_mma(block_n, step_k, warps, 4, group, stages)
        paired = build_mma(block_n, step_k, warps, 4, group, stages, paired=True)
        assert paired["spill_stores"] == plain["spill_stores"] == 0, (plain, paired)
        assert paired["loop_instructions_per_word"] <= plain["loop_instructions_per_word"], (plain, paired)
        assert group < 128 or "HMMA" in paired["loop_top_opcodes"], paired  # g32: scaling outnumbers the dots


@pytest.mark.skipif(not _tools_ready(), reason="needs Triton with its CUDA backend tools (ptxas, cuobjdump)")
def test_grouped_query_kv_kernel_default_tiles_build_without_spills():
    """benchmarks/sm90_gqa_builds.py: the grouped-query KV kernel at generic_config's tensor-core defaults for
    Qwen2-VL-7B's heads (128 tokens on 8 warps, 256 on 8, 128 on 4; with many batch rows 64 on 2, 3 tiles deep)
    spills nothing (but one register at 64 on 2 with Triton 3.9), runs both products on the tensor cores, and its
    tile loop reads the codes only through the pipelined copies into shared memory: no plain global
    loads, where a build that does not know the row width is a multiple of 16 issues one per code byte (64 per thread
    and tile at 128 tokens on 8 warps). The int8 / fp8 many-row tiles build the same way (64 tokens on 2 warps, 3
    deep, no spill with Triton 3.6 or 3.9, where int4's codes spilled one register with 3.9)."""
    from benchmarks.sm90_gqa_builds import build
    from mmsdk.kernels.kv_decode_choice import GENERIC_MIDDLE_CACHE, GENERIC_SHORT_CACHE, generic_config

    tiles = set()
    for slots in (GENERIC_SHORT_CACHE, GENERIC_MIDDLE_CACHE, 4 * GENERIC_MIDDLE_CACHE):
        for rows in (4, 32):
            block_t, warps, _, stages = generic_config(None, True, False, slots, rows=rows)[0]
            tiles.add((block_t, warps, stages))
    assert tiles == {(128, 8, 2), (256, 8, 2), (128, 4, 2), (64, 2, 3)}
    for block_t, warps, stages in sorted(tiles):
        built = build(block_t, warps, stages)
        # 64 on 2, 3 deep: no spills with Triton 3.6 (the H200 machine's, 195 registers), one 8-byte store with 3.9
        # (168 registers)
        assert built["spill_stores"] <= (1 if (block_t, warps, stages) == (64, 2, 3) else 0), built
        assert "HMMA" in built["loop_top_opcodes"] and "LDG" not in built["loop_top_opcodes"], built
    # int8 / fp8 codes with many rows (the other tiles halve int4's, which hold as many code bytes): no spills
    byte_tiles = set()
    for fmt in ("int8", "fp8"):
        for slots in (GENERIC_MIDDLE_CACHE, 4 * GENERIC_MIDDLE_CACHE):
            block_t, warps, _, stages = generic_config(None, True, False, slots, fmt=fmt, rows=32)[0]
            byte_tiles.add((fmt, block_t, warps, stages))
    assert byte_tiles == {("int8", 32, 2, 3), ("int8", 64, 2, 3), ("fp8", 32, 2, 3), ("fp8", 64, 2, 3)}
    for fmt, block_t, warps, stages in sorted(byte_tiles):
        built = build(block_t, warps, stages, fmt)
        assert built["spill_stores"] == 0, built
        assert "HMMA" in built["loop_top_opcodes"] and "LDG" not in built["loop_top_opcodes"], built
