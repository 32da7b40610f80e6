"""Which decode kernel a packed-KV attention call takes, with which tiles and how many splits (mmsdk.kernels.kv_decode).

The word kernels' launch defaults are in mmsdk.kernels.kv_word_config; the "generic" kernel's are here.
"""

from __future__ import annotations

import torch

from mmsdk.kernels.kv_word_config import TARGET_PROGRAMS

__all__ = ["GENERIC_MIDDLE_CACHE", "GENERIC_SHORT_CACHE", "MANY_ROWS_LONG", "MANY_ROWS_MIDDLE", "VARIANTS",
           "byte_pairs", "ceil_div", "completed_config", "generic_config", "launched_without_pdl", "pick_variant",
           "pow2", "splits", "words_ready"]


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1): a Triton block size."""
    return 1 << max(0, (int(n) - 1).bit_length())


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up."""
    return -(-a // b)


def splits(rows: int, t_max: int, block_t: int, target: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(number of splits, tokens per split) so that about ``target`` programs cover ``t_max``."""
    wanted = max(1, min(ceil_div(t_max, block_t), ceil_div(target, rows)))
    split_t = ceil_div(ceil_div(t_max, wanted), block_t) * block_t
    return ceil_div(t_max, split_t), split_t


def words_ready(key_codes: torch.Tensor, value_codes: torch.Tensor, fmt: str, d: int) -> bool:
    """True when int4 codes can be read as int32 words (head_dim a power of two >= 16, aligned rows)."""
    return (fmt == "int4" and d >= 16 and d & (d - 1) == 0 and key_codes.shape[-1] * 2 == d
            and all(c.is_contiguous() and c.data_ptr() % 4 == 0 for c in (key_codes, value_codes)))


# Decode kernels for int4 codes that read as int32 words: "subnormal" (MHA only, _kv_subnormal_triton.py: K
# scored by integer dot products, V's nibbles decoded as subnormal floats, per-thread V sums, lazy rescaling; launch
# defaults in kv_word_config.py) and "magic" (nibbles OR-ed into 2**23, V reduced every tile); "generic" is the byte
# kernel every format can use.
VARIANTS = ("subnormal", "magic", "generic")


def byte_pairs(key_codes: torch.Tensor, value_codes: torch.Tensor, fmt: str, d: int) -> bool:
    """True when int8 / fp8 codes can be read as 16-bit channel pairs: an even head_dim, rows of ``d`` contiguous
    codes, 2-byte aligned. Read byte by byte, every other one per load, decode attention over Mllama's image K/V
    (6404 tokens, 32 / 8 heads) took 87 µs on an H200 against 13 µs as pairs (int4: 10 µs;
    benchmarks/results/h200_kv_formats_pairs.json)."""
    return (fmt != "int4" and d % 2 == 0 and key_codes.shape[-1] == d
            and all(c.stride(-1) == 1 and c.stride(-2) == d and c.data_ptr() % 2 == 0
                    for c in (key_codes, value_codes)))


def pick_variant(variant: str | None, words: bool, group: int) -> str:
    """The kernel to run: ``variant`` if these inputs allow it, else the default for these inputs.

    Defaults: "subnormal" for MHA words; "magic" for groups of 2 and "generic" (tensor cores) for larger
    groups. "subnormal" is MHA only: a GQA version on [BLOCK_G, BLOCK_T, W] tiles went through shared
    memory and measured 2.7x slower than "generic" on an H200 (Qwen2-VL-7B heads), so it was dropped.
    """
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"decode variant {variant!r} is not one of {VARIANTS}; pass one of them or None")
    if variant is not None and variant != "generic" and not words:
        raise ValueError(f"decode variant {variant!r} needs int4 codes readable as int32 words (head_dim a power "
                         "of two >= 16, contiguous codes); pass variant='generic' or None")
    if variant == "subnormal" and group != 1:
        raise ValueError(f"decode variant 'subnormal' needs one KV head per query head (got groups of {group}); "
                         "pass variant='magic', 'generic' or None")
    if variant is not None:
        return variant
    if not words or group >= 3:
        return "generic"
    return "subnormal" if group == 1 else "magic"


# Caches of up to these many slots take the generic kernel's short- and middle-cache defaults (see generic_config).
GENERIC_SHORT_CACHE = 2048
GENERIC_MIDDLE_CACHE = 4096
# (batch row, KV head) pairs from which middle caches take the long-cache tile; from which caches beyond the short
# ones take 64-token tiles on 2 warps, 3 deep; and from which int8 / fp8 codes in long caches do (see generic_config).
MANY_ROWS_MIDDLE = 8
MANY_ROWS_WIDE = 32
MANY_ROWS_LONG = 16


def generic_config(config: tuple[int, ...] | None, use_dot: bool, small_tile: bool,
                   t_max: int, fmt: str = "int4", rows: int = 1) -> tuple[tuple[int, int, int, int], bool]:
    """((BLOCK_T, num_warps, target programs, num_stages), V loaded with K) of the generic kernel: ``config``, the rest
    from defaults. With the tensor cores (grouped-query heads) long token tiles over half as many programs measured
    fastest on an H200 (Qwen2-VL-7B heads: 8.3 / 14.0 µs at 4k / 16k tokens against 8.9 / 16.8 with
    64-token tiles; benchmarks/gpu_kernel_sweeps.py gqa), each tile's V codes loaded with its K codes (7.79 / 8.71 /
    15.09 µs at 1280 / 4k / 16k tokens against 7.87 / 8.88 / 15.56 with V loaded after the softmax). Up to 4k cache
    slots 8 warps: in Qwen2-VL-7B's decode step (1280 slots, benchmarks/gpu_decode_reuse.py --search-attention)
    2.077 against 2.089 ms for 4 warps with V after the softmax; alone 7.56 µs at 1280 tokens, as fast as 4 warps
    at 4k (8.76 against 8.71) and slower at 16k (17.07 against 15.09), so longer caches keep 4 warps. With fp16
    operands the step kept 8 warps (2.061 against 2.085 ms, no PDL); with PDL, alone, 4 warps were faster (5.64 / 7.99
    against 5.80 / 8.62 µs at 1280 / 4k tokens; h200_kernel_sweeps_gqa_final.json), in the step not (2.004 against
    1.996 / 1.999 ms; h200_step_qwen_table.json). Caches of 2k-4k slots: 256-token tiles on 8 warps, 7.02 against 8.59
    µs for the short-cache default at 4k (h200_kernel_sweeps_gqa_stages.json; 7.07 against 8.62 in _gqa_final), but
    6.76 against 5.80 at 1280 and 15.07 against 12.00 at 16k; between 2k and 4k not measured.

    Those tiles were chosen at batch 1 on 4 KV heads, where a call has few programs. Alone, with 8 and more ``rows``
    (batch x KV heads), 64-token tiles on 2 warps over twice as many programs ran fastest (Qwen2-VL-7B's heads at
    batch 4 / 8 and 4k: 10.44 / 15.08 µs against 16.62 / 23.57 with the 256-token tile, 12.10 / 17.62 with the
    long-cache tile (128 tokens on 4 warps over 264 programs), SDPA on the bf16 cache 15.33 / 23.08; at 16k 22.77 /
    40.15 against 27.12 / 59.91 for the long-cache tile; benchmarks/results/h200_kernel_sweeps_gqa_batch*_34.json).
    In the decode step (Qwen2-VL-7B shapes, int4 stack, kept graph replayed, each tile forced;
    h200_suite_qwen_batch_step_attention*_35.json, h200_suite_qwen_batch8_long_step_35.json) that held at batch 8
    (:data:`MANY_ROWS_WIDE` rows): 3.180 ms with them, 3 deep, against 3.225 with the long-cache tile at 3k-token
    prompts, 3.643 against 4.328 at 12k; but at batch 4 the long-cache tile won: 2.918 against 2.982 / 2.986 (2 / 3
    deep) at 3k, 3.143 against 3.196 at 12k (the 256-token tile: 2.942 at 3k, 3.402 at 12k). So from
    :data:`MANY_ROWS_MIDDLE` rows middle caches take the long-cache tile, and from :data:`MANY_ROWS_WIDE` rows
    middle and long caches the 64-token tile, 3 deep. Between them: at 24 rows (batch 6) the long-cache tile won (2.910
    against 2.957 ms at 3k, 3.241 against 3.306 at 12k; h200_suite_batch_checks_36.json), at 28 (batch 7, 3k, on
    an H100) the two were level (3.519 / 3.525 against 3.503; h100_suite_paired_llava_37.json); 25-27 and 29-31 not
    measured. Short caches keep theirs (alone, batch 2 / 4 / 8 at 1280 slots: 6.13 / 7.73 / 11.17 µs against 6.44 /
    7.74 / 10.72 for the 64-token tiles).

    Those defaults were measured on int4 codes. Byte codes (``fmt`` "int8" or "fp8": a byte per channel) halve the
    tiles on the tensor cores. That was chosen when int8 / fp8 codes loaded byte by byte and ptxas reported 600-930
    bytes of spills per thread with int4's tiles; read as channel pairs (:func:`byte_pairs`) no tile tried spills on
    the H200's Triton 3.6, and the halved and int4's tiles measured within 1 µs of each other at batch 1 (halved: 5.2
    / 13.4 / 8.6 µs at Mllama's 256 self slots, its 6404 image tokens and Qwen2-VL-7B's 4k; int4's: 5.6 / 12.7 / 8.7;
    benchmarks/results/h200_kv_formats_pairs.json), so the halved tiles, which Mllama's decode step was timed with,
    stay. With many rows (:data:`MANY_ROWS_MIDDLE` in middle caches, :data:`MANY_ROWS_LONG` in long ones) byte codes
    take 64-token tiles on 2 warps, 3 deep, over 528 programs instead, chosen from the call alone (their decode step
    not measured): on Qwen2-VL-7B's heads at batch 4 / 8 and 16k they took int8 from 36.1 / 69.8 µs (the halved
    tile) to 27.5 / 45.9 and fp8 from 38.8 / 80.0 to 33.6 / 57.1 (SDPA on the bf16 cache: 38.0 / 70.6); at 4k int8
    from 12.9 / 21.2 to 12.2 / 17.4, while fp8, whose codes take more instructions to decode, keeps int4's tiles
    halved there: at batch 4 the long-cache tile's (64 tokens on 4 warps: 13.8 against 16.6), at batch 8 the 64-token
    tile's (32 tokens on 2 warps, 3 deep: 20.0 against 23.9;
    benchmarks/results/h200_kernel_sweeps_gqa_bytes_batch_35.json). In the decode step (Qwen2-VL-7B shapes, int4
    stack; h200_suite_qwen_batch_step_attention_bytes_36.json) those held at batch 4 and 12k (int8 3.276 ms against
    3.418 for the long-cache tile halved, 3.370 for 32 tokens on 2 warps; fp8 within 0.02 ms of each other), but at
    batch 8 and 3k (:data:`MANY_ROWS_WIDE` rows over a middle cache) int8 too ran fastest with the wide tile halved:
    3.228 against 3.282, so there both halve it.
    """
    ahead = None
    if config is not None and len(config) == 5:  # (..., num_stages, V ahead)
        config, ahead = config[:4], bool(config[4])
    if use_dot and t_max <= GENERIC_SHORT_CACHE:
        default, v_ahead = (128, 8, TARGET_PROGRAMS // 2, 2), True
    elif use_dot and rows >= MANY_ROWS_WIDE:
        default, v_ahead = (64, 2, TARGET_PROGRAMS, 3), True
    elif use_dot and t_max <= GENERIC_MIDDLE_CACHE and rows < MANY_ROWS_MIDDLE:
        default, v_ahead = (256, 8, TARGET_PROGRAMS // 2, 2), True
    elif use_dot:
        default, v_ahead = (128, 4, TARGET_PROGRAMS // 2, 2), True
    else:  # no tensor cores (groups of up to 2): V after the softmax, V ahead not measured there
        default, v_ahead = (64 if small_tile else 32, 4, TARGET_PROGRAMS, 2), False
    if use_dot and fmt != "int4":
        many_rows = rows >= (MANY_ROWS_MIDDLE if t_max <= GENERIC_MIDDLE_CACHE else MANY_ROWS_LONG)
        default = _byte_code_tiles(default, fmt, t_max, many_rows, rows >= MANY_ROWS_WIDE)
    block_t, warps, target, stages = completed_config(config, default)
    stages = default[3] if stages is None else stages  # None: the default, as the word kernels read it
    return (block_t, warps, target, stages), v_ahead if ahead is None else ahead


def launched_without_pdl(config: tuple[int, ...] | None, use_dot: bool, fmt: str, t_max: int, rows: int) -> bool:
    """Whether the generic kernel and its combine launch without programmatic dependent launch: int4 codes on the
    tensor cores (``use_dot``, as :func:`generic_config` takes it) over a middle cache with :data:`MANY_ROWS_WIDE`
    rows (batch x KV heads) and the default tiles (the wide 64-token tile, 3 deep, over 528 programs). There,
    early-launched, its programs slowed the step: Qwen2-VL-7B's batch-8 decode step (3k-token prompts, int4 stack)
    took 3.039 / 3.040 ms with the KV kernels launched without PDL against 3.146 / 3.147 with it (docs/benchmarks.md,
    thirty-sixth pass; the whole step without PDL 3.079-3.083 against 3.135-3.139 in another process). Everywhere else
    PDL stays: at batch 4 x 12k (16 rows, a long cache) the KV kernels without it took 3.106 / 3.115 ms against 3.090
    / 3.091; other formats and long caches at 32 rows were not measured. On an H100 (thirty-seventh pass,
    h100_suite_pdl_check_37.json) the rule held: at 8 x 3k the default step took 3.513 / 3.513 ms against 3.618 with
    the same tile forced (which keeps PDL), and at 8 x 12k (a long cache, PDL kept) 4.070 / 4.071 against 4.100 with
    the KV kernels launched without it."""
    return (config is None and use_dot and fmt == "int4" and GENERIC_SHORT_CACHE < t_max <= GENERIC_MIDDLE_CACHE
            and rows >= MANY_ROWS_WIDE)


def _byte_code_tiles(default: tuple[int, int, int, int], fmt: str, t_max: int, many_rows: bool,
                     wide: bool) -> tuple[int, int, int, int]:
    """The int4 default ``default`` for int8 / fp8 codes (see :func:`generic_config`): halved, except with many rows
    beyond the short caches, where int8 (and fp8 beyond the middle ones) take 64-token tiles on 2 warps, 3 deep;
    middle caches with ``wide`` rows (int4's default there is that tile already) halve it for both."""
    middle = t_max <= GENERIC_MIDDLE_CACHE
    if many_rows and t_max > GENERIC_SHORT_CACHE and not (middle and wide) and (fmt == "int8" or not middle):
        return (64, 2, TARGET_PROGRAMS, 3)
    return (default[0] // 2, *default[1:])


def completed_config(config: tuple[int, ...] | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """``config`` (BLOCK_T, num_warps, target programs[, num_stages]) checked, missing entries from ``default``."""
    if config is None:
        return default
    if not 3 <= len(config) <= 4:
        raise ValueError(f"decode config {config!r}: pass (BLOCK_T, num_warps, target programs[, num_stages])")
    return (*config, *default[len(config):])
