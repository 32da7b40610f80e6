"""A transformers ``Cache`` whose layers store K/V packed in 4 or 8 bits, and the codecs it uses.

Two scale modes:

* ``static``: calibrated ranges per (KV head, channel) (K after RoPE) or per tensor; values are
  stored as ONNX Runtime's GroupQueryAttention stores them: int4 ``q = clamp(rint(x/s), -8, 7)``
  kept as ``q + 8`` two per byte (even channel in the low nibble), int8 ``clamp(rint(x/s), -128,
  127)``, fp8 e4m3 ``x/s``. Appending never re-quantizes old tokens.
* ``dynamic`` (torch only): per token, per group of ``group_size`` channels, asymmetric
  ``x ~ q * scale + low`` with fp16 scale and low, refitted by least squares for the chosen codes
  (fp8: symmetric ``amax/448``), KIVI style;
  the most recent ``residual_length`` tokens stay in full precision and older ones are quantized
  as they leave that window, each token exactly once.

Attention reads a dequantized copy (this module stores packed; a kernel that reads packed K/V is a
separate piece of work). By default it reads it from the first forward on, prefill included, as
ONNX Runtime's GroupQueryAttention does, so torch, ORT and the calibration loss see the same
numbers. With ``exact_new`` the tokens of the current forward are attended in full precision and
only earlier tokens are read back quantized (TensorRT-LLM's context phase, HF ``QuantizedCache``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmsdk.plugins.quantizers.packing import pack_nibbles, unpack_nibbles

__all__ = ["DynamicCodec", "Packed", "QuantizedKVLayer", "StaticCodec", "cache_bytes", "make_cache"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class Packed:
    """Packed K or V of shape ``[B, H, T, ...]``: the codes and, for dynamic scales, per-group scale/minimum."""

    data: torch.Tensor
    scale: torch.Tensor | None = None
    low: torch.Tensor | None = None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Packed:
        """Apply ``fn`` to every tensor (slicing along batch or time)."""
        return Packed(fn(self.data), *(None if t is None else fn(t) for t in (self.scale, self.low)))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.low) if t is not None)

    @staticmethod
    def cat(first: Packed | None, second: Packed) -> Packed:
        if first is None:
            return second
        parts = [
            torch.cat([a, b], dim=2) if a is not None else None
            for a, b in zip((first.data, first.scale, first.low), (second.data, second.scale, second.low), strict=True)
        ]
        return Packed(parts[0], parts[1], parts[2])


def _pad_even(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 1)) if x.shape[-1] % 2 else x


class StaticCodec:
    """Symmetric quantization with fixed scales broadcast over ``[B, H, T, D]`` (shape ``[H, D]`` or ``[1, 1]``)."""

    def __init__(self, fmt: str, scale: torch.Tensor) -> None:
        self.fmt = fmt
        self.scale = scale.float()
        self._on: dict[torch.device, torch.Tensor] = {}

    def _scale(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = self.scale.to(device)[None, :, None, :]
        return self._on[device]

    def encode(self, x: torch.Tensor) -> Packed:
        y = x.float() / self._scale(x.device)
        if self.fmt == "fp8":
            return Packed(y.clamp(-FP8_MAX, FP8_MAX).to(FP8))
        if self.fmt == "int8":
            return Packed(y.round().clamp(-128, 127).to(torch.int8))
        return Packed(pack_nibbles(_pad_even(y.round().clamp(-8, 7) + 8)))

    def decode(self, packed: Packed, dtype: torch.dtype, dim: int) -> torch.Tensor:
        data = packed.data
        if self.fmt == "int4":
            q = unpack_nibbles(data)[..., :dim].float() - 8
        else:
            q = data.float()
        return (q * self._scale(data.device)).to(dtype)

    def constant_bytes(self) -> int:
        """Bytes of the calibrated scales (per model, not per sequence: ONNX Runtime keeps them as initializers)."""
        return self.scale.numel() * 4


class DynamicCodec:
    """Per token and group of ``group`` channels: asymmetric int (fp16 scale + minimum) or symmetric fp8."""

    def __init__(self, fmt: str, group: int, refits: int = 2) -> None:
        self.fmt, self.group, self.refits = fmt, group, refits
        self.levels = {"int4": 15.0, "int8": 255.0}.get(fmt, 0.0)

    def encode(self, x: torch.Tensor) -> Packed:
        groups = x.float().unflatten(-1, (-1, self.group))  # [B, H, T, G, g]
        if self.fmt == "fp8":
            scale = (groups.abs().amax(-1) / FP8_MAX).to(torch.float16)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            data = (groups / scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)
            return Packed(data, scale)
        low, scale = groups.amin(-1, keepdim=True), (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True))
        scale = (scale / self.levels).clamp(min=1e-8)
        for _ in range(self.refits):
            low, scale = self._refit(groups, low, scale)
        low, scale = low.to(torch.float16), scale.to(torch.float16)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = ((groups - low.float()) / scale.float()).round().clamp(0, self.levels)
        q = q.flatten(-2).to(torch.uint8)
        return Packed(pack_nibbles(_pad_even(q)) if self.fmt == "int4" else q, scale.squeeze(-1), low.squeeze(-1))

    def _refit(self, groups: torch.Tensor, low: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Least-squares (minimum, scale) for the current codes: ``x ~ q * scale + low`` (HQQ's aim, closed form)."""
        q = ((groups - low) / scale).round().clamp(0, self.levels)
        q_mean, x_mean = q.mean(-1, keepdim=True), groups.mean(-1, keepdim=True)
        spread = (q - q_mean).pow(2).sum(-1, keepdim=True)
        fitted = ((q - q_mean) * (groups - x_mean)).sum(-1, keepdim=True) / spread.clamp(min=1e-12)
        scale = torch.where(spread > 0, fitted, scale).clamp(min=1e-8)
        return x_mean - scale * q_mean, scale

    def decode(self, packed: Packed, dtype: torch.dtype, dim: int) -> torch.Tensor:
        assert packed.scale is not None  # dynamic packs always carry scales
        if self.fmt == "fp8":
            q = packed.data.float().unflatten(-1, (-1, self.group))
            return (q * packed.scale.float().unsqueeze(-1)).flatten(-2).to(dtype)
        q = unpack_nibbles(packed.data)[..., :dim] if self.fmt == "int4" else packed.data
        q = q.float().unflatten(-1, (-1, self.group))
        out = q * packed.scale.float().unsqueeze(-1) + packed.low.float().unsqueeze(-1)  # type: ignore[union-attr]
        return out.flatten(-2).to(dtype)

    def constant_bytes(self) -> int:
        return 0


