"""A cross-attention layer's image K/V, packed in a fixed buffer: what Mllama reads on every step of a quantized cache.

Mllama hands each cross-attention layer's image K/V to ``cache.update`` in the prefill and reads ``layer.keys`` /
``layer.values`` on every decode step. With ``int4-kv`` / ``int8-kv`` and static scales, :class:`PackedImageLayer`
stores them as :class:`~mmsdk.plugins.quantizers.static_kv.PackedStaticLayer` stores text K/V (the same codes as the
dequantizing ``QuantizedKVLayer`` transformers' loop uses on CPU), in buffers sized by the image's tokens, and hands
the attention call a marker: the registered packed attention then runs the decode kernel over the codes with the
cross-attention mask's row (which drops the padding tiles' tokens), so a decode step never makes a bf16 copy of the
image K/V. A prefill reads them back dequantized, a group of heads at a time.

The buffers stay for the next prefill whose images have the same shape, which refills them in place (a captured
decode graph reads their addresses); a reset layer reads as empty until then, as transformers' own layers do.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from mmsdk.plugins.quantizers.quantized_cache import StaticCodec
from mmsdk.plugins.quantizers.static_kv import PackedStaticLayer

__all__ = ["PackedImageLayer"]


class PackedImageLayer(PackedStaticLayer):
    """Packed image K/V of one cross-attention layer: written whole by the prefill, read unchanged by every step."""

    def __init__(self, key_codec: StaticCodec, value_codec: StaticCodec, fused: bool) -> None:
        super().__init__(key_codec, value_codec, 0, fused)  # sized by the first prefill's image tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.max_cache_len = key_states.shape[-2]
        super().lazy_initialization(key_states, value_states)
        # one element, not none: transformers 5.24's Mllama asks ``keys.numel() > 0`` to know the layer holds an image
        self._markers = (torch.empty(1), torch.empty(1))
        for marker in self._markers:
            marker._mmsdk_packed = weakref.ref(self)  # type: ignore[attr-defined]

    def _fits(self, key_states: torch.Tensor) -> bool:
        codes = self.key_codes
        return (codes is not None and codes.shape[:3] == key_states.shape[:3] and self.head_dim == key_states.shape[-1]
                and self.dtype == key_states.dtype and codes.device == key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a prefill's image K/V ``[B, H_kv, T_image, D]``, replacing what the layer held."""
        if self._fits(key_states):  # in place: a captured decode step reads these buffers
            self.is_initialized = True
        else:  # new buffers: the captured step watches them (image_tensors), so it is captured again
            self.lazy_initialization(key_states, value_states)
        self._pending = self._rope = None
        assert self.length is not None
        self.length.zero_()
        self._append(key_states, value_states)
        self.cumulative_length = key_states.shape[-2]
        if self.fused:  # the registered attention reads the codes (by the kernel on a step, by heads in a prefill)
            return self._markers  # type: ignore[return-value]
        return self.keys, self.values  # type: ignore[return-value]

    # Mllama's decode step reads ``keys`` / ``values`` itself and hands them to the attention call: fused, they are
    # the markers that lead the packed attention to this layer (it reads dequantized copies through
    # ``dequantized_heads`` where it cannot run the kernel).
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        if self.fused and self.is_initialized:
            return self._markers[0]
        return PackedStaticLayer.keys.fget(self)  # type: ignore[attr-defined]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        PackedStaticLayer.keys.fset(self, value)  # type: ignore[attr-defined]

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        if self.fused and self.is_initialized:
            return self._markers[1]
        return PackedStaticLayer.values.fget(self)  # type: ignore[attr-defined]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        PackedStaticLayer.values.fset(self, value)  # type: ignore[attr-defined]

    def image_buffers(self) -> list[torch.Tensor]:
        """The code buffers a captured decode step reads (none while reset)."""
        if not self.is_initialized or self.key_codes is None or self.value_codes is None:
            return []
        return [self.key_codes, self.value_codes]

    def get_seq_length(self) -> int:
        return self.cumulative_length if self.is_initialized else 0

    def reset(self) -> None:
        super().reset()
        self.is_initialized = False  # empty to transformers until the next prefill refills the kept buffers
