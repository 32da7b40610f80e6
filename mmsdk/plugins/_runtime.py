"""Per-model runtime shared by passes that change what a forward call sees.

Token pruning and merging give the language model fewer tokens than ``input_ids`` holds, so
``generate()`` (which keeps the full ids, a full 2-D mask and original positions) must be
translated on every later step. One wrapper around the model's forward records the call in flight
(ids, mask, whether it carries images) and enters the passes' per-call contexts (vision-token
scorers, also around the method that encodes images, which ``generate()`` may call before the
first forward). One wrapper around the language model's forward compacts the sequence on prefill
(``SequenceReducer`` s, positions of the kept tokens, a re-padded mask) and, on decode, rebuilds
the mask and positions for the shorter cache. The cache itself is never touched, so any Cache
subclass (quantized ones included) works. State lives on the runtime object, one per model.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mmsdk.core.errors import UnsupportedInputError
from mmsdk.plugins._forward import add_forward_wrapper
from mmsdk.runtime.compaction import true_runs

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import ImageTokenScorer, ModelAdapter

__all__ = ["ModelRuntime", "SequenceReducer", "cache_of", "installed_runtime", "runtime_of"]

RUNTIME_ATTR = "_mmsdk_runtime"
_IMAGE_INPUTS = ("pixel_values", "pixel_values_videos")


class SequenceReducer(Protocol):
    """Shrinks one image's tokens: ``(embeds [n, D], scores [n] | None) -> (slots [k], values [k, D])``.

    ``slots`` are indices into the n tokens (sorted, unique): each kept token stays at its slot's
    place and position; ``values`` are its new embeddings (merged tokens carry averages).
    """

    name: str

    def __call__(self, embeds: torch.Tensor, scores: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Call:
    """The forward call in flight, as the model's own forward received it."""

    input_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    kwargs: Mapping[str, Any]
    has_images: bool
    query_image_mask: torch.Tensor | None = None  # [B, Lq] of what the language model runs now
    language_mask: torch.Tensor | None = None  # the mask the language model gets (compacted, translated)
    # what a pass computes once per call and every layer reuses (sparse-xattn's text / image masks), by the pass's key
    memo: dict[Any, Any] = field(default_factory=dict)


@dataclass
class Compaction:
    """How a prefill's cache relates to the ids generate() keeps: fewer tokens, original positions."""

    cache: Any  # weakref to the cache the prefill filled
    original_length: int
    mask: torch.Tensor  # [B, kept] 2-D mask of the kept prefill tokens (left padded)
    next_position: torch.Tensor  # [..., B, 1] first position after the prompt, per position row
    image_mask: torch.Tensor  # [B, kept] which kept tokens are image tokens


