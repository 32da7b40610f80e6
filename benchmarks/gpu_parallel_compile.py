"""A tuner's first tuning on an empty Triton cache (a fresh machine): its candidates compiled one after the other, or
side by side first (mmsdk.kernels.parallel_compile).

Each case runs in a process of its own with an empty ``TRITON_CACHE_DIR`` and ``MMSDK_COMPILE_THREADS`` set, so no
kernel is compiled before it starts; with ``--warm`` once more on the cache the first thread count's run filled (what
the first call costs without compiling). ``gemv``: LLaVA-1.5-7B's fused q/k/v projection ([12288, 4096], g32, bf16) for
one token, the first ``int4_linear`` call (the tuner compiles and times its 18 candidates), then a second call; the
output is checked against the dequantized weight. ``generate``: the first and second greedy ``generate`` call of
builtin:llava-digits with qkv-fuse, int4-weight and int4-kv (a user's first call on a machine); ``generate7b``: the same
for LLaVA-1.5-7B shapes (random weights) with rmsnorm-rope-fusion too, a 640-token prompt, 8 new tokens. ``tune``:
``mmsdk tune builtin:llava-digits --apply qkv-fuse,int4-weight,int4-kv --kinds idot,idotr``, whose first step tunes the
decode step's GEMVs (202 s of its 236 s with one thread on a fresh H100, docs/benchmarks.md, fifty-second pass).

``--warm-ups default,captured,eager``: how the W4A16 tuner warms each candidate up before timing it. "default" leaves
it to the tuner (inside a dropped capture, so on Hopper only the GEMVs' captured variants compile, but eagerly in a step
search's first tuning, whose trials run every candidate eagerly too); "captured" and "eager" force one of the two on
every tuning ("eager": one eager call per candidate, each eager variant compiled too, as the tuner did until the
fifty-third pass).

``--warm``: each case's first run is followed by two more on the Triton cache it filled, one with the tuner's
choices it kept (``MMSDK_TUNING_CACHE``, a file beside that cache: only the chosen kernels load, nothing is timed)
and one without (every candidate loaded from the cache and timed again).

``--tune-min-bytes default,0``: ``MMSDK_TUNE_MIN_BYTES`` per run (unset: the tuner takes the first candidate untimed
for weights under 256 KiB, such as every weight of the generate case's tiny model; 0: it times every weight, as before
the fifty-seventh pass).

``--step-ahead off,on,kernels``: fast generate's ``MMSDK_COMPILE_STEP_AHEAD`` per run (``on``: a new decode step's
kernels are recorded in a dropped capture and compiled side by side before its first call, the GEMV tuner's
candidates for every shape the step meets among them; ``kernels``: the same, but the tuner's candidates compiled in a
step of their own per shape at its first eager call, as in the fifty-fifth pass; it matters to the generate cases
only).

Each worker also lists every Triton compile it saw (Triton's compilation listener): on which thread, how long, so a
case says how much of its first call still compiled one kernel at a time on the calling thread ("serial") and which
kernels those were, next to what the compile threads did ("parallel", summed over threads).

    python benchmarks/gpu_parallel_compile.py --out parallel_compile.json [--threads 16,1]
        [--cases gemv,generate,generate7b,tune] [--warm] [--warm-ups default,captured,eager]
        [--compile-in threads,processes]
        [--step-ahead off,on,kernels] [--tune-min-bytes default,0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def gemv_case() -> dict[str, Any]:
    """The first and second one-row call of a 7B q/k/v GEMV in this process, with what the compile step took."""
    import torch

    import mmsdk.kernels.w4a16_tuning as tuning_module
    from mmsdk.kernels.w4a16 import int4_linear
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    compiles: list[tuple[int, float]] = []
    original = tuning_module.compile_in_parallel

    def timed_compile(launches: Any, *args: Any, **kwargs: Any) -> int:  # as tuned_config calls it (captured_on=)
        started = time.perf_counter()
        count = original(launches, *args, **kwargs)
        compiles.append((count, time.perf_counter() - started))
        return count

    tuning_module.compile_in_parallel = timed_compile
    n, k, group = 12288, 4096, 32
    packed = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, group, scale_dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dequantize_int4(packed, torch.float32).T
    seconds = []
    for _ in range(2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = int4_linear(x, packed.qweight, packed.scales, packed.zero_points, k, group)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    error = ((out.float() - expected).norm() / expected.norm()).item()
    chosen = next(iter(tuning_module.tuning().chosen.values()))
    return {"first_call_s": round(seconds[0], 2), "second_call_s": round(seconds[1], 4),
            "kernels_compiled_side_by_side": compiles[0][0] if compiles else 0,
            "compile_step_s": round(compiles[0][1], 2) if compiles else None,
            "relative_error": error, "chosen": list(chosen)}


def tune_case(folder: Path) -> dict[str, Any]:
    """``mmsdk tune`` on the digits model, timed, with the first step's own report from its stderr."""
    import contextlib
    import io

    from mmsdk.cli import main

    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        returncode = main(["tune", "builtin:llava-digits", "--apply", "qkv-fuse,int4-weight,int4-kv", "--kinds",
                           "idot,idotr", "--out", str(folder / "step.json")])
    seconds = time.perf_counter() - started
    lines = [line for line in err.getvalue().splitlines() if line.startswith(("tuned ", "decode step on"))]
    lines += [line for line in out.getvalue().splitlines() if "decode step on" in line]
    return {"returncode": returncode, "seconds": round(seconds, 1), "report": lines,
            "stderr_tail": err.getvalue()[-600:] if returncode else ""}


