"""Which Triton kernels a new decode step compiles on an H100 / H200, and how long they take to compile, found on a
machine without a GPU.

Fast generate's first decode step (its eager warm-up) compiles every Triton kernel it launches for the first time, one
at a time, unless ``MMSDK_COMPILE_STEP_AHEAD=1`` records them in a dropped capture and compiles them side by side first
(mmsdk.kernels.parallel_compile.compile_before_first_call). This script runs that recording on CPU:

* the model is built in bf16 on CPU, its passes applied, its prompt prefilled by fast generate's own code (torch
  reference ops);
* for the step, Triton's launch path is pointed at an sm_90 stand-in driver and mmsdk's kernels take CPU tensors (its
  interpreter switch is set, while every kernel module was imported before it, so the kernels stay compiled Triton
  functions), with programmatic dependent launch and inline PTX on, as a captured step on Hopper launches them.
  ``Int4Linear``'s CUDA check and the packed KV cache's device check are lifted; the GEMV tuners take their first
  candidate untimed (as with ``MMSDK_TUNE=0``), or with ``--tuner`` launch every candidate of each shape, as a step
  compiled ahead with tuning on does, so they compile in the same step;
* the step runs once under Triton's ``jit_cache_hook``, which records each kernel and launches none (torch's
  operations run on CPU over whatever the skipped kernels left), with CUDA-graph capture reported as on, so each
  module takes the branch it takes in compile_before_first_call's dropped capture;
* the tensors the step left in an attribute of the model's modules, the cache or the step's own objects that were not
  there before are listed ("kept"): in a dropped capture such a tensor is never written, so a later step reading it
  would compute with garbage. compile_before_first_call needs this list empty;
* each recorded kernel is compiled for sm_90 one at a time into an empty Triton cache (timed), then all of them on
  ``--threads`` threads into another empty cache, as compile_before_first_call does.

What it says is what the step compiles and what that costs on this machine's CPU: a GPU host's CPUs compile at their
own pace. Without ``MMSDK_COMPILE_STEP_AHEAD`` the "other" kernels compile one at a time at the warm-up, and so does
each GEMV's eager variant (the tuner compiles only its candidates' captured variants side by side, and the first
one's eager variant); with it, neither.

    python benchmarks/cpu_step_compiles.py [--model builtin:llava-digits]
        [--apply qkv-fuse,int4-weight,rmsnorm-rope-fusion,int4-kv] [--threads 2] [--tuner] [--out step_compiles.json]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pkgutil
import platform
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's root


class _Hopper:
    """What Triton's launch path asks its driver before it compiles: an sm_90 target, device 0, a stream."""

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _kernel_modules() -> list[Any]:
    """Every module of mmsdk.kernels, imported now: a kernel module first imported under the interpreter switch would
    make interpreter functions, not compiled ones."""
    import mmsdk.kernels as kernels

    return [importlib.import_module(f"mmsdk.kernels.{info.name}") for info in pkgutil.iter_modules(kernels.__path__)]


def _lift_device_checks() -> None:
    """Int4Linear's methods that send only CUDA activations to the kernels, and the packed cache's device check, made
    to take CPU tensors (this process only)."""
    from mmsdk.plugins.quantizers import int4_linear
    from mmsdk.plugins.quantizers.kv_runtime import KVQuantState

    for name, method in list(vars(int4_linear.Int4Linear).items()):
        if (inspect.isfunction(method) and not getattr(method, "lifted", False)
                and "if x.is_cuda:" in inspect.getsource(method)):
            source = textwrap.dedent(inspect.getsource(method)).replace("if x.is_cuda:", "if True:")
            made: dict[str, Any] = {}
            exec(compile(source, int4_linear.__file__, "exec"), vars(int4_linear), made)  # noqa: S102
            made[name].lifted = True  # a second call leaves it
            setattr(int4_linear.Int4Linear, name, made[name])
    KVQuantState.packed_decode_reason = lambda self, device: None


