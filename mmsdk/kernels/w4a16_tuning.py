"""Which W4A16 kernel configuration runs for a problem: the candidates timed once per process, the fastest kept.

Used by mmsdk.kernels.w4a16 and mmsdk.kernels.w4a16_gated; the table of choices is one object per process, created on
first use (:func:`tuning`).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch

from mmsdk.kernels import LOG, graph_time_ms, l2_spill_copies, note_fallback, timing_enabled
from mmsdk.kernels.parallel_compile import compile_in_parallel, guarded_launch, recording_a_first_call
from mmsdk.kernels.step_configs import StepConfigsFile, step_measured_config
from mmsdk.kernels.tuning_cache import TuningChoices

__all__ = ["DEFAULT_TUNE_MIN_BYTES", "NORMED_MAX_N", "TUNE_MIN_BYTES_ENV", "Tuning", "fit_config", "followed_by_norm",
           "tune_min_bytes", "tuned_config", "tuning"]

NORMED_MAX_N = 32768  # the widest one-row GEMV output the tuner times followed by a norm (followed_by_norm)
# Weights smaller than this (packed bytes, scales and zero points included) take their first candidate untimed. Such a
# GEMV is bound by its launch, whichever tile runs: 256 KiB is read in 0.06 µs at an H200's 4.2 TB/s, against the
# ~2.4 µs a 4096 x 4096 g32 GEMV (9 MiB, 4.6 µs) spends beyond its bytes' time (docs/benchmarks.md, tenth pass).
# Timing them would compile every candidate for nothing: the tiny built-in models (weights of 12 KiB at most) had their
# first generate compile 80 GEMV kernels for tunings (fifty-fifth pass). Every weight of a 7B model is larger (the
# smallest, Qwen2-VL-7B's k or v projection, 0.9 MiB), so all are timed as before.
DEFAULT_TUNE_MIN_BYTES = 256 << 10
TUNE_MIN_BYTES_ENV = "MMSDK_TUNE_MIN_BYTES"  # a whole number of bytes; 0 times every weight


def fit_config(cfg: tuple[Any, ...], group: int) -> tuple[Any, ...]:
    """A fused-kernel config (4-tuple) with BLOCK_K raised to the group size; GEMV configs unchanged."""
    if len(cfg) != 4:  # GEMV configs need no fitting
        return cfg
    block_n, block_k, warps, stages = cfg
    return block_n, max(block_k, group), warps, stages


class Tuning:
    """Chosen configuration per problem key (one instance per process, created on first use)."""

    def __init__(self) -> None:
        self.chosen: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.step_configs_file = StepConfigsFile()  # the MMSDK_STEP_CONFIGS file, read once while unchanged
        # how tuned_config warms each candidate up before timing it (mmsdk.kernels.captured_calls). "captured": on
        # Hopper only the captured variants compile, which is all a decode step's graph runs (a fresh H100's first
        # q/k/v GEMV tuning 13.9 s against 17.6, docs/benchmarks.md, fifty-third pass). A step search sets "eager"
        # for its first tuning: its trials run every candidate in the step's eager call too, which would otherwise
        # compile their eager variants one at a time.
        self.warm_up = "captured"
        # what earlier processes on this machine chose (mmsdk.kernels.tuning_cache, MMSDK_TUNING_CACHE); a step
        # search sets use_kept_choices False for its first tuning, which must compile and time every candidate
        self.kept_choices = TuningChoices()
        self.use_kept_choices = True
        # weights under tune_min_bytes() take their first candidate untimed; a step search sets this True for its
        # first tuning, which must time every GEMV the step runs to search them (a tiny model's included)
        self.times_small_weights = False


@cache
def tuning() -> Tuning:
    """This process's table of chosen configurations."""
    return Tuning()


def tune_min_bytes() -> int:
    """The packed weight size below which the tuner takes the first candidate untimed: ``MMSDK_TUNE_MIN_BYTES``, or
    ``DEFAULT_TUNE_MIN_BYTES`` (256 KiB) when unset."""
    value = os.environ.get(TUNE_MIN_BYTES_ENV, "").strip()
    if not value:
        return DEFAULT_TUNE_MIN_BYTES
    if not value.isdigit():
        raise ValueError(f"{TUNE_MIN_BYTES_ENV}={value!r}: set it to a whole number of bytes (0 times every weight's "
                         f"candidates), or leave it unset for {DEFAULT_TUNE_MIN_BYTES} (256 KiB).")
    return int(value)