def generate_case() -> dict[str, Any]:
    """The first and second greedy ``generate`` call (16 new tokens) of the digits model with the decode stack, as a
    user's first call on a machine meets it: every tuning, compile and capture of the fast path."""
    import torch

    from mmsdk.cli._common import prompt_sample
    from mmsdk.core.optimizer import Optimizer
    from mmsdk.core.session import Session
    from mmsdk.core.sources import load_model
    from mmsdk.profiling.measure import prompt_inputs

    session = Session.create()
    loaded = load_model("builtin:llava-digits", session=session)
    loaded.model.to("cuda", torch.bfloat16)
    opt = Optimizer(loaded, session=session)
    opt.apply("qkv-fuse", "int4-weight", "int4-kv")
    inputs = prompt_inputs(opt.model, opt.processor, opt.adapter, prompt_sample(None, None, opt.session), "cuda")
    return two_generate_calls(opt.model, inputs, 16)


def two_generate_calls(model: Any, inputs: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """The first and second greedy ``generate`` call of ``model`` on ``inputs``, timed (synchronized), their answers
    compared, the first one's new tokens listed (to compare runs by)."""
    import torch

    seconds, answers = [], []
    for _ in range(2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        answers.append(model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False))
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return {"first_call_s": round(seconds[0], 2), "second_call_s": round(seconds[1], 4),
            "same_answer": bool(torch.equal(answers[0], answers[1])),
            "new_tokens": answers[0][0, inputs["input_ids"].shape[1]:].tolist()}


def generate7b_case() -> dict[str, Any]:
    """The first and second greedy ``generate`` call (8 new tokens) of LLaVA-1.5-7B shapes (random bf16 weights built
    on the GPU) with qkv-fuse, int4-weight, rmsnorm-rope-fusion and int4-kv (static ranges), one 640-token prompt with
    an image: a 7B model's first call on a machine."""
    from benchmarks.gpu_models import build_llava, llava_inputs, optimized

    model = optimized(build_llava(), ("qkv-fuse", "int4-weight", "rmsnorm-rope-fusion"), kv=True)
    return two_generate_calls(model, llava_inputs(1, 640, images=True), 8)


def listen_to_compiles() -> list[dict[str, Any]]:
    """Every Triton compile from now on in this process, appended as it ends: the kernel, the thread it ran on, its
    time and whether Triton's cache had it (an empty list, never filled, on a Triton without the listener)."""
    import threading

    compiles: list[dict[str, Any]] = []
    try:
        from triton import knobs
    except ImportError:
        return compiles

    def listener(*, src: Any, times: Any, cache_hit: bool, **_: Any) -> None:
        compiles.append({"kernel": getattr(src, "name", str(src)), "thread": threading.current_thread().name,
                         "seconds": times.total / 1e6, "cache_hit": cache_hit})

    knobs.compilation.listener = listener
    return compiles


def compile_summary(compiles: list[dict[str, Any]]) -> dict[str, Any]:
    """The compiles of a case, the calling thread's (one at a time) apart from the compile threads'."""
    compiled = [entry for entry in compiles if not entry["cache_hit"]]
    serial = [entry for entry in compiled if not entry["thread"].startswith("mmsdk-compile")]
    parallel = [entry for entry in compiled if entry["thread"].startswith("mmsdk-compile")]
    by_kernel: dict[str, list[float]] = {}
    for entry in serial:
        by_kernel.setdefault(entry["kernel"], []).append(entry["seconds"])
    slowest = sorted(by_kernel.items(), key=lambda item: -sum(item[1]))
    return {"compiles": len(compiled), "cache_hits": len(compiles) - len(compiled),
            "serial_compiles": len(serial), "serial_compile_s": round(sum(e["seconds"] for e in serial), 2),
            "parallel_compiles": len(parallel),
            "parallel_compile_thread_s": round(sum(e["seconds"] for e in parallel), 2),
            "serial_kernels": [{"kernel": name, "compiles": len(times), "seconds": round(sum(times), 2)}
                               for name, times in slowest]}


class ProcessCompiler:
    """What ``compile_in_parallel`` does, the compiles in spawned processes instead of threads (a prototype, to learn
    whether the GIL that a Triton compile holds part of the time (benchmarks/compile_gil_share.py) costs a 16-CPU
    machine much): the recorded kernels are compiled by a pool of processes into Triton's cache (each compiles for the
    parent's GPU without a CUDA context of its own), then read back here, so the timed launches compile nothing.

    Called as ``compile_in_parallel`` is; returns the kernels recorded. The pool starts at the first call and serves
    every later one (a tuning's shapes one after another), until :meth:`close`. Each call's pool start (the first's),
    compiles and read-back are timed into ``report``."""

    def __init__(self, report: list[dict[str, Any]]) -> None:
        self.report = report
        self.pool: Any = None
        self.workers = 0

    def __call__(self, launches: Any, threads: int | None = None, *, captured_on: Any = None,
                 warm_up: str = "eager") -> int:
        from triton.runtime.driver import driver

        from mmsdk.kernels.parallel_compile import (
            _build_launcher,
            _recorded_kernels,
            _run_as_timed,
            compile_threads,
            guarded_launch,
        )

        guarded = [guarded_launch(launch) for launch in launches]  # recorded as compile_in_parallel records them
        recorded = _recorded_kernels(lambda: _run_as_timed(guarded, captured_on, warm_up) if captured_on is not None
                                     else [launch() for launch in guarded])
        if not recorded:
            return 0
        jobs = [(kernel.fn.__module__, kernel.fn.__qualname__, specialization)
                for kernel, specialization in recorded.values()]
        started = time.perf_counter()
        if self.pool is None:
            self._start(compile_threads() if threads is None else threads, driver.active.get_current_target())
        ready = time.perf_counter()
        failed = sum(seconds is None for seconds in self.pool.map(_compile_in_process, jobs))
        compiled = time.perf_counter()
        for kernel, specialization in recorded.values():  # Triton's cache has them now: read, not compiled
            try:
                _build_launcher(kernel.preload(specialization))
            except Exception:  # noqa: BLE001 - one that failed to compile: left to its launch, as the threads do
                pass
        self.report.append({"kernels": len(jobs), "failed": failed, "processes": self.workers,
                            "start_s": round(ready - started, 2), "compile_s": round(compiled - ready, 2),
                            "read_back_s": round(time.perf_counter() - compiled, 2)})
        return len(jobs)

    def _start(self, workers: int, target: Any) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.workers = workers
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_compiling_process, initargs=(target.arch, target.warp_size))
        list(self.pool.map(_ready, range(workers)))  # every process started and its imports done

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


