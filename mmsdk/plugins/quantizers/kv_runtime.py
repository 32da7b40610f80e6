"""Wiring a quantized KV cache into a model: ``generate()`` gets it without extra user code.

``install(model, state)`` attaches a :class:`KVQuantState` to the model and overrides, on that
instance only, ``_prepare_cache_for_generation``: it lets transformers prepare its cache as usual,
then swaps the default ``DynamicCache`` it created for mmsdk's quantized cache. A cache the user
passes in is left alone. ``model._mmsdk_kv.new_cache()`` gives one for manual forward calls.

On CUDA, with static scales, generation gets a
:class:`~mmsdk.plugins.quantizers.static_kv.PackedStaticLayer` cache instead (buffers sized for the
whole generation; Mllama's cross-attention layers get a
:class:`~mmsdk.plugins.quantizers.packed_image_kv.PackedImageLayer` sized by the image) and the decoder's
attention implementation is wrapped so that decode steps run the packed-KV Triton kernel; on CPU nothing
changes. A model that recomputes its image K/V (IDEFICS) gets that cache through fast generate only;
transformers' own loop keeps the dequantizing cache for it.

Cross-attention K/V that the model recomputes at every step (IDEFICS passes no cache to those
layers) are computed once per image instead: the K and V projections of each such block answer
repeated calls on the same vision states from a packed copy (:class:`CrossKVMemo`). Fast generate's decode steps
read products their first step kept instead (mmsdk.kernels.step_projections), refreshed once per call; a CUDA graph
captured elsewhere projects and rounds them at every replay.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mmsdk.plugins.quantizers.quantized_cache import DynamicCodec, Packed, QuantizedKVLayer, StaticCodec, make_cache
from mmsdk.plugins.tensor_keys import InputMemo, being_captured, storage_key

__all__ = ["CrossKVMemo", "KVQuantState", "LayerRanges", "install", "installed_state", "kv_bytes"]

ATTRIBUTE = "_mmsdk_kv"
QMAX = {"int4": 7.0, "int8": 127.0, "fp8": 448.0}


@dataclass
class LayerRanges:
    """Calibrated |K| / |V| maxima of one layer, ``[heads, head_dim]`` (None in dynamic mode)."""

    kind: str  # "self", "cross" or "recomputed"
    k_amax: torch.Tensor | None = None
    v_amax: torch.Tensor | None = None


@dataclass
class KVQuantState:
    """How a model's KV cache is quantized: format, scale mode and per-layer ranges."""

    fmt: str
    scales: str
    num_layers: int
    head_dim: int
    group_size: int
    residual_length: int
    key_granularity: str = "channel"
    value_granularity: str = "channel"
    cross_attention: bool = True
    exact_prefill: bool = False
    layers: dict[int, LayerRanges] = field(default_factory=dict)  # cache layers, by index
    recomputed: dict[int, LayerRanges] = field(default_factory=dict)  # cross blocks, by block index
    memos: list[CrossKVMemo] = field(default_factory=list)
    recomputes_image_kv: bool = False  # set by install: the model projects its image K/V again at every step
    attention_config: Any = None  # the decoder's config, whose attention implementation the packed path wraps

    def codec(self, amax: torch.Tensor | None, granularity: str) -> Any:
        """The codec for one of K/V: static from ``amax``, or per-token dynamic."""
        if self.scales == "dynamic" or amax is None:
            return DynamicCodec(self.fmt, self.group_size)
        if granularity == "tensor":
            amax = amax.max().reshape(1, 1)
        scale = torch.where(amax > 0, amax.float() / QMAX[self.fmt], torch.ones_like(amax.float()))
        return StaticCodec(self.fmt, scale)

    def layer(self, index: int) -> Any:
        """A fresh cache layer for decoder layer ``index``."""
        from transformers.cache_utils import DynamicLayer

        ranges = self.layers.get(index, LayerRanges("self"))
        if ranges.kind == "cross" and not self.cross_attention:
            return DynamicLayer()
        residual = self.residual_length if (self.scales == "dynamic" and ranges.kind == "self") else 0
        return QuantizedKVLayer(
            self.codec(ranges.k_amax, self.key_granularity),
            self.codec(ranges.v_amax, self.value_granularity),
            residual,
            self.exact_prefill,
        )

    def new_cache(self) -> Any:
        """An empty quantized cache for one generation (also clears the cross-attention memos)."""
        for memo in self.memos:
            memo.clear()
        return make_cache([self.layer(i) for i in range(self.num_layers)])

    def packed_decode_reason(self, device: torch.device) -> str | None:
        """Why generation on ``device`` cannot use the packed static cache and kernel (None when it can)."""
        from mmsdk.kernels import triton_available

        if device.type != "cuda" or not triton_available():
            return "not on CUDA or no Triton"
        if self.scales != "static" or self.exact_prefill:
            return "dynamic scales or exact prefill attention"
        unranged = [i for i in range(self.num_layers) if self._packs(i) and not self._kernel_reads(i)]
        if unranged:
            return (f"cache layers {unranged[:4]} have no calibrated K/V range (calibration prompts never reached "
                    "them)")
        base = getattr(self.attention_config, "_attn_implementation", None)
        if base is None or not (base.startswith("mmsdk_packed_kv_") or base in ("sdpa", "eager")):
            return f"attention implementation {base!r} (sdpa or eager can be wrapped)"
        return None

    def _packs(self, index: int) -> bool:
        """Whether :meth:`static_cache` stores cache layer ``index`` packed (cross-attention K/V only if quantized)."""
        return self.layers.get(index, LayerRanges("self")).kind != "cross" or self.cross_attention

    def _kernel_reads(self, index: int) -> bool:
        """Whether the packed kernel reads cache layer ``index``'s codes as the dequantizing layer does (static
        scales from calibrated ranges; a layer calibration never reached has none)."""
        from mmsdk.plugins.quantizers.static_kv import fused_supported

        ranges = self.layers.get(index, LayerRanges("self"))
        return fused_supported(self.codec(ranges.k_amax, self.key_granularity),
                               self.codec(ranges.v_amax, self.value_granularity), self.exact_prefill)

    def static_cache(self, max_cache_len: int, *, fused: bool) -> Any:
        """A packed cache with buffers for ``max_cache_len`` tokens; ``fused`` decode steps run the packed kernel.

        A cross-attention layer whose image K/V the model caches (Mllama) gets buffers sized by its image's tokens
        (:class:`PackedImageLayer`), or full-precision ones with ``cross_attention=False``.
        """
        from mmsdk.kernels.cross_attention_decode import ImageKVLayer
        from mmsdk.plugins.quantizers.packed_image_kv import PackedImageLayer
        from mmsdk.plugins.quantizers.static_kv import PackedStaticLayer

        if fused:
            from mmsdk.kernels.grouped_decode import set_own_attention
            from mmsdk.kernels.kv_decode import attention_implementation

            set_own_attention(self.attention_config,
                              attention_implementation(self.attention_config._attn_implementation))
        layers = []
        for index in range(self.num_layers):
            ranges = self.layers.get(index, LayerRanges("self"))
            if ranges.kind == "cross" and not self.cross_attention:
                layers.append(ImageKVLayer())
                continue
            keys = self.codec(ranges.k_amax, self.key_granularity)
            values = self.codec(ranges.v_amax, self.value_granularity)
            if ranges.kind == "cross":
                layers.append(PackedImageLayer(keys, values, fused))
            else:
                layers.append(PackedStaticLayer(keys, values, max_cache_len, fused))
        return make_cache(layers)

    def generation_cache(self, device: torch.device, max_cache_len: int) -> Any:
        """The cache generate() gets: packed static with the kernel where possible, else :meth:`new_cache`."""
        from mmsdk.kernels import note_fallback

        reason = self.packed_decode_reason(device)
        if reason is None and self.recomputes_image_kv:
            # fast generate runs such models over the packed cache (tests/test_fast_generate.py); transformers' own
            # loop (beams, padded batches) over it has not been checked on a GPU, so it keeps the dequantizing cache
            reason = "transformers' loop on a model that recomputes its cross-attention K/V (IDEFICS)"
        if reason is None:
            return self.static_cache(max_cache_len, fused=True)
        note_fallback("packed KV decode attention", reason)
        return self.new_cache()


