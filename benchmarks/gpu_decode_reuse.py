"""What a generate() call costs once fast generate keeps its cache and CUDA graph, and what one decode step costs.

LLaVA-1.5-7B shapes (random bf16 weights built on the GPU), batch 1, 1k-token text prompt, mmsdk's full
decode stack (qkv-fuse + int4-weight + rmsnorm-rope-fusion + int4-kv), group sizes 32 and 128. (An earlier
build launched every decode kernel with programmatic dependent launch, each waiting first: no difference
beyond 1.5%, benchmarks/results/h200_decode_reuse_pdl.json. The GEMVs now load their first weight tiles
before they wait; ``step_ms_without_pdl`` is the same step captured with ``MMSDK_PDL=0``.)

* ``cold_128_ms``: a 128-token call after ``release(model)`` (new cache, warm-up step, graph capture);
* ``warm_1_ms`` / ``warm_128_ms``: the same calls reusing the kept state (medians of ``--reps``);
* ``step_ms``: the kept decode-step graph replayed 64 more times right after a warm call, timed with CUDA
  events (no Python, no prefill): the steady decode step itself, against its bandwidth floor.

``--stacks`` picks stacks by key (default ``g32,g128``; ``g32_rope_outside`` / ``g128_rope_outside`` are the same with
each step's RoPE in a launch of its own, rmsnorm-rope-fusion's ``rope_in_attention=False``; ``qwen_g128`` and
``qwen_g128_rope_outside`` the g128 stack on Qwen2-VL-7B shapes; ``g32_int4_head`` / ``qwen_g128_int4_head`` quantize
the LM head too (int4-weight's ``lm_head=True``; their floor counts the int4 head); the default stacks run each layer's
input RMSNorm inside its q/k/v GEMV and their attention's o_proj leaves the post-attention norm's statistics for the
gated GEMV (rmsnorm-rope-fusion's defaults ``norm_in_gemv=True``, ``mlp_norm_in_gemv=True``), ``g32_norm_in_qkv_only`` /
``qwen_g128_norm_in_qkv_only`` run the post-attention norm as a launch (``mlp_norm_in_gemv=False``) and
``g32_norms_unfolded`` / ``qwen_g128_norms_unfolded`` every norm (``norm_in_gemv=False``), while the default stacks'
down projections also leave the next layer's input-norm statistics for its q/k/v GEMV and ``g32_no_qkv_statistics`` /
``qwen_g128_no_qkv_statistics`` fold that norm in every layer's q/k/v GEMV (``qkv_norm_statistics=False``); the keys of
``_PINNED`` pin some GEMVs to given configs, against the tuner's picks in one process; ``g32_norms_free`` /
``g32_combine_free`` / ``qwen_g128_combine_free`` time a step with its norms or its attention combines replaced by
nothing (``_FREE``: wrong outputs, a bound on what fusing them away could gain); ``--step-only`` measures ``step_ms``
alone (one call to tune and capture, then the replays); ``--search`` then chooses each step GEMV's config by timing the
replayed step itself (:func:`search_step`: what the step reaches when its configs are ranked as the step runs them, not
as the tuner times them alone); ``--search-attention`` times the step with each of the KV decode kernel's candidate
configs (:func:`search_attention`); ``--against-tuner`` times it again with the tuner's own picks where
mmsdk.kernels.step_configs answered (benchmarks/_step_against_tuner.py); ``--ab-rounds N`` with ``--save FILE`` then
times each stack's step in 2N fresh processes, alternating without and with ``MMSDK_STEP_CONFIGS=FILE``
(:func:`fresh_process_ab`: whether what the search kept beats the tuner's own picks in a process that did not search,
the test a built-in table entry has to pass).

    python benchmarks/gpu_decode_reuse.py --out reuse.json
    python benchmarks/gpu_decode_reuse.py --stacks g32,g32_rope_outside --step-only --out rope.json
    python benchmarks/gpu_decode_reuse.py --stacks qwen_g128 --step-only --search --out search.json
    python benchmarks/gpu_decode_reuse.py --stacks g128 --step-only --search --save step_configs.json --ab-rounds 2
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import benchmarks.gpu_suite as suite
from benchmarks._step_against_tuner import step_with_tuner_picks
from benchmarks.gpu_tune import NoLaunch
from mmsdk.kernels.step_configs import STEP_CONFIGS_ENV, write_step_configs

REPLAYS = 64


def call_ms(model: Any, inputs: dict[str, Any], new: int, reps: int, cold: bool = False) -> float:
    """Median wall milliseconds of ``reps`` generate() calls (each after ``release`` when ``cold``)."""
    from mmsdk.kernels.fast_generate import release

    times = []
    for _ in range(reps):
        if cold:
            release(model)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def replay_step_ms(model: Any) -> float:
    """Milliseconds per replay of the kept decode-step graph (the cache has room: see ``measure``)."""
    from mmsdk.kernels.step_search import replay_kept_step_ms

    return replay_kept_step_ms(model, REPLAYS)


def measure(model: Any, inputs: dict[str, Any], reps: int) -> dict[str, Any]:
    """One stack's row: cold and warm calls, and the kept step's replay time."""
    call_ms(model, inputs, 128, 1)  # tune, compile and capture
    row = {"cold_128_ms": call_ms(model, inputs, 128, reps, cold=True)}
    row["warm_1_ms"] = call_ms(model, inputs, 1, reps)
    row["warm_128_ms"] = call_ms(model, inputs, 128, reps)
    row["warm_step_ms_per_call"] = (row["warm_128_ms"] - row["warm_1_ms"]) / 127
    row["step_ms"] = statistics.median(_replay_after_call(model, inputs) for _ in range(3))
    row["step_ms_without_pdl"] = _without_pdl(model, inputs)
    return row


def _without_pdl(model: Any, inputs: dict[str, Any]) -> float:
    """The kept step's replay time when its graph is captured with programmatic dependent launch turned off."""
    from benchmarks.gpu_tune import pdl_setting
    from mmsdk.kernels.fast_generate import release

    try:
        with pdl_setting(False):
            release(model)  # the next call captures a new graph, launching without PDL
            return statistics.median(_replay_after_call(model, inputs) for _ in range(3))
    finally:
        release(model)