def _compiling_process(arch: int, warp_size: int) -> None:
    """A compiling process's start: Triton's driver reports the parent's GPU, so no CUDA context is made here."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    import mmsdk.kernels.parallel_compile  # noqa: F401 - its imports (torch, Triton) are part of a process's start

    try:
        active = driver.active
    except RuntimeError:  # no CUDA driver here (a check on a CPU machine): compile only, build no launcher
        import types

        active = driver._active = types.SimpleNamespace()
    active.get_current_device = lambda: 0
    active.get_device_capability = lambda device=None: divmod(arch, 10)
    active.get_current_target = lambda: GPUTarget("cuda", arch, warp_size)


def _ready(_: int) -> int:
    time.sleep(0.2)  # held a moment, so every process of the pool takes one
    return os.getpid()


def _compile_in_process(job: tuple[str, str, str]) -> float | None:
    """Compile one recorded kernel (its module, name and specialization) into Triton's cache, with its launcher; its
    seconds, or None if it failed."""
    import importlib

    from mmsdk.kernels.parallel_compile import _build_launcher

    module, name, specialization = job
    kernel: Any = importlib.import_module(module)
    for part in name.split("."):
        kernel = getattr(kernel, part)
    while not hasattr(kernel, "preload") and hasattr(kernel, "fn"):  # an autotuner or heuristics around the kernel
        kernel = kernel.fn
    started = time.perf_counter()
    try:
        _build_launcher(kernel.preload(specialization))
    except Exception:  # noqa: BLE001 - left to the real launch, which compiles it again and raises where it is handled
        return None
    return time.perf_counter() - started


def force_warm_up(warm_up: str) -> None:
    """The W4A16 tuner in this process with ``warm_up`` forced on its compile and timing calls (``eager``: as before
    the tuner warmed its candidates up inside a capture)."""
    import mmsdk.kernels.w4a16_tuning as tuning_module

    for name in ("compile_in_parallel", "graph_time_ms"):
        original = getattr(tuning_module, name)

        def forced(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            return _original(*args, **{**kwargs, "warm_up": warm_up})

        setattr(tuning_module, name, forced)


def run_case(case: str, threads: int, cache: Path, warm_up: str, compile_in: str,
             step_ahead: str = "off", keep_choices: bool = True, tune_min_bytes: str = "default") -> dict[str, Any]:
    """``case`` in a fresh process with Triton's cache in ``cache``, ``threads`` compile threads (or processes:
    ``compile_in``), the tuner's candidates warmed up ``warm_up`` and a new decode step's kernels compiled ahead
    (``step_ahead`` "on") or not. The tuner's choices are kept in a file beside ``cache`` (``MMSDK_TUNING_CACHE``),
    so a later run on the same cache takes them untimed, or (``keep_choices`` False) not at all. ``tune_min_bytes``
    sets ``MMSDK_TUNE_MIN_BYTES`` (the weights the tuner leaves untimed), or leaves it unset ("default")."""
    choices = cache.parent / f"{cache.name}-tuning-choices.json"
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "MMSDK_COMPILE_THREADS": str(threads),
               "MMSDK_COMPILE_STEP_AHEAD": "0" if step_ahead == "off" else "1",
               "MMSDK_TUNING_CACHE": str(choices) if keep_choices else "0",
               **({} if tune_min_bytes == "default" else {"MMSDK_TUNE_MIN_BYTES": tune_min_bytes}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        warm = cache.is_dir() and any(cache.iterdir())
        tuning_cache = ("kept" if choices.exists() else "empty") if keep_choices else "off"
        started = time.perf_counter()
        run = subprocess.run([sys.executable, __file__, "--worker", case, "--folder", folder, "--warm-ups", warm_up,
                              "--compile-in", compile_in, "--step-ahead", step_ahead],
                             env=env, capture_output=True, text=True)
        label = {"case": case, "threads": threads, "warm_up": warm_up, "compile_in": compile_in,
                 "step_ahead": step_ahead, "triton_cache": "warm" if warm else "empty", "tuning_cache": tuning_cache,
                 "tune_min_bytes": tune_min_bytes}
        if run.returncode:
            return {**label, "error": run.stderr[-2000:]}
        result = json.loads(run.stdout.strip().splitlines()[-1])
        return {**label, "process_s": round(time.perf_counter() - started, 1), **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--threads", default=f"1,{len(os.sched_getaffinity(0))}",
                        help="compile threads per run, comma separated (default: 1 and this machine's CPUs)")
    parser.add_argument("--cases", default="gemv,tune", help="comma separated: gemv, generate, generate7b, tune")
    parser.add_argument("--warm", action="store_true",
                        help="then run each case's first run twice more on the Triton cache it filled: with the "
                             "tuner's choices it kept and without")
    parser.add_argument("--warm-ups", default="default",
                        help="the tuner's warm-up per run, comma separated: default (its own choice), or captured or "
                             "eager forced on every tuning")
    parser.add_argument("--compile-in", default="threads",
                        help="comma separated: threads (mmsdk's compile step), processes (a prototype: the tuner's "
                             "recorded kernels compiled by spawned processes into Triton's cache)")
    parser.add_argument("--step-ahead", default="off",
                        help="comma separated: off, on (fast generate compiles a new decode step's kernels side by "
                             "side before its first call: MMSDK_COMPILE_STEP_AHEAD), kernels (on, but the tuner "
                             "compiles its candidates per shape at its first eager call)")
    parser.add_argument("--tune-min-bytes", default="default",
                        help="comma separated: default (MMSDK_TUNE_MIN_BYTES unset: weights under 256 KiB take their "
                             "first candidate untimed) or a whole number of bytes per run (0: every weight timed)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for option, given, known in (("--cases", args.cases, ("gemv", "generate", "generate7b", "tune")),
                                 ("--warm-ups", args.warm_ups, ("default", "captured", "eager")),
                                 ("--compile-in", args.compile_in, ("threads", "processes")),
                                 ("--step-ahead", args.step_ahead, ("off", "on", "kernels"))):
        unknown = [value for value in given.split(",") if value not in known]
        if unknown:
            parser.error(f"{option} {given}: {', '.join(unknown)} unknown; use a comma-separated list of "
                         f"{', '.join(known)}")
    if any(value != "default" and not value.isdigit() for value in args.tune_min_bytes.split(",")):
        parser.error(f"--tune-min-bytes {args.tune_min_bytes}: use a comma-separated list of default and whole "
                     "numbers of bytes")
    if args.worker:
        process_compiles: list[dict[str, Any]] = []
        compiler = ProcessCompiler(process_compiles)
        if args.compile_in == "processes":
            import mmsdk.kernels.w4a16_tuning as tuning_module

            tuning_module.compile_in_parallel = compiler
        if args.warm_ups != "default":
            force_warm_up(args.warm_ups)
        if args.step_ahead == "kernels":  # the tuner launches no candidate inside the step's recording
            import mmsdk.kernels.w4a16_tuning as tuning_module

            tuning_module.recording_a_first_call = lambda: False
        cases = {"gemv": gemv_case, "generate": generate_case, "generate7b": generate7b_case,
                 "tune": lambda: tune_case(args.folder)}
        compiles = listen_to_compiles()
        try:
            result = cases[args.worker]()
        finally:
            compiler.close()
        print(json.dumps({**result, **compile_summary(compiles), "process_compiles": process_compiles}))
        return
    import torch
    import triton

    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "triton": triton.__version__, "cpus": len(os.sched_getaffinity(0)), "runs": []}
    counts = [int(t) for t in args.threads.split(",")]
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory() as caches:
            runs = [dict(threads=threads, warm_up=warm_up, compile_in=compile_in, step_ahead=ahead,
                         tune_min_bytes=least, keep_choices=True,
                         cache=Path(caches) / f"{threads}-{compile_in}-{warm_up}-{ahead}-{least}")
                    for least in args.tune_min_bytes.split(",") for ahead in args.step_ahead.split(",")
                    for warm_up in args.warm_ups.split(",") for compile_in in args.compile_in.split(",")
                    for threads in counts]
            if args.warm:  # what is left without compiling: the first run again, on the cache it filled, with the
                runs += [runs[0], {**runs[0], "keep_choices": False}]  # tuner's choices it kept and without them
            for run in runs:
                results["runs"].append(run_case(case, **run))
                print(json.dumps(results["runs"][-1]), flush=True)
                if args.out:
                    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
