"""Stage and module bookkeeping during one measured generation.

Forward hooks mark where each stage (vision encode, projector, prefill, decode) and each module
begins and ends; the accountant reports every allocation and free. The recorder keeps the event
log, the per-module peaks and (on CUDA) the allocator's peak per stage segment.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmsdk.profiling.kv import cache_bytes, cache_tensors

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.profiling.accounting import TensorAccountant

__all__ = ["Recorder", "instrument"]


@dataclass
class _Frame:
    name: str
    entry: int
    peak: int


@dataclass
class Recorder:
    """Collects (time, delta, serial, stage) events plus stage times, module peaks and KV sizes."""

    cuda: bool = False
    emit_spans: bool = True
    start: float = field(default_factory=time.perf_counter)
    events: list[tuple[float, int, int, str]] = field(default_factory=list)
    stage_stack: list[str] = field(default_factory=lambda: ["other"])
    stage_seconds: dict[str, float] = field(default_factory=dict)
    stage_calls: dict[str, int] = field(default_factory=dict)
    cuda_peaks: dict[str, int] = field(default_factory=dict)
    module_peak: dict[str, int] = field(default_factory=dict)
    module_allocated: dict[str, int] = field(default_factory=dict)
    kv_serials: set[int] = field(default_factory=set)
    kv_after_step: list[int] = field(default_factory=list)
    transitions: list[tuple[float, str]] = field(default_factory=list)  # (seconds, stage now running)
    steps: int = 0
    live: int = 0
    accountant: TensorAccountant | None = None
    _frames: list[_Frame] = field(default_factory=list)
    _last: float = field(default_factory=time.perf_counter)
    _spans: list[ExitStack] = field(default_factory=list)

    # --- allocation events (from the accountant) -----------------------------------------------
    def on_change(self, delta: int, serial: int) -> None:
        self.live += delta
        self.events.append((time.perf_counter() - self.start, delta, serial, self.stage_stack[-1]))
        if self._frames:
            top = self._frames[-1]
            top.peak = max(top.peak, self.live)
            if delta > 0:
                self.module_allocated[top.name] = self.module_allocated.get(top.name, 0) + delta

    # --- stages ---------------------------------------------------------------------------------
    def push_stage(self, name: str) -> None:
        self._close_segment()
        self.stage_stack.append(name)
        self.transitions.append((time.perf_counter() - self.start, name))
        self.stage_calls[name] = self.stage_calls.get(name, 0) + 1
        if self.emit_spans:
            from mmsdk.telemetry import span

            stack = ExitStack()
            stack.enter_context(span(f"mmsdk.generate.{name}"))
            self._spans.append(stack)

    def pop_stage(self) -> None:
        self._close_segment()
        if len(self.stage_stack) > 1:
            self.stage_stack.pop()
            self.transitions.append((time.perf_counter() - self.start, self.stage_stack[-1]))
            if self._spans:
                self._spans.pop().close()

    def finish(self) -> None:
        """Close the last segment (call once generation returned)."""
        self._close_segment()
        while self._spans:
            self._spans.pop().close()

    def _close_segment(self) -> None:
        stage = self.stage_stack[-1]
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.cuda_peaks[stage] = max(self.cuda_peaks.get(stage, 0), torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        now = time.perf_counter()
        self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + now - self._last
        self._last = now

    # --- steps and KV ---------------------------------------------------------------------------
    def step_started(self) -> None:
        self.push_stage("prefill" if self.steps == 0 else "decode")

    def step_finished(self, output: Any) -> None:
        from mmsdk.profiling.kv import cache_of

        cache = cache_of(output)
        if cache is not None:
            self.kv_after_step.append(cache_bytes(cache))
            if self.accountant is not None:
                for tensor in cache_tensors(cache):
                    serial = self.accountant.serial_of(tensor.untyped_storage())
                    if serial is not None:
                        self.kv_serials.add(serial)
        self.steps += 1
        self.pop_stage()

    # --- modules --------------------------------------------------------------------------------
    def enter_module(self, name: str) -> None:
        self._frames.append(_Frame(name, self.live, self.live))

    def exit_module(self) -> None:
        if not self._frames:
            return
        frame = self._frames.pop()
        self.module_peak[frame.name] = max(self.module_peak.get(frame.name, 0), frame.peak - frame.entry)
        if self._frames:
            self._frames[-1].peak = max(self._frames[-1].peak, frame.peak)


def _stage_hooks(module: nn.Module, on_enter: Callable[[], None], on_exit: Callable[[Any], None]) -> list[Any]:
    pre = module.register_forward_pre_hook(lambda _m, _args: on_enter())
    post = module.register_forward_hook(lambda _m, _args, output: on_exit(output), always_call=True)
    return [pre, post]


@contextmanager
def instrument(model: nn.Module, adapter: ModelAdapter, recorder: Recorder, *, modules: bool = True) -> Iterator[None]:
    """Hook ``model``'s stages (and every module when ``modules``) into ``recorder``; unhook on exit."""
    handles: list[Any] = []
    try:
        handles += _stage_hooks(model, recorder.step_started, recorder.step_finished)
        handles += _stage_hooks(adapter.vision_tower(model), lambda: recorder.push_stage("vision_encode"),
                                lambda _out: recorder.pop_stage())
        projector = adapter.projector(model)
        if projector is not None:
            handles += _stage_hooks(projector, lambda: recorder.push_stage("projector"),
                                    lambda _out: recorder.pop_stage())
        if modules:
            for name, module in model.named_modules():
                handles += _stage_hooks(module, lambda name=name or "(model)": recorder.enter_module(name),
                                        lambda _out: recorder.exit_module())
        yield
    finally:
        for handle in handles:
            handle.remove()
