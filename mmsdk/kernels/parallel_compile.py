"""Compiling a tuner's candidates on every CPU at once, before it times them one by one.

A tuner times each candidate configuration of a kernel by launching it, and the first launch of a configuration
compiles it. On a fresh machine (Triton's cache empty) that was most of a tuning's time: ``mmsdk tune`` on
builtin:llava-digits spent 202 s of its 236 s tuning the step's 4 GEMVs over 18 candidates each, one compile after the
other, and 3 s searching (docs/benchmarks.md, fifty-second pass); compiled side by side on 16 threads, 33 s of 55
(fifty-third pass). Triton's compiler leaves the GIL in its long passes, so threads compile side by side (Triton's
own ``AsyncCompileMode`` runs its compiles on an executor for this).

How, without knowing what a launch compiles: each candidate's launch runs once with Triton's ``jit_cache_hook``
answering "skip" for every kernel not compiled yet. Triton then hands the hook the kernel and its specialization
(what ``JITFunction.preload`` takes) and returns without launching it; kernels compiled before launch as usual, which
is harmless for a tuner (its launches write only their own outputs). The launches run inside a CUDA graph capture
too, where the GEMVs compile a variant of their own (programmatic dependent launch); the W4A16 tuner warms its
candidates up inside a capture as well, so their eager variants (but the first's) are not compiled at all. Then every
recorded kernel is preloaded under ``AsyncCompileMode`` on a thread pool: compiled (or read from Triton's cache) and
kept where the next launch looks, so the timed launches compile nothing. Their C launchers (Triton 3.6 builds one per
argument signature at a kernel's first launch) are built on the same threads afterwards.

The same recording serves a decode step's first call (:func:`compile_before_first_call`): the step runs once inside a
CUDA graph capture that is then dropped, where nothing runs (torch's operations and the compiled kernels are only
recorded, then thrown away) and Triton skips every kernel it has not compiled; those are then compiled side by side,
and the step's real first call finds them compiled.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from functools import cache
from typing import Any

import torch

from mmsdk.kernels import LOG, WARM_UPS, ThreadScope, call_in_dropped_capture, captured_calls

__all__ = ["COMPILE_STEP_AHEAD_ENV", "COMPILE_THREADS_ENV", "compile_before_first_call", "compile_in_parallel",
           "compile_step_ahead", "compile_threads", "guarded_launch", "recording_a_first_call"]

# how many threads compile a tuner's candidates at once (default: the CPUs this process may use, at most
# DEFAULT_MOST_THREADS); "1" compiles each candidate at its first launch, one after the other, as without this module
COMPILE_THREADS_ENV = "MMSDK_COMPILE_THREADS"
# "1" (the default): fast generate compiles a new decode step's kernels side by side before its first (eager) call
# (compile_before_first_call); "0" leaves each to compile at its first launch. On a fresh H100 it took the digits
# model's first generate from 40.9 to 32.9 s with the same tokens (docs/benchmarks.md, fifty-fifth pass).
COMPILE_STEP_AHEAD_ENV = "MMSDK_COMPILE_STEP_AHEAD"
# a compile holds a few hundred MB while it runs, and a shape has a few dozen candidate kernels at most
DEFAULT_MOST_THREADS = 32
# a compile step at least this long is logged at INFO (compiling); a shorter one read its kernels from Triton's cache
# (36 kernels in 0.6 s on an H100, docs/benchmarks.md, fifty-third pass)
NOTED_SECONDS = 2.0


def compile_threads() -> int:
    """The threads :func:`compile_in_parallel` uses: ``MMSDK_COMPILE_THREADS``, or this process's CPUs (at most
    ``DEFAULT_MOST_THREADS``)."""
    value = os.environ.get(COMPILE_THREADS_ENV, "")
    if not value:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return min(cpus, DEFAULT_MOST_THREADS)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{COMPILE_THREADS_ENV}={value!r}: set it to a whole number of threads, 1 or more (1 compiles "
                         "one kernel at a time), or leave it unset for one per CPU.")
    return int(value)


def compile_step_ahead() -> bool:
    """Whether fast generate compiles a new decode step's kernels ahead of its first call: ``MMSDK_COMPILE_STEP_AHEAD``
    "1" / unset (on) or "0" (off)."""
    value = os.environ.get(COMPILE_STEP_AHEAD_ENV, "") or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{COMPILE_STEP_AHEAD_ENV}={value!r}: set it to 1 (compile a decode step's kernels side by "
                         "side before its first call) or 0 (each at its first launch), or leave it unset (1).")
    return value == "1"


def compile_in_parallel(launches: Sequence[Callable[[], Any]], threads: int | None = None, *,
                        captured_on: torch.device | None = None, warm_up: str = "eager") -> int:
    """Compile every Triton kernel that ``launches`` would compile, on ``threads`` threads at once (default
    :func:`compile_threads`), launching none of them; returns how many kernels it compiled (or tried to).

    ``captured_on`` (a CUDA device; others are ignored): the launches are also recorded as a CUDA graph captured on
    that device runs them. The GEMVs take programmatic dependent launch only while captured
    (mmsdk.kernels.pdl_preload_ready), a kernel of its own. ``warm_up`` says how the tuner calls them before it times
    them (:func:`mmsdk.kernels.captured_calls`): ``"eager"``, each once eagerly, so each is recorded eagerly and
    captured; ``"captured"``, each inside a capture, after one eager call of the first (which makes what a launch
    makes on its first call), so only the first is recorded eagerly as well. Without ``captured_on`` every launch is
    recorded eagerly.

    Nothing happens (0) with one thread or one launch, without Triton's hooks (``triton.knobs``, Triton 3.4 and
    newer), or while a ``jit_cache_hook`` of someone else's is set (it is left to see every compile). A launch that
    fails while its kernels are recorded, and a kernel that fails to compile, are left to fail again at their real
    launch, where the tuner drops that candidate.
    """
    if warm_up not in WARM_UPS:
        raise ValueError(f"warm_up={warm_up!r}: use one of {', '.join(WARM_UPS)}.")
    threads = compile_threads() if threads is None else threads
    if threads <= 1 or len(launches) <= 1:
        return 0
    guarded = [guarded_launch(launch) for launch in launches]
    if captured_on is not None and captured_on.type == "cuda":
        recorded = _recorded_kernels(lambda: _run_as_timed(guarded, captured_on, warm_up))
    else:
        recorded = _recorded_kernels(lambda: [launch() for launch in guarded])
    return _compile_side_by_side(recorded, threads, "a tuner")


def compile_before_first_call(call: Callable[[], Any], stream: torch.cuda.Stream | None,
                              threads: int | None = None) -> int:
    """Compile, on ``threads`` threads at once (default :func:`compile_threads`), every Triton kernel that ``call``'s
    first run would compile one after the other, without running it; returns how many kernels it compiled (or tried
    to).

    ``call`` runs once inside a CUDA graph capture on ``stream`` that is then dropped, with Triton told to skip every
    kernel it has not compiled yet: nothing of it runs on the device (torch's operations and the kernels compiled
    before are only recorded into the dropped graph), so it must be a call that may be captured, such as fast
    generate's decode step, and one that keeps no tensor it makes for a later call (such a tensor would never be
    written). What it records is each kernel as launched inside a capture. That is what an eager call launches too,
    except for kernels with a variant of their own inside captures (the GEMVs' programmatic dependent launch,
    mmsdk.kernels.pdl_preload_ready). The GEMVs' tuner, met here for a new shape, runs the choice an earlier process
    kept (mmsdk.kernels.tuning_cache), or else launches every candidate (:func:`recording_a_first_call`) and runs the
    first, keeping no choice: all are recorded and compiled here, and the tuner times them at the first eager call,
    its own compile step (:func:`compile_in_parallel`) left with at most the first one's eager variant. A capture
    that fails (a host sync in ``call``) keeps what was recorded before it failed; nothing happens (0) with one
    thread, without Triton's hooks, or while a ``jit_cache_hook`` of someone else's is set.
    """
    threads = compile_threads() if threads is None else threads
    if threads <= 1:
        return 0

    def recorded_call() -> None:
        with _recording().entered():
            _call_in_dropped_capture(call, stream)

    return _compile_side_by_side(_recorded_kernels(recorded_call), threads, "a first decode step")


def recording_a_first_call() -> bool:
    """Whether :func:`compile_before_first_call` is recording a call on this thread (inside its dropped capture).

    A tuner met there for the first time launches every candidate (recorded, not run: nothing of the capture runs), so
    the candidates of all the call's shapes compile in one step with its other kernels, instead of in a step of their
    own per shape at the first eager call (18 candidates on 16 threads take two rounds of compiles, the second
    nearly empty)."""
    return bool(_recording())


@cache
def _recording() -> ThreadScope:
    """This process's scope of compile_before_first_call's recordings (one per thread)."""
    return ThreadScope()


def _compile_side_by_side(recorded: dict[tuple[int, str], tuple[Any, str]], threads: int, caller: str) -> int:
    """Compile ``recorded`` (from :func:`_recorded_kernels`) on ``threads`` threads, each kept where its next launch
    looks, then build their launchers on the same threads; returns how many there were."""
    if not recorded:
        return 0
    import triton

    started = time.perf_counter()
    workers = min(threads, len(recorded))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mmsdk-compile") as pool:
        with triton.AsyncCompileMode(pool, ignore_errors=True):
            pending = [_preload(kernel, specialization) for kernel, specialization in recorded.values()]
            # the mode's exit drops a failed compile's error, and its launch compiles that kernel again: said here
            _log_failed_compiles([kernel for kernel, _ in recorded.values()], pending)
        # the mode's exit waited for every compile; now each compiled kernel's launcher on the same threads
        compiled = [future.kernel for future in pending if getattr(future, "kernel", None) is not None]
        list(pool.map(_build_launcher, compiled))
    seconds = time.perf_counter() - started
    # a first call that stalls for seconds says why, once per compile step; read from Triton's cache it is quiet
    LOG.log(logging.INFO if seconds >= NOTED_SECONDS else logging.DEBUG,
            "mmsdk.kernels: compiled %d kernels for %s on %d threads in %.1f s (Triton's cache keeps them for "
            "later processes; %s sets the threads)", len(recorded), caller, workers, seconds, COMPILE_THREADS_ENV)
    return len(recorded)


def _log_failed_compiles(kernels: Sequence[Any], pending: Sequence[Any]) -> None:
    """Wait for the pending compiles (Triton's ``FutureKernel``, one per kernel of ``kernels``) and log each that
    failed, with its error; the compile mode drops them silently."""
    # only the raw future is read: any other attribute of a FutureKernel waits for its result and raises its error
    running = [(kernel, entry.future) for kernel, entry in zip(kernels, pending, strict=True)
               if entry is not None and getattr(entry, "future", None) is not None]
    wait([future for _, future in running])
    for kernel, future in running:
        error = future.exception()
        if error is not None:
            LOG.debug("compiling %s on a compile thread failed (%s: %s); its launch compiles it again",
                      getattr(kernel, "__name__", kernel), type(error).__name__, error)


def _recorded_kernels(run: Callable[[], Any]) -> dict[tuple[int, str], tuple[Any, str]]:
    """(kernel, specialization data) of every kernel that ``run`` would compile, keyed so each is compiled once; none
    is compiled or launched while ``run`` runs."""
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one older than its hooks: each launch compiles its own kernels
        return {}
    if knobs.runtime.jit_cache_hook is not None:
        return {}
    recorded: dict[tuple[int, str], tuple[Any, str]] = {}

    def record(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        kernel, specialization = fn.jit_function, compile["specialization_data"]
        recorded.setdefault((id(kernel), specialization), (kernel, specialization))
        return True  # skip: Triton neither compiles nor launches this kernel now

    knobs.runtime.jit_cache_hook = record
    try:
        run()
    finally:
        knobs.runtime.jit_cache_hook = None
    return recorded


def guarded_launch(launch: Callable[[], Any]) -> Callable[[], None]:
    """``launch``, its failure logged and dropped: the real launch raises it again, where the tuner handles it (for
    launches that are only recorded)."""

    def run() -> None:
        try:
            launch()
        except Exception as error:  # noqa: BLE001
            LOG.debug("recording a launch's kernels failed (%s: %s)", type(error).__name__, error)

    return run


def _run_as_timed(launches: Sequence[Callable[[], None]], device: torch.device, warm_up: str) -> None:
    """The launches as a tuner runs them with :func:`mmsdk.kernels.graph_time_ms`: on a side stream, each once
    eagerly (``"eager"``; ``"captured"``: the first only), then inside a CUDA graph capture (the graph, holding only
    kernels compiled before, is dropped). A capture that fails leaves its kernels to compile at their own captured
    launch."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            if warm_up == "captured":  # the tuner's one eager call, before its captured warm-up
                launches[0]()
            captured_calls(launches, len(launches), stream, warm_up)
    except Exception as error:  # noqa: BLE001 - nothing of the capture is used
        LOG.debug("recording the captured launches failed (%s: %s)", type(error).__name__, error)
    torch.cuda.current_stream(device).wait_stream(stream)


def _call_in_dropped_capture(call: Callable[[], Any], stream: torch.cuda.Stream | None) -> None:
    """``call`` inside a CUDA graph capture on ``stream`` that is dropped; a capture that fails is logged and left."""
    try:
        call_in_dropped_capture([call], stream)
    except Exception as error:  # noqa: BLE001 - nothing of the capture is used; the real call meets the error again
        LOG.debug("recording a first call's kernels in a capture failed (%s: %s)", type(error).__name__, error)


def _preload(kernel: Any, specialization: str) -> Any:
    """Submit one kernel's compile (under AsyncCompileMode Triton queues it on the pool and returns the pending
    compile, whose ``kernel`` is set once the mode ends; None if the submission failed)."""
    try:
        return kernel.preload(specialization)
    except Exception as error:  # noqa: BLE001 - the real launch compiles it again and raises where it is handled
        LOG.debug("preloading %s failed (%s: %s)", getattr(kernel, "__name__", kernel), type(error).__name__, error)
        return None


def _build_launcher(compiled: Any) -> None:
    """Build the C launcher of a compiled kernel once, into Triton's cache.

    Triton 3.6 launches each kernel through a small C module made for its argument signature, built with the
    system's C compiler at the kernel's first launch, one at a time (a profile of a 7B GEMV's first tuning on an H100
    counted 8 such builds, 2.6 s: docs/benchmarks.md, fifty-second pass). Built here, side by side, the first launch
    finds the module in Triton's cache and only loads it. Nothing is loaded onto the GPU. Newer Tritons launch every
    kernel through one module their driver builds, so this costs them nothing and saves nothing."""
    try:
        from triton.runtime.driver import driver

        launcher = getattr(driver.active, "launcher_cls", None)
        if launcher is not None:
            launcher(compiled.src, compiled.metadata)
    except Exception as error:  # noqa: BLE001 - the first launch builds it again and raises where it is handled
        LOG.debug("building the launcher of %s failed (%s: %s)", getattr(compiled, "name", compiled),
                  type(error).__name__, error)
