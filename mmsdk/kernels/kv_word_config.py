"""Launch configurations of the int4 word decode kernels behind :mod:`mmsdk.kernels.kv_decode` ("subnormal" and
"magic"), with the H200 measurements behind each default (benchmarks/gpu_kernel_sweeps.py mha; each call reads its
cache from HBM, as each layer of a model does).

A config is ``(BLOCK_T, num_warps, target programs[, num_stages[, prefetch[, fold[, kdot]]]])``; entries left out, or
given as None, take the defaults for the cache's size. The last three are the subnormal kernel's only:

* ``num_stages``: for "subnormal" Triton pipelines the tile loop (the next ``num_stages - 1`` tiles' K and V through
  shared memory); for "magic" it is the launch's ``num_stages``.
* ``prefetch``: the next tile's K and V loaded into registers before this tile's arithmetic.
* ``fold``: V's sums over a quarter of each tile's tokens (fewer registers, the same FMAs).
* ``kdot``: the scores as integer dot products of K's codes with the query rounded to 16-bit integers
  (mmsdk/kernels/_kv_intdot_triton.py: 7 instructions per word of K instead of ~18).
"""

from __future__ import annotations

from dataclasses import dataclass

TARGET_PROGRAMS = 528  # about four per multiprocessor on an H100/H200


@dataclass(frozen=True)
class WordLaunch:
    """One launch of an int4 word kernel: tile, warps, programs and the subnormal kernel's options."""

    block_t: int
    warps: int
    target: int
    stages: int | None
    prefetch: bool
    fold: bool
    kdot: bool


def _subnormal_default(t_max: int) -> WordLaunch:
    """The subnormal kernel's defaults for a cache of ``t_max`` slots (32 MHA heads of LLaVA-1.5-7B, H200).

    Up to 4k slots: 16-token tiles over 1056 one-warp programs, the loop pipelined in 4 stages (twentieth pass:
    7.34 against 7.82 µs for 32-token tiles over 528 programs with the tile ahead in registers at 1280 tokens, 10.54
    against 10.96 at 4k, h200_kernel_sweeps_kv_combine.json; LLaVA-1.5-7B's step 1.803 against 1.819-1.824 ms,
    h200_step_attention_g32_19.json; before the combine kernels came to load their partials first the same tile had
    lost, 8.17 against 7.88 and 11.37 against 11.22). Longer caches: 32-token tiles pipelined in 3 stages over 1056
    programs (nineteenth pass, h200_kernel_sweeps_mha_stages.json: 24.89 µs at 16k against 26.45 with the tile ahead
    in registers and 29.79 for 528 pipelined programs; 8k not measured).
    Integer K dots: 11.49 against 11.84 µs at 4k and 26.55 against 28.34 at 16k, equal at 1280 tokens (8.37 / 8.31;
    h200_kernel_sweeps_mha_kdot.json). Folded V sums: 8.02 / 11.81 / 28.23 against 8.18 / 12.09 / 28.32 µs at
    1280 / 4k / 16k tokens in one run, equal in the next (h200_kernel_sweeps_mha_fold.json, _ahead2.json).
    """
    if t_max <= 4096:
        return WordLaunch(16, 1, 2 * TARGET_PROGRAMS, 4, False, True, True)
    return WordLaunch(32, 1, 2 * TARGET_PROGRAMS, 3, False, True, True)


def word_launch(config: tuple[int | None, ...] | None, variant: str, group: int, t_max: int) -> WordLaunch:
    """``config`` checked and completed from the defaults of ``variant`` ("subnormal" or "magic") for a cache of
    ``t_max`` slots with ``group`` query heads per KV head ("magic": fastest in an H200 sweep, MHA)."""
    if variant == "subnormal":
        default = _subnormal_default(t_max)
    else:
        default = WordLaunch(64, 4, TARGET_PROGRAMS, None, False, False, False) if group >= 3 else \
            WordLaunch(32, 2, 2 * TARGET_PROGRAMS, None, False, False, False)
    if config is None:
        return default
    longest = 7 if variant == "subnormal" else 4
    if not 3 <= len(config) <= longest:
        raise ValueError(f"decode config {config!r}: pass (BLOCK_T, num_warps, target programs[, num_stages]); a "
                         "fifth entry (load ahead) is for variants 'subnormal' and 'generic' only, a sixth (fold "
                         "V's tokens) and a seventh (integer K dots) for 'subnormal'")
    fields = [default.block_t, default.warps, default.target, default.stages, default.prefetch, default.fold,
              default.kdot]
    for i, value in enumerate(config):
        if value is not None:
            fields[i] = bool(value) if i >= 4 else value
    return WordLaunch(*fields)
