"""Position ids the decoder takes: 1-D from the attention mask, or Qwen-VL's 3-D M-RoPE positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["MRope", "text_positions", "mrope_positions", "step_positions"]


@dataclass(frozen=True)
class MRope:
    """What M-RoPE positions need: the image token and the vision merge size."""

    image_token_id: int
    spatial_merge_size: int


def text_positions(mask: np.ndarray) -> np.ndarray:
    """[B, T] positions: running count of real tokens minus one; padding gets 0 (as transformers' generate)."""
    positions = np.cumsum(mask, axis=-1) - 1
    return np.where(mask == 0, 0, positions).astype(np.int64)


def mrope_positions(input_ids: np.ndarray, mask: np.ndarray, grids: Sequence[Sequence[int]],
                    spec: MRope) -> tuple[np.ndarray, np.ndarray]:
    """([3, B, S] positions, [B] deltas) as Qwen2-VL's get_rope_index computes them for images.

    Text runs count up by one; an image's tokens take (t, h, w) grid coordinates (after the 2x2
    merge) offset by the position where the image starts, and text after it resumes at
    start + max(h, w). ``grids`` lists every image's (t, h, w) patch grid in reading order.
    """
    batch, length = input_ids.shape
    positions = np.zeros((3, batch, length), dtype=np.int64)
    deltas = np.zeros(batch, dtype=np.int64)
    grid_iter = iter(grids)
    for row in range(batch):
        keep = mask[row].astype(bool)
        ids = input_ids[row][keep]
        row_pos = _row_positions(ids, grid_iter, spec)
        positions[:, row, keep] = row_pos
        deltas[row] = (row_pos.max() + 1 - len(ids)) if len(ids) else 0
    return positions, deltas


def _row_positions(ids: np.ndarray, grids: object, spec: MRope) -> np.ndarray:
    parts, current, index = [], 0, 0
    while index < len(ids):
        is_image = ids[index] == spec.image_token_id
        end = index
        while end < len(ids) and (ids[end] == spec.image_token_id) == is_image:
            end += 1
        if not is_image:
            parts.append(np.broadcast_to(np.arange(end - index) + current, (3, end - index)))
            current += end - index
        else:
            t, h, w = next(grids)  # type: ignore[call-overload]
            gh, gw = h // spec.spatial_merge_size, w // spec.spatial_merge_size
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            parts.append(np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + current)
            current += max(h, w) // spec.spatial_merge_size
        index = end
    return np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64)


def step_positions(mask: np.ndarray, deltas: np.ndarray | None) -> np.ndarray:
    """Positions of the newest token of each row: [B, 1], or [3, B, 1] with M-RoPE deltas."""
    last = (mask.sum(axis=-1, keepdims=True) - 1).astype(np.int64)
    if deltas is None:
        return last
    return np.broadcast_to((last + deltas[:, None])[None], (3, *last.shape)).copy()
