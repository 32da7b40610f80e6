"""Sampled token choice for fast generate: temperature, top-k, top-p and min-p, as transformers' generate samples.

Many instruction-tuned checkpoints ship a generation config that samples (Llama-3.2-11B-Vision-Instruct: temperature
0.6, top-p 0.9), so ``model.generate(**inputs)`` without ``do_sample=False`` samples. Fast generate refused such calls,
which then ran transformers' eager loop: with int4 weights each linear's launch costs 85-185 µs of host time there
(benchmarks/gpu_prefill_linear.py), and Mllama-11B's step took 48.9 ms against 31.8 ms in bf16
(benchmarks/results/h200_mllama_decode.json).

The step applies transformers' own warpers (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
MinPLogitsWarper, in the order and with the values transformers' generate would use) to the fp32 logits, then draws
one token per row as ``torch.multinomial(probs, 1)`` does for one sample: ``argmax(probs / q)`` with ``q ~ Exp(1)``
from ``exponential_``. The draw is written out so the captured step does not depend on how a torch version checks
multinomial's input (a host-side read in some, which a CUDA graph cannot hold; a device-side assert in others, which
would poison the CUDA context on a NaN): it consumes the generator as ``torch.multinomial`` does, so an eager call
draws the tokens transformers' generate draws from the same seed (where transformers would raise on NaN or infinite
logits, a row gets a token). Inside a captured step the CUDA generator advances at every replay (CUDA graphs register
it), so each step draws afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmsdk.kernels.generation_settings import generation_setting
from mmsdk.kernels.greedy import greedy_step, record_choice

__all__ = ["Sampler", "choose_step", "sampling_reason"]

# options transformers' generate reads for sampling, with the defaults it falls back on when neither the call nor the
# model's generation config sets them (GenerationConfig._get_default_generation_params, where it exists)
_FALLBACKS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
              "eta_cutoff": 0.0, "top_h": None}
SAMPLING_OPTIONS = tuple(_FALLBACKS)


def _setting(model: Any, kwargs: dict[str, Any], name: str) -> Any:
    """The value transformers' generate samples with (:func:`generation_setting`, this module's fallbacks)."""
    return generation_setting(model, kwargs, name, _FALLBACKS[name])


def sampling_reason(model: Any, kwargs: dict[str, Any]) -> str | None:
    """Why a sampling call cannot take the fast path (None when it can): a warper it does not apply."""
    unsupported = {"typical_p": lambda v: v < 1.0, "epsilon_cutoff": lambda v: 0.0 < v < 1.0,
                   "eta_cutoff": lambda v: 0.0 < v < 1.0, "top_h": lambda v: True}
    for name, applies in unsupported.items():
        value = _setting(model, kwargs, name)
        if value is not None and applies(value):
            return f"sampling with {name}={value!r} (the fast path samples with temperature, top_k, top_p and min_p)"
    return None


@dataclass(frozen=True)
class Sampler:
    """One call's sampling settings (a captured step bakes them in: a kept step is reused only with equal ones)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    @classmethod
    def for_call(cls, model: Any, kwargs: dict[str, Any]) -> Sampler | None:
        """The sampler of a generate() call, or None when it decodes greedily."""
        config = model.generation_config
        do_sample = kwargs["do_sample"] if "do_sample" in kwargs else getattr(config, "do_sample", None)
        if not do_sample:
            return None
        # the values as given: transformers' warpers refuse bad ones (the call then falls back and transformers
        # raises the same error)
        return cls(**{name: _setting(model, kwargs, name) for name in ("temperature", "top_k", "top_p", "min_p")})

    def warpers(self) -> list[Any]:
        """transformers' warpers for these settings, in the order its generate applies them."""
        from transformers.generation.logits_process import (
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        chain: list[Any] = []
        if self.temperature is not None and self.temperature != 1.0:
            chain.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k is not None and self.top_k != 0:
            chain.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p is not None and self.top_p < 1.0:
            chain.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        if self.min_p is not None:
            chain.append(MinPLogitsWarper(min_p=self.min_p, min_tokens_to_keep=1))
        return chain

    def choose(self, logits: torch.Tensor, warpers: list[Any] | None = None) -> torch.Tensor:
        """One token per row of ``[B, V]`` logits, drawn from the warped distribution: ``[B]`` int64."""
        scores = logits.to(dtype=torch.float32, copy=True)
        for warper in self.warpers() if warpers is None else warpers:
            scores = warper(None, scores)
        probs = torch.softmax(scores, dim=-1)
        # torch.multinomial(probs, 1) without its input check (see the module docstring)
        return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)


def choose_step(sampler: Sampler | None, logits: torch.Tensor, finished: torch.Tensor, eos: torch.Tensor, pad: int,
                token: torch.Tensor, tokens: torch.Tensor | None = None, column: torch.Tensor | None = None,
                warpers: list[Any] | None = None) -> None:
    """:func:`~mmsdk.kernels.greedy.greedy_step` (``sampler`` None), or the same step with a sampled token."""
    if sampler is None:
        greedy_step(logits, finished, eos, pad, token, tokens, column)
    else:
        record_choice(sampler.choose(logits, warpers), finished, eos, pad, token, tokens, column)
