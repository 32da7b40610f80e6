"""Fast generate for cross-attention models (Mllama, IDEFICS): image K/V in the static cache, and the step's needs.

Mllama keeps each cross-attention layer's image K/V in the same cache as the text's K/V: the prefill's
cross-attention layers hand them to ``cache.update`` and every decode step reads ``layer.keys`` / ``layer.values``.
A transformers ``StaticLayer`` in that place would write them at the text's positions and hand back all its slots
(and a ``DynamicLayer`` would grow on every refill), so fast generate gives those layers an :class:`ImageKVLayer`:
it keeps what the prefill wrote in tensors whose addresses a captured decode graph can read, and refills them in
place on the next call whose images have the same shape. A captured step watches those tensors
(:func:`image_tensors`), so a refill that had to allocate anew makes the next call capture its step again. With
int4-kv / int8-kv / fp8-kv those layers are packed
(:class:`~mmsdk.plugins.quantizers.packed_image_kv.PackedImageLayer`, made by the KV-cache pass's state) and behave
the same way (:func:`holds_image_kv`).

Also here: what a cross-attention model's captured step needs besides (:func:`own_lengths_for_cross_attention`,
:func:`step_mask`).

Imported by fast generate when it is installed or runs, never with ``import mmsdk`` (the layer class derives from
transformers' ``DynamicLayer``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

__all__ = ["ImageKVLayer", "cross_attention_reads_its_own_length", "holds_image_kv", "image_layer_indices",
           "image_tensors", "own_lengths_for_cross_attention", "step_mask", "with_image_layers"]


class ImageKVLayer(DynamicLayer):
    """One cross-attention layer's image K/V: set by the prefill, read unchanged by every decode step."""

    # fixed tensors: the cache stays compileable, so transformers keeps masking a decode step's self-attention over
    # the static layers' empty slots (a cache that is not compileable lets a one-token query skip its mask)
    is_compileable = True

    def __init__(self) -> None:
        super().__init__()
        # the tensors a reset layer keeps for the next prefill to refill in place (a captured graph reads them);
        # while reset, ``keys`` / ``values`` are None and ``is_initialized`` False, so every transformers release
        # sees an empty layer (5.24 asks ``is_initialized`` and ``keys.numel()``, 5.17 ``get_seq_length``)
        self._kept: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self._kept
        if kept is not None and all(old.shape == new.shape and old.dtype == new.dtype and old.device == new.device
                                    for old, new in zip(kept, (key_states, value_states), strict=True)):
            kept[0].copy_(key_states)  # in place: a captured graph reads these addresses
            kept[1].copy_(value_states)
        else:  # the projections' outputs (nothing else writes them), laid out as [B, H, T, D]: Mllama hands them
            # over transposed, and the decode kernel (mmsdk.kernels.grouped_decode) reads contiguous K/V
            kept = (key_states.contiguous(), value_states.contiguous())
        self._kept = kept
        self.keys, self.values = kept
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return int(self.keys.shape[-2]) if self.is_initialized and self.keys is not None else 0

    def image_buffers(self) -> list[torch.Tensor]:
        """The tensors a captured decode step reads (none while reset)."""
        return [self.keys, self.values] if self.is_initialized and self.keys is not None else []

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False


def image_layer_indices(adapter: Any, model: nn.Module) -> list[int]:
    """Decoder indices of the cross-attention layers whose image K/V the model keeps in its cache (Mllama)."""
    return [block.decoder_index for block in adapter.cross_attention_blocks(model) if block.kv_cached]


def with_image_layers(cache: Any, indices: list[int]) -> Any:
    """``cache`` with an :class:`ImageKVLayer` at each cross-attention layer index in ``indices``."""
    for index in indices:
        if not 0 <= index < len(cache.layers):
            raise ValueError(f"cross-attention layer {index} is outside the cache's {len(cache.layers)} layers: the "
                             "adapter's cross_attention_blocks() must number blocks as the model's decoder layers")
        cache.layers[index] = ImageKVLayer()
    return cache


def holds_image_kv(layer: Any) -> bool:
    """Whether a cache layer holds a cross-attention layer's image K/V: an :class:`ImageKVLayer`, or packed (with
    int4-kv / int8-kv / fp8-kv, :class:`~mmsdk.plugins.quantizers.packed_image_kv.PackedImageLayer`)."""
    from mmsdk.plugins.quantizers.packed_image_kv import PackedImageLayer

    return isinstance(layer, (ImageKVLayer, PackedImageLayer))


def image_tensors(cache: Any) -> list[torch.Tensor]:
    """The image K/V tensors (or packed codes) ``cache``'s image layers hold now (what a captured step reads)."""
    return [t for layer in getattr(cache, "layers", ()) if holds_image_kv(layer) for t in layer.image_buffers()]


@contextmanager
def cross_attention_reads_its_own_length(cache: Any, modules: list[tuple[int, nn.Module]]) -> Iterator[None]:
    """While inside, a cross-attention module (``(layer index, module)`` in ``modules``) that asks ``cache`` for its
    length without naming a layer gets its own image layer's count, a host int, instead of the first
    layer's.

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
    shadowed = vars(cache).get("get_seq_length")  # an instance override from an enclosing use, put back after

    def get_seq_length(layer_idx: int | None = None) -> Any:
        if layer_idx is None:
            layer_idx = 0 if reading[0] is None else reading[0]
        return original(layer_idx)

    handles = []
    try:
        for index, module in modules:
            handles.append(module.register_forward_pre_hook(lambda *_, index=index: reading.__setitem__(0, index)))
            handles.append(module.register_forward_hook(lambda *_: reading.__setitem__(0, None)))
        cache.get_seq_length = get_seq_length
        yield
    finally:
        for handle in handles:
            handle.remove()
        if shadowed is None:
            vars(cache).pop("get_seq_length", None)
        else:
            cache.get_seq_length = shadowed


def own_lengths_for_cross_attention(adapter: Any, model: nn.Module, cache: Any) -> AbstractContextManager[None]:
    """:func:`cross_attention_reads_its_own_length` for the model's cross-attention layers whose image K/V ``cache``
    holds in image layers (:func:`holds_image_kv`; none for other models: then nothing changes)."""
    layers = getattr(cache, "layers", ())
    cached = set(image_layer_indices(adapter, model))
    modules = [(block.decoder_index, block.attention) for block in adapter.cross_attention_blocks(model)
               if block.decoder_index in cached and block.decoder_index < len(layers)
               and holds_image_kv(layers[block.decoder_index])]
    return cross_attention_reads_its_own_length(cache, modules)


def step_mask(adapter: Any, model: nn.Module, cache: Any, ids: torch.Tensor) -> torch.Tensor | None:
    """The attention mask a captured decode step hands the language model: None (the batch has no padding), or for
    models that would otherwise make one as long as the cached tokens (a length the capture would freeze; IDEFICS,
    ``ModelAdapter.needs_decode_mask_over_cache``) an all-ones mask over the static cache's slots."""
    if not adapter.needs_decode_mask_over_cache(model):
        return None
    slots = max((getattr(layer, "max_cache_len", 0) for layer in getattr(cache, "layers", ())), default=0)
    if slots <= 0:
        raise ValueError("the decode step's mask is sized over the static cache's slots, but the cache reports none: "
                         "pass a cache whose layers have max_cache_len (transformers' StaticCache)")
    return torch.ones(ids.shape[0], slots, dtype=torch.long, device=ids.device)