def _layer_base() -> type:
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class QuantizedKVLayer(_layer_base()):  # type: ignore[misc]
    """One cache layer holding packed K/V (plus a full-precision window of recent tokens in dynamic mode).

    ``keys`` / ``values`` read as the dequantized tensors, so model code that reads a layer
    directly (Mllama's cross-attention on decode steps) works unchanged.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, key_codec: Any, value_codec: Any, residual_length: int = 0, exact_new: bool = False) -> None:
        self.key_codec, self.value_codec, self.residual_length = key_codec, value_codec, residual_length
        self.exact_new = exact_new
        self._k: Packed | None = None
        self._v: Packed | None = None
        self._rk: torch.Tensor | None = None
        self._rv: torch.Tensor | None = None
        self.cumulative_length = 0
        super().__init__()

    # ``keys`` / ``values`` are views computed on read; the base class assigns None on reset only.
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._read(self._k, self._rk, self.key_codec)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("QuantizedKVLayer.keys is read-only; use update().")

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._read(self._v, self._rv, self.value_codec)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("QuantizedKVLayer.values is read-only; use update().")

    def _read(self, packed: Packed | None, residual: torch.Tensor | None, codec: Any) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        parts = [] if packed is None else [codec.decode(packed, self.dtype, self.head_dim)]
        if residual is not None:
            parts.append(residual)
        if not parts:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.head_dim = key_states.shape[-1]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        previous = (self.keys, self.values) if self.exact_new and self.cumulative_length else None
        self.cumulative_length += key_states.shape[-2]
        if self.residual_length <= 0:
            self._k = Packed.cat(self._k, self.key_codec.encode(key_states))
            self._v = Packed.cat(self._v, self.value_codec.encode(value_states))
        else:
            self._rk = key_states if self._rk is None else torch.cat([self._rk, key_states], dim=-2)
            self._rv = value_states if self._rv is None else torch.cat([self._rv, value_states], dim=-2)
            self._flush()
        if self.exact_new:
            if previous is None:
                return key_states, value_states
            return torch.cat([previous[0], key_states], dim=-2), torch.cat([previous[1], value_states], dim=-2)
        return self.keys, self.values  # type: ignore[return-value]

    def _flush(self) -> None:
        assert self._rk is not None and self._rv is not None
        spill = self._rk.shape[-2] - self.residual_length
        if spill <= 0:
            return
        self._k = Packed.cat(self._k, self.key_codec.encode(self._rk[..., :spill, :]))
        self._v = Packed.cat(self._v, self.value_codec.encode(self._rv[..., :spill, :]))
        self._rk, self._rv = self._rk[..., spill:, :], self._rv[..., spill:, :]

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> int:
        """Bytes this layer holds for the sequence: packed codes, per-token scales and the full-precision window.

        The calibrated static scales are per model, not per sequence (``constant_bytes``).
        """
        total = sum(p.nbytes() for p in (self._k, self._v) if p is not None)
        return total + sum(t.numel() * t.element_size() for t in (self._rk, self._rv) if t is not None)

    def constant_bytes(self) -> int:
        return self.key_codec.constant_bytes() + self.value_codec.constant_bytes()

    def reset(self) -> None:
        self._k = self._v = None
        self._rk = self._rv = None
        self.cumulative_length = 0
        self.is_initialized = False

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._k, self._v = (None if p is None else p.map(fn) for p in (self._k, self._v))
        self._rk, self._rv = (None if t is None else fn(t) for t in (self._rk, self._rv))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("QuantizedKVLayer.crop takes the negative number of tokens to remove.")
        drop = -tokens_to_remove
        in_window = 0 if self._rk is None else min(drop, self._rk.shape[-2])
        if in_window:
            self._rk, self._rv = (
                self._rk[..., : self._rk.shape[-2] - in_window, :],
                self._rv[..., : self._rv.shape[-2] - in_window, :],
            )
        rest = drop - in_window
        if rest and self._k is not None:
            keep = self._k.data.shape[2] - rest
            self._k, self._v = self._k.map(lambda t: t[:, :, :keep]), self._v.map(lambda t: t[:, :, :keep])  # type: ignore[union-attr]
        self.cumulative_length = max(0, self.cumulative_length - drop)

    def offload(self) -> None:  # offloading a packed cache is not supported; keep it where it is
        return None

    def prefetch(self) -> None:
        return None


def make_cache(layers: list[Any]) -> Any:
    """A transformers ``Cache`` over ``layers`` (QuantizedKVLayer or plain DynamicLayer)."""
    from transformers.cache_utils import Cache

    class QuantizedKVCache(Cache):
        """mmsdk's quantized KV cache: packed layers, counted by :func:`cache_bytes`."""

        def nbytes(self) -> int:
            return cache_bytes(self)

    return QuantizedKVCache(layers=layers)


def cache_bytes(cache: Any) -> int:
    """Bytes a cache holds in K/V: packed layers count their codes and scales, others their tensors."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, QuantizedKVLayer):
            total += layer.nbytes()
        elif getattr(layer, "is_initialized", False) and layer.keys is not None:
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return total