@contextmanager
def _as_in_a_hopper_capture(modules: list[Any]) -> Iterator[None]:
    """mmsdk's kernels take CPU tensors, with PDL and inline PTX as on sm_90, and every capture check says a CUDA
    graph is being captured; put back on exit."""
    import torch

    from mmsdk.kernels import INTERPRET_ENV
    from mmsdk.plugins import tensor_keys

    replaced = {"interpreting": lambda: False, "pdl_ready": lambda tensor: True,
                "pdl_preload_ready": lambda tensor: True, "being_captured": lambda tensor: True}
    loaded = [module for name, module in sys.modules.items() if name.startswith("mmsdk.") and module is not None]
    saved = [(module, name, module.__dict__[name]) for module in {*modules, *loaded}
             if module.__name__ != "mmsdk.kernels" for name in replaced if name in module.__dict__
             and (name != "being_captured" or module.__dict__[name] is tensor_keys.being_captured)]
    saved.append((torch.cuda, "is_current_stream_capturing", torch.cuda.is_current_stream_capturing))
    os.environ[INTERPRET_ENV] = "1"  # read by mmsdk.kernels.triton_ready / timing_enabled at each call
    for module, name, _ in saved[:-1]:
        setattr(module, name, replaced[name])
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        yield
    finally:
        os.environ.pop(INTERPRET_ENV)
        for module, name, original in saved:
            setattr(module, name, original)


def _held_tensors(roots: Iterable[Any]) -> dict[tuple[int, str, int], tuple[str, int]]:
    """(owner id, attribute, position) -> (owner type.attribute, tensor id) for every tensor held in an attribute (or
    a list, tuple or dict attribute) of the roots, their submodules and the mmsdk / transformers cache objects they
    hold; parameters and buffers are left out (a step never makes those)."""
    import torch

    held: dict[tuple[int, str, int], tuple[str, int]] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        owner = stack.pop()
        if id(owner) in seen or not hasattr(owner, "__dict__"):
            continue
        seen.add(id(owner))
        if isinstance(owner, torch.nn.Module):
            stack.extend(owner.children())
        for name, value in vars(owner).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            values = (list(value) if isinstance(value, (list, tuple)) else list(value.values())
                      if isinstance(value, dict) else [value])
            for position, item in enumerate(values):
                if isinstance(item, torch.Tensor):
                    held[(id(owner), name, position)] = (f"{type(owner).__name__}.{name}", id(item))
                elif (hasattr(item, "__dict__") and not isinstance(item, type)
                      and type(item).__module__.startswith(("mmsdk.", "transformers.cache_utils"))):
                    stack.append(item)
    return held


@contextmanager
def _tuner_recording(on: bool) -> Iterator[None]:
    """With ``on``, the W4A16 tuner times (the interpreter switch turns it off), every weight as a 7B's (the tiny
    models' are under ``MMSDK_TUNE_MIN_BYTES``), and this thread is inside compile_before_first_call's recording, so a
    new GEMV shape launches all its candidates; put back on exit."""
    if not on:
        yield
        return
    from mmsdk.kernels import parallel_compile, w4a16_tuning

    timing_enabled = w4a16_tuning.timing_enabled
    w4a16_tuning.timing_enabled = lambda: True
    w4a16_tuning.tuning().times_small_weights = True
    try:
        with parallel_compile._recording().entered():
            yield
    finally:
        w4a16_tuning.timing_enabled = timing_enabled
        w4a16_tuning.tuning().times_small_weights = False


@dataclass
class StepRecord:
    """What a new decode step's first run, as inside a capture, would compile and what it left behind."""

    kernels: dict[tuple[int, str], tuple[Any, str]]  # parallel_compile's records: (kernel, specialization)
    kept: list[str]  # "Type.attribute" of each tensor it made and left held (see the module's doc)