def _replay_after_call(model: Any, inputs: dict[str, Any]) -> float:
    """A 128-token call (it refills the kept state), then the kept step replayed: ms per step.

    The call leaves 1024 + 128 + 1 = 1153 of the kept 1280 slots used, so 64 more steps fit.
    """
    call_ms(model, inputs, 128, 1)
    return replay_step_ms(model)


def stacks() -> dict[str, tuple[str, str, tuple[Any, ...]]]:
    """Stack key -> (description, model: "llava" or "qwen2-vl", passes before int4-kv)."""
    from mmsdk.plugins.attention.rmsnorm_rope import RMSNormRoPEFusionConfig
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    outside = RMSNormRoPEFusionConfig(rope_in_attention=False)
    qkv_only = RMSNormRoPEFusionConfig(mlp_norm_in_gemv=False)
    unfolded = RMSNormRoPEFusionConfig(norm_in_gemv=False)
    unchained = RMSNormRoPEFusionConfig(qkv_norm_statistics=False)
    g128 = Int4WeightConfig(group_size=128)
    g32_head, g128_head = Int4WeightConfig(lm_head=True), Int4WeightConfig(group_size=128, lm_head=True)
    # each model's default stack (label, passes), which the timing-only and pinned stacks run
    default = {"llava": ("g32", ("qkv-fuse", "int4-weight", "rmsnorm-rope-fusion")),
               "qwen2-vl": ("Qwen2-VL-7B shapes, g128", ("qkv-fuse", g128, "rmsnorm-rope-fusion"))}
    return {
        **{key: (f"{default[model][0]}, timing only: the {kind} replaced by nothing", model, default[model][1])
           for key, (model, kind) in _FREE.items()},
        **{key: (f"{default[model][0]}, pinned: {pins}", model, default[model][1])
           for key, (model, pins) in _PINNED.items()},

        "g32": ("qkv-fuse + int4-weight (g32) + rmsnorm-rope-fusion + int4-kv", "llava",
                ("qkv-fuse", "int4-weight", "rmsnorm-rope-fusion")),
        "g128": ("same with int4-weight g128", "llava", ("qkv-fuse", g128, "rmsnorm-rope-fusion")),
        "g32_norm_in_qkv_only": ("g32, the post-attention RMSNorm a launch (mlp_norm_in_gemv=False)", "llava",
                                 ("qkv-fuse", "int4-weight", qkv_only)),
        "qwen_g128_norm_in_qkv_only": ("Qwen2-VL-7B shapes, g128, the post-attention RMSNorm a launch", "qwen2-vl",
                                       ("qkv-fuse", g128, qkv_only)),
        "g32_no_qkv_statistics": ("g32, q/k/v folding the input norm in every layer (qkv_norm_statistics=False)",
                                  "llava", ("qkv-fuse", "int4-weight", unchained)),
        "qwen_g128_no_qkv_statistics": ("Qwen2-VL-7B shapes, g128, q/k/v folding the input norm in every layer",
                                        "qwen2-vl", ("qkv-fuse", g128, unchained)),
        "g32_norms_unfolded": ("g32, every RMSNorm a launch of its own (norm_in_gemv=False)", "llava",
                               ("qkv-fuse", "int4-weight", unfolded)),
        "qwen_g128_norms_unfolded": ("Qwen2-VL-7B shapes, g128, every RMSNorm a launch of its own", "qwen2-vl",
                                     ("qkv-fuse", g128, unfolded)),
        "g32_rope_outside": ("g32, RoPE in its own launch (rope_in_attention=False)", "llava",
                             ("qkv-fuse", "int4-weight", outside)),
        "g128_rope_outside": ("g128, RoPE in its own launch (rope_in_attention=False)", "llava",
                              ("qkv-fuse", g128, outside)),
        "qwen_g128": ("Qwen2-VL-7B shapes, qkv-fuse + int4-weight g128 + rmsnorm-rope-fusion + int4-kv", "qwen2-vl",
                      ("qkv-fuse", g128, "rmsnorm-rope-fusion")),
        "g32_int4_head": ("g32, the LM head int4 too (int4-weight lm_head=True)", "llava",
                          ("qkv-fuse", g32_head, "rmsnorm-rope-fusion")),
        "qwen_g128_int4_head": ("Qwen2-VL-7B shapes, g128, the LM head int4 too (int4-weight lm_head=True)",
                                "qwen2-vl", ("qkv-fuse", g128_head, "rmsnorm-rope-fusion")),
        "qwen_g128_rope_outside": ("Qwen2-VL-7B shapes, g128, RoPE in its own launch", "qwen2-vl",
                                   ("qkv-fuse", g128, outside)),
    }


