"""A preallocated packed KV cache layer for CUDA: written in place, read by the packed decode kernel.

:class:`PackedStaticLayer` holds the same codes as :class:`QuantizedKVLayer` with static scales
(int4 two per byte, int8, fp8), but in buffers sized for the whole generation, with the token
count in a device tensor. New tokens are quantized and written by one Triton launch per layer (on an
decode step, by the attention kernel itself: ``update`` keeps the token until ``attend``);
``update`` hands the attention call a marker instead of K/V tensors, and the registered attention
function (:func:`mmsdk.kernels.kv_decode.attention_implementation`) runs
:func:`~mmsdk.kernels.kv_decode.decode_attention` over the codes on decode steps. Nothing is
reallocated between steps, so a CUDA graph can replay the decode step. Prefill reads the stored codes
back dequantized (what the dynamic layer does, so both layers compute the same numbers), a group of
heads at a time, so the dequantized prefix never exists for all heads at once.

A decode step's RoPE may also move into the attention kernel: an attention whose rotary op
``rmsnorm-rope-fusion`` installed offers the step's unrotated q and k through :meth:`take_rope`; when the
layer accepts, ``update`` and ``attend`` must receive exactly those tensors, the kernel rotates them as it
loads them, and every other path (another reader of the cache, a fallback attention) rotates them first.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from mmsdk.plugins.quantizers.quantized_cache import FP8, Packed, QuantizedKVLayer, StaticCodec

__all__ = ["PackedStaticLayer", "fused_supported", "packed_layer"]

CODE_DTYPES = {"int4": torch.uint8, "int8": torch.int8, "fp8": FP8}


def fused_supported(key_codec: Any, value_codec: Any, exact_new: bool) -> bool:
    """True when the packed decode kernel computes what the dequantizing layer computes for these codecs."""
    return (
        isinstance(key_codec, StaticCodec)
        and isinstance(value_codec, StaticCodec)
        and key_codec.fmt == value_codec.fmt
        and key_codec.fmt in CODE_DTYPES
        and not exact_new
    )


def packed_layer(tensor: Any) -> PackedStaticLayer | None:
    """The layer whose decode-step marker ``tensor`` is (what ``update`` returned for K or V), else None."""
    ref = getattr(tensor, "_mmsdk_packed", None)
    return ref() if ref is not None else None


@dataclass
class _StepRoPE:
    """A decode step's RoPE left to the attention kernel: cos / sin and the unrotated q and k it applies to."""

    cos: torch.Tensor
    sin: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor

    def rotated(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from mmsdk.kernels.norm_rope_gpu import rope_qk

        return rope_qk(query, key, self.cos, self.sin)


class PackedStaticLayer(QuantizedKVLayer):
    """Packed K/V for up to ``max_cache_len`` tokens in fixed buffers; decode steps return markers."""

    def __init__(self, key_codec: StaticCodec, value_codec: StaticCodec, max_cache_len: int, fused: bool) -> None:
        super().__init__(key_codec, value_codec, 0, False)
        self.max_cache_len = max_cache_len
        self.fused = fused
        self.fmt = key_codec.fmt
        self.key_codes: torch.Tensor | None = None
        self.value_codes: torch.Tensor | None = None
        self.length: torch.Tensor | None = None  # device int64 [1]: tokens stored
        self.key_scale: torch.Tensor | None = None  # fp32 [heads, head_dim] on the cache's device
        self.value_scale: torch.Tensor | None = None
        self.merge_counters: torch.Tensor | None = None  # int32 [B * heads + 1], see lazy_initialization
        self.unpadded = False  # set by callers that know no row is padded: decode steps then take no mask
        # a decode step's new K/V, kept by update() for attend(), whose kernel writes them into the cache
        # and advances the length (one launch and one increment less per layer); anything else that reads the
        # cache writes them first (_flush)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        # a decode step whose q and k the attention kernel rotates (take_rope); cleared by attend / settle_rope
        self._rope: _StepRoPE | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads, _, dim = key_states.shape
        width = (dim + 1) // 2 if self.fmt == "int4" else dim
        shape = (batch, heads, self.max_cache_len, width)
        device = key_states.device
        self.key_codes = torch.zeros(shape, dtype=CODE_DTYPES[self.fmt], device=device)
        self.value_codes = torch.zeros(shape, dtype=CODE_DTYPES[self.fmt], device=device)
        self.length = torch.zeros(1, dtype=torch.int64, device=device)
        self.key_scale = self.key_codec.scale.to(device).expand(heads, dim).contiguous()
        self.value_scale = self.value_codec.scale.to(device).expand(heads, dim).contiguous()
        # the int4 MHA decode kernel merges its own splits with these (unless MMSDK_KV_MERGE=0); left at zero
        self.merge_counters = torch.zeros(batch * heads + 1, dtype=torch.int32, device=device)
        self._markers = (torch.empty(0), torch.empty(0))
        for marker in self._markers:
            # weakly: a strong reference would make layer and markers a cycle that only the garbage
            # collector frees, so a released cache would keep its buffers until the next collection
            marker._mmsdk_packed = weakref.ref(self)  # type: ignore[attr-defined]

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._dequantized(self.key_codes, self.key_codec, self.key_scale)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("PackedStaticLayer.keys is read-only; use update().")

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._dequantized(self.value_codes, self.value_codec, self.value_scale)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("PackedStaticLayer.values is read-only; use update().")

    def _dequantized(self, codes: torch.Tensor | None, codec: StaticCodec, scale: torch.Tensor | None,
                     heads: slice = slice(None)) -> torch.Tensor | None:
        if not self.is_initialized or codes is None:
            return None
        self._flush()
        from mmsdk.kernels import triton_ready

        if scale is not None and triton_ready(codes, scale):  # same numbers, without the decode's fp32 temporaries
            from mmsdk.kernels.kv_decode import dequantize_codes

            return dequantize_codes(codes[:, heads], scale[heads], self.fmt, self.cumulative_length, self.head_dim,
                                    self.dtype)
        return codec.decode(Packed(codes[:, :, : self.cumulative_length]), self.dtype, self.head_dim)[:, heads]

    def dequantized_heads(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of KV heads ``first .. end`` over the stored tokens, dequantized: ``[B, end - first, T, D]``."""
        heads = slice(first, end)
        keys = self._dequantized(self.key_codes, self.key_codec, self.key_scale, heads)
        values = self._dequantized(self.value_codes, self.value_codec, self.value_scale, heads)
        if keys is None or values is None:
            raise RuntimeError("PackedStaticLayer.dequantized_heads: the layer holds no tokens yet (call update first)")
        return keys, values

    def take_rope(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether this decode step's attention kernel will rotate ``query`` / ``key`` ([B, H, 1, D], unrotated)
        by ``cos`` / ``sin`` ([B, 1, D] or [1, 1, D]); if so the caller hands them on unrotated."""
        from mmsdk.kernels import triton_ready

        self.settle_rope()
        batch, dim = query.shape[0], query.shape[-1]
        rows = (cos.dim() == 3 and cos.shape[1:] == (1, dim) and cos.shape[0] in (1, batch)
                and sin.shape == cos.shape and cos.dtype == sin.dtype == query.dtype == key.dtype)
        ok = (rows and self.is_initialized and self.fused and dim == self.head_dim and query.dim() == key.dim() == 4
              and query.shape[-2] == key.shape[-2] == 1 and key.shape[0] == batch
              and triton_ready(query, key, cos, sin, self.key_codes))
        if ok:
            self._rope = _StepRoPE(cos, sin, query, key)
        return ok

    def settle_rope(self) -> None:
        """Rotate what a step left to the attention kernel that never ran (no-op after ``attend``)."""
        if self._rope is not None:
            self._flush()  # rotates a kept token first
            self._rope = None

    def rotated_query(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` as the model meant it for attention code other than the packed kernel: rotated if this step's
        RoPE was left to the kernel (the kept token is then rotated and written too)."""
        rope = self._rope
        if rope is None:
            return query
        self._check_rope(query, rope.query, "query")
        query, key = rope.rotated(query, rope.key)  # one RoPE launch for both
        self._rope = None
        if self._pending is not None:  # the kept token is this step's key (update checked it): write it rotated
            self._pending = (key, self._pending[1])
        self._flush()
        return query

    def _check_rope(self, got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        if got is not expected:
            self._rope = None
            raise RuntimeError(
                f"the attention forward passed another {what} tensor than the one whose RoPE the packed KV kernel "
                "was to apply (it changed q or k between RoPE and the cache / attention call); run "
                "rmsnorm-rope-fusion with rope_in_attention=False for this model")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._rope is not None:
            self._check_rope(key_states, self._rope.key, "key")
        self._flush()
        count = key_states.shape[-2]
        if self.cumulative_length + count > self.max_cache_len:
            raise ValueError(
                f"the packed KV cache holds {self.max_cache_len} tokens but {self.cumulative_length + count} were "
                "written: generate() sizes it from max_length / max_new_tokens; pass a larger one."
            )
        if self._attention_appends(key_states, count):
            self._pending = (key_states, value_states)  # unrotated while self._rope is set: attend rotates it
        else:
            if self._rope is not None:
                key_states = self._rope.rotated(self._rope.query, key_states)[1]
            self._append(key_states, value_states)
        self.cumulative_length += count
        if self.fused:  # the registered attention reads the codes: one token by the kernel, a prompt by heads
            return self._markers  # type: ignore[return-value]
        return self.keys, self.values  # type: ignore[return-value]

    def _attention_appends(self, key_states: torch.Tensor, count: int) -> bool:
        """True when :meth:`attend` will write this step's token: a fused decode step on the Triton path."""
        from mmsdk.kernels import triton_ready

        return self.fused and count == 1 and triton_ready(key_states, self.key_codes)

    def _flush(self) -> None:
        """Write a token kept for :meth:`attend` now (something else reads the cache first)."""
        if self._pending is not None:
            (key, value), self._pending = self._pending, None
            if self._rope is not None:  # kept unrotated for the kernel: rotate it for everyone else
                key = self._rope.rotated(self._rope.query, key)[1]
            self._append(key, value)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        assert self.length is not None and self.key_codes is not None and self.value_codes is not None
        from mmsdk.kernels import note_fallback, triton_ready

        if triton_ready(key_states, self.key_codes):
            from mmsdk.kernels.kv_decode import append_kv

            append_kv(key_states, value_states, self.key_codes, self.value_codes, self.key_scale, self.value_scale,
                      self.length, self.fmt)
        else:
            note_fallback("packed KV append", "not a CUDA tensor or no Triton")
            positions = torch.arange(key_states.shape[-2], device=self.length.device) + self.length
            # as bytes: every code dtype is one byte wide, and index_copy_ has no float8 kernel
            self.key_codes.view(torch.uint8).index_copy_(
                2, positions, self.key_codec.encode(key_states).data.view(torch.uint8))
            self.value_codes.view(torch.uint8).index_copy_(
                2, positions, self.value_codec.encode(value_states).data.view(torch.uint8))
        self.length.add_(key_states.shape[-2])

    def attend(self, query: torch.Tensor, scaling: float, mask: torch.Tensor | None) -> torch.Tensor:
        """Decode attention of ``query`` [B, Hq, 1, D] over the stored tokens: ``[B, 1, Hq, D]``."""
        from mmsdk.kernels import kv_merge_enabled
        from mmsdk.kernels.kv_decode import decode_attention

        if self._rope is not None:
            self._check_rope(query, self._rope.query, "query")
        pending, self._pending = self._pending, None  # the kernel writes it and advances the length
        rope, self._rope = self._rope, None  # the kernel rotates q (and the kept token) as it loads them
        return decode_attention(query, self.key_codes, self.value_codes, self.key_scale, self.value_scale,
                                self.length, self.fmt, scaling, mask, append=pending,
                                rope=(rope.cos, rope.sin) if rope is not None else None,
                                merge_counters=self.merge_counters if kv_merge_enabled() else None)

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def nbytes(self) -> int:
        """Bytes of the code buffers (allocated for the whole generation)."""
        return sum(t.numel() * t.element_size() for t in (self.key_codes, self.value_codes) if t is not None)

    def reset(self) -> None:
        self._pending = None
        self._rope = None
        self.cumulative_length = 0
        if self.length is not None:
            self.length.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("PackedStaticLayer.crop takes the negative number of tokens to remove.")
        self._flush()
        self.cumulative_length = max(0, self.cumulative_length + tokens_to_remove)
        if self.length is not None:
            self.length.fill_(self.cumulative_length)

    def _map(self, fn: Any) -> None:
        self._flush()
        if self.key_codes is not None and self.value_codes is not None:
            self.key_codes, self.value_codes = fn(self.key_codes).contiguous(), fn(self.value_codes).contiguous()
            batch, heads = self.key_codes.shape[:2]
            self.merge_counters = torch.zeros(batch * heads + 1, dtype=torch.int32, device=self.key_codes.device)
