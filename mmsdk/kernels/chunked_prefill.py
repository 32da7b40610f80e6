"""Chunked prefill for fast generate, and a static cache sized for the prompt the language model gets.

:func:`chunked` wraps the language model's forward so a long prompt runs in chunks, each writing its
K/V into the static cache and attending to everything before it; fast generate installs it inside
the passes' forward wrappers, so token pruning still sees the whole prompt. Its ``on_prompt`` hook
hears the prompt length the language model actually receives, before anything runs, which is when
:func:`size_static_cache` fits a new cache to it (token pruning may have cut the prompt that
``input_ids`` sized the cache for).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mmsdk.kernels.decode_state import capacity_for

__all__ = ["Regrow", "chunked", "size_static_cache"]

# language-model tensor arguments whose token axis chunked prefill knows how to cut
_CHUNKED_TENSORS = {"inputs_embeds", "attention_mask", "position_ids", "cache_position"}


class Regrow(Exception):
    """The kept cache is too small for the prompt the language model got (raised before the prefill writes)."""


def chunked(forward: Any, chunk: int, on_prompt: Callable[[int], None] | None = None) -> Any:
    """``forward`` of the language model that runs a long prefill in chunks of ``chunk`` tokens.

    Each chunk writes its K/V into the static cache and attends to everything before it; only the
    last chunk's hidden states are returned (the caller keeps the last position's logits only).
    Calls it cannot cut safely (positional arguments, unknown per-token tensors, 4-D masks) run whole.
    ``on_prompt`` hears the prompt length the language model gets, before anything runs.
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        embeds = kwargs.get("inputs_embeds")
        mask = kwargs.get("attention_mask")
        if on_prompt is not None and isinstance(embeds, torch.Tensor):
            on_prompt(embeds.shape[1])
        unknown = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _CHUNKED_TENSORS]
        if (args or unknown or not isinstance(embeds, torch.Tensor) or embeds.shape[1] <= chunk
                or (isinstance(mask, torch.Tensor) and mask.dim() != 2)):
            return forward(*args, **kwargs)
        total, out = embeds.shape[1], None
        for start in range(0, total, chunk):
            end = min(start + chunk, total)
            part = dict(kwargs, inputs_embeds=embeds[:, start:end])
            if isinstance(kwargs.get("position_ids"), torch.Tensor):
                part["position_ids"] = kwargs["position_ids"][..., start:end]
            if isinstance(kwargs.get("cache_position"), torch.Tensor):
                part["cache_position"] = kwargs["cache_position"][start:end]
            if isinstance(mask, torch.Tensor):
                part["attention_mask"] = mask[:, :end]
            out = forward(**part)
        return out

    return run


def size_static_cache(cache: Any, needed: int) -> None:
    """Fit a static cache to a call that writes ``needed`` tokens (the language model's prompt + new + 1).

    The kept decode state is sized from ``input_ids`` before the model runs; a new cache's layers allocate
    at their first write, so they take the capacity this call needs instead (LLaVA-1.5 at batch 4 x 4096
    tokens with token-prune 0.25: 3840 tokens instead of 4352, 0.3 GB of packed int4 KV). A kept cache
    smaller than that raises :class:`Regrow` before anything is written. Sliding-window layers keep theirs.
    """
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    from mmsdk.plugins.quantizers.static_kv import PackedStaticLayer

    for layer in cache.layers:
        if not isinstance(layer, (StaticLayer, PackedStaticLayer)) or isinstance(layer, StaticSlidingWindowLayer):
            continue
        if not layer.is_initialized:
            layer.max_cache_len = min(layer.max_cache_len, capacity_for(needed))
        elif layer.max_cache_len < needed:
            raise Regrow(f"the kept cache holds {layer.max_cache_len} tokens, this call needs {needed}")
