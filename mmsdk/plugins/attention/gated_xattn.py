"""``gated-xattn``: gate-aware cross-attention for the Flamingo family (IDEFICS, Mllama).

* Vision K/V once per image: where the family recomputes the cross-attention K/V projections of
  the (constant) image states at every decode step (IDEFICS), the projections remember their
  last input and output and return the stored product while the same image states come back.
  Mllama already keeps them in its cache (recorded as native).
* Closed gates: a gated cross-attention layer adds ``tanh(gate) * branch`` to the residual; when
  every ``|tanh(gate)|`` is below ``gate_threshold`` the layer is (nearly) the identity and is
  skipped.
* Latency budget: with ``latency_budget_ms``, each cross-attention layer's time on a calibration
  prompt is measured (median of ``repeats`` forwards) and the layers with the weakest gates are
  skipped until the remaining cross-attention time fits the budget.

Models without cross-attention (LLaVA, Qwen-VL) are refused by the planner (``requires``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from pydantic import Field
from torch import nn

import mmsdk
from mmsdk.core.adapter import CROSS_ATTENTION, CrossAttentionBlock, ModelAdapter
from mmsdk.core.config import PassConfig
from mmsdk.core.errors import CalibrationError
from mmsdk.core.passes import PassContext, PassSpec
from mmsdk.core.registry import Registrar
from mmsdk.plugins._forward import add_forward_wrapper, foreign_forward, set_forward_body
from mmsdk.plugins.tensor_keys import InputMemo, being_captured, storage_key

__all__ = ["GatedXAttnConfig", "KVMemo", "apply_gated_xattn", "restore_gated_xattn", "gate_strength"]


class GatedXAttnConfig(PassConfig):
    """When a cross-attention layer may be skipped, and whether its image K/V are computed once."""

    gate_threshold: float = Field(1e-3, ge=0, le=1, description="Skip layers whose every |tanh(gate)| is below this.")
    latency_budget_ms: float | None = Field(
        None, gt=0, description="Cross-attention time per forward to fit, skipping the weakest-gated layers."
    )
    cache_kv: bool = Field(True, description="Compute each layer's image K/V once per image and reuse them.")
    repeats: int = Field(5, ge=1, le=100, description="Forwards timed per measurement (the median counts).")


class KVMemo(InputMemo):
    """Remembers a projection's last input (by storage, shape, stride, version) and output."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.source: torch.Tensor | None = None  # held so its storage cannot be reused while cached
        self.output: torch.Tensor | None = None
        self.hits = 0
        self.misses = 0
        self.owner: nn.Module | None = None
        self.wrapper: Any = None

    def displaced(self) -> bool:
        """True once another component replaced the projection's forward around this memo (e.g. int4-kv's
        packed memo): it then keeps the product, and a second, full-precision copy would waste memory."""
        return self.owner is not None and self.owner.__dict__.get("forward") is not self.wrapper

    def __call__(self, inner: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.displaced():
            self.clear()
            return inner(x, *args, **kwargs)
        if args or kwargs or torch.is_grad_enabled() or x.requires_grad:
            return inner(x, *args, **kwargs)
        if being_captured(x):
            # a captured decode step (fast generate) replays with each call's image states copied into its inputs:
            # it must project them, not keep this call's stored product, whose tensor the next image replaces
            return inner(x)
        key = (*storage_key(x), x.dtype, x.device)
        if key == self.key and self.output is not None:
            self.hits += 1
            return self.output
        self.misses += 1
        self.key, self.source, self.output = key, x, inner(x)
        return self.output

    def clear(self) -> None:
        self.key = self.source = self.output = None

    @property
    def holding(self) -> bool:
        return self.output is not None


def gate_strength(block: CrossAttentionBlock) -> float:
    """The largest |tanh(gate)| of a cross-attention layer (0 when it contributes nothing)."""
    values = [getattr(block.module, name).detach().float().tanh().abs().max().item() for name in block.gate_names]
    return max(values) if values else 1.0


def _skip(block: CrossAttentionBlock) -> None:
    def identity(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states

    set_forward_body(block.module, identity)


def _install_memos(adapter: ModelAdapter, blocks: list[CrossAttentionBlock]) -> tuple[int, int]:
    """Memoize each K/V projection; (installed, left to an existing override such as int4-kv's packed memo)."""
    count = left = 0
    for block in blocks:
        for role in ("k", "v"):
            name = getattr(block.projections, role)
            projection = getattr(block.attention, name, None) if name else None
            if not isinstance(projection, nn.Module):
                continue
            if foreign_forward(projection) is not None:
                left += 1  # a full-precision copy here would undo a quantizer's packed memo
                continue
            memo = KVMemo()
            projection.kv_memo = memo
            add_forward_wrapper(projection, memo)
            memo.wrapper = projection.forward
            memo.owner = projection
            count += 1
    return count, left


def _calibration_inputs(context: PassContext) -> dict[str, Any]:
    calibration = context.require_calibration("gated-xattn")
    processor = context.processor
    if processor is None:
        raise CalibrationError(
            "gated-xattn latency_budget_ms times the model on a calibration prompt, which needs the model's processor.",
            fix="create the Optimizer with processor=... (mmsdk.load_model returns one), or drop latency_budget_ms.",
        )
    sample = calibration.samples[0]
    return processor(images=[sample.image], text=[context.adapter.format_prompt(sample.text, processor)])


def _measure(model: nn.Module, blocks: list[CrossAttentionBlock], inputs: dict[str, Any], repeats: int) -> list[float]:
    """Median milliseconds each block takes per forward."""
    times: list[list[float]] = [[] for _ in blocks]
    starts: dict[int, float] = {}
    cuda = next(model.parameters()).is_cuda
    handles = []
    for index, block in enumerate(blocks):
        def before(module: nn.Module, args: Any, index: int = index) -> None:
            if cuda:
                torch.cuda.synchronize()
            starts[index] = time.perf_counter()

        def after(module: nn.Module, args: Any, output: Any, index: int = index) -> None:
            if cuda:
                torch.cuda.synchronize()
            times[index].append((time.perf_counter() - starts[index]) * 1e3)

        handles += [block.module.register_forward_pre_hook(before), block.module.register_forward_hook(after)]
    try:
        with torch.no_grad():
            for _ in range(repeats + 1):  # the first run warms up and is dropped
                model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return [statistics.median(t[1:]) if len(t) > 1 else 0.0 for t in times]


def _budget_skips(strengths: list[float], costs: list[float], open_layers: list[int], budget: float) -> list[int]:
    """Indices to skip, weakest gate first, until the remaining open layers' cost fits ``budget``."""
    remaining = sum(costs[i] for i in open_layers)
    skipped = []
    for index in sorted(open_layers, key=lambda i: strengths[i]):
        if remaining <= budget:
            break
        skipped.append(index)
        remaining -= costs[index]
    return skipped


def apply_gated_xattn(model: nn.Module, config: GatedXAttnConfig, context: PassContext) -> dict[str, Any]:
    """Skip closed-gate (and, with a budget, weak-gate) layers; cache image K/V; return what was done."""
    adapter = context.adapter
    blocks = adapter.cross_attention_blocks(model)
    strengths = [gate_strength(block) for block in blocks]
    closed = [i for i, s in enumerate(strengths) if s < config.gate_threshold]
    records: dict[str, Any] = {
        "layers": [b.decoder_index for b in blocks],
        "gates": [round(s, 6) for s in strengths],
        "skipped": [blocks[i].decoder_index for i in closed],
        "reasons": {str(blocks[i].decoder_index): f"|tanh(gate)| {strengths[i]:.2e} < {config.gate_threshold}"
                    for i in closed},
    }
    if config.latency_budget_ms is not None:
        costs = _measure(model, blocks, _calibration_inputs(context), config.repeats)
        open_layers = [i for i in range(len(blocks)) if i not in closed]
        extra = _budget_skips(strengths, costs, open_layers, config.latency_budget_ms)
        records["layer_ms"] = [round(c, 4) for c in costs]
        records["cross_attention_ms"] = round(sum(costs[i] for i in open_layers), 4)
        records["cross_attention_ms_after"] = round(sum(costs[i] for i in open_layers if i not in extra), 4)
        for i in extra:
            records["skipped"].append(blocks[i].decoder_index)
            records["reasons"][str(blocks[i].decoder_index)] = f"latency budget (gate {strengths[i]:.3f})"
    _finish(model, adapter, blocks, config, records)
    return records


def _finish(model: nn.Module, adapter: ModelAdapter, blocks: list[CrossAttentionBlock], config: GatedXAttnConfig,
            records: dict[str, Any]) -> None:
    skipped = set(records["skipped"])
    kept = [b for b in blocks if b.decoder_index not in skipped]
    for block in blocks:
        if block.decoder_index in skipped:
            _skip(block)
    if not config.cache_kv:
        records["kv_cache"] = "off"
    elif adapter.cross_kv_cached(model):
        records["kv_cache"] = "native (the model caches cross-attention K/V itself)"
    else:
        installed, left = _install_memos(adapter, kept)
        records["kv_cache"] = f"memoized {installed} K/V projections" + (
            f"; {left} already memoized by another pass" if left else "")


def restore_gated_xattn(model: nn.Module, config: GatedXAttnConfig, records: Any, context: PassContext) -> None:
    """Rebuild the skips and memos from the records (no timing, no calibration data)."""
    blocks = context.adapter.cross_attention_blocks(model)
    _finish(model, context.adapter, blocks, config, {"skipped": list(records.get("skipped", []))})


@mmsdk.hookimpl
def mmsdk_register_attention(register: Registrar[PassSpec]) -> None:
    register(
        PassSpec(
            name="gated-xattn",
            config_cls=GatedXAttnConfig,
            apply=apply_gated_xattn,
            restore=restore_gated_xattn,
            requires=frozenset({CROSS_ATTENTION}),
            fast_generate=True,  # tests/test_fast_generate.py: same tokens as transformers' loop (Mllama, IDEFICS)
            summary="Flamingo family: image K/V once per image, skip closed-gate layers, fit a latency budget",
        )
    )
