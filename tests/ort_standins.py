"""Stand-in quantizer passes for the onnxruntime tests: INT4 linears in MatMulNBits layout and KV records.

They produce exactly what the lowering reads (a module with ``packed()``; a ``calibration`` record
with ``kv_cache`` ranges), so the backend's lowering is tested on its own contract.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import torch
from torch import nn

import mmsdk
from mmsdk.core.passes import PassSpec
from mmsdk.plugins.attention.qkv_fuse import QKVFuseConfig


def pack_int4(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT4 in MatMulNBits layout (even k in the low nibble, implicit zero point 8)."""
    n, k = weight.shape
    blocks = -(-k // block)
    padded = np.pad(weight, ((0, 0), (0, blocks * block - k))).reshape(n, blocks, block)
    amax = np.abs(padded).max(-1)
    scale = np.where(amax == 0, 1.0, amax / 7.0).astype(np.float32)
    q = (np.clip(np.rint(padded / scale[..., None]), -8, 7) + 8).astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), scale


class PackedInt4Linear(nn.Module):
    """A linear whose weight lives only as MatMulNBits bytes; forward dequantizes (optionally AWQ-scaled)."""

    def __init__(self, linear: nn.Linear, block: int = 16, prequant: np.ndarray | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach().numpy()
        if prequant is not None:
            weight = weight / prequant[None, :]  # y = (x * prequant) @ (W / prequant).T
        q, scale = pack_int4(weight, block)
        self.register_buffer("qweight", torch.from_numpy(q))
        self.register_buffer("scales", torch.from_numpy(scale))
        self.register_buffer("prequant", None if prequant is None else torch.from_numpy(prequant.astype(np.float32)))
        self.in_features, self.out_features, self.block_size = linear.in_features, linear.out_features, block
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def packed(self) -> Any:
        return types.SimpleNamespace(qweight=self.qweight, scales=self.scales, zero_points=None,
                                     in_features=self.in_features, block_size=self.block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.stack([self.qweight & 15, self.qweight >> 4], -1).flatten(-2).float() - 8
        weight = (q * self.scales[..., None]).reshape(self.out_features, -1)[:, : self.in_features]
        if self.prequant is not None:
            x = x * self.prequant
        out = x @ weight.T
        return out if self.bias is None else out + self.bias


def _quantize_linears(model: nn.Module, context: Any, awq: bool) -> None:
    rng = np.random.RandomState(0)
    for layer in context.adapter.decoder_layers(model):
        for owner in (context.adapter.self_attention(layer), context.adapter.mlp(layer)):
            for name, child in list(owner.named_children()) if owner is not None else []:
                if type(child) is nn.Linear:
                    pre = rng.uniform(0.5, 2.0, child.in_features) if awq else None
                    setattr(owner, name, PackedInt4Linear(child, prequant=pre))


def plugin(kv_records: dict[str, Any] | None = None) -> Any:
    """A plugin with ``test-int4`` / ``test-int4-awq`` and, given records, ``int8-kv`` / ``int4-kv`` stand-ins."""
    holder = types.SimpleNamespace(__name__="ort-test-quantizers")
    from mmsdk.core.session import Session

    installed = set(Session.create(autoload=False, disabled=()).passes.names())

    @mmsdk.hookimpl
    def mmsdk_register_quantizers(register: Any) -> None:
        register(PassSpec("test-int4", QKVFuseConfig, lambda m, c, x: _quantize_linears(m, x, False), "int4 stand-in"))
        register(PassSpec("test-int4-awq", QKVFuseConfig, lambda m, c, x: _quantize_linears(m, x, True), "awq stand-in"))
        for name, record in (kv_records or {}).items():
            if name in installed:
                continue
            register(PassSpec(name, QKVFuseConfig, lambda m, c, x, r=record: {"calibration": {"kv_cache": r}},
                              f"{name} stand-in carrying calibrated ranges"))

    holder.mmsdk_register_quantizers = mmsdk_register_quantizers
    return holder
