"""Identity keys for tensors, safe under ``torch.inference_mode``, and whether a CUDA graph is being captured (shared
by memoizing modules)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["being_captured", "version_of", "storage_key"]


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter; 0 for inference tensors, which have none.

    Inference tensors cannot be changed in place outside inference mode, and the modules that memo
    on them (cross-attention K/V of image states) always receive freshly allocated states, so a
    fixed version is safe there.
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
