"""benchmarks/sm90_kv_builds.py: offline sm_90 builds of the MHA int4 KV kernel (Triton's bundled ptxas, no GPU).
The integer K dots must keep their edge over the float ones in the tile loop: fewer instructions per code word and
fewer registers (19.5 against 24.3 and 124 against 158 with Triton 3.9)."""

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
