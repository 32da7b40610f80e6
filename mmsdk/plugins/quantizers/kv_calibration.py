"""K/V ranges from calibration statistics: min-max, percentile, or learned with a straight-through estimator.

``ste`` starts from the min-max ranges and learns ``log(amax)`` per (KV head, channel) (or per
tensor) for a few hundred steps: the model runs its calibration prompts with K/V fake-quantized
(``s * clamp(round(x / s))``, gradients passed straight through the rounding, LSQ style) and the
loss is the KL divergence between its next-token distributions and those of the model with
full-precision K/V, on the last positions of each prompt. Weights stay frozen; only ranges learn.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mmsdk.plugins.quantizers.calibration_stats import (
    KVStats,
    cache_argument,
    calibration_inputs,
    progress,
    vision_memo,
)
from mmsdk.plugins.quantizers.kv_runtime import QMAX, KVQuantState, LayerRanges

if TYPE_CHECKING:
    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.calibration import CalibrationSet

__all__ = ["learn_ranges_ste", "ranges_from_stats"]


def _percentile(rows: torch.Tensor | None, fallback: torch.Tensor, q: float) -> torch.Tensor:
    if rows is None or len(rows) == 0:
        return fallback
    return torch.quantile(rows.abs().flatten(1).float(), q / 100.0, dim=0).reshape(fallback.shape)


def _pair_norm(rows: torch.Tensor) -> torch.Tensor:
    half = rows.shape[-1] // 2
    pair = torch.sqrt(rows[..., :half] ** 2 + rows[..., half : 2 * half] ** 2)
    return torch.cat([pair, pair, rows[..., 2 * half :].abs()], dim=-1)


def ranges_from_stats(stats: KVStats, method: str, percentile: float, rotary_envelope: bool) -> LayerRanges:
    """|K| / |V| ranges per (head, channel) of one layer, by min-max or percentile."""
    envelope = rotary_envelope and stats.kind == "self"
    if method == "percentile":
        k_rows = stats.k_rows.rows
        k_rows = _pair_norm(k_rows) if (envelope and k_rows is not None) else k_rows
        k_amax = _percentile(k_rows, stats.k_envelope if envelope else stats.k_amax, percentile)
        v_amax = _percentile(stats.v_rows.rows, stats.v_amax, percentile)
    else:
        k_amax = stats.k_envelope if envelope else stats.k_amax
        v_amax = stats.v_amax
    return LayerRanges(stats.kind, k_amax.clone(), v_amax.clone())


def _fake_quant(x: torch.Tensor, log_amax: torch.Tensor, fmt: str) -> torch.Tensor:
    scale = (log_amax.exp() / QMAX[fmt])[None, :, None, :]
    y = x / scale
    if fmt == "fp8":
        y = y.clamp(-448.0, 448.0)
        y = y + (y.to(torch.float8_e4m3fn).float() - y).detach()
    else:
        low, high = (-8, 7) if fmt == "int4" else (-128, 127)
        y = y.clamp(low, high)
        y = y + (y.round() - y).detach()
    return y * scale


def _fake_quant_cache(params: dict[int, tuple[nn.Parameter, nn.Parameter]], fmt: str) -> Any:
    from transformers import DynamicCache

    class FakeQuantCache(DynamicCache):
        """Returns fake-quantized K/V (differentiable in the ranges) while caching the originals."""

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if layer_idx not in params:
                return keys, values
            log_k, log_v = params[layer_idx]
            return _fake_quant(keys.float(), log_k, fmt).to(keys.dtype), _fake_quant(values.float(), log_v, fmt).to(
                values.dtype
            )

    return FakeQuantCache()


def _last_logits(model: nn.Module, batch: dict[str, torch.Tensor], keep: int, cache: Any) -> torch.Tensor:
    extra: dict[str, Any] = {cache_argument(model): cache, "use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        extra["logits_to_keep"] = keep
    return model(**batch, **extra).logits[:, -keep:].float()


def _init_params(state: KVQuantState) -> dict[int, tuple[nn.Parameter, nn.Parameter]]:
    params = {}
    for index, ranges in state.layers.items():
        if ranges.k_amax is None or ranges.v_amax is None:
            continue
        k = ranges.k_amax if state.key_granularity == "channel" else ranges.k_amax.max().reshape(1, 1)
        v = ranges.v_amax if state.value_granularity == "channel" else ranges.v_amax.max().reshape(1, 1)
        params[index] = (nn.Parameter(k.clamp(min=1e-6).log().clone()), nn.Parameter(v.clamp(min=1e-6).log().clone()))
    return params


def learn_ranges_ste(
    model: nn.Module,
    adapter: ModelAdapter,
    calibration: CalibrationSet,
    processor: Any,
    state: KVQuantState,
    *,
    steps: int,
    lr: float,
    positions: int = 8,
) -> dict[str, float]:
    """Refine ``state.layers``' ranges in place by STE; returns the loss before and after."""
    from transformers import DynamicCache

    inputs = calibration_inputs(calibration, adapter, processor)
    device = next(model.parameters()).device
    batches = [{k: v.to(device) for k, v in b.items()} for b in inputs]
    params = _init_params(state)
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    losses: list[float] = []
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        with vision_memo(model, adapter, calibration):
            with torch.no_grad():
                targets = [torch.log_softmax(_last_logits(model, b, positions, DynamicCache()), -1) for b in batches]
            optimizer = torch.optim.Adam([t for pair in params.values() for t in pair], lr=lr)
            for step in progress(range(steps), "int4-kv: learning ranges (STE)", total=steps):
                index = step % len(batches)
                logits = _last_logits(model, batches[index], positions, _fake_quant_cache(params, state.fmt))
                loss = torch.nn.functional.kl_div(
                    torch.log_softmax(logits, -1), targets[index], log_target=True, reduction="batchmean"
                )
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
    for index, (log_k, log_v) in params.items():
        ranges = state.layers[index]
        k_amax = log_k.detach().exp().cpu().expand_as(ranges.k_amax).clone()
        v_amax = log_v.detach().exp().cpu().expand_as(ranges.v_amax).clone()
        state.layers[index] = LayerRanges(ranges.kind, k_amax, v_amax)
    window = max(1, len(batches))
    return {"first_loss": sum(losses[:window]) / window, "last_loss": sum(losses[-window:]) / window}
