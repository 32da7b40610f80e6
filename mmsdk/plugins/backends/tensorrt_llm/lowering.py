"""What the TensorRT-LLM backend needs from each linear layer, and how it gets it.

A plain ``nn.Linear`` is read directly. Any other module is first passed to the ``mmsdk_lower``
hook with ``LowerTarget(backend="tensorrt-llm")``, so the plugin that introduced it can answer with
a :class:`DenseLinear` or an :class:`Int4Linear`. Without an answer, a module holding mmsdk's INT4
layout (the ``int4-weight`` pass: ONNX MatMulNBits buffers ``qweight``/``scales`` and optional
``zero_points``/``prequant``, with ``block_size`` and ``in_features``) is converted directly.
Anything else is an error naming the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mmsdk.core.backend import LowerTarget
from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.tensorrt_llm.packing import dequantize, from_matmulnbits

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.session import Session

__all__ = ["BACKEND_NAME", "DenseLinear", "Int4Linear", "LinearWeights", "resolve_linear"]

BACKEND_NAME = "tensorrt-llm"


@dataclass(frozen=True)
class DenseLinear:
    """A full-precision linear: ``y = x @ weight.T + bias``."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def float_weight(self) -> torch.Tensor:
        """The weight in float32."""
        return self.weight.detach().float()


@dataclass(frozen=True)
class Int4Linear:
    """A symmetric group-wise INT4 linear: ``y = (x * pre_quant_scale) @ (q * scales).T + bias``.

    ``q`` holds the signed integer values (int8 [out, in], each in [-8, 7]); ``scales`` is
    [out, in / group_size]. ``pre_quant_scale`` [in] is the AWQ activation multiplier (None = ones).
    """

    q: torch.Tensor
    scales: torch.Tensor
    group_size: int
    pre_quant_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    def prequant(self) -> torch.Tensor:
        """The activation multiplier, ones when the layer has none."""
        if self.pre_quant_scale is None:
            return torch.ones(self.in_features)
        return self.pre_quant_scale.detach().float()

    def float_weight(self) -> torch.Tensor:
        """The effective float32 weight (dequantized, pre-quant scale folded into the columns)."""
        return dequantize(self.q, self.scales) * self.prequant()[None, :]


LinearWeights = DenseLinear | Int4Linear


def resolve_linear(module: nn.Module, name: str, session: Session) -> LinearWeights:
    """The weights of the linear ``module`` (qualified ``name``), asking plugins for non-Linear modules."""
    from torch import nn

    if type(module) is nn.Linear:
        return DenseLinear(module.weight.detach(), None if module.bias is None else module.bias.detach())
    answer = session.lower(module, LowerTarget(backend=BACKEND_NAME))
    if isinstance(answer, (DenseLinear, Int4Linear)):
        return answer
    if _holds_matmulnbits(module):
        return _from_mmsdk_int4(module, name)
    if isinstance(module, nn.Linear):  # a Linear subclass nobody claimed: its weight is still a weight
        return DenseLinear(module.weight.detach(), None if module.bias is None else module.bias.detach())
    raise ExportError(
        f"the TensorRT-LLM backend does not know how to write {name} ({type(module).__name__}), and no plugin "
        "answered mmsdk_lower for it.",
        fix="the plugin whose pass introduced this module must implement mmsdk_lower(module, target) for "
        f"target.backend == {BACKEND_NAME!r}, returning DenseLinear or Int4Linear "
        "(mmsdk.plugins.backends.tensorrt_llm.lowering).",
    )


def _holds_matmulnbits(module: nn.Module) -> bool:
    qweight = getattr(module, "qweight", None)
    return (isinstance(qweight, torch.Tensor) and qweight.dtype == torch.uint8 and qweight.dim() == 3
            and isinstance(getattr(module, "scales", None), torch.Tensor) and hasattr(module, "block_size"))


def _from_mmsdk_int4(module: nn.Module, name: str) -> Int4Linear:
    """mmsdk's INT4 linear (MatMulNBits layout) as TensorRT-LLM's signed values + scales; nothing is re-rounded."""
    in_features, block = int(module.in_features), int(module.block_size)
    if in_features % block:
        raise ExportError(
            f"{name}: in_features {in_features} is not a multiple of its INT4 group size {block} (the weight was "
            "zero-padded along K, which TensorRT-LLM's W4A16_AWQ layout cannot hold).",
            fix="re-run int4-weight with indivisible='skip' (keeps such layers in full precision) for TensorRT-LLM.",
        )
    try:
        q, scales = from_matmulnbits(module.qweight, module.scales, in_features, getattr(module, "zero_points", None))
    except ExportError as err:
        raise ExportError(f"{name}: {err.problem}", fix=err.fix) from err
    bias = getattr(module, "bias", None)
    prequant = getattr(module, "prequant", None)
    return Int4Linear(q=q, scales=scales.detach(), group_size=block,
                      pre_quant_scale=None if prequant is None else prequant.detach(),
                      bias=None if bias is None else bias.detach())
