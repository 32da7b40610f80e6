"""GPU kernels (Triton) for mmsdk's optimized modules, with the torch reference ops as fallback.

Nothing here imports Triton at module import: each kernel module is imported by the code that
needs it, and :func:`triton_ready` decides per tensor whether the Triton path can run. Where it
cannot (no CUDA tensor, no Triton, an unsupported dtype), callers use the torch reference op and
:func:`note_fallback` says so once per reason in the ``mmsdk.kernels`` log.

Modules:

* ``w4a16``: INT4 weight x bf16/fp16 activation matmul reading the MatMulNBits packed layout.
* ``w4a16_gated``: a gated MLP's INT4 gate and up projections for one token, ``silu(gate) * up`` in one launch.
* ``kv_decode``: decode attention over a packed INT4 / INT8 / FP8 KV cache (GQA), and the fused
  quantize-and-append of new K/V tokens.
* ``norm_rope_triton``: residual-add + RMSNorm, RoPE on q and k, M-RoPE tables, q/k RMSNorm + RoPE.
* ``flex_masks``: FlexAttention block masks built from a block layout (sparse-xattn).
* ``greedy``: the argmax over each row of logits (the decode step's token choice), one kernel.
* ``fast_generate``: static cache + CUDA-graph decode loop behind ``model.generate``; ``decode_state``
  keeps the cache and the captured step on the model for the next call (``fast_generate.release`` frees them).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

__all__ = ["INTERPRET_ENV", "KV_MERGE_ENV", "PAIRED_ROWS_ENV", "PDL_ENV", "TUNE_ENV", "WARM_UPS", "ThreadScope",
           "call_in_dropped_capture", "captured_calls", "graph_time_ms", "kv_merge_enabled", "l2_spill_copies",
           "note_fallback", "paired_rows_enabled", "pdl_preload_ready", "pdl_ready", "timing_enabled",
           "triton_available", "triton_ready", "weights_settled"]

LOG = logging.getLogger("mmsdk.kernels")
INTERPRET_ENV = "TRITON_INTERPRET"
PDL_ENV = "MMSDK_PDL"  # "0" turns programmatic dependent launch off (to measure what it buys)
# "0" makes kernel tuners take their first candidate instead of timing them all: correctness runs (tests) then compile
# one configuration per problem, not every candidate (minutes on a fresh machine)
TUNE_ENV = "MMSDK_TUNE"
# "0" has the packed cache's int4 MHA decode kernel leave its splits to a combine kernel instead of merging them itself
# (kv_decode.decode_attention's merge_counters), to measure what the merge buys
KV_MERGE_ENV = "MMSDK_KV_MERGE"
# "0" has a gated MLP's gate and up projections of 2-16 activation rows (batched decode) run as two GEMVs, their K-slice
# sums, a SiLU and a multiply instead of one paired tensor-core GEMV (mmsdk.kernels.w4a16_gated, kind "mma"; the
# default: on the H200 it took Qwen2-VL-7B's batch-4 / batch-8 decode step from 2.909 to 2.845 ms and from 3.197 to
# 3.137, docs/benchmarks.md, thirty-sixth pass)
PAIRED_ROWS_ENV = "MMSDK_PAIRED_ROWS"


@cache
def triton_available() -> bool:
    """True when Triton imports (it is optional: CPU-only installs run the torch reference ops)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when Triton's interpreter runs kernels on CPU tensors (``TRITON_INTERPRET=1``, for tests)."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def timing_enabled() -> bool:
    """False when tuners must take their first candidate untimed: under the interpreter or with ``MMSDK_TUNE=0``."""
    return not interpreting() and os.environ.get(TUNE_ENV, "1") != "0"


def kv_merge_enabled() -> bool:
    """Whether the int4 MHA decode kernel is to merge its own splits (see :data:`KV_MERGE_ENV`)."""
    mode = os.environ.get(KV_MERGE_ENV, "1")
    if mode not in ("0", "1"):
        raise ValueError(f"{KV_MERGE_ENV}={mode!r}: set it to 0 or 1 (or leave it unset)")
    return mode == "1"


