"""Vision-token reducers shared by ``token-prune`` and ``token-merge``: which tokens survive and what they hold.

Each reducer takes one image's tokens ``[n, D]`` (and, for VisionZip, their vision-tower scores)
and returns the kept slots (indices into the n tokens, sorted) with their new values. The same
reducer serves inline families (through the runtime's sequence compaction) and cross-attention
families (through :func:`group_reducer`, over the image states of each image or tile).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import Field, model_validator

from mmsdk.core.config import PassConfig
from mmsdk.core.errors import UnsupportedInputError

__all__ = ["DEFAULT_KEEP_RATIO", "ToMeReducer", "TokenBudgetConfig", "VisionZipReducer", "group_reducer", "kept_count"]

DEFAULT_KEEP_RATIO = 0.5


class TokenBudgetConfig(PassConfig):
    """The per-image token budget of a vision-token pass: ``keep_ratio`` or ``keep_tokens``, not both."""

    keep_ratio: float | None = Field(
        None, gt=0, le=1, description=f"Fraction of each image's tokens kept (default {DEFAULT_KEEP_RATIO})."
    )
    keep_tokens: int | None = Field(None, ge=1, description="Tokens kept per image (instead of keep_ratio).")

    @model_validator(mode="after")
    def _one_budget(self) -> TokenBudgetConfig:
        if self.keep_ratio is not None and self.keep_tokens is not None:
            raise ValueError("give keep_ratio or keep_tokens, not both")
        return self

    def budget(self) -> tuple[float | None, int | None]:
        """(keep_ratio, keep_tokens) with the default ratio filled in when neither is given."""
        if self.keep_ratio is None and self.keep_tokens is None:
            return DEFAULT_KEEP_RATIO, None
        return self.keep_ratio, self.keep_tokens

    def kept(self, n: int) -> int:
        """Tokens an image of ``n`` tokens keeps."""
        return kept_count(n, *self.budget())


def kept_count(n: int, keep_ratio: float | None, keep_tokens: int | None) -> int:
    """How many of an image's ``n`` tokens survive: ``keep_tokens`` (capped at n) or round(n * ratio), >= 1."""
    if keep_tokens is not None:
        return min(n, keep_tokens)
    return max(1, min(n, math.floor(n * (keep_ratio if keep_ratio is not None else 1.0) + 0.5)))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a = torch.nn.functional.normalize(a.float(), dim=-1)
    b = torch.nn.functional.normalize(b.float(), dim=-1)
    return a @ b.T


@dataclass(frozen=True)
class VisionZipReducer:
    """VisionZip: keep the dominant tokens (highest vision-tower attention), merge the rest into a few.

    ``contextual_fraction`` of the kept budget goes to contextual tokens: evenly spaced targets
    among the non-dominant tokens, each the mean of itself and the non-dominant tokens most similar
    to it (cosine of the projected features; VisionZip uses CLIP keys, which mmsdk does not keep).
    """

    keep_ratio: float | None
    keep_tokens: int | None
    contextual_fraction: float
    name: str = "visionzip"

    def __call__(self, embeds: torch.Tensor, scores: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if scores is None:
            raise ValueError("visionzip needs vision-tower scores; the adapter gave none")
        n = embeds.shape[0]
        k = kept_count(n, self.keep_ratio, self.keep_tokens)
        if k >= n:
            return torch.arange(n, device=embeds.device), embeds
        contextual = min(k - 1, math.floor(k * self.contextual_fraction + 0.5))
        dominant = torch.topk(scores.float(), k - contextual).indices
        rest = torch.ones(n, dtype=torch.bool, device=embeds.device)
        rest[dominant] = False
        rest_index = rest.nonzero().squeeze(1)
        if contextual == 0 or rest_index.numel() == 0:
            slots = dominant.sort().values
            return slots, embeds[slots]
        targets, values = _contextual(embeds, rest_index, contextual)
        slots = torch.cat([dominant, targets])
        merged = torch.cat([embeds[dominant], values])
        order = slots.argsort()
        return slots[order], merged[order]


def _contextual(embeds: torch.Tensor, rest: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Evenly spaced targets among ``rest``; every other rest token is averaged into its closest target."""
    step = max(1, rest.numel() // count)
    pick = torch.arange(0, rest.numel(), step, device=embeds.device)[:count]
    targets = rest[pick]
    others = rest[torch.isin(rest, targets, invert=True)]
    sums = embeds[targets].float().clone()
    counts = torch.ones(targets.numel(), device=embeds.device)
    if others.numel():
        nearest = _cosine(embeds[others], embeds[targets]).argmax(dim=-1)
        sums.index_add_(0, nearest, embeds[others].float())
        counts.index_add_(0, nearest, torch.ones(others.numel(), device=embeds.device))
    return targets, (sums / counts[:, None]).to(embeds.dtype)


@dataclass(frozen=True)
class ToMeReducer:
    """ToMe bipartite soft matching, repeated until the budget is met; merges are size-weighted means.

    Tokens alternate into sets A (even) and B (odd); each A token proposes its most similar B token
    (cosine); the r most similar pairs merge into the B token, whose slot (and so position) the
    merged token keeps. One round halves the tokens at most, so small budgets take several rounds.
    """

    keep_ratio: float | None
    keep_tokens: int | None
    name: str = "tome"

    def __call__(self, embeds: torch.Tensor, scores: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        n = embeds.shape[0]
        k = kept_count(n, self.keep_ratio, self.keep_tokens)
        slots = torch.arange(n, device=embeds.device)
        values = embeds.float()
        sizes = torch.ones(n, device=embeds.device)
        while values.shape[0] > k and values.shape[0] > 1:
            slots, values, sizes = _merge_round(slots, values, sizes, values.shape[0] - k)
        order = slots.argsort()
        return slots[order], values[order].to(embeds.dtype)


def _merge_round(slots: torch.Tensor, values: torch.Tensor, sizes: torch.Tensor,
                 wanted: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, b = values[0::2], values[1::2]
    r = min(wanted, a.shape[0])
    best, partner = _cosine(a, b).max(dim=-1)
    merged = best.argsort(descending=True)[:r]
    stay = best.argsort(descending=True)[r:]
    size_a, size_b = sizes[0::2], sizes[1::2]
    total = b * size_b[:, None]
    total = total.index_add(0, partner[merged], a[merged] * size_a[merged][:, None])
    new_size_b = size_b.index_add(0, partner[merged], size_a[merged])
    new_b = total / new_size_b[:, None]
    keep_a = stay.sort().values
    return (
        torch.cat([slots[0::2][keep_a], slots[1::2]]),
        torch.cat([a[keep_a], new_b]),
        torch.cat([size_a[keep_a], new_size_b]),
    )


def group_reducer(
    reducer: VisionZipReducer | ToMeReducer,
) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """Apply a per-image reducer to every group of cross-attention image states ([G, P, D] -> [G, K, D])."""

    def reduce(states: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        groups, per_group = states.shape[:2]
        if scores is not None and scores.numel() != groups * per_group:
            raise UnsupportedInputError(
                f"the vision tower scored {scores.numel()} tokens but {groups * per_group} image states reached "
                "cross-attention.",
                fix="give every image through pixel_values in the same call (one tile layout per batch).",
            )
        flat = scores.reshape(groups, per_group) if scores is not None else None
        out = [reducer(states[g], flat[g] if flat is not None else None)[1] for g in range(groups)]
        return torch.stack(out)

    return reduce
