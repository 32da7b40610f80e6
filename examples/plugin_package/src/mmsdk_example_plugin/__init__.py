"""``bf16-weights``: keep chosen components' linear weights in bfloat16, compute in the input dtype."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

import mmsdk
from mmsdk import PassConfig, PassContext, PassSpec

Component = Literal["vision_tower", "projector", "language_model", "lm_head"]


class Bf16WeightsConfig(PassConfig):
    """Which components store their linear weights in bfloat16."""

    components: tuple[Component, ...] = Field(("vision_tower",), min_length=1,
                                              description="Model parts whose nn.Linear weights become bf16.")


class Bf16Linear(nn.Module):
    """A linear layer whose weight is stored in bfloat16 and upcast to the input dtype per call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


def apply_bf16_weights(model: nn.Module, config: Bf16WeightsConfig, context: PassContext) -> dict[str, Any]:
    """Swap every nn.Linear of the chosen components for a Bf16Linear."""
    owners = context.adapter.component_map(model)
    converted = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and owners.get(full) in config.components:
                setattr(module, child_name, Bf16Linear(child))
                converted.append(full)
    return {"converted": len(converted)}


@mmsdk.hookimpl
def mmsdk_register_quantizers(register: Any) -> None:
    register(PassSpec(name="bf16-weights", config_cls=Bf16WeightsConfig, apply=apply_bf16_weights,
                      summary="store chosen components' linear weights in bfloat16 (example plugin)"))
