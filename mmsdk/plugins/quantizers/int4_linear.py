"""``Int4Linear``: a weight-only INT4 linear layer whose buffers are MatMulNBits' inputs, byte for byte.

Buffers (all persistent, so a torch export holds exactly what ONNX Runtime's MatMulNBits reads):
``qweight`` uint8 ``[N, k_blocks, block/2]``, ``scales`` ``[N, k_blocks]``, ``zero_points`` uint8
``[N, ceil(k_blocks/2)]`` when asymmetric, and ``prequant`` ``[K]`` when AWQ chose per-input-channel
scales (``y = (x * prequant) @ W_hat.T + bias``, TensorRT-LLM's ``prequant_scaling_factor``).

On CPU, and on CUDA when the shape does not fit the kernel, the weight is dequantized group by
group for each call (transient memory only). On CUDA with bf16/fp16 activations it runs torch's
tinygemm kernel ``_weight_int4pack_mm``; its repacked copy is built on the first CUDA call and
kept as a non-persistent buffer, so memory reports count it.
"""

from __future__ import annotations

import torch
from torch import nn

from mmsdk.plugins.quantizers.packing import PackedInt4, dequantize_int4, padded_k, quantize_int4, to_tinygemm

__all__ = ["Int4Linear"]

_TINYGEMM_TILES = 8


class Int4Linear(nn.Module):
    """Drop-in replacement of ``nn.Linear`` holding a packed INT4 weight in MatMulNBits layout."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        block_size: int,
        symmetric: bool = True,
        bias: bool = False,
        prequant: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_size, self.symmetric = block_size, symmetric
        k_blocks = padded_k(in_features, block_size) // block_size
        empty = dict(device=device)
        self.register_buffer(
            "qweight", torch.zeros(out_features, k_blocks, block_size // 2, dtype=torch.uint8, **empty)
        )
        self.register_buffer("scales", torch.ones(out_features, k_blocks, dtype=dtype, **empty))
        zp_shape = (out_features, -(-k_blocks // 2))
        self.register_buffer("zero_points", None if symmetric else torch.zeros(zp_shape, dtype=torch.uint8, **empty))
        self.register_buffer("prequant", torch.ones(in_features, dtype=dtype, **empty) if prequant else None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, **empty), requires_grad=False) if bias else None
        self.register_buffer("_tinygemm_weight", None, persistent=False)
        self.register_buffer("_tinygemm_scales", None, persistent=False)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        block_size: int,
        symmetric: bool = True,
        channel_scale: torch.Tensor | None = None,
        clip: torch.Tensor | None = None,
    ) -> Int4Linear:
        """Quantize ``linear``; with ``channel_scale`` s (AWQ), store ``W * s`` and ``prequant = 1 / s``."""
        weight = linear.weight.detach()
        if channel_scale is not None:
            weight = weight.float() * channel_scale.float().to(weight.device)
        packed = quantize_int4(weight, block_size, symmetric=symmetric, clip=clip, scale_dtype=linear.weight.dtype)
        module = cls(
            linear.in_features,
            linear.out_features,
            block_size=block_size,
            symmetric=symmetric,
            bias=linear.bias is not None,
            prequant=channel_scale is not None,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        module.load_packed(packed)
        with torch.no_grad():
            if linear.bias is not None:
                module.bias.copy_(linear.bias.detach())
            if channel_scale is not None:
                module.prequant.copy_((1.0 / channel_scale.float()).to(module.prequant))
        return module

    def load_packed(self, packed: PackedInt4) -> None:
        """Copy a :class:`PackedInt4` into this module's buffers."""
        with torch.no_grad():
            self.qweight.copy_(packed.qweight)
            self.scales.copy_(packed.scales)
            if self.zero_points is not None and packed.zero_points is not None:
                self.zero_points.copy_(packed.zero_points)
        self._tinygemm_weight = self._tinygemm_scales = None

    def packed(self) -> PackedInt4:
        """This layer's weight as a :class:`PackedInt4` (views of the buffers, no copy)."""
        return PackedInt4(self.qweight, self.scales, self.zero_points, self.in_features, self.block_size)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ``[N, K]`` weight this layer multiplies by (AWQ scale still folded in)."""
        return dequantize_int4(self.packed(), dtype or self.scales.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prequant is not None:
            x = x * self.prequant.to(x.dtype)
        if x.is_cuda and self._fits_tinygemm(x):
            return self._tinygemm(x)
        out = torch.nn.functional.linear(x, self.dequantize(x.dtype))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _fits_tinygemm(self, x: torch.Tensor) -> bool:
        k = self.in_features
        return (
            x.dtype in (torch.bfloat16, torch.float16)
            and self.block_size in (32, 64, 128, 256)
            and k == padded_k(k, self.block_size)
            and k % (_TINYGEMM_TILES * 16) == 0
            and self.out_features % 8 == 0
            and hasattr(torch.ops.aten, "_weight_int4pack_mm")
        )

    def _tinygemm(self, x: torch.Tensor) -> torch.Tensor:
        if self._tinygemm_weight is None or self._tinygemm_weight.device != x.device:
            weight, scales = to_tinygemm(self.packed(), _TINYGEMM_TILES)
            self._tinygemm_weight, self._tinygemm_scales = weight.to(x.device), scales.to(x.device)
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = torch.ops.aten._weight_int4pack_mm(flat, self._tinygemm_weight, self.block_size, self._tinygemm_scales)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        awq = ", awq prequant" if self.prequant is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{self.block_size} {kind}{awq}"
