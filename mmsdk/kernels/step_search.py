"""Choose a batch-1 decode step's GEMV configurations by timing the step itself, and keep them for later processes.

The tuner (mmsdk.kernels.w4a16_tuning) times each candidate of a GEMV alone. Inside a decode step the candidates do not
rank that way: what runs before and after a GEMV overlaps its first and last programs, and the candidates that sum
their K slices in a second launch can rank differently there than alone. mmsdk.kernels.step_configs holds what a
search of the step found for LLaVA-1.5-7B and Qwen2-VL-7B shapes on the H100 and H200 (1-4% off their steps). For
another GPU, model or group size :func:`search_decode_step` runs that search on the model itself: one round of
coordinate descent over every one-row GEMV the step runs (the plain GEMVs and the paired gate / up), each candidate
pinned in the tuner's table in turn, the step captured again and its graph replayed. :meth:`StepSearch.save` writes
what it chose to a JSON file; a process started with ``MMSDK_STEP_CONFIGS=<that file>`` takes those configs untimed
for that GPU::

    result = search_decode_step(opt.model, inputs)   # a few minutes on a 7B model
    result.save("step_configs.json")

It needs CUDA, fast generate (``opt.model.generate`` taking its CUDA-graph path) and a batch-1 prompt.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["NoKeptStepError", "StepSearch", "check_search_settings", "descend", "fast_path_refusal", "kept_step_ms",
           "one_row_candidates", "one_row_kinds", "one_row_trials", "replay_kept_step_ms", "search_decode_step"]

Key = tuple[Any, ...]
Config = tuple[Any, ...]
Trials = dict[str, tuple[Key, tuple[Config, ...]]]


class NoKeptStepError(RuntimeError):
    """A generate call kept no decode step to time: fast generate fell back to transformers' loop during the call
    (a failed capture, a model quirk; the ``mmsdk.kernels`` log says why). What :func:`fast_path_refusal` can tell
    before the call is refused earlier, as a ValueError."""


@dataclass
class StepSearch:
    """What :func:`descend` measured: the step before and after (ms), the config kept per label, every trial."""

    start_ms: float
    final_ms: float
    kept: dict[str, Config | str]
    trials: list[dict[str, Any]]
    # label -> the config the tuner's table held when the search came to it
    started_with: dict[str, Config] = field(default_factory=dict)
    # tuner key -> the config kept for it (the keys the step ran)
    chosen: dict[Key, Config] = field(default_factory=dict)
    device_name: str = ""

    def save(self, path: str | Path) -> Path:
        """Write the kept configs for this GPU into the JSON file at ``path`` (entries of other GPUs, and of this GPU's
        other keys, stay), as mmsdk.kernels.step_configs reads it with ``MMSDK_STEP_CONFIGS=<path>``."""
        from mmsdk.kernels.step_configs import write_step_configs

        if not self.device_name:
            raise ValueError("this search names no GPU (device_name is empty): run it with search_decode_step on CUDA")
        return write_step_configs(path, self.device_name, self.chosen)


def one_row_candidates(key: Key, kinds: tuple[str, ...] | None = None) -> tuple[Config, ...]:
    """The tuner's candidates for a one-row GEMV key: the plain GEMV's split-K configs or the paired gate / up GEMV's
    (fused-kernel configs left out; ``kinds``: only those kinds); empty for any other key."""
    from mmsdk.kernels.w4a16 import gemv_candidates
    from mmsdk.kernels.w4a16_gated import _paired_candidates

    if key[0] == "gemv" and key[1] == 1:  # ("gemv", rows bucket, N, K groups, group, dtype, ...)
        candidates = gemv_candidates(1, key[4])
    elif key[0] == "gated" and len(key) == 7:  # ("gated", N, K groups, group, dtype, zero points, norm)
        candidates = _paired_candidates(key[3])
    else:
        return ()
    return tuple(c for c in candidates if len(c) > 4 and (kinds is None or c[4] in kinds))


def one_row_kinds() -> tuple[str, ...]:
    """Every kind among the one-row candidates of the plain and the paired gate / up GEMV, any group size."""
    from mmsdk.kernels.w4a16 import gemv_candidates
    from mmsdk.kernels.w4a16_gated import _paired_candidates

    candidates = (*gemv_candidates(1, 128), *_paired_candidates(128), *_paired_candidates(32))
    return tuple(dict.fromkeys(c[4] for c in candidates if len(c) > 4))


def one_row_trials(kinds: tuple[str, ...] | None = None) -> Trials:
    """Label -> (tuner key, candidates) for every one-row GEMV this process has tuned (:func:`one_row_candidates`)."""
    from mmsdk.kernels.w4a16_tuning import tuning

    trials: Trials = {}
    for key in list(tuning().chosen):
        candidates = one_row_candidates(key, kinds)
        if candidates:  # labelled by the whole key: two GEMVs of one shape may differ in bias or zero points
            trials[" ".join(str(part).removeprefix("torch.") for part in key)] = (key, candidates)
    return trials


def descend(trials: Trials, step_ms: Callable[[], float],
            report: Callable[[str], None] | None = None) -> StepSearch:
    """One round of coordinate descent over the tuner's table: per label of ``trials`` (tuner key, candidates), each
    candidate is pinned for that key in turn, the others as chosen so far, and ``step_ms()`` times the step with the
    table as it is then; the fastest stays. A candidate that fails to run is recorded, reported and skipped; a key the
    table does not hold (the step did not run that GEMV) is left alone. The table keeps the choices."""
    from mmsdk.kernels.w4a16_tuning import tuning

    table = tuning().chosen
    start_ms = step_ms()
    out = StepSearch(start_ms=start_ms, final_ms=start_ms, kept={}, trials=[])
    best_ms = start_ms
    for label, (key, candidates) in trials.items():
        if key not in table:
            out.kept[label] = "not run by this step (no such tuner key)"
            continue
        best_cfg = out.started_with[label] = table[key]
        for cfg in candidates:
            if cfg == best_cfg:
                continue
            table[key] = cfg
            try:
                ms = step_ms()
            except Exception as error:  # a config that cannot run here is no candidate
                out.trials.append({"label": label, "cfg": cfg, "error": repr(error)[:200]})
                if report is not None:
                    report(f"{label} {cfg}: failed, {repr(error)[:200]}")
                continue
            finally:
                table[key] = best_cfg
            out.trials.append({"label": label, "cfg": cfg, "step_ms": ms})
            if report is not None:
                report(f"{label} {cfg}: {ms:.4f} ms (best {best_ms:.4f})")
            if ms < best_ms:
                best_ms, best_cfg = ms, cfg
        table[key] = best_cfg
        out.kept[label] = best_cfg
        out.chosen[key] = best_cfg
    out.final_ms = step_ms()
    return out


def kept_step_ms(model: torch.nn.Module, inputs: dict[str, Any], replays: int = 64, rounds: int = 3,
                 min_new_tokens: int = 8) -> float:
    """Milliseconds per decode step of ``model``'s kept CUDA graph, the median of ``rounds``: each round drops the kept
    graph, runs a greedy generate call (so the step is captured with the tuner's table as it is now), then replays
    the step ``replays`` times, timed with CUDA events. The call's new tokens are chosen so the cache it sizes has
    room for exactly those replays after it."""
    from mmsdk.kernels.decode_state import capacity_for
    from mmsdk.kernels.fast_generate import release

    prompt = inputs["input_ids"].shape[1]
    # the cache holds capacity_for(prompt + new + 1) slots; the replays write the slots after the call's
    new_tokens = capacity_for(prompt + min_new_tokens + replays + 1) - prompt - replays - 1
    times = []
    for _ in range(rounds):
        release(model)
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        times.append(replay_kept_step_ms(model, replays))
    release(model)
    return statistics.median(times)


def replay_kept_step_ms(model: torch.nn.Module, replays: int) -> float:
    """Milliseconds per replay of ``model``'s kept decode step, replayed ``replays`` times after a generate call and
    timed with CUDA events (the caller leaves the cache room for them: :func:`kept_step_ms`)."""
    from mmsdk.kernels.decode_state import kept

    state = kept(model)
    if state is None or state.step is None:
        raise NoKeptStepError("generate() kept no decode step: fast generate did not run on this model and input (the "
                              "mmsdk.kernels log says why); timing the step needs it.")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        state.step.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def check_search_settings(kinds: tuple[str, ...] | None) -> None:
    """Raise ValueError, naming the fix, where :func:`search_decode_step` could not search: the tuner's timing off
    (``MMSDK_TUNE=0`` or the Triton interpreter) or a kind no one-row candidate has. Cheap: callers that load a model
    first (``mmsdk tune``) check before."""
    from mmsdk.kernels import TUNE_ENV, timing_enabled

    if not timing_enabled():
        raise ValueError(f"the decode-step search needs the GEMV tuner timing ({TUNE_ENV}=0 or the Triton interpreter "
                         f"turns it off): unset {TUNE_ENV} and run on a GPU.")
    unknown = sorted(set(kinds or ()) - set(one_row_kinds()))
    if unknown:
        raise ValueError(f"no one-row GEMV candidate is of kind {unknown}: name kinds among {one_row_kinds()}.")


def fast_path_refusal(model: torch.nn.Module, inputs: dict[str, Any]) -> str | None:
    """Why a greedy generate call of ``model`` on ``inputs`` would not take fast generate's CUDA-graph path, which
    the search times (None when it would): ``model.generate`` not mmsdk's (a module that did not come from
    ``Optimizer.model``), the model off the GPU, a pass not declared safe for the fast path, a generation setting."""
    from mmsdk.kernels.fast_generate import ATTRIBUTE, unsupported_reason

    if getattr(model, ATTRIBUTE, None) is None:
        return ("model.generate is not mmsdk's fast generate: search the module Optimizer(...).model returns, which "
                "installs it")
    reason = unsupported_reason(model, (), {**inputs, "max_new_tokens": 8, "do_sample": False})
    if reason == "cpu":
        return "the model's weights are not on a CUDA device: move the model to the GPU with .to('cuda')"
    return reason


def search_decode_step(model: torch.nn.Module, inputs: dict[str, Any], kinds: tuple[str, ...] | None = None,
                       report: Callable[[str], None] | None = None) -> StepSearch:
    """The batch-1 decode step's GEMV configs chosen by timing the step itself (module docstring). ``inputs`` are a
    batch-1 prompt as ``model.generate`` takes it; ``kinds`` limits the candidates to those GEMV kinds. The tuning
    it starts with, what it is then about to try, and each trial go to ``report`` (default: logged at INFO in the
    ``mmsdk.kernels`` logger): a search takes minutes, most of them compiling candidates the first time. A model
    that would not take fast generate's path (:func:`fast_path_refusal`) is a ValueError before any timing; a capture
    that fails during a call is a :class:`NoKeptStepError`. The GEMVs this step runs are tuned afresh first (so the
    search covers them and nothing else); the tuner's table keeps the choices for the rest of the process, and its
    entries for other GEMVs."""
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError("search_decode_step times a batch-1 decode step: pass inputs with input_ids of shape "
                         "[1, prompt length] (one prompt, as the processor returns it).")
    if not ids.is_cuda:
        raise ValueError("search_decode_step needs the model and inputs on a CUDA device: move both with .to('cuda').")
    from mmsdk.kernels.w4a16_tuning import tuning

    check_search_settings(kinds)
    refusal = fast_path_refusal(model, inputs)
    if refusal is not None:
        raise ValueError(f"the search times fast generate's CUDA-graph decode step, which this model and input would "
                         f"not take: {refusal}.")

    def step_ms() -> float:
        return kept_step_ms(model, inputs)

    report = report or logging.getLogger("mmsdk.kernels").info
    table = tuning().chosen
    others = dict(table)  # what the process chose for other GEMVs (other models): kept, not searched
    table.clear()
    warm_up = tuning().warm_up
    # every trial runs its candidate in the step's eager call as well as in its graph: the first tuning compiles both
    # variants side by side (warmed up in a capture, the eager ones compiled one at a time in the trials: on a fresh
    # H100 the digits tune took 77.2 s against 67.9, docs/benchmarks.md, fifty-third pass)
    tuning().warm_up = "eager"
    tuning().use_kept_choices = False  # an earlier process's choices would leave the other candidates uncompiled
    tuning().times_small_weights = True  # a tiny model's GEMVs too: the search needs each one's candidates timed
    try:
        # silent otherwise for minutes: on a fresh machine this compiles every candidate of every GEMV the step runs
        report("tuning the decode step's GEMVs on their own first (a fresh machine compiles each candidate: minutes)")
        started = time.perf_counter()
        step_ms()  # tunes exactly the GEMVs this step runs, so the table names them
        trials = one_row_trials(kinds)
        if not trials:
            raise ValueError("the decode step ran no tuned one-row INT4 GEMV: apply int4-weight to the model first.")
        report(f"tuned {len(tuning().chosen)} GEMVs and ran the step in {time.perf_counter() - started:.1f} s")
        count = sum(len(candidates) for _, candidates in trials.values())
        report(f"timing the decode step with up to {count} candidates over {len(trials)} one-row GEMVs")
        result = descend(trials, step_ms, report)
    finally:
        tuning().warm_up = warm_up
        tuning().use_kept_choices = True
        tuning().times_small_weights = False
        for key, cfg in others.items():
            table.setdefault(key, cfg)
    result.device_name = torch.cuda.get_device_name(ids.device)
    return result
