"""Identity keys for tensors, safe under ``torch.inference_mode``, whether a CUDA graph is being captured, and the
memos that key on them (shared by memoizing modules)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["InputMemo", "being_captured", "input_memos", "storage_key", "version_of"]


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter; 0 for inference tensors, which have none.

    So an inference tensor refilled in place keeps its :func:`storage_key`, and a memo keyed on it would serve the
    product of its old values. Whoever refills a memo's input in place under inference mode clears the memos
    (:func:`input_memos`): fast generate's kept decode step does, when a later call copies its image states into the
    step's own input tensors.
    """
    return 0 if tensor.is_inference() else tensor._version


def storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Where and what a tensor is: storage pointer, offset, shape, stride and version."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
            version_of(tensor))


def being_captured(tensor: torch.Tensor) -> bool:
    """True while ``tensor``'s stream is being captured into a CUDA graph: a memo must not serve a stored product
    there, since a graph replays on inputs refilled in place (fast generate's decode step)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


class InputMemo:
    """A memo of a module's output keyed on its input tensor (:func:`storage_key`), found by :func:`input_memos`."""

    def clear(self) -> None:
        """Forget the stored input and product (the next call computes again)."""
        raise NotImplementedError

    @property
    def holding(self) -> bool:
        """True while a product is stored."""
        raise NotImplementedError


def input_memos(model: nn.Module) -> list[InputMemo]:
    """Every :class:`InputMemo` on ``model``'s modules: set as a module's ``kv_memo`` or standing in for its forward."""
    found: list[InputMemo] = []
    for module in model.modules():
        for candidate in (module.__dict__.get("kv_memo"), module.__dict__.get("forward")):
            if isinstance(candidate, InputMemo) and not any(candidate is memo for memo in found):
                found.append(candidate)
    return found
