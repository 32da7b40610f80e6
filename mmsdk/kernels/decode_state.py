"""What fast generate keeps on a model between ``generate()`` calls: static cache, step buffers, CUDA graph.

Building a static cache, warming the decode step up and capturing its CUDA graph costs tens of
milliseconds, on every call. A later call whose shapes fit reuses them instead: the cache is reset
in place and the step's inputs are refilled with ``copy_`` / ``fill_``, because a graph replays the
addresses it captured, so those tensors must never be reallocated. Before its prefill, a call
compares with the kept state:

* a key of plain values (batch, token dtype, device, end/pad tokens, attention implementation, graphs);
* a :class:`Watch` of what the cache was built for (the KV-cache pass's state, the embedding weight,
  whose dtype and storage change when the model is converted or moved);
* the cache capacity (:func:`fits`).

After its prefill (and the model's forward for the first decode token, stopped where the language
model would run) it compares with the kept step: the :func:`signature` of the arguments the language
model receives, and a :class:`Watch` of every module of the language model, embedding and LM head
with its forward overrides, hooks, parameters and buffers (a pass that replaced a module, or a
``.to()`` that moved a weight, stales a graph).

A difference before the prefill drops the kept state (first, so its memory can serve the new one)
and builds a new one; a difference in the step builds and captures the step again, in the
kept cache. :func:`release` frees everything on request. The state lives in the model's ``__dict__``: nothing is kept
at module level.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mmsdk.kernels.step_projections import StepProjections

__all__ = ["ATTRIBUTE", "CAPACITY_STEP", "DecodeState", "Step", "Watch", "cache_objects", "capacity_for", "fits",
           "keep", "kept", "release", "signature", "step_objects", "watched_objects"]

ATTRIBUTE = "_mmsdk_fast_generate_state"
# capacities are rounded up to whole steps, so prompts of slightly different lengths share one cache
CAPACITY_STEP = 256
# transformers' StaticCache attends over its whole capacity (masked): a kept cache more than this many
# times larger than a call needs (rounded) costs more per step than rebuilding it once
CAPACITY_SLACK = 2


def capacity_for(needed: int) -> int:
    """Tokens a new cache holds for a call that needs ``needed``: rounded up to :data:`CAPACITY_STEP`."""
    return -(-needed // CAPACITY_STEP) * CAPACITY_STEP


def fits(capacity: int, needed: int) -> bool:
    """True when a kept cache of ``capacity`` tokens serves a call that needs ``needed``."""
    return needed <= capacity <= CAPACITY_SLACK * capacity_for(needed)


def _ref(value: Any) -> Callable[[], Any]:
    """A weak reference where the type allows one (a strong one otherwise: small callables, None)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def _detail(value: Any) -> Any:
    """What may change on the same object and stale a graph: a tensor's storage, a module's hooks."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr(), value.dtype
    if isinstance(value, nn.Module):
        return tuple(value._forward_pre_hooks), tuple(value._forward_hooks)
    return None


class Watch:
    """Objects a kept cache or captured step depends on, held weakly: was any replaced, moved or re-hooked?

    Weak references: the kept state must not keep a replaced module's weights alive, and an object
    that died cannot be confused with a new one at the same address.
    """

    def __init__(self, objects: list[Any]) -> None:
        self._refs = [(_ref(o), _detail(o)) for o in objects]

    def matches(self, objects: list[Any]) -> bool:
        """True when ``objects`` are the watched ones, in order, with the same storages and hooks."""
        return len(objects) == len(self._refs) and all(
            ref() is o and detail == _detail(o) for (ref, detail), o in zip(self._refs, objects, strict=True)
        )


def signature(seen: dict[str, Any]) -> tuple[Any, ...]:
    """What a captured step depends on in the language model's decode-step arguments, besides their values.

    Tensors by shape, dtype and device (their values are copied in on reuse); plain values by value;
    other objects (the cache) by identity, which the kept step holds so the id cannot be reused.
    """
    parts: list[Any] = []
    for name, value in sorted(seen.items()):
        if isinstance(value, torch.Tensor):
            parts.append((name, tuple(value.shape), value.dtype, str(value.device)))
        elif value is None or isinstance(value, (bool, int, float, str)):
            parts.append((name, type(value).__name__, value))
        else:
            parts.append((name, "object", id(value)))
    return tuple(parts)


@dataclass(eq=False)
class Step:
    """A decode step's input/output buffers and how to run it (a graph replay, or the eager step)."""

    signature: tuple[Any, ...]
    watch: Watch  # the modules and tensors the captured step reads
    token: torch.Tensor  # [B] last token
    index: torch.Tensor  # [1] column of ``tokens`` the step writes
    positions: torch.Tensor  # the language model's position_ids for the step
    fixed: dict[str, Any]  # other language-model arguments (the cache, flags, per-call tensors)
    replay: Callable[[], None]
    occurred: torch.Tensor | None = None  # [B, V + 1] ids the sequence holds so far (a repetition penalty's)
    # the eager step, kept after ``replay`` became a graph's: a CUDA graph holds none of the tensors it reads, so the
    # ones only the step's body refers to (IDEFICS's mask over the cache's slots, sampling and penalty settings) would
    # otherwise be freed and their memory handed to later allocations that the replays then read
    body: Callable[[], None] | None = None
    # the model's input memos (mmsdk.plugins.tensor_keys.InputMemo): a refill writes new values into the tensors an
    # eager step hands them, keeping their storage keys, so the refill clears them
    memos: tuple[Any, ...] = ()
    # image K/V products the steps read instead of projecting the image states at every token (IDEFICS), refreshed
    # by a refill (mmsdk.kernels.step_projections.StepProjections)
    projections: StepProjections = field(default_factory=lambda: StepProjections([]))