class CrossKVMemo(InputMemo):
    """Stands in for a cross-attention K or V projection's forward: computes once per vision state, stores packed."""

    def __init__(self, module: nn.Module, codec: Any, head_dim: int, exact_first: bool = False) -> None:
        self.original = module.forward
        self.codec, self.head_dim, self.exact_first = codec, head_dim, exact_first
        self._input: torch.Tensor | None = None
        self._key: tuple[Any, ...] | None = None
        self._packed: Packed | None = None
        self._dtype = torch.float32
        self.computed = 0  # how many times the projection really ran (once per image set)

    @staticmethod
    def _key_of(x: torch.Tensor) -> tuple[Any, ...]:
        return storage_key(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if being_captured(x):
            # a captured decode step (fast generate) replays with each call's image states copied into its inputs:
            # it must project and round them itself, not keep this call's stored codes, which the next image replaces
            # (the same codes the memo would hold: encode then decode, as on a hit)
            y = self.original(x)
            return self._decoded(self._encoded(y), y.dtype)
        key = self._key_of(x)
        # Holding the input keeps its storage alive, so an equal key can only mean the same data.
        if self._packed is None or key != self._key:
            y = self.original(x)
            self.computed += 1
            self._packed = self._encoded(y)
            self._input, self._key, self._dtype = x, key, y.dtype
            if self.exact_first:
                return y
        return self._decoded(self._packed, self._dtype)

    def _encoded(self, y: torch.Tensor) -> Packed:
        """The projection's output ``[B, T, H * D]`` as codes of ``[B, H, T, D]``."""
        b, t, _ = y.shape
        return self.codec.encode(y.reshape(b, t, -1, self.head_dim).transpose(1, 2))

    def _decoded(self, packed: Packed, dtype: torch.dtype) -> torch.Tensor:
        """Codes back in the projection's layout, ``[B, T, H * D]``."""
        return self.codec.decode(packed, dtype, self.head_dim).transpose(1, 2).flatten(2)

    def clear(self) -> None:
        self._input = self._key = self._packed = None

    @property
    def holding(self) -> bool:
        return self._packed is not None

    def rebind(self, module: nn.Module) -> None:
        """Move onto ``module``, which replaced the projection (a weight quantizer swapped the layer)."""
        self.original = module.forward
        module.forward = self
        self.clear()

    def nbytes(self) -> int:
        return 0 if self._packed is None else self._packed.nbytes()


def _prepare_cache_for_generation(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Let transformers prepare its cache, then replace its default DynamicCache with the quantized one."""
    from transformers import DynamicCache

    original = type(self)._prepare_cache_for_generation
    result = original(self, *args, **kwargs)
    arguments = inspect.signature(original).bind(self, *args, **kwargs).arguments
    model_kwargs = arguments["model_kwargs"]
    state: KVQuantState = getattr(self, ATTRIBUTE)
    device = next(self.parameters()).device
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        if type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False):
            max_length = arguments.get("max_cache_length")
            if device.type == "cuda" and isinstance(max_length, int) and max_length > 0:
                model_kwargs[name] = state.generation_cache(device, max_length)
            else:
                model_kwargs[name] = state.new_cache()
    return result


def install(model: nn.Module, state: KVQuantState, adapter: Any) -> None:
    """Attach ``state`` to ``model``: generate() then uses the quantized cache; recomputed cross K/V are memoised."""
    state.attention_config = adapter.text_config(model)
    state.recomputes_image_kv = any(not block.kv_cached for block in adapter.cross_attention_blocks(model))
    object.__setattr__(model, ATTRIBUTE, state)
    model._prepare_cache_for_generation = _prepare_cache_for_generation.__get__(model)  # type: ignore[method-assign]
    adapter.install_packed_cache_queries(model)
    if not state.cross_attention:
        return
    for index, block in enumerate(adapter.cross_attention_blocks(model)):
        if block.kv_cached:
            continue
        ranges = state.recomputed.get(index, LayerRanges("recomputed"))
        for attr, amax, granularity in (
            (block.projections.k, ranges.k_amax, state.key_granularity),
            (block.projections.v, ranges.v_amax, state.value_granularity),
        ):
            projection = getattr(block.attention, attr)
            memo = CrossKVMemo(projection, state.codec(amax, granularity), state.head_dim, state.exact_prefill)
            projection.forward = memo
            state.memos.append(memo)


def installed_state(model: nn.Module) -> KVQuantState | None:
    """The KV quantization attached to ``model`` by a KV-cache pass, if any."""
    return getattr(model, ATTRIBUTE, None)


def kv_bytes(cache: Any, model: nn.Module | None = None) -> int:
    """K/V bytes held for a generation: the cache's, plus memoised cross-attention K/V of ``model``."""
    from mmsdk.plugins.quantizers.quantized_cache import cache_bytes

    state = installed_state(model) if model is not None else None
    return cache_bytes(cache) + (sum(m.nbytes() for m in state.memos) if state is not None else 0)
