"""Bytes held by a generation cache, whatever its class.

The protocol: a cache that knows its own size (a quantized cache holding packed codes, scales and a
full-precision residual) defines ``nbytes() -> int``. Any other cache is walked: every tensor reachable
through its attributes, lists, tuples and dicts is counted once per storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from mmsdk.core.memory import tensor_bytes

__all__ = ["cache_bytes", "cache_of", "cache_tensors"]

_MAX_DEPTH = 6


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """Every tensor reachable from ``cache`` (attributes, containers), each object visited once."""
    return list(_walk(cache, set(), 0))


def _walk(value: Any, seen: set[int], depth: int) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
        return
    if depth > _MAX_DEPTH or id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return
    seen.add(id(value))
    if isinstance(value, dict):
        children: Any = value.values()
    elif isinstance(value, (list, tuple, set)):
        children = value
    elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
        children = vars(value).values()
    else:
        return
    for child in children:
        yield from _walk(child, seen, depth + 1)


def cache_bytes(cache: Any) -> int:
    """The cache's own ``nbytes()`` when it has one, else the bytes of every tensor it holds."""
    if cache is None:
        return 0
    own = getattr(cache, "nbytes", None)
    if callable(own):
        return int(own())
    return tensor_bytes(cache_tensors(cache))


def cache_of(output: Any) -> Any:
    """The cache a model forward returned (``cache`` in newer transformers, ``past_key_values`` before)."""
    if not isinstance(output, dict):
        return None
    for key in ("cache", "past_key_values"):
        if output.get(key) is not None:
            return output[key]
    return None