def paired_rows_enabled() -> bool:
    """Whether gated MLPs pair their gate and up GEMVs for 2-16 rows too (see :data:`PAIRED_ROWS_ENV`)."""
    mode = os.environ.get(PAIRED_ROWS_ENV, "1")
    if mode not in ("0", "1"):
        raise ValueError(f"{PAIRED_ROWS_ENV}={mode!r}: set it to 0 or 1 (or leave it unset)")
    return mode == "1"


def triton_ready(*tensors: torch.Tensor) -> bool:
    """True when a Triton kernel can take these tensors: all on one CUDA device (or the interpreter is on)."""
    if not tensors or not triton_available():
        return False
    if interpreting():
        return all(t.device.type == "cpu" for t in tensors)
    device = tensors[0].device
    return device.type == "cuda" and all(t.device == device for t in tensors)


def pdl_ready(tensor: torch.Tensor) -> bool:
    """True when kernels on ``tensor``'s device may use programmatic dependent launch (PDL).

    PDL (compute capability 9.0 and newer) lets a kernel start while the one before it on the stream
    is still running; it must wait (``griddepcontrol.wait``) before reading what that kernel wrote or
    writing anything. The batch-1 GEMVs use the time in between to load their first weight tiles, which
    no earlier kernel writes (mmsdk/kernels/_gemv_quad_triton.py). False on CPU, under the interpreter,
    on older GPUs and with ``MMSDK_PDL=0``.
    """
    if tensor.device.type != "cuda" or interpreting() or os.environ.get(PDL_ENV, "1") == "0":
        return False
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return _pdl_capable(index)


def pdl_preload_ready(tensor: torch.Tensor) -> bool:
    """:func:`pdl_ready` for a kernel that loads weights before it waits: only while a CUDA graph is captured, or
    inside :func:`weights_settled` on this thread.

    Loads issued before ``griddepcontrol.wait`` may miss the previous kernel's writes, so they must read data
    written earlier than that. Weights satisfy this inside a captured decode step (no kernel of the graph
    writes them, and the graph replays after they were made); an eager call could directly follow the kernel
    that packed them.
    """
    return pdl_ready(tensor) and (torch.cuda.is_current_stream_capturing() or bool(_settled()))


