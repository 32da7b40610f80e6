"""What the ``mmsdk_lower`` hook answers for the ``onnxruntime`` backend, and how linears are read.

A plugin whose pass introduces a module type teaches this backend to emit it by answering
``mmsdk_lower(module, target)`` for ``target.backend == "onnxruntime"`` with one of:

* :class:`DenseWeights` or :class:`NBitsWeights`, for modules that act as a linear layer
  (``y = x @ W.T + b``); NBits weights are copied as they are into ``com.microsoft::MatMulNBits``;
* an :class:`OrtEmitter`: an object with ``emit(graph, inputs) -> list[str]`` that adds the nodes
  itself through :class:`~mmsdk.plugins.backends.onnxruntime.graph.GraphBuilder`;
* :class:`Traceable`, for modules inside the traced vision graph whose torch code the exporter can
  trace as it is.

The backend asks before anything is written; a module nobody answers for is an ExportError
naming the module and the pass that made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from mmsdk.core.errors import ExportError

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.backend import LowerTarget
    from mmsdk.core.session import Session
    from mmsdk.plugins.backends.onnxruntime.graph import GraphBuilder

__all__ = [
    "DenseWeights",
    "NBitsWeights",
    "OrtEmitter",
    "Traceable",
    "LinearWeights",
    "linear_weights",
    "concat_rows",
]


@dataclass(frozen=True)
class DenseWeights:
    """A float linear: ``weight`` [out, in] as torch stores it, optional ``bias`` [out]."""

    weight: np.ndarray
    bias: np.ndarray | None = None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])


@dataclass(frozen=True)
class NBitsWeights:
    """Block-quantized weights in MatMulNBits' layout (ORT contrib op spec, section 1.1).

    ``packed`` uint8 [out, blocks, block_size * bits / 8] (low bits first along ``in``), ``scales``
    float [out, blocks], optional ``zero_points`` (uint8 packed [out, ceil(blocks * bits / 8)] or
    float [out, blocks]; absent means 2^(bits-1)), dequantized as ``(q - zero_point) * scale``.
    ``prequant`` [in] multiplies the input first (AWQ's per-input-channel scale, ``1 / s``).
    """

    packed: np.ndarray
    scales: np.ndarray
    in_features: int
    bits: int = 4
    block_size: int = 32
    zero_points: np.ndarray | None = None
    bias: np.ndarray | None = None
    prequant: np.ndarray | None = None

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[0])


LinearWeights = DenseWeights | NBitsWeights


@runtime_checkable
class OrtEmitter(Protocol):
    """Emits a module's ONNX nodes itself: ``emit(graph, inputs)`` returns the output value names."""

    def emit(self, graph: GraphBuilder, inputs: list[str]) -> list[str]: ...


@dataclass(frozen=True)
class Traceable:
    """The module's torch code exports as it is (vision graph only)."""

    reason: str = ""


def linear_weights(module: nn.Module, session: Session, target: LowerTarget, where: str) -> LinearWeights:
    """The weights of a linear-like ``module``: nn.Linear natively, anything else through ``mmsdk_lower``."""
    native = _native_linear(module)
    if native is not None:
        return native
    answer = session.lower(module, target)
    if isinstance(answer, (DenseWeights, NBitsWeights)):
        return answer
    raise ExportError(
        f"the onnxruntime backend cannot emit {where} ({type(module).__name__}) as a linear layer: "
        f"no plugin answered mmsdk_lower for it with DenseWeights or NBitsWeights (got {type(answer).__name__}).",
        fix="drop the pass that introduced this module, export to the 'torch' backend, or have its plugin "
        "implement mmsdk_lower for target.backend == 'onnxruntime' (docs/onnxruntime.md, 'Lowering').",
    )


def _native_linear(module: Any) -> DenseWeights | None:
    """nn.Linear, or a Linear subclass that only appends rows from an ``additional_fc`` (IDEFICS's head)."""
    from torch import nn

    if not isinstance(module, nn.Linear):
        return None
    extra = getattr(module, "additional_fc", None)
    plain = type(module).forward is nn.Linear.forward
    if not plain and not hasattr(module, "out_additional_features"):
        return None  # a subclass with its own forward: ask the plugins
    parts = [module] + ([extra] if isinstance(extra, nn.Linear) else [])
    weight = np.concatenate([p.weight.detach().float().cpu().numpy() for p in parts])
    biases = [None if p.bias is None else p.bias.detach().float().cpu().numpy() for p in parts]
    return DenseWeights(weight, _concat_bias(biases, [p.out_features for p in parts]))


def concat_rows(parts: list[LinearWeights], where: str) -> LinearWeights | None:
    """One linear computing ``parts`` side by side (q|k|v, gate|up): their rows stacked.

    None when they cannot share one matmul (different AWQ input scales); the caller emits them apart.
    """
    if all(isinstance(p, DenseWeights) for p in parts):
        dense = [p for p in parts if isinstance(p, DenseWeights)]
        bias = _concat_bias([p.bias for p in dense], [p.out_features for p in dense])
        return DenseWeights(np.concatenate([p.weight for p in dense]), bias)
    nbits = [p for p in parts if isinstance(p, NBitsWeights)]
    first = nbits[0] if nbits else None
    same = first is not None and len(nbits) == len(parts) and all(
        (p.bits, p.block_size, p.in_features, p.zero_points is None, p.scales.dtype)
        == (first.bits, first.block_size, first.in_features, first.zero_points is None, first.scales.dtype)
        for p in nbits
    )
    if not same or first is None:
        raise ExportError(
            f"{where}: the projections to fuse mix quantized and float weights or differ in bits / block size, "
            "so they cannot share one MatMulNBits.",
            fix="quantize all of q/k/v (and gate/up) with one config, or leave them all in float.",
        )
    prequants = [p.prequant for p in nbits]
    if any(q is None for q in prequants) != all(q is None for q in prequants) or (
            first.prequant is not None and not all(np.array_equal(q, first.prequant) for q in prequants)):
        return None
    zeros = None if first.zero_points is None else np.concatenate([p.zero_points for p in nbits])  # type: ignore[misc]
    bias = _concat_bias([p.bias for p in nbits], [p.out_features for p in nbits])
    return NBitsWeights(np.concatenate([p.packed for p in nbits]), np.concatenate([p.scales for p in nbits]),
                        first.in_features, first.bits, first.block_size, zeros, bias, first.prequant)


def _concat_bias(biases: list[np.ndarray | None], sizes: list[int]) -> np.ndarray | None:
    if all(b is None for b in biases):
        return None
    return np.concatenate([b if b is not None else np.zeros(n, np.float32) for b, n in zip(biases, sizes)])


def nbits_from_packed(module: Any) -> NBitsWeights | None:
    """NBitsWeights of a module exposing ``packed()`` in MatMulNBits layout (mmsdk's INT4 linear), else None.

    ``packed()`` returns an object with ``qweight`` [N, blocks, block/2] uint8, ``scales`` [N, blocks],
    ``zero_points`` (packed uint8 or None), ``in_features`` and ``block_size``; the module may hold
    ``bias`` and ``prequant``. The bytes are copied as they are: no re-quantization.
    """
    packed_fn = getattr(module, "packed", None)
    if not callable(packed_fn):
        return None
    packed = packed_fn()
    if not all(hasattr(packed, a) for a in ("qweight", "scales", "zero_points", "in_features", "block_size")):
        return None

    def arr(t: Any) -> np.ndarray | None:
        return None if t is None else t.detach().cpu().numpy()

    scales = packed.scales.detach().float().cpu().numpy()
    prequant = getattr(module, "prequant", None)
    bias = getattr(module, "bias", None)
    return NBitsWeights(arr(packed.qweight), scales, int(packed.in_features), 4, int(packed.block_size),
                        arr(packed.zero_points), None if bias is None else bias.detach().float().cpu().numpy(),
                        None if prequant is None else prequant.detach().float().cpu().numpy())
