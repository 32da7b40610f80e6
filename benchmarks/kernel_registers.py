"""Registers and spills of the packed-KV decode kernel, compiled ahead of time for sm_90 (no GPU needed).

A Triton kernel whose tiles hold more values than the 255 registers a thread may have spills them to local memory,
which a timing shows only on the GPU. This script compiles ``mmsdk.kernels._kv_grouped_triton.decode_partial``
(the "generic" kernel: int8 / fp8 codes, and int4 codes on grouped-query heads) for each code format and tile
through Triton's compiler and asks the ptxas that ships with Triton's wheel for its resource report, and does the
same for the int4 MHA kernel of a decode step (merging its splits itself or not) and its combine kernel. The numbers
are this machine's Triton's; the GPU machine's Triton may allocate differently.

It also serves as a compile check against the GPU machine's Triton, whose front end differs (3.6 rejects a string
passed as a constexpr argument, which 3.9 takes): unpack that version's wheel, make its ptxas executable and put it
first on the path.

    python benchmarks/kernel_registers.py --out benchmarks/results/kernel_registers.json
    pip download --no-deps -d wheels triton==3.6.0 && python -m zipfile -e wheels/triton-3.6.0-*.whl t36 \
        && chmod +x t36/triton/backends/nvidia/bin/* && PYTHONPATH=t36 python benchmarks/kernel_registers.py
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's root

from benchmarks._aot import aot_signature  # noqa: E402

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


def compiled_resources(kernel: Any, signature: dict[str, str], constants: dict[str, Any],
                       warps: int) -> dict[str, Any]:
    """Compile ``kernel`` for sm_90 through this machine's Triton and read ptxas's registers and spill bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants = aot_signature(kernel, constants, signature)
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": 2, "enable_fp_fusion": True})
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


def resources(fmt: int, mask: bool, append: bool, block_t: int, warps: int, v_ahead: bool) -> dict[str, Any]:
    """ptxas's registers and spill bytes for one compiled variant of the generic decode kernel."""
    from mmsdk.kernels import _kv_grouped_triton

    kernel = _kv_grouped_triton.decode_partial
    constants = dict(FMT=fmt, HAS_MASK=mask, USE_DOT=True, BLOCK_G=16, BLOCK_T=block_t, BLOCK_HD=64, APPEND=append,
                     ROPE=append, V_AHEAD=v_ahead, ASM=True, PDL=True, PAIRS=fmt != 0)
    signature = {name: FORMATS[fmt][1] if name in ("kc_ptr", "vc_ptr") else POINTERS.get(name, "i32")
                 for name in kernel.arg_names}
    signature["qk_scale"] = "fp32"
    return compiled_resources(kernel, signature, constants, warps)


def mha_resources(merge: bool) -> dict[str, Any]:
    """The int4 MHA ("subnormal") decode kernel of a decode step (LLaVA's heads: appends and rotates its token,
    integer K dots, 64-token tiles pipelined in 3 stages, 4 warps), merging its splits itself or not."""
    from mmsdk.kernels import _kv_subnormal_triton

    kernel = _kv_subnormal_triton.decode_partial_int4_subnormal_mha
    constants = dict(HAS_MASK=False, BLOCK_T=64, W=16, PREFETCH=False, APPEND=True, ROPE=True, FOLD=True, KDOT=True,
                     ASM=True, STAGES=3, MERGE=merge, BLOCK_S=16, PDL=True)
    words = {"kc_ptr": "*i32", "vc_ptr": "*i32", "q_ptr": "*bf16", "kn_ptr": "*bf16", "vn_ptr": "*bf16",
             "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16", "cnt_ptr": "*i32"}
    signature = {name: words.get(name, POINTERS.get(name, "i32")) for name in kernel.arg_names}
    signature["qk_scale"] = "fp32"
    return compiled_resources(kernel, signature, constants, 4)


def combine_resources() -> dict[str, Any]:
    """The combine kernel that merges the MHA kernel's splits when it does not merge them itself."""
    from mmsdk.kernels import _split_merge_triton

    kernel = _split_merge_triton.decode_combine_natural
    signature = {name: {"out_ptr": "*bf16"}.get(name, POINTERS.get(name, "*fp32" if name.endswith("_ptr") else "i32"))
                 for name in kernel.arg_names}
    return compiled_resources(kernel, signature, dict(BLOCK_S=16, D=128, PDL=True, ADVANCE=True, SCALED=True), 4)


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
    for merge in (False, True):
        rows.append({"launch": "MHA int4 step kernel" + (", merging its splits" if merge else ""),
                     **mha_resources(merge)})
        print(rows[-1], flush=True)
    rows.append({"launch": "MHA combine kernel", **combine_resources()})
    print(rows[-1], flush=True)
    results = {"command": "python benchmarks/kernel_registers.py", "triton": triton.__version__,
               "ptxas": _ptxas().name, "target": "sm_90a", "rows": rows}
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
