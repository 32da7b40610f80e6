"""Prompts after vision-token reduction: only the kept image tokens, at their original positions.

Mirrors what the token passes do in torch: per image run, keep the slots the vision graph names,
left-pad the rows to one width, gather mask and positions (1-D or M-RoPE's 3-D) at the kept
places; decode steps continue from the largest prompt position + 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Compacted", "compact", "true_runs"]


@dataclass(frozen=True)
class Compacted:
    """The shortened prompt and where decoding continues."""

    input_ids: np.ndarray  # [B, W]
    attention_mask: np.ndarray  # [B, W]
    positions: np.ndarray  # [B, W] or [3, B, W]
    next_position: np.ndarray  # [B, 1] or [3, B, 1]
    keep: list[np.ndarray]  # per row: indices of the original tokens kept (before left padding)


def compact(input_ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, image_token_id: int,
            slots: list[np.ndarray]) -> Compacted:
    """Drop the image tokens the reducers did not keep (``slots``: one array per image, reading order)."""
    batch, length = input_ids.shape
    remaining = iter(slots)
    rows = []
    for row in range(batch):
        keep = np.ones(length, dtype=bool)
        for start, end in true_runs((input_ids[row] == image_token_id).tolist()):
            kept = next(remaining)
            keep[start:end] = False
            keep[start + kept] = True
        rows.append(np.nonzero(keep)[0])
    width = max(len(r) for r in rows)
    index = np.stack([np.concatenate([np.zeros(width - len(r), np.int64), r]) for r in rows])
    valid = np.stack([np.arange(width) >= width - len(r) for r in rows])
    gathered = np.take_along_axis
    ids = gathered(input_ids, index, 1)
    new_mask = gathered(mask, index, 1) * valid
    if positions.ndim == 3:
        new_positions = np.stack([gathered(p, index, 1) for p in positions])
    else:
        new_positions = gathered(positions, index, 1)
    next_position = positions.max(axis=-1, keepdims=True) + 1
    return Compacted(ids.astype(np.int64), new_mask.astype(np.int64), new_positions.astype(np.int64),
                     next_position.astype(np.int64), rows)


def true_runs(flags: Iterable[Any]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive true values (the image-token spans of a row)."""
    runs, start = [], None
    for index, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            runs.append((start, index))
            start = None
    return runs