class ThreadScope(threading.local):
    """A scope that each thread enters on its own, nested entries counted: true on a thread while it is inside."""

    depth = 0

    @contextmanager
    def entered(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def __bool__(self) -> bool:
        return self.depth > 0


@cache
def _settled() -> ThreadScope:
    """This process's weights_settled scope (one per thread)."""
    return ThreadScope()


@contextmanager
def weights_settled() -> Iterator[None]:
    """While inside, on this thread, kernels launch eagerly as inside a capture where that only concerns when they may
    read weights (:func:`pdl_preload_ready`): for an eager run of a decode step whose kernels are the ones its graph
    holds, so that none writes a weight, entered on a stream that waited for the work that made them (fast
    generate's warm-up step). It then launches the variants its graph runs, not eager ones of its own: no kernel
    compiles for it alone."""
    with _settled().entered():
        yield


@cache
def _pdl_capable(index: int) -> bool:
    from mmsdk.kernels import _pdl_triton

    return _pdl_triton.AVAILABLE and torch.cuda.get_device_capability(index) >= (9, 0)


@cache
def note_fallback(kernel: str, reason: str, warn: bool = False) -> None:
    """Log, once per (kernel, reason), that the torch reference op runs instead of the Triton kernel.

    ``warn`` logs at WARNING: for failures the user did not choose (an expected fallback, such as a CPU
    tensor or a sampling option, stays at INFO).
    """
    LOG.log(logging.WARNING if warn else logging.INFO, "mmsdk.kernels: %s runs the torch reference op (%s)", kernel,
            reason)


def graph_time_ms(fn: Callable[[], Any] | Sequence[Callable[[], Any]], calls: int = 10, reps: int = 5,
                  warm_up: str = "eager") -> float:
    """Median GPU milliseconds of one call, replayed from a CUDA graph of ``calls`` calls.

    Why a graph: a decode-sized kernel runs for 5-40 µs, less than its Python launch, so timing
    eager calls measures the launcher (the W4A16 tuner did, and picked configurations at random).
    ``fn`` may be a sequence of callables (the same work on different copies of its inputs, from
    :func:`l2_spill_copies`): the graph calls them in turn, at least once each. ``warm_up``: how each is
    called before the timed capture (:func:`captured_calls`).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph, calls = captured_calls(fn, calls, stream, warm_up)
        graph.replay()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
    torch.cuda.current_stream().wait_stream(stream)
    return sorted(times)[len(times) // 2]


WARM_UPS = ("eager", "captured")


def captured_calls(fn: Callable[[], Any] | Sequence[Callable[[], Any]], calls: int,
                   stream: torch.cuda.Stream | None = None, warm_up: str = "eager") -> tuple[torch.cuda.CUDAGraph, int]:
    """A CUDA graph of ``fn`` called about ``calls`` times, and the number of calls it holds.

    ``fn`` may be a sequence of callables: called in turn, whole rounds only. Each is called once before
    the capture, so that what a first call does (Triton compiles and loads the kernel, a launcher makes its
    buffers) is not what the graph holds. ``warm_up="eager"`` makes that call eagerly; ``"captured"`` inside a
    capture that is then dropped, for kernels that have a variant of their own inside captures (the GEMVs take
    programmatic dependent launch only there, :func:`pdl_preload_ready`): only that variant is compiled, half of a
    tuner's compiles on Hopper. A ``"captured"`` warm-up cannot make buffers that must hold values (what a capture
    fills, it only records): make them with an eager call first.
    """
    if warm_up not in WARM_UPS:
        raise ValueError(f"warm_up={warm_up!r}: use one of {', '.join(WARM_UPS)}.")
    fns = list(fn) if isinstance(fn, Sequence) else [fn]
    calls = -(-max(calls, len(fns)) // len(fns)) * len(fns)
    if warm_up == "eager":
        for each in fns:
            each()
    else:
        call_in_dropped_capture(fns, stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fns[i % len(fns)]()
    return graph, calls


def call_in_dropped_capture(fns: Sequence[Callable[[], Any]], stream: torch.cuda.Stream | None = None) -> None:
    """Call each of ``fns`` once inside a CUDA graph capture on ``stream`` whose graph is then dropped: what a first
    call does inside captures (compile and load a captured kernel variant) without running anything."""
    with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
        for each in fns:
            each()


def l2_spill_copies(tensors: Sequence[torch.Tensor | None], l2_multiple: int = 3,
                    most: int = 64) -> list[tuple[torch.Tensor | None, ...]]:
    """``tensors`` and copies of them, together at least ``l2_multiple`` times the device's L2 cache.

    A kernel timed over and over on the same weights reads them from L2 once they fit (the H200's
    L2 holds 50 MB: a 7B model's int4 qkv, o_proj and down weights all fit), while in a model every
    layer's weights come from HBM. Timing the copies in turn (:func:`graph_time_ms` with one callable
    per copy) evicts each copy before it is read again, as in a decode step. The first entry is
    ``tensors`` itself; ``None`` entries stay None. Where the device has no memory left for the copies
    (they take up to ``l2_multiple`` times L2), fewer are made, with a warning in the ``mmsdk.kernels`` log.
    """
    present = [t for t in tensors if t is not None]
    if not present or present[0].device.type != "cuda":
        return [tuple(tensors)]
    l2 = torch.cuda.get_device_properties(present[0].device).L2_cache_size
    size = sum(t.numel() * t.element_size() for t in present)
    count = min(most, max(2, -(-l2_multiple * l2 // max(size, 1))))
    copies = [tuple(tensors)]
    try:
        for _ in range(count - 1):
            copies.append(tuple(None if t is None else t.clone() for t in tensors))
    except torch.cuda.OutOfMemoryError:
        LOG.warning("mmsdk.kernels: only %d of %d copies of a kernel's inputs fit in GPU memory for timing; its "
                    "times may count reads from L2", len(copies), count)
    return copies
