"""Choosing the next token from logits: greedy, or sampling with temperature / top-k / top-p."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import Field

from mmsdk.core.config import PassConfig

if TYPE_CHECKING:
    import torch

__all__ = ["SamplingConfig", "Sampler"]


class SamplingConfig(PassConfig):
    """How tokens are chosen (validated like every mmsdk config)."""

    do_sample: bool = Field(False, description="Sample from the distribution instead of taking the argmax.")
    temperature: float = Field(1.0, gt=0, le=100, description="Divide logits by this before sampling.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens (0: all).")
    top_p: float = Field(1.0, gt=0, le=1, description="Keep the smallest set of tokens whose probability reaches p.")
    seed: int | None = Field(None, description="Seed for reproducible sampling.")


@dataclass
class Sampler:
    """Picks next tokens for a batch; holds its own random generator."""

    config: SamplingConfig
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        import torch

        if self.config.do_sample:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.config.seed if self.config.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, vocab] logits -> [B] token ids."""
        import torch

        if not self.config.do_sample:
            return logits.argmax(dim=-1)
        scores = logits.float() / self.config.temperature
        if self.config.top_k:
            kth = torch.topk(scores, min(self.config.top_k, scores.shape[-1])).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.config.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative - ordered.softmax(-1) > self.config.top_p  # keep the token that crosses p
            scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
        probs = scores.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