def _packed_bytes(weights: tuple[torch.Tensor | None, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in weights if t is not None)


def tuned_config(key: tuple[Any, ...], launch: Any, candidates: tuple[tuple[Any, ...], ...], group: int,
                 weights: tuple[torch.Tensor | None, ...], within: float = 0.0) -> Any:
    """The fastest candidate for ``key`` (timed once on CUDA; the first one, not kept, under the interpreter, a capture
    or ``MMSDK_TUNE=0``; the first one, kept untimed, for weights under :func:`tune_min_bytes`), or the configuration
    measured for it inside the decode step on this GPU (mmsdk.kernels.step_configs: taken untimed), or the one an
    earlier process on this machine chose among the same candidates with the same toolchain (mmsdk.kernels.tuning_cache:
    taken untimed; each new choice is kept there); with ``within`` > 0 the first candidate, in the given order, whose
    time is within that fraction of the fastest (for candidates that time alike alone but not in the decode step, listed
    in the step's order). Every candidate is compiled first, on all CPUs at once
    (:func:`mmsdk.kernels.parallel_compile.compile_in_parallel`), and warmed up as ``tuning().warm_up`` says (by default
    inside a dropped capture, after one eager call of the first).

    ``launch(cfg, weights)`` runs a candidate on ``weights`` (the packed tensors, as a tuple). Candidates are
    timed on enough copies of the weights, in turn, that each call reads them from HBM as in a model
    (:func:`mmsdk.kernels.l2_spill_copies`; the copies live only while tuning): timed on one L2-resident
    copy, the tuner would pick the tiles that read L2 fastest, not HBM.
    """
    table = tuning().chosen
    if key in table:
        return table[key]
    measured = step_measured_config(key, weights[0].device, candidates, tuning().step_configs_file)
    if measured is not None:
        table[key] = measured
        return measured
    if not timing_enabled():
        return candidates[0]
    if not tuning().times_small_weights and _packed_bytes(weights) < tune_min_bytes():
        table[key] = candidates[0]  # bound by its launch whichever tile runs: not worth a compile per candidate
        return candidates[0]
    configs = list(dict.fromkeys(fit_config(c, group) for c in candidates))
    device, kept = weights[0].device, tuning().kept_choices
    if tuning().use_kept_choices:
        # an earlier process's choice among the same candidates: only it compiles, untimed; taken inside a capture
        # too (a read of the host's file), so a decode step compiled ahead from a dropped capture compiles it
        chosen = kept.chosen(key, tuple(configs), within, device)
        if chosen is not None:
            table[key] = chosen
            return chosen
    if torch.cuda.is_current_stream_capturing():
        if recording_a_first_call():  # a step compiled ahead: every candidate's kernels compile with the step's
            for cfg in configs:  # a failing one is met again, and skipped with its reason, when it is timed
                guarded_launch(lambda c=cfg: launch(c, weights))()
        return candidates[0]
    launches = [lambda c=cfg: launch(c, weights) for cfg in configs]
    warm_up = tuning().warm_up
    # all at once, not one per launch, as they run below (captured warm-up: the first eagerly, then each captured)
    compile_in_parallel(launches, captured_on=device, warm_up=warm_up)
    if warm_up == "captured":
        try:  # what a launch makes on its first call (followed_by_norm's buffers) made eagerly, not just recorded
            launches[0]()
        except Exception as error:  # noqa: BLE001 - timed below, this candidate is skipped with its reason
            LOG.debug("w4a16 tuning: the first candidate's eager call failed (%s: %s)", type(error).__name__, error)
    copies = l2_spill_copies(weights)
    timings = []
    for cfg in configs:
        try:
            # warmed up inside a capture: on Hopper the GEMVs run a variant of their own there (programmatic dependent
            # launch), the only one a timed graph and the decode step's graph hold, so the eager ones need no compile
            timings.append((graph_time_ms([lambda c=cfg, w=w: launch(c, w) for w in copies], warm_up=warm_up), cfg))
        except Exception as error:  # a config the compiler rejects (resources) is simply not a candidate
            note_fallback("w4a16 tuning", f"config {cfg} skipped: {type(error).__name__}")
    if not timings:
        table[key] = candidates[0]
        return table[key]
    table[key] = _first_within(timings, within)
    kept.remember(key, tuple(configs), within, device, table[key])
    return table[key]


def _first_within(timings: list[tuple[float, tuple[Any, ...]]], within: float) -> tuple[Any, ...]:
    """The first config of ``timings`` ((ms, config) in candidate order) within ``within`` of the fastest."""
    fastest = min(ms for ms, _ in timings)
    return next(cfg for ms, cfg in timings if ms <= fastest * (1.0 + within))


def followed_by_norm(launch: Any, out: torch.Tensor) -> Any:
    """``launch`` as the tuner times a one-row GEMV: each call followed by an add + RMSNorm of ``out``.

    In a decoder layer's decode step a norm follows the o_proj and down GEMVs and the attention's small kernels follow
    the qkv GEMV, so none is followed by another GEMV whose programs could fill the multiprocessors during its last
    ones (the paired gate/up GEMV, which the down GEMV follows, is still timed back to back). Timed followed by a norm
    the configs rank as in the step; timed back to back they did not. On an H200
    (benchmarks/gpu_kernel_sweeps.py step_norms) LLaVA-1.5-7B's g32 down projection took 10.3 µs in one K slice
    against 13.5 in two alone, 13.3 against 14.6 with the norm; Qwen2-VL-7B's g128 one 15.5 against 16.9 alone, but
    19.0 against 18.0 with the norm, and in the replayed step one slice cost that stack 22-27 µs
    (benchmarks/gpu_decode_reuse.py, stacks qwen_g128 and qwen_g128_one_slice_down). The norm's buffers are made on
    the first timed call only. Outputs wider than ``NORMED_MAX_N`` (a vocabulary head, which the token choice follows,
    not a norm) are timed back to back: the norm kernel holds a whole row in one program. Every GEMV call wraps its
    launch so; the wrapper does nothing until the tuner times it.

    Not re-measured since rmsnorm-rope-fusion's defaults took the norm launches out of the step (fifteenth pass in
    docs/benchmarks.md): o_proj is now followed by the gated GEMV and the down projection by the next layer's q/k/v
    GEMV, so for them this emulation no longer matches the step; the tuner's picks there still change from one
    process to the next.
    """
    if out.shape[-1] > NORMED_MAX_N:
        return launch
    buffers: list[torch.Tensor] = []

    def timed(cfg: tuple[Any, ...], weights: tuple[torch.Tensor | None, ...]) -> None:
        from mmsdk.kernels.norm_rope_gpu import add_rms_norm

        launch(cfg, weights)
        if not buffers:
            buffers.extend((torch.zeros_like(out), torch.ones(out.shape[-1], device=out.device, dtype=out.dtype)))
        add_rms_norm(out, buffers[0], buffers[1], 1e-6)

    return timed
