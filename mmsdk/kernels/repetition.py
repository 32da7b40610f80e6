"""transformers' repetition penalty inside fast generate's token choice.

Instruction-tuned checkpoints often set a repetition penalty in their generation config (1.05 is common for Qwen's),
so ``model.generate(**inputs)`` applies transformers' ``RepetitionPenaltyLogitsProcessor``: every token id that occurs
in the sequence so far (prompt included, image placeholders too) has its fp32 logit divided by the penalty
(multiplied where it is negative), once however often it occurs. Fast generate refused such calls, which then ran
transformers' eager loop.

The step keeps which ids occurred as a ``[B, V + 1]`` boolean mask on the device, marks each new token in it, and
applies the penalty with ``torch.where`` over the fp32 logits: element for element the gather / scatter transformers
runs, so greedy and sampled answers are its answers. transformers applies the penalty before the sampling warpers,
and so does the step. The extra column takes ids the LM head has no logit for (Llama-3.2-Vision's ``<|image|>``,
128256, is one past its 128256 logits): transformers 5.24 drops them from the penalty, as the step does; 5.17's
gather raises on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmsdk.kernels.generation_settings import generation_setting

__all__ = ["RepetitionPenalty", "repetition_reason"]


def _setting(model: Any, kwargs: dict[str, Any]) -> Any:
    """The penalty transformers' generate uses (:func:`generation_setting`; its default, 1.0, applies none)."""
    return generation_setting(model, kwargs, "repetition_penalty")


def repetition_reason(model: Any, kwargs: dict[str, Any]) -> str | None:
    """Why a call's repetition penalty keeps transformers' loop (None when the step can apply it, or none applies):
    a value transformers refuses, which its generate then reports."""
    value = _setting(model, kwargs)
    if value is None or value == 1.0:
        return None
    if not isinstance(value, float) or not value > 0:
        return f"repetition_penalty={value!r} (transformers takes a positive float)"
    return None


@dataclass(frozen=True)
class RepetitionPenalty:
    """One call's repetition penalty (a captured step bakes it in: a kept step is reused only with an equal one)."""

    penalty: float

    @classmethod
    def for_call(cls, model: Any, kwargs: dict[str, Any]) -> RepetitionPenalty | None:
        """The call's penalty, or None when transformers would apply none (unset, or 1.0)."""
        value = _setting(model, kwargs)
        return None if value is None or value == 1.0 else cls(float(value))

    @staticmethod
    def occurred(ids: torch.Tensor, vocab: int) -> torch.Tensor:
        """``[B, vocab + 1]`` bool: which ids occur in each row of ``ids`` (the prompt); ids the LM head has no logit
        for land in the last column."""
        seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
        return seen.scatter_(1, ids.clamp(max=vocab), True)

    @staticmethod
    def record(seen: torch.Tensor, token: torch.Tensor) -> None:
        """Mark each row's new ``token`` ([B], pad for a finished row, as transformers appends it) in ``seen``."""
        seen.scatter_(1, token[:, None].clamp(max=seen.shape[1] - 1), True)

    def apply(self, logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` logits penalized where ``seen`` (fp32, as transformers' generate scores them)."""
        scores = logits.float()
        penalized = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(seen[:, : scores.shape[-1]], penalized, scores)
