"""Offline sm_90 builds of the batch-1 "quad" GEMV per tile: registers, barriers, weight bytes per thread (no GPU).

Triton compiles for an H100/H200 target on any machine; the build shows what a tile costs before device time is
spent on it. Barriers (``bar.sync`` in the PTX) count the shared-memory round trips the compiler inserts to split the
activations by nibble position; registers come from ``cuobjdump -res-usage``.

    python benchmarks/sm90_gemv_builds.py
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

TILES = [(32, 16, 4), (16, 64, 4), (16, 32, 2), (8, 128, 4), (16, 64, 2), (8, 64, 2), (4, 64, 1), (8, 32, 1),
         (4, 128, 1), (8, 64, 1), (2, 128, 1)]  # (rows, quads of 4 words, warps)
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "b_ptr": "*bf16", "out_ptr": "*fp32",
            "w2_ptr": "*i32", "s2_ptr": "*bf16", "z2_ptr": "*u8"}


def build(rows: int, quads: int, warps: int) -> dict[str, object]:
    """One g128 tile without zero points, split K (fp32 partials), as the tuner launches it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mmsdk.kernels import _w4a16_triton as kernels

    names = kernels.gemv_quad.arg_names
    constants = dict(GROUP=128, HAS_ZP=False, HAS_BIAS=False, DIRECT=False, PAIRED=False, BLOCK_N=rows,
                     BLOCK_C=quads, PREFETCH=False)
    signature = {n: "constexpr" if n in constants else POINTERS.get(n, "i32") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n not in constants and (n.endswith("_ptr") or n in ("KW", "K_in", "N", "stride_xm"))}
    compiled = triton.compile(ASTSource(kernels.gemv_quad, signature, constants, aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "gemv.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    registers = next(int(part.split(":")[1]) for part in usage.split() if part.startswith("REG:"))
    return {"tile": (rows, quads, warps), "registers": registers, "barriers": compiled.asm["ptx"].count("bar.sync"),
            "weight_bytes_per_thread_and_step": rows * quads * 16 // (32 * warps)}


def main() -> None:
    for tile in TILES:
        print(build(*tile), flush=True)


if __name__ == "__main__":
    main()