# Per model of the step benchmarks: hidden size, MLP width, q/k/v rows (qkv-fuse) and whether q/k/v has a bias.
_DIMENSIONS = {"llava": (4096, 11008, 12288, False), "qwen2-vl": (3584, 18944, 4608, True)}


def shape_keys(model_name: str, group: int) -> dict[str, tuple[Any, ...]]:
    """Projection -> the tuner's key of that decode-step GEMV for ``model_name`` with int4-weight groups of ``group``:
    ("gemv", rows bucket, N, K groups, group, bias, norm folded) or ("gated", N, K groups, group, norm folded); dtype
    bf16 and no zero points are added by :func:`_tuner_key`. With rmsnorm-rope-fusion's defaults the input norm is
    folded into the first layer's q/k/v ("qkv") and its statistics handed to the others' ("qkv_statistics"); the
    gated GEMV's key is that of a plain gated GEMV when o_proj leaves it the post-attention norm's statistics."""
    hidden, width, qkv_rows, qkv_bias = _DIMENSIONS[model_name]
    return {"qkv": ("gemv", 1, qkv_rows, hidden // group, group, qkv_bias, True),
            "qkv_statistics": ("gemv", 1, qkv_rows, hidden // group, group, qkv_bias, "statistics"),
            "o_proj": ("gemv", 1, hidden, hidden // group, group, False, False),
            "down": ("gemv", 1, hidden, width // group, group, False, False),
            "gated": ("gated", width, hidden // group, group, False)}


def stack_group(passes: tuple[Any, ...]) -> int:
    """The int4-weight group size a stack's passes quantize with (the pass's default where it is named by string)."""
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    configs = [p for p in passes if isinstance(p, Int4WeightConfig)]
    return (configs[0] if configs else Int4WeightConfig()).group_size


# stack key -> (model, {projection: pinned config}). The one-slice configs (264 target programs) are what the tuner
# picked on the H200 when a trial candidate list led with them and was timed back to back
# (benchmarks/results/h200_decode_reuse_one_slice_ab.json): in the step they gained LLaVA-1.5-7B g32 about 30 µs and
# cost Qwen2-VL-7B g128 about 25. The tuner now times each candidate before a norm and picks one slice for LLaVA's down
# projection only.
_PINNED = {
    "g32_one_slice": ("llava", {"o_proj": (8, 128, 2, 1, "quad", 264), "down": (8, 128, 4, 1, "quad", 264)}),
    "g32_down_one_slice": ("llava", {"down": (8, 128, 4, 1, "quad", 264)}),
    "g32_down_wide_two_slices": ("llava", {"down": (8, 128, 4, 1, "quad", 528)}),
    "qwen_g128_one_slice": ("qwen2-vl", {"qkv": (8, 128, 2, 1, "quad", 264), "down": (8, 128, 4, 1, "quad", 264)}),
    "qwen_g128_one_slice_qkv": ("qwen2-vl", {"qkv": (8, 128, 2, 1, "quad", 264)}),
    "qwen_g128_one_slice_down": ("qwen2-vl", {"down": (8, 128, 4, 1, "quad", 264)}),
}


def _tuner_key(shape: tuple[Any, ...]) -> tuple[Any, ...]:
    """A :func:`shape_keys` entry as the tuner's table keys it (bf16, no zero points)."""
    return ((*shape[:5], torch.bfloat16, False, *shape[5:]) if shape[0] == "gemv"
            else (*shape[:4], torch.bfloat16, False, shape[4]))


def pinned_configs(stack: str, group: int) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """The tuner's table entries (key -> config) a stack pins, its weights in groups of ``group``; empty for the
    stacks that let the tuner pick."""
    model, pins = _PINNED.get(stack, ("llava", {}))
    return {_tuner_key(shape_keys(model, group)[projection]): cfg for projection, cfg in pins.items()}


def search_candidates(shape: tuple[Any, ...], kinds: tuple[str, ...] | None = None) -> tuple[tuple[Any, ...], ...]:
    """What ``--search`` tries for one step GEMV (mmsdk.kernels.step_search's list for its tuner key): by default the
    one-row tuner's "quad", "quadp", "idot" and "idotr" candidates, or the gated MLP's "gated", "idot" and "idotr"
    tiles (the library's search also tries the "fma" GEMVs and the gated MLP as two "quad" GEMVs, which the benchmark
    leaves out to keep a search within one device call); ``kinds``: those kinds instead."""
    from mmsdk.kernels.gemv_launch import IDOT_KINDS
    from mmsdk.kernels.step_search import one_row_candidates
    from mmsdk.kernels.w4a16 import QUAD_KINDS

    searched = (*QUAD_KINDS, *IDOT_KINDS) if shape[0] == "gemv" else ("gated", *IDOT_KINDS)
    return one_row_candidates(_tuner_key(shape), kinds or searched)


def step_ms_recaptured(model: Any, inputs: dict[str, Any]) -> float:
    """The step with the kernels' settings as they are now: the kept graph dropped, a call captures it again, median
    of three replays after a call (:func:`_replay_after_call`)."""
    from mmsdk.kernels.fast_generate import release

    release(model)
    return statistics.median(_replay_after_call(model, inputs) for _ in range(3))


def search_step(model: Any, inputs: dict[str, Any], model_name: str, group: int,
                projections: tuple[str, ...] | None = None, kinds: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The step's GEMV configs chosen by timing the replayed step itself (one round of coordinate descent,
    :func:`descend_step`).

    Per projection (qkv, qkv_statistics, o_proj, down, gated), each of its candidates (:func:`search_candidates`) is
    pinned in the tuner's table in turn, the others as chosen so far. The tuner times each GEMV alone (followed by a
    norm launch), which does not rank its configs as the step does: this measures what the step reaches with
    step-ranked configs.
    ``group`` is the stack's int4-weight group size, ``projections`` limits the search to those keys of
    :func:`shape_keys`, ``kinds`` the candidates to those kinds (all by default).
    """
    shapes = shape_keys(model_name, group)
    unknown = set(projections or ()) - set(shapes)
    if unknown:
        raise ValueError(f"--projections {sorted(unknown)}: the step's projections are {list(shapes)}")
    trials = {projection: (_tuner_key(shape), search_candidates(shape, kinds))
              for projection, shape in shapes.items()
              if projections is None or projection in projections}
    return descend_step(model, inputs, trials)


def kept_configs(search: dict[str, Any], model_name: str, group: int) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """Tuner key -> config kept by a :func:`search_step` row, for the projections the step ran (what ``--save``
    writes)."""
    shapes = shape_keys(model_name, group)
    return {_tuner_key(shapes[label]): tuple(cfg) for label, cfg in search["kept"].items() if not isinstance(cfg, str)}


def search_step_rows(model: Any, inputs: dict[str, Any], bucket: int) -> dict[str, Any]:
    """:func:`search_step` for a batched decode step: every GEMV the step ran for a rows ``bucket`` (the tuner's keys
    of that bucket after a call: the plain GEMVs and the paired gate / up), each over the tensor-core ("mma")
    candidates of that bucket."""
    return descend_step(model, inputs, row_bucket_trials(bucket))


def row_bucket_trials(bucket: int,
                      gated: bool = True) -> dict[str, tuple[tuple[Any, ...], tuple[tuple[Any, ...], ...]]]:
    """Label -> (tuner key, its tensor-core "mma" candidates) for every GEMV this process has tuned for a rows
    ``bucket``: the plain GEMVs and (with ``gated``) the paired gate / up."""
    from mmsdk.kernels.w4a16 import gemv_candidates
    from mmsdk.kernels.w4a16_gated import _paired_row_candidates
    from mmsdk.kernels.w4a16_tuning import tuning

    trials = {}
    for key in list(tuning().chosen):
        if key[0] == "gemv" and key[1] == bucket:  # ("gemv", bucket, N, K groups, group, dtype, ...)
            candidates = tuple(c for c in gemv_candidates(bucket, key[4]) if len(c) > 5 and c[4] == "mma")
            trials[f"gemv {key[2]}x{key[3] * key[4]}"] = (key, candidates)
        elif gated and key[0] == "gated" and len(key) == 8 and key[-1] == bucket:  # (..., group, ..., bucket)
            trials[f"gated {key[1]}x{key[2] * key[3]}"] = (key, _paired_row_candidates(key[3]))
    return trials


def descend_step(model: Any, inputs: dict[str, Any],
                 trials: dict[str, tuple[tuple[Any, ...], tuple[tuple[Any, ...], ...]]]) -> dict[str, Any]:
    """mmsdk.kernels.step_search's coordinate descent over ``trials`` (label -> tuner key, candidates), each trial
    timed by :func:`step_ms_recaptured` (the graph captured again, median of three replays after a call), as a row of
    this script's JSON; the kept graph is dropped afterwards."""
    from mmsdk.kernels.fast_generate import release
    from mmsdk.kernels.step_search import descend

    found = descend(trials, lambda: step_ms_recaptured(model, inputs), lambda line: print(line, flush=True))
    release(model)
    return {"start_ms": found.start_ms, "started_with": found.started_with,
            "trials": [{"projection": t.pop("label"), **t} for t in found.trials], "kept": found.kept,
            "final_ms": found.final_ms}


# What ``--search-attention`` tries for the step's int4 KV decode kernel (decode_attention's ``config``; None = its
# default). Qwen2-VL-7B (grouped heads, "generic"; the cache holds 1280 slots, so 128-token tiles give 10 splits, 40
# programs): 64-token tiles over twice the programs, the fastest alternative with fp16 operands and PDL, the default's
# tile on 4 warps (faster alone with PDL; the default, 128 x 8 warps with V loaded with K, is timed twice for the
# spread), and the default without PDL. (Earlier searches:
# h200_step_attention_qwen.json, h200_step_attention_confirm_qwen.json with tf32 operands; h200_step_attention_qwen_fp16
# and _pdl.json with fp16 operands, the second also with a first-tile preload since removed.) LLaVA-1.5-7B (MHA,
# "subnormal"): the tile loop pipelined by Triton instead of the next tile in registers, 16- and 32-token tiles over
# the default's programs and twice as many (16-token tiles with 4 stages over 1056 programs led the kernel alone at
# 1280 tokens once the combine kernel loaded its partials first, h200_kernel_sweeps_kv_combine.json). Earlier: V's
# sums folded, more or fewer programs, two warps, no prefetch (h200_step_attention_g32.json, _g32_fold.json).
_ATTENTION_CANDIDATES = {
    "qwen2-vl": [(64, 4, 528, 2, True), (128, 4, 264, 2, True), "no_pdl"],
    "llava": [(16, 1, 1056, 4, False, True, True), (32, 1, 1056, 3, False, True, True),
              (16, 1, 528, 4, False, True, True)],
}


# Launch trials among the candidates (the default config): the attention kernels launched without programmatic
# dependent launch ("no_pdl"). (A "no_preload" trial timed the grouped kernel's first-tile preload, since removed.)
_LAUNCH_TRIALS = {"no_pdl": ("pdl_ready",)}


@contextmanager
def attention_config(config: tuple[Any, ...] | str | None) -> Iterator[None]:
    """Every decode_attention call without a ``config`` takes ``config`` while the block runs (None: unchanged; a key
    of ``_LAUNCH_TRIALS``: the default config with those PDL checks of mmsdk.kernels.kv_decode answering False)."""
    import mmsdk.kernels.kv_decode as kv_decode

    if isinstance(config, str):
        checks = {name: getattr(kv_decode, name) for name in _LAUNCH_TRIALS[config]}
        for name in checks:
            setattr(kv_decode, name, lambda tensor: False)
        try:
            yield
        finally:
            for name, check in checks.items():
                setattr(kv_decode, name, check)
        return
    original = kv_decode.decode_attention
    signature = inspect.signature(original)

    def with_config(*args: Any, **kwargs: Any) -> torch.Tensor:
        call = signature.bind(*args, **kwargs)
        if call.arguments.get("config") is None:
            call.arguments["config"] = config
        return original(*call.args, **call.kwargs)

    kv_decode.decode_attention = with_config if config is not None else original
    try:
        yield
    finally:
        kv_decode.decode_attention = original


def search_attention(model: Any, inputs: dict[str, Any], model_name: str) -> dict[str, Any]:
    """The step timed (median of three replays after a call, graph captured again) with each of the model's
    ``_ATTENTION_CANDIDATES`` as the KV decode kernel's config; the GEMV configs stay as the tuner chose them. Each
    timing drops the graph kept before it (:func:`step_ms_recaptured`), so no trial replays another's."""

    def step_ms(config: tuple[Any, ...] | str | None) -> float:
        with attention_config(config):
            return step_ms_recaptured(model, inputs)

    out: dict[str, Any] = {"default_ms": step_ms(None), "trials": []}
    for config in _ATTENTION_CANDIDATES[model_name]:
        try:
            ms = step_ms(config)
        except Exception as error:  # a config that cannot run here is no candidate
            out["trials"].append({"cfg": config, "error": repr(error)[:200]})
            continue
        out["trials"].append({"cfg": config, "step_ms": ms})
        print("attention", config, f"{ms:.4f} ms (default {out['default_ms']:.4f})", flush=True)
    out["default_again_ms"] = step_ms(None)
    return out


# Timing-only stacks (their outputs are wrong): a default stack with a kind of kernel replaced by nothing, to bound what
# removing or fusing it away could gain. "norms": every RMSNorm of the step (65: two per layer and the last) returns
# its input; "combine": the attention's split merge (one per layer; decode_combine_natural for MHA, decode_combine for
# grouped heads) is not launched, so its output is left unwritten and the cache length does not advance (each replay
# attends over the same tokens). Key -> (model, kind).
_FREE = {"g32_norms_free": ("llava", "norms"), "g32_combine_free": ("llava", "combine"),
         "qwen_g128_combine_free": ("qwen2-vl", "combine")}


@contextmanager
def kernels_made_free(stack: str) -> Iterator[None]:
    """For a key of ``_FREE``, that kind of kernel replaced by nothing while the block runs; otherwise nothing."""
    import mmsdk.kernels._split_merge_triton as merging
    import mmsdk.kernels.norm_rope_gpu as norm_ops

    kind = _FREE.get(stack, (None, None))[1]
    saved = {"rms_norm": norm_ops.rms_norm, "add_rms_norm": norm_ops.add_rms_norm,
             "decode_combine_natural": merging.decode_combine_natural, "decode_combine": merging.decode_combine}
    if kind == "norms":
        norm_ops.rms_norm = lambda x, weight, eps: x
        norm_ops.add_rms_norm = lambda x, residual, weight, eps: (x, x)
    elif kind == "combine":
        merging.decode_combine_natural = merging.decode_combine = NoLaunch()
    try:
        yield
    finally:
        norm_ops.rms_norm, norm_ops.add_rms_norm = saved["rms_norm"], saved["add_rms_norm"]
        merging.decode_combine_natural = saved["decode_combine_natural"]
        merging.decode_combine = saved["decode_combine"]


def text_prompt(name: str, length: int = 1024) -> dict[str, torch.Tensor]:
    """A batch-1 text prompt of ``length`` tokens for ``name`` ("llava" or "qwen2-vl"), the same for every run."""
    if name == "llava":
        return suite.llava_inputs(1, length, False)
    ids = torch.randint(1, 150000, (1, length), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _model_and_inputs(name: str, passes: tuple[Any, ...]) -> tuple[Any, dict[str, torch.Tensor], float]:
    """(optimized model with int4-kv, a 1k-token text prompt, K/V bytes per token of its int4 cache)."""
    if name == "llava":
        return suite.optimized(suite.build_llava(), passes, kv=True), text_prompt(name), suite.KV_INT4
    kv_int4 = 28 * 2 * 4 * 128 * 0.5  # layers x (K, V) x KV heads x head_dim, half a byte each
    return suite.optimized(suite.build_qwen2_vl(), passes, kv=True), text_prompt(name), kv_int4


def fresh_step(stack: str, configs: str | None, reps: int,
               run: Any = subprocess.run) -> tuple[float, dict[str, Any]]:
    """The replayed step of ``stack`` in a new process (``--step-only``), with ``MMSDK_STEP_CONFIGS`` set to the file
    ``configs``, or unset (the built-in table and the tuner's own picks) when ``configs`` is None: its step time and the
    GEMV configs that process ran (the tuner's picks for the shapes no table answers can differ between processes:
    each times its own, with no choices kept from an earlier one, ``MMSDK_TUNING_CACHE=0``)."""
    env = {**os.environ, "MMSDK_TUNING_CACHE": "0"}
    env.pop(STEP_CONFIGS_ENV, None)
    if configs is not None:
        env[STEP_CONFIGS_ENV] = configs
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "step.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--reps", str(reps), "--stacks", stack,
                   "--step-only", "--out", str(out)]
        finished = run(command, env=env, capture_output=True, text=True)
        if finished.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(command)} failed ({finished.returncode}):\n{finished.stderr[-2000:]}")
        row = json.loads(out.read_text())["rows"][0]
        return row["step_ms"], row.get("gemv_configs", {})


def varied_shapes(picks: list[dict[str, Any]]) -> list[str]:
    """The shapes whose config was not the same in every one of ``picks`` (one dict of shape -> config per process):
    where fresh processes of one arm disagree, their step times differ for that reason as well as by chance."""
    shapes = sorted({shape for pick in picks for shape in pick})
    return [shape for shape in shapes if len({json.dumps(pick.get(shape)) for pick in picks}) > 1]


def fresh_process_ab(stacks: list[str], configs: str, rounds: int, reps: int,
                     run: Any = subprocess.run) -> dict[str, Any]:
    """Per stack, ``rounds`` pairs of fresh processes, each pair without then with the step-configs file ``configs``
    (alternating, so a drift of the machine falls on both): their step times, medians, the configs each process ran
    and the shapes whose config varied between the processes of one arm."""
    out: dict[str, Any] = {"configs": configs, "rounds": rounds}
    for stack in stacks:
        arms: dict[str, tuple[list[float], list[dict[str, Any]]]] = {"tuner": ([], []), "saved": ([], [])}
        for _ in range(rounds):
            for arm, file in (("tuner", None), ("saved", configs)):
                step_ms, picks = fresh_step(stack, file, reps, run)
                arms[arm][0].append(step_ms)
                arms[arm][1].append(picks)
            print(f"fresh processes, {stack}: tuner {arms['tuner'][0][-1]:.4f} ms, "
                  f"saved configs {arms['saved'][0][-1]:.4f} ms", flush=True)
        out[stack] = {}
        for arm, (times, picks) in arms.items():
            varied = varied_shapes(picks)
            out[stack].update({f"{arm}_ms": times, f"{arm}_median_ms": statistics.median(times),
                               f"{arm}_configs": picks, f"{arm}_varied": varied})
            if varied:
                print(f"fresh processes, {stack}, {arm}: configs varied for {varied}", flush=True)
    return out


def main() -> None:
    from mmsdk.kernels.w4a16_tuning import tuning

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="reuse.json")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--stacks", default="g32,g128", help=f"comma-separated keys of {sorted(stacks())}")
    parser.add_argument("--step-only", action="store_true", help="measure the replayed step alone")
    parser.add_argument("--search", action="store_true",
                        help="then choose the step's GEMV configs by timing the replayed step (search_step)")
    parser.add_argument("--projections", default="", help="with --search: comma-separated projections to search "
                        "(qkv, qkv_statistics, o_proj, down, gated; all by default)")
    parser.add_argument("--kinds", default="", help="with --search: comma-separated GEMV kinds to try (all by "
                        "default)")
    parser.add_argument("--save", default="", help="with --search: write the kept configs for this GPU into this "
                        "step-configs file (MMSDK_STEP_CONFIGS=<file> makes a process take them)")
    parser.add_argument("--ab-rounds", type=int, default=0, help="with --save: then time each stack's step in this "
                        "many pairs of fresh processes, without and with MMSDK_STEP_CONFIGS=<the saved file>")
    parser.add_argument("--search-attention", action="store_true",
                        help="then time the step with each of the KV decode kernel's candidate configs")
    parser.add_argument("--against-tuner", action="store_true",
                        help="then time the step with the tuner's own picks where the step-measured table answered")
    args = parser.parse_args()
    if args.ab_rounds and not (args.search and args.save):
        parser.error("--ab-rounds compares a saved search with the tuner: give it with --search --save FILE")
    chosen = {key: stacks()[key] for key in args.stacks.split(",")}
    command = f"python benchmarks/gpu_decode_reuse.py --reps {args.reps} --stacks {args.stacks}"
    command += (" --step-only" if args.step_only else "") + (" --search" if args.search else "")
    command += f" --projections {args.projections}" if args.projections else ""
    command += f" --kinds {args.kinds}" if args.kinds else ""
    command += f" --save {args.save}" if args.save else ""
    command += f" --ab-rounds {args.ab_rounds}" if args.ab_rounds else ""
    command += (" --search-attention" if args.search_attention else "") + (" --against-tuner" if args.against_tuner
                                                                           else "")
    results: dict[str, Any] = {"command": command,
                               "env": suite.section_env(), "rows": []}
    for key, (name, model_name, passes) in chosen.items():
        model, inputs, kv_bytes = _model_and_inputs(model_name, passes)
        floor_ms = suite.lm_bytes(model, kv_bytes, 1024 + 128) / suite.speed_limit() * 1e3
        group = stack_group(passes)
        pins = pinned_configs(key, group)
        for shape in pins:  # a pinned stack and the stacks after it tune these shapes afresh
            tuning().chosen.pop(shape, None)
        before = set(tuning().chosen)
        tuning().chosen.update(pins)
        with kernels_made_free(key):
            if args.step_only:
                call_ms(model, inputs, 128, 1)  # tune, compile and capture
                measured = {"step_ms": statistics.median(_replay_after_call(model, inputs) for _ in range(5))}
            else:
                measured = measure(model, inputs, args.reps)
        row = {"stack": name, "floor_ms": floor_ms, **measured}
        row["step_over_floor"] = row["step_ms"] / floor_ms
        row["gemv_configs"] = {str(shape): cfg for shape, cfg in tuning().chosen.items() if shape not in before}
        if args.search:
            row["search"] = search_step(model, inputs, model_name, group,
                                        tuple(args.projections.split(",")) if args.projections else None,
                                        tuple(args.kinds.split(",")) if args.kinds else None)
            row["search"]["floor_ms"] = floor_ms
            if args.save:
                write_step_configs(args.save, torch.cuda.get_device_name(),
                                   kept_configs(row["search"], model_name, group))
        if args.search_attention:
            row["search_attention"] = search_attention(model, inputs, model_name)
        if args.against_tuner:
            row["against_tuner"] = step_with_tuner_picks(model, inputs, step_ms_recaptured)
        for shape in pins:
            tuning().chosen.pop(shape, None)
        results["rows"].append(row)
        print(row, flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
        del model
        suite.release_memory()
    if args.ab_rounds:
        results["fresh_process_ab"] = fresh_process_ab(list(chosen), str(Path(args.save).resolve()), args.ab_rounds,
                                                       args.reps)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
