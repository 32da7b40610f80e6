"""Cross-attention K/V in fast generate's static cache: the image's keys and values, written once by the prefill.

Mllama keeps each cross-attention layer's image K/V in the same cache as the text's K/V: the prefill's
cross-attention layers hand them to ``cache.update`` and every decode step reads ``layer.keys`` / ``layer.values``.
A transformers ``StaticLayer`` in that place would write them at the text's positions and hand back all its slots
(and a ``DynamicLayer`` would grow on every refill), so fast generate gives those layers an :class:`ImageKVLayer`:
it keeps what the prefill wrote in tensors whose addresses a captured decode graph can read, and refills them in
place on the next call whose images have the same shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

__all__ = ["ImageKVLayer", "cross_attention_reads_its_own_length", "image_lengths", "with_image_layers"]


class ImageKVLayer(DynamicLayer):
    """One cross-attention layer's image K/V: set by the prefill, read unchanged by every decode step."""

    # fixed tensors: the cache stays compileable, so transformers keeps masking a decode step's self-attention over
    # the static layers' empty slots (a cache that is not compileable lets a one-token query skip its mask)
    is_compileable = True

    def __init__(self) -> None:
        super().__init__()
        self.filled = False  # False after reset(): the tensors stay for the graph, their contents are stale

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        same = (self.is_initialized and self.keys.shape == key_states.shape and self.keys.dtype == key_states.dtype
                and self.keys.device == key_states.device and self.values.shape == value_states.shape)
        if same:  # in place: a captured graph reads these addresses
            self.keys.copy_(key_states)
            self.values.copy_(value_states)
        else:  # the projections' own outputs, which nothing else writes
            self.keys, self.values = key_states, value_states
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        self.filled = True
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return int(self.keys.shape[-2]) if self.filled else 0

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.get_seq_length(), 0

    def reset(self) -> None:
        self.filled = False


def with_image_layers(cache: Any, indices: list[int]) -> Any:
    """``cache`` with an :class:`ImageKVLayer` at each cross-attention layer index in ``indices``."""
    for index in indices:
        if not 0 <= index < len(cache.layers):
            raise ValueError(f"cross-attention layer {index} is outside the cache's {len(cache.layers)} layers: the "
                             "adapter's cross_attention_blocks() must number blocks as the model's decoder layers")
        cache.layers[index] = ImageKVLayer()
    return cache


@contextmanager
def cross_attention_reads_its_own_length(cache: Any, modules: list[tuple[int, nn.Module]]) -> Iterator[None]:
    """While inside, a cross-attention module (``(layer index, module)`` in ``modules``) that asks ``cache`` for its
    length gets its own :class:`ImageKVLayer`'s count, a host int, instead of the first layer's.

    transformers 5.17's Mllama cross-attention checks ``cache.get_seq_length() > 0`` before it reads its image K/V: on
    a static cache that is the first (self-attention) layer's count, a device tensor, so the check waits for the GPU
    and a CUDA-graph capture of the decode step fails. The image layer's count is the same at every step, so the
    answer a captured step keeps is right for every replay. Other callers get the cache's own answer.
    """
    if not modules:
        yield
        return
    reading: list[int | None] = [None]  # the cross-attention layer running now, if any
    original = cache.get_seq_length

    def get_seq_length(layer_idx: int = 0) -> Any:
        return original(layer_idx if reading[0] is None else reading[0])

    handles = []
    for index, module in modules:
        handles.append(module.register_forward_pre_hook(lambda *_, index=index: reading.__setitem__(0, index)))
        handles.append(module.register_forward_hook(lambda *_: reading.__setitem__(0, None)))
    cache.get_seq_length = get_seq_length
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        del cache.get_seq_length


def image_lengths(adapter: Any, model: nn.Module, cache: Any) -> Any:
    """:func:`cross_attention_reads_its_own_length` for the model's cross-attention layers whose image K/V ``cache``
    holds in :class:`ImageKVLayer` layers (none for other models: then nothing changes)."""
    modules = [(block.decoder_index, block.attention) for block in adapter.cross_attention_blocks(model)
               if block.kv_cached and isinstance(cache.layers[block.decoder_index], ImageKVLayer)]
    return cross_attention_reads_its_own_length(cache, modules)
