"""The W4A16 tuner timed from a table instead of on a GPU, for the CPU tests of what it picks and when it times:
mmsdk.kernels.w4a16_tuning with its compile step, weight copies, timing and step-measured table replaced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class FakeTimings:
    """What the faked tuner did; ``launch`` is the launch to hand it (it records the candidate's label)."""

    times: dict[str, float]  # a candidate's label -> the time the tuner reads for it (ms)
    label: Callable[[tuple[Any, ...]], str]
    timed: list[str] = field(default_factory=list)  # the labels of the candidates launched, in order
    compiled: list[int] = field(default_factory=list)  # how many launches each compile step was handed
    warm_ups: list[str] = field(default_factory=list)  # the warm-up each compile step and each timing was given
    capturing: bool = False  # what torch.cuda.is_current_stream_capturing answers

    def launch(self, cfg: tuple[Any, ...], weights: Any) -> None:
        self.timed.append(self.label(cfg))


def fake_timings(monkeypatch: Any, times: dict[str, float], label: Callable[[tuple[Any, ...]], str] = lambda c: c[4],
                 time_small_weights: bool = True) -> FakeTimings:
    """Make the tuner time each candidate from ``times`` (by ``label(candidate)``); its compile steps only counted.
    ``time_small_weights``: the stand-in weights (a few bytes) are timed too (``MMSDK_TUNE_MIN_BYTES=0``); False leaves
    the threshold at its default."""
    from mmsdk.kernels import w4a16_tuning

    fake = FakeTimings(dict(times), label)

    def graph_time_ms(calls: list[Callable[[], Any]], warm_up: str = "eager") -> float:
        fake.warm_ups.append(warm_up)
        calls[0]()
        return fake.times[fake.timed[-1]]

    def compile_in_parallel(launches: list[Any], **how: Any) -> None:
        fake.compiled.append(len(launches))
        fake.warm_ups.append(how["warm_up"])

    monkeypatch.setattr(w4a16_tuning, "timing_enabled", lambda: True)
    monkeypatch.setattr(w4a16_tuning, "l2_spill_copies", lambda weights: [weights])
    monkeypatch.setattr(w4a16_tuning, "graph_time_ms", graph_time_ms)
    monkeypatch.setattr(w4a16_tuning, "compile_in_parallel", compile_in_parallel)
    monkeypatch.setattr(w4a16_tuning, "step_measured_config", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake.capturing)
    if time_small_weights:
        monkeypatch.setenv(w4a16_tuning.TUNE_MIN_BYTES_ENV, "0")
    else:
        monkeypatch.delenv(w4a16_tuning.TUNE_MIN_BYTES_ENV, raising=False)
    return fake
