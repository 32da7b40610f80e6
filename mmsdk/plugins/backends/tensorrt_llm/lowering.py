"""What the TensorRT-LLM backend needs from each linear layer, and how it gets it.

A plain ``nn.Linear`` is read directly. Any other module (an INT4 linear from ``int4-weight``, a
third-party quantized layer) is passed to the ``mmsdk_lower`` hook with
``LowerTarget(backend="tensorrt-llm")``; the plugin that introduced the module answers with a
:class:`DenseLinear` or an :class:`Int4Linear`. Nobody answering is an error naming the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mmsdk.core.backend import LowerTarget
from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.tensorrt_llm.packing import dequantize

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
    if isinstance(module, nn.Linear):  # a Linear subclass nobody claimed: its weight is still a weight
        return DenseLinear(module.weight.detach(), None if module.bias is None else module.bias.detach())
    raise ExportError(
        f"the TensorRT-LLM backend does not know how to write {name} ({type(module).__name__}), and no plugin "
        "answered mmsdk_lower for it.",
        fix="the plugin whose pass introduced this module must implement mmsdk_lower(module, target) for "
        f"target.backend == {BACKEND_NAME!r}, returning DenseLinear or Int4Linear "
        "(mmsdk.plugins.backends.tensorrt_llm.lowering).",
    )
