"""Registers and spills of the packed-KV decode kernel, compiled ahead of time for sm_90 (no GPU needed).

A Triton kernel whose tiles hold more values than the 255 registers a thread may have spills them to local memory,
which a timing shows only on the GPU. This script compiles ``mmsdk.kernels._kv_grouped_triton.decode_partial``
(the "generic" kernel: int8 / fp8 codes, and int4 codes on grouped-query heads) for each code format and tile
through Triton's compiler and asks the ptxas that ships with Triton's wheel for its resource report. The numbers are
this machine's Triton's; the GPU machine's Triton may allocate differently.

    python benchmarks/kernel_registers.py --out benchmarks/results/kernel_registers.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

FORMATS = {0: ("int4", "*u8"), 1: ("int8", "*i8"), 2: ("fp8", "*fp8e4nv")}
POINTERS = {"q_ptr": "*fp16", "ks_ptr": "*fp32", "len_ptr": "*i64", "mask_ptr": "*fp32", "po_ptr": "*fp32",
            "pl_ptr": "*fp32", "kn_ptr": "*fp16", "vn_ptr": "*fp16", "vs_ptr": "*fp32", "cos_ptr": "*fp16",
            "sin_ptr": "*fp16"}
# (what the launch is, HAS_MASK, APPEND and ROPE, BLOCK_T, num_warps, V loaded with K): the grouped-query launches of
# a decode step (a self-attention layer appends its token and rotates q / k; Mllama's image layers take a mask)
CASES = (("self, short cache", False, True, 128, 8, True), ("self, short cache", False, True, 64, 8, True),
         ("self, middle cache", False, True, 256, 8, True), ("self, middle cache", False, True, 128, 8, True),
         ("image, long", True, False, 128, 4, True), ("image, long", True, False, 64, 4, True))


def _ptxas() -> Path:
    """The newest ptxas in Triton's wheel (it must read the PTX version Triton writes)."""
    import triton

    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (folder / name).exists():
            return folder / name
    raise FileNotFoundError(f"no ptxas in {folder}: install a Triton wheel that ships one")


def resources(fmt: int, mask: bool, append: bool, block_t: int, warps: int, v_ahead: bool) -> dict[str, Any]:
    """ptxas's registers and spill bytes for one compiled variant of the generic decode kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mmsdk.kernels import _kv_grouped_triton

    kernel = _kv_grouped_triton.decode_partial
    constants = dict(FMT=fmt, HAS_MASK=mask, USE_DOT=True, BLOCK_G=16, BLOCK_T=block_t, BLOCK_HD=64, APPEND=append,
                     ROPE=append, V_AHEAD=v_ahead, ASM=True, PDL=True, PAIRS=fmt != 0)
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in ("kc_ptr", "vc_ptr"):
            signature[name] = FORMATS[fmt][1]
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": 2})
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([str(_ptxas()), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(folder) / "k.o")],
                                capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, report)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads")}


def main() -> None:
    import triton

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("kernel_registers.json"))
    args = parser.parse_args()
    rows = []
    for label, mask, append, block_t, warps, v_ahead in CASES:
        for fmt, (name, _) in FORMATS.items():
            rows.append({"launch": label, "format": name, "block_t": block_t, "warps": warps, "v_ahead": v_ahead,
                         **resources(fmt, mask, append, block_t, warps, v_ahead)})
            print(rows[-1], flush=True)
    results = {"command": "python benchmarks/kernel_registers.py", "triton": triton.__version__,
               "ptxas": _ptxas().name, "target": "sm_90a", "rows": rows}
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
