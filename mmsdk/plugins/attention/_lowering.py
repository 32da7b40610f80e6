"""Lowering descriptions that built-in passes answer ``mmsdk_lower`` with.

For ``onnxruntime`` a pass's module lowers to one or more ONNX nodes (:class:`OnnxLowering`):
op type, domain, attributes, and the role of each input/output, so the exporter can wire them
to the tensors its graph already has. For ``tensorrt_llm`` a module lowers to the tensors
TensorRT-LLM's own layers take (a name -> array mapping), or to configuration when the engine
builds the fused kernel itself. Backends document what they accept; these are plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["OnnxNode", "OnnxLowering", "TrtLlmLowering"]


@dataclass(frozen=True)
class OnnxNode:
    """One ONNX node: ``inputs``/``outputs`` name roles (the exporter maps roles to graph values)."""

    op_type: str
    domain: str = ""
    attributes: Mapping[str, Any] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    initializers: Mapping[str, Any] = field(default_factory=dict)  # role -> tensor for constant inputs


@dataclass(frozen=True)
class OnnxLowering:
    """How a module becomes ONNX nodes (in order), with a note for anything the exporter must know."""

    nodes: tuple[OnnxNode, ...]
    note: str = ""


@dataclass(frozen=True)
class TrtLlmLowering:
    """What TensorRT-LLM needs for a module: tensors by name and/or config entries for its builder."""

    tensors: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""
