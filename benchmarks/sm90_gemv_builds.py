"""Offline sm_90 builds of the batch-1 "quad" GEMVs per tile: registers, spills, barriers, weight bytes per thread.

Triton compiles for an H100/H200 target on any machine (no GPU); the build shows what a tile costs before device time is
spent on it. ``loop_instructions_per_word`` counts the SASS instructions of the first K loop (for the quad kernels the
whole steps, without K masks; ``every_loop_instructions_per_word`` lists each loop) per weight word a thread handles
(the kernel's issue cost per byte: an H200 issues about 33e12 thread instructions per second, 132 multiprocessors x 4
schedulers x 32 lanes x 1.98 GHz). Barriers (``bar.sync`` in the PTX) count the shared-memory round trips the compiler
inserts to split the activations by nibble position; registers and the stack (spills) come from
``cuobjdump -res-usage``, spill stores are the ``STL`` instructions of the SASS. ``gemv_quad`` is built as the tuner
launches it with split K (fp32 partials); ``gemv_quad_gated`` (a gated MLP's gate and up rows in one program) with one K
slice, storing ``silu(gate) * up``. ``gemv_mma`` (the tensor-core kind) is built per group size, activation rows
(the accumulator's columns) and candidate tile of ``mmsdk.kernels.w4a16._MMA_CANDIDATES``. ``gemv_idot`` (kind "idot":
integer dot products against activations rounded to 16-bit integers) is built per tile of ``IDOT_TILES`` with PDL, as
a captured decode step launches it; ``gemv_idot_gated`` (its gated-MLP twin) per tile of ``IDOT_GATED_TILES``, one K
slice, scaled by a norm's statistics. ``--norm`` builds the quad
kernels with an RMSNorm folded in (``NORM``: the GEMV reads the norm's input, mmsdk/kernels/norm_fold.py).

    python benchmarks/sm90_gemv_builds.py [--kernels quad,gated,mma,mma_paired,idot,idotr,idot_gated] [--norm]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's root

from benchmarks._aot import aot_signature  # noqa: E402

TILES = [(32, 16, 4), (16, 64, 4), (16, 32, 2), (8, 128, 4), (8, 128, 2), (16, 64, 2), (8, 64, 2), (4, 64, 1),
         (8, 32, 1), (4, 128, 1), (8, 64, 1), (2, 128, 1)]  # (rows, quads of 4 words, warps)
IDOT_TILES = [(8, 128, 4), (16, 64, 4), (16, 32, 2), (32, 32, 4), (16, 128, 4), (32, 32, 2)]
IDOT_GATED_TILES = [(8, 64, 4), (4, 64, 2), (4, 32, 1), (16, 32, 4), (8, 32, 2), (8, 64, 2)]
GATED_TILES = [(8, 64, 2), (8, 128, 4), (16, 64, 2), (4, 64, 1), (4, 128, 1), (8, 32, 1)]
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "b_ptr": "*bf16", "out_ptr": "*fp32",
            "w2_ptr": "*i32", "s2_ptr": "*bf16", "z2_ptr": "*u8", "r_ptr": "*bf16", "f_ptr": "*bf16", "eps": "fp32"}


def build(rows: int, quads: int, warps: int, gated: bool = False, norm: bool = False) -> dict[str, object]:
    """One g128 tile without zero points, bf16 activations and scales (``norm``: an RMSNorm folded in, bf16 factors,
    its squares summed in the K loop as a one-slice program does)."""
    from mmsdk.kernels import _w4a16_triton as kernels

    kernel = kernels.gemv_quad_gated if gated else kernels.gemv_quad
    constants: dict[str, object] = dict(GROUP=128, HAS_ZP=False, DIRECT=gated, BLOCK_N=rows, BLOCK_C=quads, PDL=False,
                                        ROW_MASK=False,  # the 7B shapes' rows are whole multiples of every tile's
                                        NORM=norm, NORM_BLOCK=min(4096, 1024 * warps), WHOLE_ROW=norm)
    if gated:
        constants.update(ROW_SCALE=False, PARTS=1)
    else:
        constants.update(HAS_BIAS=False, PAIRED=False, PREFETCH=False)
    pointers = {**POINTERS, "out_ptr": "*bf16"} if gated else POINTERS
    words = rows * quads * 4 * (2 if gated else 1) / (32 * warps)  # weight words per thread and step
    return {"kernel": kernel.__name__ + (" + norm" if norm else ""), "tile": (rows, quads, warps),
            **_compiled(kernel, constants, pointers, {"num_warps": warps}, words)}


def build_idot(rows: int, quads: int, warps: int, gated: bool = False, self_round: bool = False) -> dict[str, object]:
    """One g128 tile of the integer-dot GEMV without zero points, bf16 scales and output, one K slice, PDL on
    (``gated``: a gated MLP's gate and up rows in one program, scaled by the post-attention norm's statistics, as the
    decode step launches it; ``self_round``: kind "idotr", each step's quads rounded in the program)."""
    from mmsdk.kernels import _w4a16_triton as kernels

    constants: dict[str, object] = dict(GROUP=128, HAS_ZP=False, DIRECT=True, BLOCK_N=rows, BLOCK_C=quads,
                                        ROW_MASK=False, ASM=True, PDL=True)
    if gated:
        constants.update(PARTS=4, ROW_SCALE=True)
    else:
        constants.update(HAS_BIAS=False, HAS_RESIDUAL=False, SELF_ROUND=self_round)
    pointers = {**POINTERS, "xq_ptr": "*i32", "xs_ptr": "*fp32", "xsum_ptr": "*i32", "out_ptr": "*bf16",
                "sq_ptr": "*fp32"}
    if self_round:  # the rounding kernel's buffers are not read; x stands in for them, as the launch passes it
        pointers.update(xq_ptr="*bf16", xs_ptr="*bf16", xsum_ptr="*bf16")
    kernel = kernels.gemv_idot_gated if gated else kernels.gemv_idot
    words = rows * quads * 4 * (2 if gated else 1) / (32 * warps)  # weight words per thread and step
    return {"kernel": kernel.__name__ + ("[idotr]" if self_round else ""), "tile": (rows, quads, warps),
            **_compiled(kernel, constants, pointers, {"num_warps": warps}, words)}


def build_mma(block_n: int, step_k: int, warps: int, block_m: int, group: int, stages: int,
              paired: bool = False) -> dict[str, object]:
    """One tile of the tensor-core GEMV (kind "mma") for ``block_m`` activation rows, bf16, no zero points; with
    ``paired`` a gated MLP's gate and up rows in each program (one K slice, storing ``silu(gate) * up``; words per
    thread count both weights)."""
    from mmsdk.kernels import _w4a16_triton as kernels

    step_g = max(1, step_k // group)
    constants: dict[str, object] = dict(GROUP=group, HAS_ZP=False, HAS_BIAS=False, DIRECT=paired, BLOCK_N=block_n,
                                        BLOCK_M=block_m, STEP_G=step_g, ASM=True, PDL=False, HAS_RESIDUAL=False,
                                        PAIRED=paired)
    pointers = {**POINTERS, "w_ptr": "*u8", "w2_ptr": "*u8", "out_ptr": "*bf16" if paired else "*fp32"}
    words = block_n * group * step_g / 8 / (32 * warps) * (2 if paired else 1)
    return {"kernel": "gemv_mma", "paired": paired, "tile": (block_n, step_k, warps, block_m, stages), "group": group,
            **_compiled(kernels.gemv_mma, constants, pointers, {"num_warps": warps, "num_stages": stages}, words)}


def _compiled(kernel: object, constants: dict[str, object], pointers: dict[str, str], options: dict[str, int],
              words: float, divisible: tuple[str, ...] = ("KW", "K_in", "N", "stride_xm"),
              top: int = 6) -> dict[str, object]:
    """Registers, stack, spills, barriers and the K loop's instructions per weight word of one sm_90 build.

    ``divisible``: the integer arguments built as multiples of 16, as Triton's launcher specializes them when they
    are (a kernel's loads vectorize only where the compiler knows that of its strides). ``top``: how many of the loop's
    most frequent opcodes to list."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names  # type: ignore[attr-defined]
    signature, constants = aot_signature(kernel, constants, pointers)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n not in constants and (n.endswith("_ptr") or n in divisible)
               and pointers.get(n) != "fp32"}
    compiled = triton.compile(ASTSource(kernel, signature, constants, aligned),
                              target=GPUTarget("cuda", 90, 32), options={**options, "enable_fp_fusion": True})
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "gemv.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True).stdout
    fields = dict(part.split(":", 1) for part in usage.split() if part.count(":") == 1 and part[0].isupper())
    loops = loop_bodies(sass)
    loop = loops[0] if loops else []
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]), "spill_stores": sass.count(" STL"),
            "barriers": compiled.asm["ptx"].count("bar.sync"),
            "weight_bytes_per_thread_and_step": int(words * 4),
            "loop_instructions": len(loop), "loop_instructions_per_word": round(len(loop) / words, 1),
            "every_loop_instructions_per_word": [round(len(body) / words, 1) for body in loops],
            "loop_top_opcodes": dict(Counter(_opcode(line) for line in loop).most_common(top))}


def loop_bodies(sass: str) -> list[list[str]]:
    """The SASS instructions of each K loop (a backward branch's span, the outermost where spans nest), in address
    order. The quad kernels' first loop runs the whole steps (loads without K masks), the second the slice's last,
    partial step."""
    lines = [line for line in sass.splitlines() if _ADDRESS.match(line)]
    spans = []
    for line in lines:
        target = re.search(r"BRA\s+`?\(?\.?L?_?x?_?(?:0x)?([0-9a-f]+)", line)
        if target and int(target.group(1), 16) < _address(line):
            spans.append((int(target.group(1), 16), _address(line)))
    outer = [s for s in spans if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in spans)]
    return [[line for line in lines if first <= _address(line) <= last] for first, last in sorted(outer)]


_ADDRESS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")


def _address(line: str) -> int:
    return int(_ADDRESS.match(line).group(1), 16)  # type: ignore[union-attr]


def _opcode(line: str) -> str:
    return re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default="quad,gated,mma,idot,idot_gated",
                        help="comma-separated: quad, gated, mma, mma_paired, idot, idotr, idot_gated")
    parser.add_argument("--norm", action="store_true", help="quad kernels with an RMSNorm folded in")
    args = parser.parse_args()
    chosen = args.kernels.split(",")
    if "quad" in chosen:
        for tile in TILES:
            print(build(*tile, norm=args.norm), flush=True)
    if "gated" in chosen:
        for tile in GATED_TILES:
            print(build(*tile, gated=True, norm=args.norm), flush=True)
    if "idot" in chosen:
        for tile in IDOT_TILES:
            print(build_idot(*tile), flush=True)
    if "idotr" in chosen:
        for tile in IDOT_TILES:
            print(build_idot(*tile, self_round=True), flush=True)
    if "idot_gated" in chosen:
        for tile in IDOT_GATED_TILES:
            print(build_idot(*tile, gated=True), flush=True)
    if "mma" in chosen:
        from mmsdk.kernels.w4a16 import _MMA_CANDIDATES

        for group in (128, 64, 32):
            for block_m in (1, 8, 16):
                for cfg in _MMA_CANDIDATES:
                    print(build_mma(cfg[0], cfg[1], cfg[2], block_m, group, cfg[6]), flush=True)
    if "mma_paired" in chosen:  # the gated MLP's gate and up for 2-16 rows (the default; MMSDK_PAIRED_ROWS=0: off)
        from mmsdk.kernels.w4a16 import _MMA_CANDIDATES

        for group in (128, 32):
            for block_m in (4, 8, 16):
                for cfg in _MMA_CANDIDATES:
                    print(build_mma(cfg[0], cfg[1], cfg[2], block_m, group, cfg[6], paired=True), flush=True)


if __name__ == "__main__":
    main()
