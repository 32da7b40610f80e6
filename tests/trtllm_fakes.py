"""Stand-ins for the INT4 weight and KV-cache quantizers, used by the TensorRT-LLM tests.

``FakeInt4Linear`` stores a symmetric group-wise INT4 weight with the buffers of mmsdk's INT4 linear
(ONNX MatMulNBits layout: ``qweight`` uint8 [N, K/b, b/2], even input column in the low nibble,
zero point 8; ``scales``; ``prequant``, an AWQ-style activation multiplier), which the TensorRT-LLM
backend reads without help. The KV stand-ins record calibrated K/V amax the way the backend reads them.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

import mmsdk
from mmsdk.core.config import PassConfig
from mmsdk.core.passes import PassContext, PassSpec
from mmsdk.plugins.backends.tensorrt_llm.packing import from_matmulnbits, quantize_groupwise


class FakeInt4Linear(nn.Module):
    """y = (x * prequant) @ ((u - 8) * scales).T + bias, u the MatMulNBits nibbles."""

    def __init__(self, linear: nn.Linear, block: int, awq: torch.Tensor | None) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        pre = torch.ones(weight.shape[1]) if awq is None else 1.0 / awq
        q, scales = quantize_groupwise(weight * (1.0 / pre)[None, :], block)
        u = (q.to(torch.int16) + 8).reshape(q.shape[0], -1, block)
        self.register_buffer("qweight", (u[..., 0::2] | (u[..., 1::2] << 4)).to(torch.uint8))
        self.register_buffer("scales", scales)
        self.register_buffer("prequant", pre)
        self.register_buffer("zero_points", None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.block_size, self.in_features, self.out_features = block, weight.shape[1], weight.shape[0]

    def dequantized(self) -> torch.Tensor:
        q, scales = from_matmulnbits(self.qweight, self.scales, self.in_features)
        return q.float() * scales.repeat_interleave(self.block_size, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (x * self.prequant) @ self.dequantized().T
        return out if self.bias is None else out + self.bias


class FakeInt4Config(PassConfig):
    """Group size and whether to use a non-trivial AWQ activation scale."""

    group_size: int = Field(64, description="INT4 group size.")
    awq: bool = Field(True, description="Random per-input-channel AWQ scales shared by q/k/v and by gate/up.")


def _apply_int4(model: nn.Module, config: FakeInt4Config, context: PassContext) -> dict[str, Any]:
    adapter = context.adapter
    generator = torch.Generator().manual_seed(0)
    count = 0

    def awq(width: int) -> torch.Tensor | None:
        return torch.rand(width, generator=generator) + 0.5 if config.awq else None

    for layer in adapter.decoder_layers(model):
        attention, mlp = adapter.self_attention(layer), adapter.mlp(layer)
        groups = [(attention, ["qkv_proj"] if hasattr(attention, "qkv_proj") else ["q_proj", "k_proj", "v_proj"]),
                  (attention, ["o_proj"]), (mlp, ["gate_proj", "up_proj"]), (mlp, ["down_proj"])]
        for owner, names in groups:
            scale = awq(getattr(owner, names[0]).in_features)
            for name in names:
                setattr(owner, name, FakeInt4Linear(getattr(owner, name), config.group_size, scale))
                count += 1
    return {"quantized": count}


class FakeKVConfig(PassConfig):
    """Nothing to configure."""


def _kv_pass(name: str) -> PassSpec:
    def apply(model: nn.Module, config: FakeKVConfig, context: PassContext) -> dict[str, Any]:
        layers = context.adapter.decoder_layers(model)
        generator = torch.Generator().manual_seed(1)
        amax = {str(i): {"k": (torch.rand(4, generator=generator) * 4 + 1).tolist(), "v": 2.0 + i}
                for i in range(len(layers))}
        return {"kv_amax": amax}

    return PassSpec(name=name, config_cls=FakeKVConfig, apply=apply, summary=f"test stand-in for {name}")


class FakeQuantPlugin:
    """Registers ``fake-int4`` and the KV passes that are not registered yet."""

    __name__ = "trtllm-fakes"

    def __init__(self, kv_names: tuple[str, ...]) -> None:
        self.kv_names = kv_names

    @mmsdk.hookimpl
    def mmsdk_register_quantizers(self, register: Any) -> None:
        register(PassSpec(name="fake-int4", config_cls=FakeInt4Config, apply=_apply_int4,
                          summary="test INT4 weights in MatMulNBits layout"))
        for name in self.kv_names:
            register(_kv_pass(name))


def fake_session() -> Any:
    """A session with the built-ins plus the stand-ins for KV passes not (yet) provided by mmsdk."""
    from mmsdk.core.session import Session

    builtin = Session.create(autoload=False, disabled=())
    missing = tuple(n for n in ("int8-kv", "fp8-kv", "int4-kv") if n not in builtin.passes.names())
    return Session.create(autoload=False, disabled=(), extra=[FakeQuantPlugin(missing)])


def int4_config(session: Any, group_size: int = 64) -> Any:
    """The INT4 pass to use: mmsdk's ``int4-weight`` (AWQ) where registered, else the stand-in."""
    if "int4-weight" in session.passes.names():
        return session.passes.get("int4-weight").config_cls(method="awq", group_size=group_size)
    return FakeInt4Config(group_size=group_size)


def calibration_samples(count: int = 4) -> list[tuple[Any, str]]:
    """(image, question) pairs for opt.calibrate(); the stand-ins ignore them, mmsdk's passes use them."""
    from mmsdk.testing import sample_image

    return [(sample_image(i), "what digit is this ?") for i in range(count)]
