"""Offline sm_90 builds of the grouped-query KV decode kernel (variant "generic" on the tensor cores, int4 codes) at
its default tiles and one more: registers, spills and the SASS instructions of one pass of its tile loop per thread,
with the loop's most frequent opcodes, as benchmarks/sm90_kv_builds.py does for the MHA kernel. No GPU needed.

Qwen2-VL-7B's heads: groups of 7 query heads padded to the tensor cores' 16 rows, head_dim 128, V loaded with K, PDL,
no mask, append or RoPE. The tiles are mmsdk.kernels.kv_decode_choice.generic_config's defaults (128 tokens on 8
warps up to 2k cache slots, 256 on 8 up to 4k, 128 on 4 beyond and with many batch rows), the 64-token tile on 2 warps
that the sweeps found as fast at 4k (int8 / fp8 codes' default with many batch rows, 3 tiles deep), and 128 tokens on 4
warps' twin on 8. A thread's instructions per tile say how long one program's
arithmetic is for its warps; compare builds with each other, not with a clock.

    python benchmarks/sm90_gqa_builds.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's root

from benchmarks.sm90_gemv_builds import _compiled  # noqa: E402

BUILDS = [(128, 8), (256, 8), (128, 4), (64, 2)]  # (BLOCK_T, num_warps)
POINTERS = {"q_ptr": "*bf16", "kc_ptr": "*u8", "vc_ptr": "*u8", "ks_ptr": "*fp32", "len_ptr": "*i64",
            "mask_ptr": "*fp32", "po_ptr": "*fp32", "pl_ptr": "*fp32", "kn_ptr": "*bf16", "vn_ptr": "*bf16",
            "vs_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "qk_scale": "fp32"}
# integer arguments that are multiples of 16 at these shapes (strides, head_dim, row width, slots, split length)
DIVISIBLE = ("sq_b", "sq_h", "TMAX", "D", "HDP", "SPLIT_T", "sk_b", "sk_h", "sv_b", "sv_h", "sc_b")


def build(block_t: int, warps: int, stages: int = 2, fmt: str = "int4") -> dict[str, object]:
    """One build for head_dim 128 (per token 64 code bytes for K and as many for V in int4; int8 / fp8 twice that,
    read as channel pairs, as decode_attention launches them)."""
    from mmsdk.kernels import _kv_grouped_triton as kernels
    from mmsdk.kernels.kv_decode import FORMATS

    byte_codes = fmt != "int4"
    constants: dict[str, object] = dict(FMT=FORMATS[fmt], HAS_MASK=False, USE_DOT=True, BLOCK_G=16, BLOCK_T=block_t,
                                        BLOCK_HD=64, V_AHEAD=True, ASM=True, PDL=True, PAIRS=byte_codes, APPEND=False,
                                        ROPE=False)
    code_type = {"int4": "*u8", "int8": "*i8", "fp8": "*fp8e4nv"}[fmt]
    pointers = {**POINTERS, "kc_ptr": code_type, "vc_ptr": code_type}
    code_words = block_t * 64 * (4 if byte_codes else 2) / 4 / (32 * warps)  # K and V code words per thread and tile
    result = _compiled(kernels.decode_partial, constants, pointers, {"num_warps": warps, "num_stages": stages},
                       code_words, DIVISIBLE, top=10)
    result["code_bytes_per_thread_and_tile"] = result.pop("weight_bytes_per_thread_and_step")
    return {"config": dict(block_t=block_t, warps=warps, stages=stages, fmt=fmt), **result}


def main() -> None:
    for spec in BUILDS:
        print(build(*spec), flush=True)


if __name__ == "__main__":
    main()
