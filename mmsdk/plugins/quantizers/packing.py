"""INT4 packing in ONNX Runtime's MatMulNBits layout, and its conversion to torch's int4 kernels.

MatMulNBits (bits=4) stores a ``[N, K]`` weight (``nn.Linear.weight``: out x in) as

* ``B``: uint8 ``[N, k_blocks, block/2]``; inside a block, element ``k`` sits in byte ``k // 2``,
  even ``k`` in the **low** nibble, odd ``k`` in the high one. K is zero-padded to
  ``k_blocks * block``.
* ``scales``: ``[N, k_blocks]`` in the activation dtype.
* ``zero_points`` (optional): uint8 ``[N, ceil(k_blocks / 2)]``, block ``2j`` in the low nibble of
  byte ``j``. Absent means the implicit zero point 8.

and dequantizes ``w = (q - zero_point) * scale``. Symmetric quantization uses ``scale = amax / 7``
and ``q = clamp(rint(w / scale), -8, 7) + 8`` (the TensorRT-LLM W4A16_AWQ formula too), so the
same bytes serve both exporters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "PackedInt4",
    "dequantize_int4",
    "group_absmax",
    "pack_nibbles",
    "padded_k",
    "quantize_int4",
    "to_tinygemm",
    "unpack_nibbles",
]


@dataclass(frozen=True)
class PackedInt4:
    """One weight in MatMulNBits layout: packed values, scales and (asymmetric only) packed zero points."""

    qweight: torch.Tensor  # uint8 [N, k_blocks, block/2]
    scales: torch.Tensor  # [N, k_blocks]
    zero_points: torch.Tensor | None  # uint8 [N, ceil(k_blocks/2)] or None (implicit 8)
    in_features: int
    block_size: int


def padded_k(in_features: int, block_size: int) -> int:
    """K rounded up to whole blocks."""
    return -(-in_features // block_size) * block_size


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit values (0..15, last dim even) two per byte, even index in the low nibble."""
    values = values.to(torch.uint8)
    return values[..., 0::2] | (values[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., m]`` -> uint8 ``[..., 2m]``."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def _blocks(weight: torch.Tensor, block_size: int) -> torch.Tensor:
    n, k = weight.shape
    kp = padded_k(k, block_size)
    if kp != k:
        weight = torch.nn.functional.pad(weight, (0, kp - k))
    return weight.reshape(n, kp // block_size, block_size)


def group_absmax(weight: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-(row, block) absolute maximum of a ``[N, K]`` weight: ``[N, k_blocks]``."""
    return _blocks(weight.float(), block_size).abs().amax(-1)


def quantize_int4(
    weight: torch.Tensor,
    block_size: int,
    *,
    symmetric: bool = True,
    clip: torch.Tensor | None = None,
    scale_dtype: torch.dtype | None = None,
) -> PackedInt4:
    """Round-to-nearest INT4 of a ``[N, K]`` weight into MatMulNBits layout.

    ``clip`` (``[N, k_blocks]``, values in (0, 1]) shrinks each group's range before rounding;
    AWQ's clipping search chooses it. Scales are stored in ``scale_dtype`` (default: the weight's).
    """
    scale_dtype = scale_dtype or weight.dtype
    groups = _blocks(weight.detach().float(), block_size)
    ratio = clip.float().unsqueeze(-1) if clip is not None else 1.0
    if symmetric:
        amax = groups.abs().amax(-1, keepdim=True) * ratio
        scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).to(scale_dtype).float()
        q = (groups / scale).round().clamp(-8, 7) + 8
        zero_points = None
    else:
        high = groups.amax(-1, keepdim=True).clamp(min=0) * ratio
        low = groups.amin(-1, keepdim=True).clamp(max=0) * ratio
        scale = torch.where(high > low, (high - low) / 15.0, torch.ones_like(high)).to(scale_dtype).float()
        zero = (-low / scale).round().clamp(0, 15)
        q = (groups / scale).round().add(zero).clamp(0, 15)
        zp = zero.squeeze(-1).to(torch.uint8)
        if zp.shape[1] % 2:
            zp = torch.nn.functional.pad(zp, (0, 1), value=8)
        zero_points = pack_nibbles(zp)
    return PackedInt4(
        qweight=pack_nibbles(q.to(torch.uint8)).contiguous(),
        scales=scale.squeeze(-1).to(scale_dtype).contiguous(),
        zero_points=zero_points,
        in_features=weight.shape[1],
        block_size=block_size,
    )


def zero_point_values(packed: PackedInt4) -> torch.Tensor:
    """The zero point of every (row, block) as floats ``[N, k_blocks]`` (8 when symmetric)."""
    n, k_blocks = packed.scales.shape
    if packed.zero_points is None:
        return torch.full((n, k_blocks), 8.0, device=packed.scales.device)
    return unpack_nibbles(packed.zero_points)[:, :k_blocks].float()


def dequantize_int4(packed: PackedInt4, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The ``[N, K]`` weight that MatMulNBits computes with: ``(q - zero_point) * scale``."""
    q = unpack_nibbles(packed.qweight).float()  # [N, k_blocks, block]
    zero = zero_point_values(packed).unsqueeze(-1)
    weight = (q - zero) * packed.scales.float().unsqueeze(-1)
    weight = weight.flatten(1)[:, : packed.in_features]
    return weight.to(dtype or packed.scales.dtype)


def to_tinygemm(packed: PackedInt4, inner_k_tiles: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Repack for ``torch.ops.aten._weight_int4pack_mm`` (CUDA): (int4pack weight, bf16 scales-and-zeros).

    tinygemm dequantizes ``(q - 8) * scale + zero`` with q in 0..15 packed even-k-high-nibble,
    so MatMulNBits' ``(q - zp) * scale`` maps to ``zero = (8 - zp) * scale``. Needs
    ``K % (inner_k_tiles * 16) == 0`` and an unpadded K.
    """
    n, k_blocks, half = packed.qweight.shape
    k = k_blocks * half * 2
    swapped = ((packed.qweight & 0x0F) << 4) | (packed.qweight >> 4)  # even k to the high nibble
    weight = torch.ops.aten._convert_weight_to_int4pack(swapped.reshape(n, k // 2).contiguous(), inner_k_tiles)
    scale = packed.scales.float()
    zero = (8.0 - zero_point_values(packed)) * scale
    scales_and_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return weight, scales_and_zeros