def cache_of(kwargs: Mapping[str, Any]) -> Any:
    """The cache argument, whichever name this transformers version gives it."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _cache_length(cache: Any) -> int:
    if cache is None:
        return 0
    length = cache.get_seq_length()
    return int(length)


class ModelRuntime:
    """The wrappers' shared state for one model: the call in flight and the cache's compaction."""

    def __init__(self, model: nn.Module, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.image_token_id = adapter.image_tokens(model).image_token_id
        self.inline = adapter.image_tokens(model).mode == "inline"
        self.scorers: list[ImageTokenScorer] = []
        self.pending_scores: list[list[torch.Tensor]] = []  # latest image encoding's, one list per scorer
        self.reducers: list[SequenceReducer] = []
        self.call: Call | None = None
        self.compaction: Compaction | None = None
        self.prefill_image_mask: torch.Tensor | None = None
        self.encoder_call = adapter.image_features_call(model)

    # --- what other passes ask ---------------------------------------------------------------
    def current_scores(self) -> torch.Tensor | None:
        """The image-token scores of the latest image encoding (None if no scorer ran)."""
        scores = [s.reshape(-1) for found in self.pending_scores for s in found]
        return torch.cat(scores) if scores else None

    def encode_images(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the image encoder with every scorer watching; its scores replace the pending ones."""
        call_kwargs = _as_kwargs(original, args, kwargs)
        with ExitStack() as stack:
            # the lists fill while the tower runs, so reducers inside this call already see them
            self.pending_scores = [stack.enter_context(scorer.capture(call_kwargs)) for scorer in self.scorers]
            return original(*args, **kwargs)

    def key_image_mask(self, kv_length: int, batch: int, device: torch.device) -> torch.Tensor:
        """[B, kv_length]: which cached-plus-current keys are image tokens (prefill image slots)."""
        mask = torch.zeros(batch, kv_length, dtype=torch.bool, device=device)
        prefill = self.prefill_image_mask
        if prefill is not None and prefill.shape[0] == batch:
            width = min(kv_length, prefill.shape[1])
            mask[:, :width] = prefill[:, :width].to(device)
        return mask

    # --- the model's forward -----------------------------------------------------------------
    def model_forward(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs = _as_kwargs(original, args, kwargs) if args else kwargs
        if kwargs.get("labels") is not None and self.reducers:
            raise UnsupportedInputError(
                "labels were given, but token pruning/merging changes the sequence length, so no loss can be computed.",
                fix="compute losses on the unoptimized model; use the optimized one for inference.",
            )
        ids = kwargs.get("input_ids")
        pixels = any(kwargs.get(name) is not None for name in _IMAGE_INPUTS)
        if self.inline:  # generate() may have encoded the images already: the placeholders tell
            has_images = ids is not None and bool((ids == self.image_token_id).any())
        else:
            has_images = pixels
        self.call = Call(input_ids=ids, attention_mask=kwargs.get("attention_mask"), kwargs=kwargs,
                         has_images=has_images)
        try:
            if pixels and self.encoder_call is None:
                return self.encode_images(original, **kwargs)
            return original(**kwargs)
        finally:
            self.call = None

    # --- the language model's forward --------------------------------------------------------
    def language_forward(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        call = self.call
        embeds = kwargs.get("inputs_embeds")
        if call is None or not self.inline or embeds is None:
            return original(*args, **kwargs)
        cache = cache_of(kwargs)
        image_mask = self._image_mask(call, embeds)
        if image_mask is not None and bool(image_mask.any()):
            return self._prefill(original, args, kwargs, image_mask, cache)
        comp = self.compaction
        if comp is not None and cache is not None and comp.cache() is cache and _cache_length(cache) > 0:
            self._translate(kwargs, comp, cache, embeds)
        call.query_image_mask = torch.zeros(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        call.language_mask = kwargs.get("attention_mask")
        return original(*args, **kwargs)

    def _image_mask(self, call: Call, embeds: torch.Tensor) -> torch.Tensor | None:
        if not call.has_images:
            return None
        if call.input_ids is None:
            if self.reducers:
                raise UnsupportedInputError(
                    "token pruning/merging needs input_ids to find the image tokens; got inputs_embeds.",
                    fix="pass input_ids and pixel_values (as the processor returns them).",
                )
            return None
        mask = call.input_ids == self.image_token_id
        return mask if mask.shape == embeds.shape[:2] else None

    def _prefill(self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 image_mask: torch.Tensor, cache: Any) -> Any:
        call = self.call
        assert call is not None
        if _cache_length(cache) > 0 and self.reducers:
            raise UnsupportedInputError(
                "images arrived on a call that continues a filled cache; token pruning/merging only handles "
                "images in the first (prefill) call.",
                fix="start generation with the images in the prompt, with an empty cache.",
            )
        embeds = kwargs["inputs_embeds"]
        batch, length = embeds.shape[:2]
        mask2d = _two_d_mask(kwargs.get("attention_mask"), batch, length, embeds.device)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=embeds.device).expand(batch, length)
        if not self.reducers:
            call.query_image_mask = image_mask
            call.language_mask = kwargs.get("attention_mask")
            self.prefill_image_mask = image_mask
            return original(*args, **kwargs)
        plan = _compact(embeds, image_mask, mask2d, positions, self.reducers, self.current_scores())
        kwargs.update(inputs_embeds=plan.embeds, attention_mask=plan.mask, position_ids=plan.positions)
        call.query_image_mask = plan.image_mask
        call.language_mask = plan.mask
        self.prefill_image_mask = plan.image_mask
        output = original(*args, **kwargs)
        filled = cache if cache is not None else _output_cache(output)
        if filled is not None:
            next_position = positions.amax(dim=-1, keepdim=True) + 1
            self.compaction = Compaction(weakref.ref(filled), length, plan.mask, next_position, plan.image_mask)
        return output

    def _translate(self, kwargs: dict[str, Any], comp: Compaction, cache: Any, embeds: torch.Tensor) -> None:
        batch, steps = embeds.shape[:2]
        appended = _cache_length(cache) - comp.mask.shape[1]
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise UnsupportedInputError(
                f"a {mask.dim()}-D attention mask reached a token-pruned model's decode step; it needs the 2-D mask.",
                fix="use a dynamic cache (the default), not a static/compiled one, with token pruning or merging.",
            )
        expected = comp.original_length + appended + steps
        if mask is not None and mask.shape[1] != expected:
            raise UnsupportedInputError(
                f"the decode step's attention mask has {mask.shape[1]} columns; expected {expected} "
                f"({comp.original_length} prompt + {appended + steps} generated).",
                fix="pass the 2-D mask generate() maintains (prompt mask plus one column per new token).",
            )
        tail = mask[:, comp.original_length:] if mask is not None else comp.mask.new_ones(batch, appended + steps)
        kwargs["attention_mask"] = torch.cat([comp.mask.to(tail.device, tail.dtype), tail], dim=1)
        offsets = torch.arange(steps, device=embeds.device) + appended
        positions = comp.next_position.to(embeds.device) + offsets
        incoming = kwargs.get("position_ids")
        if incoming is not None and incoming.dim() == 3 and positions.dim() == 2:
            positions = positions.expand(incoming.shape[0], -1, -1)
        kwargs["position_ids"] = positions


@dataclass
class _Plan:
    embeds: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    image_mask: torch.Tensor


def _as_kwargs(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Positional and keyword arguments of a call to ``function``, all by name."""
    bound = inspect.signature(function).bind_partial(*args, **kwargs).arguments
    extra = bound.pop("kwargs", {})
    return {**bound, **extra}


def _two_d_mask(mask: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(batch, length, dtype=torch.long, device=device)
    if mask.dim() != 2:
        raise UnsupportedInputError(
            f"token pruning/merging needs a 2-D attention mask at prefill; got {mask.dim()}-D.",
            fix="pass the processor's 2-D attention_mask (or none) and a dynamic cache.",
        )
    return mask


def _reduce_run(embeds: torch.Tensor, scores: torch.Tensor | None,
                reducers: list[SequenceReducer]) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.arange(embeds.shape[0], device=embeds.device)
    for reducer in reducers:
        picked, embeds = reducer(embeds, scores)
        slots = slots[picked]
        scores = scores[picked] if scores is not None else None
    return slots, embeds


def _compact(embeds: torch.Tensor, image_mask: torch.Tensor, mask2d: torch.Tensor, positions: torch.Tensor,
             reducers: list[SequenceReducer], scores: torch.Tensor | None) -> _Plan:
    """Apply the reducers to every image run of every row, then left-pad the rows to one length."""
    batch, length = image_mask.shape
    total = int(image_mask.sum())
    if scores is not None and scores.numel() != total:
        raise UnsupportedInputError(
            f"the vision tower scored {scores.numel()} tokens but the prompt holds {total} image tokens "
            "(video inputs, or images the scorer did not see).",
            fix="use token pruning with images only, one placeholder per image.",
        )
    rows, values, offset = [], [], 0
    for b in range(batch):
        keep = torch.ones(length, dtype=torch.bool, device=embeds.device)
        row = embeds[b].clone()
        for start, end in true_runs(image_mask[b].tolist()):
            run_scores = scores[offset: offset + end - start] if scores is not None else None
            offset += end - start
            slots, merged = _reduce_run(embeds[b, start:end], run_scores, reducers)
            keep[start:end] = False
            keep[start + slots] = True
            row[start + slots] = merged.to(row.dtype)
        rows.append(keep.nonzero().squeeze(1))
        values.append(row)
    width = max(len(r) for r in rows)
    index = torch.stack([torch.cat([r.new_zeros(width - len(r)), r]) for r in rows])  # left pad with slot 0
    valid = torch.stack([torch.arange(width, device=embeds.device) >= width - len(r) for r in rows])
    gathered = torch.stack(values).gather(1, index[..., None].expand(-1, -1, embeds.shape[-1]))
    new_mask = mask2d.gather(1, index) * valid.to(mask2d.dtype)
    pos_index = index.expand(*positions.shape[:-2], batch, width) if positions.dim() == 3 else index
    new_positions = positions.expand(*positions.shape[:-2], batch, length).gather(-1, pos_index)
    new_image = image_mask.gather(1, index) & valid
    return _Plan(gathered * valid[..., None].to(gathered.dtype), new_mask, new_positions, new_image)


def _output_cache(output: Any) -> Any:
    for name in ("cache", "past_key_values"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    return None


def installed_runtime(model: nn.Module) -> ModelRuntime | None:
    """The model's runtime if a pass installed one, else None (never installs; for exporters)."""
    return model.__dict__.get(RUNTIME_ATTR)


def runtime_of(model: nn.Module, adapter: ModelAdapter) -> ModelRuntime:
    """The model's runtime, installing the two forward wrappers the first time it is asked for."""
    existing = model.__dict__.get(RUNTIME_ATTR)
    if existing is not None:
        return existing
    runtime = ModelRuntime(model, adapter)
    object.__setattr__(model, RUNTIME_ATTR, runtime)
    add_forward_wrapper(model, runtime.model_forward)
    if runtime.encoder_call is not None:
        _wrap_method(*runtime.encoder_call, runtime.encode_images)
    if runtime.inline:
        add_forward_wrapper(adapter.language_model(model), runtime.language_forward)
    return runtime


def _wrap_method(owner: Any, name: str, handler: Callable[..., Any]) -> None:
    """Replace ``owner.name`` (a bound method) by one calling ``handler(original, ...)``; same signature."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return handler(original, *args, **kwargs)

    setattr(owner, name, wrapper)
