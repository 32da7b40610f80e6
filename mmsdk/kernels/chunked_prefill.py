"""Chunked prefill for fast generate, and a static cache sized for the prompt the language model gets.

:func:`chunked` wraps the language model's forward so a long prompt runs in chunks, each writing its
K/V into the static cache and attending to everything before it; fast generate installs it inside
the passes' forward wrappers, so token pruning still sees the whole prompt. Its ``on_prompt`` hook
hears the prompt length the language model actually receives, before anything runs, which is when
:func:`size_static_cache` fits a new cache to it (token pruning may have cut the prompt that
``input_ids`` sized the cache for).

A static cache hands attention all its slots, with a mask over the empty ones, so every prefill chunk
after the first would attend over the whole capacity with that mask; :func:`filled_prefix` makes
transformers' ``StaticCache`` layers hand only the tokens written so far. (On an empty cache transformers
already runs the first chunk as causal attention, which never reads past the diagonal.) Each call also gets its
query offset from the host (:func:`host_query_offset`): read from transformers' static cache it is a device tensor,
and the causal-mask maker's look at it waits for all the GPU work queued before the text prefill.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mmsdk.kernels.decode_state import capacity_for

__all__ = ["PREFILL_ENV", "PREFILL_TOKENS", "Regrow", "chunked", "filled_prefix", "host_query_offset", "prefill_tokens",
           "size_static_cache"]

# tokens of all batch rows per prefill chunk: memory against time to the first token. LLaVA-1.5-7B with int4-weight +
# int4-kv + token-prune 0.25 at batch 4 x 4096 tokens (H200, benchmarks/gpu_memory_peak.py): chunks of 4096 / 2048 /
# 1024 peaked at 1.117 / 1.098 / 1.091x its packed floor and took 520 / 571 / 770 ms to the first token (bf16, no
# passes: 537 / 544 / 566 ms). Every chunk is one more pass through the host's kernel launches and, with a packed KV
# cache, one more decode of the prefix written so far; 2048 is the largest chunk within 10% of the floor.
# ``MMSDK_PREFILL_TOKENS`` picks another chunk (e.g. 4096: a faster first token for more memory).
PREFILL_TOKENS = 2048
PREFILL_ENV = "MMSDK_PREFILL_TOKENS"

# language-model tensor arguments whose token axis chunked prefill knows how to cut
_CHUNKED_TENSORS = {"inputs_embeds", "input_ids", "attention_mask", "position_ids", "cache_position"}
# the prompt itself, one or the other
_PROMPT_TENSORS = {"inputs_embeds", "input_ids"}


def prefill_tokens() -> int:
    """Tokens of all batch rows per prefill chunk: ``MMSDK_PREFILL_TOKENS`` when set, else :data:`PREFILL_TOKENS`."""
    text = os.environ.get(PREFILL_ENV, "").strip()
    if not text:
        return PREFILL_TOKENS
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{PREFILL_ENV}={text!r} is not a number of tokens: set a positive integer (tokens of all "
                         f"batch rows per prefill chunk; more is a faster first token and a higher memory peak) or "
                         f"unset it for the default {PREFILL_TOKENS}.")
    return int(text)


class Regrow(Exception):
    """The kept cache is too small for the prompt the language model got (raised before the prefill writes)."""


def chunked(forward: Any, chunk: int, on_prompt: Callable[[int], None] | None = None, cache: Any = None,
            attend_filled_prefix: bool = True) -> Any:
    """``forward`` of the language model that runs a long prefill in chunks of ``chunk`` tokens (of its
    ``inputs_embeds``, or of the ``input_ids`` of a language model that embeds them itself).

    Each chunk writes its K/V into the static cache and attends to everything before it; only the
    last chunk's hidden states are returned (the caller keeps the last position's logits only).
    Calls it cannot cut safely (positional arguments, unknown per-token tensors, 4-D masks) run whole.
    ``on_prompt`` hears the prompt length the language model gets, before anything runs. ``cache`` (empty when
    the prefill starts) gives each call that writes into it its query offset from the host
    (:func:`host_query_offset`) and, with ``attend_filled_prefix`` (a cache holding no cross-attention states),
    makes it attend over the tokens written so far only (:func:`filled_prefix`). Once a call's writes cannot be
    counted (no prompt tensor, another cache, no cache use) neither applies any more.
    """

    from mmsdk.plugins._runtime import cache_of

    # tokens the calls so far wrote into ``cache`` (empty when the prefill starts), counted on the host: reading the
    # cache's count would wait for the GPU; None once a call wrote an unknown number (no view from then on)
    written: list[int | None] = [0]

    def whole(begin: int, end: int, *args: Any, **kwargs: Any) -> Any:
        counted = cache if written[0] is not None else None
        with host_query_offset(counted, begin), filled_prefix(counted if attend_filled_prefix else None, end):
            return forward(*args, **kwargs)

    def run(*args: Any, **kwargs: Any) -> Any:
        # the prompt as embeddings, or as token ids for a language model that embeds them itself (Mllama's)
        name = "inputs_embeds" if isinstance(kwargs.get("inputs_embeds"), torch.Tensor) else "input_ids"
        prompt = kwargs.get(name)
        mask = kwargs.get("attention_mask")
        writes_here = cache is None or (kwargs.get("use_cache") is not False and cache_of(kwargs) is cache)
        if not isinstance(prompt, torch.Tensor) or prompt.dim() < 2 or not writes_here:
            written[0] = None
            return forward(*args, **kwargs)
        if on_prompt is not None:
            on_prompt(prompt.shape[1])
        unknown = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)
                   and (k not in _CHUNKED_TENSORS or k in _PROMPT_TENSORS and k != name)]  # ids and embeds: whole
        total, begin = prompt.shape[1], written[0] or 0
        if written[0] is not None:
            written[0] += total
        if isinstance(mask, torch.Tensor) and mask.dim() != 2:  # sized for the whole cache by its maker
            return forward(*args, **kwargs)
        if args or unknown or total <= chunk:
            return whole(begin, begin + total, *args, **kwargs)
        out = None
        for start in range(0, total, chunk):
            end = min(start + chunk, total)
            part = dict(kwargs, **{name: prompt[:, start:end]})
            if isinstance(kwargs.get("position_ids"), torch.Tensor):
                part["position_ids"] = kwargs["position_ids"][..., start:end]
            if isinstance(kwargs.get("cache_position"), torch.Tensor):
                part["cache_position"] = kwargs["cache_position"][start:end]
            if isinstance(mask, torch.Tensor):  # it covers what the cache holds, then this call's tokens
                part["attention_mask"] = mask[:, : mask.shape[1] - total + end]
            out = whole(begin + start, begin + end, **part)
        return out

    return run


@contextmanager
def host_query_offset(cache: Any, offset: int) -> Iterator[None]:
    """While inside, ``cache.get_query_offset`` answers ``offset`` (the tokens written before this call, counted on
    the host) for the language model's own layers; image layers and a ``cache`` of None are left alone.

    transformers' ``StaticLayer`` keeps its length in a device tensor (for torch.compile), and the causal-mask maker
    compares the query offset with 0 to decide whether SDPA may run as causal: a read that waits for everything
    queued before it. On Mllama that is the whole vision encoder (~50 ms on an H200), after which the text prefill's
    launches no longer overlap any GPU work.
    """
    original = getattr(cache, "get_query_offset", None)
    if original is None or "get_query_offset" in vars(cache):  # an older transformers, or changed by someone else
        yield
        return
    from mmsdk.kernels.cross_attention_decode import holds_image_kv

    layers = getattr(cache, "layers", ())

    def query_offset(layer_idx: int = 0) -> Any:
        own = 0 <= layer_idx < len(layers) and not holds_image_kv(layers[layer_idx])
        return offset if own else original(layer_idx)

    cache.get_query_offset = query_offset
    try:
        yield
    finally:
        del cache.get_query_offset  # the class's method again


@contextmanager
def filled_prefix(cache: Any, end: int) -> Iterator[None]:
    """While inside, ``cache``'s plain ``StaticLayer`` layers return their first ``end`` tokens from ``update`` and
    size attention masks to them, instead of all ``max_cache_len`` slots with the empty ones masked.

    ``end`` is the number of tokens written once the call inside has written its own. A chunk attends over what is
    there and no more: the chunks of a long prompt after the first each ran a masked attention over every slot,
    about twice the attention work of one causal prefill, in a kernel slower than the causal one. Other layers
    (sliding-window, mmsdk's packed KV, which sizes its masks itself) are left alone; so is a ``cache`` of None.
    """
    from transformers.cache_utils import StaticLayer

    layers = [layer for layer in getattr(cache, "layers", ()) if type(layer) is StaticLayer
              and not {"update", "get_mask_sizes"} & set(vars(layer))]  # one changed by someone else: left as is
    for layer in layers:
        layer.update = _prefix_update(layer.update, end)
        layer.get_mask_sizes = lambda query_length, *args: (end, 0)
    try:
        yield
    finally:
        for layer in layers:  # the class's methods again
            del layer.update, layer.get_mask_sizes


def _prefix_update(update: Callable[..., tuple[torch.Tensor, torch.Tensor]], end: int) -> Callable[..., Any]:
    def first_tokens(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = update(*args, **kwargs)
        return keys[:, :, :end], values[:, :, :end]

    return first_tokens


def size_static_cache(cache: Any, needed: int) -> None:
    """Fit a static cache to a call that writes ``needed`` tokens (the language model's prompt + new + 1).

    The kept decode state is sized from ``input_ids`` before the model runs; a new cache's layers allocate
    at their first write, so they take the capacity this call needs instead (LLaVA-1.5 at batch 4 x 4096
    tokens with token-prune 0.25: 3840 tokens instead of 4352, 0.3 GB of packed int4 KV). A kept cache
    smaller than that raises :class:`Regrow` before anything is written. Sliding-window layers and image layers
    (sized by their image) keep theirs.
    """
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    from mmsdk.plugins.quantizers.packed_image_kv import PackedImageLayer
    from mmsdk.plugins.quantizers.static_kv import PackedStaticLayer

    for layer in cache.layers:
        if (not isinstance(layer, (StaticLayer, PackedStaticLayer))
                or isinstance(layer, (StaticSlidingWindowLayer, PackedImageLayer))):
            continue
        if not layer.is_initialized:
            layer.max_cache_len = min(layer.max_cache_len, capacity_for(needed))
        elif layer.max_cache_len < needed:
            raise Regrow(f"the kept cache holds {layer.max_cache_len} tokens, this call needs {needed}")
