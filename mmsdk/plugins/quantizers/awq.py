"""Activation-aware weight quantization (AWQ): per-input-channel scale search and per-group clipping.

For linears that read the same input X (q/k/v, gate/up), AWQ looks for one scale vector s with
``s = mean|X|^alpha`` (normalised) that minimises ``sum_i ||X W_i^T - (X / s) Q(W_i * s)^T||^2`` on
calibration rows; ``alpha = 0`` is plain round-to-nearest, so the chosen scale never does worse
than RTN on those rows. Then, per linear, it shrinks each group's range by the ratio that
minimises that group's output error (AWQ's ``auto_clip``). Reference: Lin et al., arXiv 2306.00978,
and mit-han-lab/llm-awq ``auto_scale.py`` / ``auto_clip.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmsdk.plugins.quantizers.packing import dequantize_int4, padded_k, quantize_int4

__all__ = ["AWQChoice", "output_error", "search_clip", "search_scale"]


@dataclass(frozen=True)
class AWQChoice:
    """The scale AWQ chose for a group of linears sharing one input, and the errors it saw."""

    scale: torch.Tensor  # [K]
    ratio: float
    error: float
    rtn_error: float


def _fake_quant(
    weight: torch.Tensor, block_size: int, symmetric: bool, clip: torch.Tensor | None = None
) -> torch.Tensor:
    packed = quantize_int4(weight, block_size, symmetric=symmetric, clip=clip, scale_dtype=torch.float32)
    return dequantize_int4(packed, torch.float32)


def output_error(rows: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> float:
    """``||rows @ weight.T - rows @ approx.T||^2`` summed over rows and outputs."""
    return float((rows @ (weight - approx).T).pow(2).sum())


def search_scale(
    weights: list[torch.Tensor],
    rows: torch.Tensor,
    abs_mean: torch.Tensor,
    *,
    block_size: int,
    symmetric: bool,
    grid: int = 20,
) -> AWQChoice:
    """The per-input-channel scale (shared by ``weights``) with the least output error on ``rows``."""
    rows = rows.float()
    weights = [w.detach().float().to(rows.device) for w in weights]
    mean = abs_mean.float().to(rows.device).clamp(min=1e-8)
    references = [rows @ w.T for w in weights]
    best: AWQChoice | None = None
    rtn_error = 0.0
    for step in range(grid):
        ratio = step / grid
        scale = mean.pow(ratio).clamp(min=1e-4)
        scale = scale / (scale.max() * scale.min()).sqrt()
        scaled_rows = rows / scale
        error = sum(
            float((ref - scaled_rows @ _fake_quant(w * scale, block_size, symmetric).T).pow(2).sum())
            for w, ref in zip(weights, references, strict=True)
        )
        if step == 0:
            rtn_error = error
        if best is None or error < best.error:
            best = AWQChoice(scale=scale.cpu(), ratio=ratio, error=error, rtn_error=rtn_error)
    assert best is not None  # grid >= 1 is enforced by the config
    return AWQChoice(best.scale, best.ratio, best.error, rtn_error)


def search_clip(
    weight: torch.Tensor,
    rows: torch.Tensor,
    *,
    block_size: int,
    symmetric: bool,
    grid: int = 20,
    max_shrink: float = 0.5,
    chunk: int = 256,
) -> torch.Tensor:
    """Per (row, group) range ratio in ``[1 - max_shrink, 1]`` minimising that group's output error."""
    weight = weight.detach().float()
    n, k = weight.shape
    kp = padded_k(k, block_size)
    rows = torch.nn.functional.pad(rows.float().to(weight.device), (0, kp - k))
    x = rows.reshape(rows.shape[0], kp // block_size, block_size)  # [t, groups, block]
    best_ratio = torch.ones(n, kp // block_size, device=weight.device)
    for start in range(0, n, chunk):
        w = weight[start : start + chunk]
        w_groups = torch.nn.functional.pad(w, (0, kp - k)).reshape(w.shape[0], -1, block_size)
        best_error = torch.full(w_groups.shape[:2], float("inf"), device=weight.device)
        for step in range(grid):
            ratio = 1.0 - max_shrink * step / grid
            clip = torch.full(w_groups.shape[:2], ratio, device=weight.device)
            diff = w_groups - torch.nn.functional.pad(
                _fake_quant(w, block_size, symmetric, clip), (0, kp - k)
            ).reshape_as(w_groups)
            error = torch.einsum("tgb,ngb->tng", x, diff).pow(2).sum(0)  # [rows of w, groups]
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_ratio[start : start + chunk] = torch.where(better, ratio, best_ratio[start : start + chunk])
    return best_ratio
