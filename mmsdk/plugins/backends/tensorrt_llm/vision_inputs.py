"""Host-side inputs of the Qwen vision ONNX graphs: rotary angles, block masks and window order.

TensorRT-LLM's multimodal runner computes these on the host for ``qwen2_vl`` (specs/tensorrt-llm.md
3.2); mmsdk's reference loader and dual pipeline do the same, with this code, for both Qwen2-VL and
Qwen2.5-VL (whose window attention adds a window order and a second mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["QwenVisionGeometry", "block_mask", "rotary_pos_emb", "window_index", "window_order"]


@dataclass(frozen=True)
class QwenVisionGeometry:
    """What the host needs to know about a Qwen vision tower."""

    head_dim: int
    merge_size: int
    theta: float = 10000.0
    patch_size: int = 14
    window_size: int | None = None  # Qwen2.5-VL only

    @property
    def merge_unit(self) -> int:
        return self.merge_size * self.merge_size


def _merge_ordered(values: torch.Tensor, m: int) -> torch.Tensor:
    # Patches are stored merge-window by merge-window (m x m blocks), row-major inside a block.
    h, w = values.shape
    return values.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()


def rotary_pos_emb(grid_thw: torch.Tensor, geo: QwenVisionGeometry) -> torch.Tensor:
    """Rotary angles [patches, head_dim/2]: (h, w) position of each patch times the axial frequencies."""
    quarter = geo.head_dim // 2
    inv_freq = 1.0 / (geo.theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
    rows = []
    for t, h, w in grid_thw.tolist():
        hpos = _merge_ordered(torch.arange(h)[:, None].expand(h, w), geo.merge_size)
        wpos = _merge_ordered(torch.arange(w)[None, :].expand(h, w), geo.merge_size)
        pos = torch.stack([hpos, wpos], dim=-1).repeat(t, 1).float()
        rows.append(torch.cat([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], dim=-1))
    return torch.cat(rows)


def block_mask(lengths: list[int]) -> torch.Tensor:
    """Additive mask [1, n, n]: 0 inside each block of ``lengths``, float32 min elsewhere."""
    n = sum(lengths)
    mask = torch.full((1, n, n), torch.finfo(torch.float32).min)
    start = 0
    for length in lengths:
        mask[:, start:start + length, start:start + length] = 0
        start += length
    return mask


def window_index(grid_thw: torch.Tensor, geo: QwenVisionGeometry) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL window order of merged tokens, and each window's length in patches."""
    if geo.window_size is None:
        raise ValueError("window_index needs a Qwen2.5-VL geometry (window_size set)")
    m, size = geo.merge_size, geo.window_size // geo.merge_size // geo.patch_size
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // m, w // m
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = size - gh % size, size - gw % size
        padded = F.pad(index, (0, pw, 0, ph), value=-1)
        nh, nw = (gh + ph) // size, (gw + pw) // size
        windows = padded.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, size * size)
        for window in windows:
            kept = window[window >= 0]
            if kept.numel():
                order.append(kept + offset)
                lengths.append(int(kept.numel()) * geo.merge_unit)
        offset += t * gh * gw
    return torch.cat(order), lengths


def window_order(rows: torch.Tensor, index: torch.Tensor, merge_unit: int) -> torch.Tensor:
    """``rows`` [patches, ...] regrouped into window order (whole merge units move together)."""
    grouped = rows.reshape(rows.shape[0] // merge_unit, merge_unit, *rows.shape[1:])
    return grouped[index].reshape(rows.shape)
