"""Which W4A16 kernel configuration runs for a problem: the candidates timed once per process, the fastest kept.

Used by mmsdk.kernels.w4a16 and mmsdk.kernels.w4a16_gated; the table of choices is one object per process, created on
first use (:func:`tuning`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from mmsdk.kernels import graph_time_ms, l2_spill_copies, note_fallback, timing_enabled

__all__ = ["Tuning", "fit_config", "tuned_config", "tuning"]


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


@cache
def tuning() -> Tuning:
    """This process's table of chosen configurations."""
    return Tuning()


def tuned_config(key: tuple[Any, ...], launch: Any, candidates: tuple[tuple[Any, ...], ...], group: int,
                 weights: tuple[torch.Tensor | None, ...]) -> Any:
    """The fastest candidate for ``key`` (timed once on CUDA; the first one, not kept, under the interpreter, a
    capture or ``MMSDK_TUNE=0``).

    ``launch(cfg, weights)`` runs a candidate on ``weights`` (the packed tensors, as a tuple). Candidates are
    timed on enough copies of the weights, in turn, that each call reads them from HBM as in a model
    (:func:`mmsdk.kernels.l2_spill_copies`; the copies live only while tuning): timed on one L2-resident
    copy, the tuner would pick the tiles that read L2 fastest, not HBM.
    """
    table = tuning().chosen
    if key in table:
        return table[key]
    if not timing_enabled() or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    copies = l2_spill_copies(weights)
    timings = []
    for cfg in dict.fromkeys(fit_config(c, group) for c in candidates):
        try:
            timings.append((graph_time_ms([lambda c=cfg, w=w: launch(c, w) for w in copies]), cfg))
        except Exception as error:  # a config the compiler rejects (resources) is simply not a candidate
            note_fallback("w4a16 tuning", f"config {cfg} skipped: {type(error).__name__}")
    table[key] = min(timings)[1] if timings else candidates[0]
    return table[key]
