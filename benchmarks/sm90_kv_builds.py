"""Offline sm_90 builds of the MHA int4 KV decode kernel (variant "subnormal") per option: registers, spills and the
tile loop's SASS instructions per code word a thread handles (K and V words together), as
benchmarks/sm90_gemv_builds.py does for the GEMVs. No GPU needed; the numbers say what an option costs in issue slots
before device time is spent on it (an H200 issues about 33e12 thread instructions per second).

The static count includes the lazy rescale's branch (taken rarely), so it overstates the loop a little; compare
builds with each other, not with a clock.

    python benchmarks/sm90_kv_builds.py
"""

from __future__ import annotations

from benchmarks.sm90_gemv_builds import _compiled

# (BLOCK_T, num_warps, prefetch, stages, fold, kdot): the earlier default, this pass's options, and the defaults now
BUILDS = [(32, 1, True, None, True, False), (32, 1, True, None, True, True), (32, 1, False, 3, True, True),
          (16, 1, False, 4, True, True), (64, 2, False, 3, True, True)]
POINTERS = {"q_ptr": "*bf16", "kc_ptr": "*i32", "vc_ptr": "*i32", "ks_ptr": "*fp32", "len_ptr": "*i64",
            "mask_ptr": "*fp32", "po_ptr": "*fp32", "pl_ptr": "*fp32", "kn_ptr": "*bf16", "vn_ptr": "*bf16",
            "vs_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "qk_scale": "fp32"}


def build(block_t: int, warps: int, prefetch: bool, stages: int | None, fold: bool, kdot: bool) -> dict[str, object]:
    """One build for head_dim 128 (16 words per token), no mask, no append or RoPE."""
    from mmsdk.kernels import _kv_subnormal_triton as kernels

    constants: dict[str, object] = dict(HAS_MASK=False, BLOCK_T=block_t, W=16, PREFETCH=prefetch, APPEND=False,
                                        ROPE=False, FOLD=fold, KDOT=kdot, ASM=True, STAGES=stages)
    words = block_t * 16 * 2 / (32 * warps)  # K and V words per thread and tile
    result = _compiled(kernels.decode_partial_int4_subnormal_mha, constants, POINTERS, {"num_warps": warps}, words)
    result["code_bytes_per_thread_and_tile"] = result.pop("weight_bytes_per_thread_and_step")
    return {"config": dict(block_t=block_t, warps=warps, prefetch=prefetch, stages=stages, fold=fold, kdot=kdot),
            **result}


def main() -> None:
    for spec in BUILDS:
        print(build(*spec), flush=True)


if __name__ == "__main__":
    main()
