"""Image K/V projections that a decode step would run at every token (IDEFICS), run once per call instead.

IDEFICS hands its cross-attention layers the image states, not their K/V: each layer projects them with its K and
V projections on every forward. The image states are the same for a whole generation, yet a captured decode step
would replay those GEMMs (and int4-kv's rounding of their products) at every token. While fast generate's decode
steps run, :class:`StepProjections` stands in for these projections' forwards:

* the first step (eager, before the capture) projects the step's own image-state tensor through the projection's
  forward as it stands (a memo or a quantized layer included) and keeps the product;
* later steps, and the capture, are handed that product: the graph reads it and projects nothing;
* a later call that refills the step's image states in place calls :meth:`StepProjections.refresh`, which projects
  them again, once, into the kept products.

Outside the steps (prefill, transformers' own generate) the projections are as they were.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mmsdk.plugins._forward import innermost_override
from mmsdk.plugins.tensor_keys import being_captured, storage_key

__all__ = ["StepProjections", "recomputed_projections"]


def recomputed_projections(adapter: Any, model: nn.Module) -> list[nn.Module]:
    """The K and V projections of the cross-attention layers that recompute their image K/V at every forward
    (``CrossAttentionBlock.kv_cached`` False: IDEFICS); none for other models."""
    found: list[nn.Module] = []
    for block in adapter.cross_attention_blocks(model):
        if block.kv_cached:
            continue
        for name in (block.projections.k, block.projections.v):
            projection = getattr(block.attention, name, None) if name else None
            if isinstance(projection, nn.Module) and not any(projection is p for p in found):
                found.append(projection)
    return found


@dataclass(eq=False)
class _Kept:
    source: torch.Tensor  # the input as the step handed it (a view of the step's own image states)
    key: tuple[Any, ...]  # its storage_key when ``product`` was made
    product: torch.Tensor


class StepProjections:
    """Products of ``projections`` on the decode step's image states, made once per call (see the module's doc)."""

    def __init__(self, projections: list[nn.Module]) -> None:
        self.projections = projections
        self.kept: list[_Kept | None] = [None] * len(projections)
        self.computed = 0  # how many times a projection really ran inside a step or a refresh

    @contextmanager
    def standing_in(self) -> Iterator[None]:
        """While inside, each projection answers the step's image states from its kept product (inside any pass
        wrapper, as mmsdk.plugins._forward.innermost_override places it)."""
        with ExitStack() as stack:
            for index, projection in enumerate(self.projections):
                stack.enter_context(innermost_override(projection, functools.partial(self._forward, index)))
            yield

    def _forward(self, index: int, previous: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if args or kwargs or torch.is_grad_enabled():
                return previous(x, *args, **kwargs)
            kept, key = self.kept[index], storage_key(x)
            if kept is not None and kept.key == key:
                return kept.product
            if being_captured(x):  # never seen by an eager step: project inside the graph, as without this
                return previous(x)
            product = previous(x)
            self.computed += 1
            self.kept[index] = _Kept(x, key, product)
            return product

        return forward

    def refresh(self) -> None:
        """Project the step's refilled image states again into the kept products (outside the steps, eagerly)."""
        for projection, kept in zip(self.projections, self.kept, strict=True):
            if kept is None:
                continue
            product = projection(kept.source)
            if product is not kept.product:
                kept.product.copy_(product)
            self.computed += 1
            kept.key = storage_key(kept.source)

    @property
    def holding(self) -> bool:
        return any(kept is not None for kept in self.kept)