def record_step(model_name: str, passes: list[Any], tuner: bool = False) -> StepRecord:
    """The kernels a new decode step of ``model_name`` with ``passes`` would compile, and the tensors it would keep.
    ``tuner``: as compile_before_first_call records it with the GEMV tuner on (each GEMV shape met for the first time
    launches every candidate: mmsdk.kernels.parallel_compile.recording_a_first_call); without, as with
    ``MMSDK_TUNE=0`` (its first candidate only)."""
    import torch
    from triton.runtime.driver import driver

    from mmsdk.cli._common import prompt_sample
    from mmsdk.core.optimizer import Optimizer
    from mmsdk.core.session import Session
    from mmsdk.core.sources import load_model
    from mmsdk.kernels import fast_generate, parallel_compile
    from mmsdk.profiling.measure import prompt_inputs

    modules = _kernel_modules()
    _lift_device_checks()
    driver._active = _Hopper()
    session = Session.create()
    loaded = load_model(model_name, session=session)
    loaded.model.to(torch.bfloat16)
    opt = Optimizer(loaded, session=session)
    opt.apply(*passes)
    inputs = prompt_inputs(opt.model, opt.processor, opt.adapter, prompt_sample(None, None, opt.session), "cpu")
    record = StepRecord({}, [])

    class Recorded(Exception):
        pass

    def record_instead_of_warming_up(self: Any, step: Callable[[], Any]) -> None:
        roots = (opt.model, self)  # the model holds the kept decode state (its cache and step)
        before = _held_tensors(roots)
        with _as_in_a_hopper_capture(modules), _tuner_recording(tuner):
            record.kernels.update(parallel_compile._recorded_kernels(step))
        record.kept.extend(sorted({where for key, (where, tensor) in _held_tensors(roots).items()
                                   if before.get(key, ("", None))[1] != tensor}))
        raise Recorded

    fast_generate._Generator._warm_up = record_instead_of_warming_up
    try:
        fast_generate._Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 4}).run()
    except Recorded:
        return record
    raise RuntimeError("the decode step was never built: the fast path refused this model or these passes")


def timed_compiles(recorded: dict[tuple[int, str], tuple[Any, str]], threads: int) -> dict[str, Any]:
    """Each kernel compiled for sm_90 alone into an empty cache (seconds each), then all on ``threads`` threads."""
    from mmsdk.kernels import parallel_compile

    kernels = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        for kernel, specialization in recorded.values():
            started = time.perf_counter()
            kernel.preload(specialization)
            kernels.append({"kernel": f"{kernel.__module__.rsplit('.', 1)[-1]}.{kernel.__name__}",
                            "seconds": round(time.perf_counter() - started, 2)})
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        started = time.perf_counter()
        parallel_compile._compile_side_by_side(recorded, threads, "this benchmark")
        side_by_side = time.perf_counter() - started
    gemv = [k["seconds"] for k in kernels if k["kernel"].startswith("_gemv_")]
    other = [k["seconds"] for k in kernels if not k["kernel"].startswith("_gemv_")]
    return {"kernels": kernels, "one_at_a_time_s": round(sum(gemv) + sum(other), 2),
            "gemv_kernels": len(gemv), "gemv_s": round(sum(gemv), 2), "other_kernels": len(other),
            "other_s": round(sum(other), 2), "threads": threads, "side_by_side_s": round(side_by_side, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:llava-digits")
    parser.add_argument("--apply", default="qkv-fuse,int4-weight,rmsnorm-rope-fusion,int4-kv",
                        help="comma separated passes (fast generate's: those that declare it)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--tuner", action="store_true",
                        help="record the GEMV tuner's candidates too, as a step compiled ahead with tuning on does")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: give 1 or more")
    import torch
    import triton

    record = record_step(args.model, args.apply.split(","), args.tuner)
    result = {"model": args.model, "passes": args.apply, "tuner": args.tuner,
              "cpu": platform.processor() or platform.machine(), "cpus": len(os.sched_getaffinity(0)),
              "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
              "kept": record.kept, **timed_compiles(record.kernels, args.threads)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