@dataclass(eq=False)
class DecodeState:
    """A model's kept static cache and decode buffers; ``step`` is set once a step was captured."""

    key: tuple[Any, ...]
    watch: Watch  # what the cache was built for (the KV-cache pass's state, the model's dtype and device)
    capacity: int
    cache: Any
    tokens: torch.Tensor  # [B, capacity] new tokens of the call (pad after the end)
    finished: torch.Tensor  # [B] rows that produced an end token
    eos: torch.Tensor
    pad: int
    step: Step | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # a copied model starts without one (a CUDA graph cannot be copied)


def kept(model: nn.Module) -> DecodeState | None:
    """The decode state kept on ``model``, if any."""
    return model.__dict__.get(ATTRIBUTE)


def keep(model: nn.Module, state: DecodeState) -> None:
    """Keep ``state`` on ``model`` for later calls."""
    model.__dict__[ATTRIBUTE] = state


def release(model: nn.Module) -> None:
    """Free what fast generate keeps on ``model`` between calls (static cache, buffers, CUDA graph).

    The memory returns to PyTorch's allocator (``torch.cuda.empty_cache()`` hands it back to the
    device); the next ``generate()`` call builds and captures again.
    """
    model.__dict__.pop(ATTRIBUTE, None)


def watched_objects(kv_state: Any, modules: Iterable[nn.Module], override_attrs: tuple[str, ...]) -> list[Any]:
    """The KV state, then every module under ``modules`` with its forward overrides, parameters and buffers."""
    objects: list[Any] = [kv_state]
    for root in modules:
        for module in root.modules():
            objects.append(module)
            objects.extend(module.__dict__[a] for a in override_attrs if a in module.__dict__)
            objects.extend(t for t in module._parameters.values() if t is not None)
            objects.extend(t for t in module._buffers.values() if t is not None)
    return objects


def cache_objects(model: nn.Module) -> list[Any]:
    """What a kept cache was built for: the KV-cache pass's state, and the embedding weight (its dtype and device)."""
    from mmsdk.plugins.quantizers.kv_runtime import installed_state

    return [installed_state(model), getattr(model.get_input_embeddings(), "weight", None)]


def step_objects(model: nn.Module, adapter: Any, cache: Any) -> list[Any]:
    """What a captured decode step reads: the KV-cache pass's state, the embedding, language model and LM head, and
    the image K/V ``cache`` holds for cross-attention layers (a prefill that had to allocate them anew stales it)."""
    from mmsdk.kernels.cross_attention_decode import image_tensors
    from mmsdk.plugins._forward import BODY_ATTR
    from mmsdk.plugins.quantizers.kv_runtime import installed_state

    modules = (adapter.language_model(model), model.get_input_embeddings(), adapter.lm_head(model))
    return watched_objects(installed_state(model), modules, ("forward", BODY_ATTR)) + image_tensors(cache)
