"""W4A16_AWQ INT4 weights in TensorRT-LLM's checkpoint layout, and conversion from mmsdk's ONNX layout.

TensorRT-LLM's checkpoint (and ModelOpt's Hugging Face export) stores a symmetric, group-wise INT4
linear as ``weight`` int8 ``[n/2, k]``: two *output* rows per byte, row 2j in the low nibble and row
2j+1 in the high one, each a signed 4-bit value. The per-group scales are ``[n, k/g]``. The build GPU
rearranges these bytes for its own kernels, so the exporter must not (specs/tensorrt-llm.md 2.2).

mmsdk's INT4 linears keep ONNX Runtime's MatMulNBits layout instead: uint8 ``[n, k/b, b/2]`` with
two *input* columns per byte (even k in the low nibble) and an implicit zero point of 8. Converting
between the two only moves nibbles; the integer values and the scales are carried over unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmsdk.core.errors import ExportError

__all__ = [
    "QMAX",
    "QMIN",
    "W4A16Weight",
    "dequantize",
    "from_matmulnbits",
    "pack_int4_rows",
    "pack_w4a16_awq",
    "quantize_groupwise",
    "unpack_int4_rows",
]

QMIN, QMAX = -8, 7


@dataclass(frozen=True)
class W4A16Weight:
    """One W4A16_AWQ linear as written to a checkpoint: packed bytes, group scales, pre-quant scale."""

    weight: torch.Tensor  # int8 [n/2, k]
    scales: torch.Tensor  # [n, k/g]
    prequant: torch.Tensor  # [k]: the kernel computes (x * prequant) @ dequant(weight).T


def quantize_groupwise(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 of ``weight`` [n, k]: (q int8 [n, k] in [-8, 7], scales [n, k/g] = amax/7)."""
    n, k = weight.shape
    if k % group_size:
        raise ExportError(
            f"in_features {k} is not a multiple of group_size {group_size}.",
            fix="pick a group_size that divides the layer's input width (64 or 128 for TensorRT-LLM).",
        )
    groups = weight.float().reshape(n, k // group_size, group_size)
    scales = groups.abs().amax(dim=-1) / QMAX
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.clamp(torch.round(groups / scales[..., None]), QMIN, QMAX).to(torch.int8)
    return q.reshape(n, k), scales


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Pack signed INT4 values ``q`` [n, k] into int8 [n/2, k]: row 2j low nibble, row 2j+1 high nibble."""
    n, _ = q.shape
    if n % 2:
        raise ExportError(
            f"cannot pack {n} output rows two per byte (odd count).",
            fix="leave this layer in full precision, or use a model whose layer widths are even.",
        )
    if int(q.min()) < QMIN or int(q.max()) > QMAX:
        raise ExportError(
            f"INT4 values must lie in [{QMIN}, {QMAX}]; got [{int(q.min())}, {int(q.max())}].",
            fix="quantize with a symmetric INT4 scheme (int4-weight) before exporting.",
        )
    nibbles = q.to(torch.int16) & 0x0F
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return packed.to(torch.uint8).view(torch.int8)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_rows`: int8/uint8 [n/2, k] -> signed int8 [n, k]."""
    raw = packed.view(torch.uint8).to(torch.int16)
    low, high = raw & 0x0F, raw >> 4
    rows = torch.stack([low, high], dim=1).reshape(-1, packed.shape[1])
    return torch.where(rows >= 8, rows - 16, rows).to(torch.int8)


def pack_w4a16_awq(
    weight: torch.Tensor, group_size: int, prequant: torch.Tensor | None = None, dtype: torch.dtype = torch.float16
) -> W4A16Weight:
    """Quantize and pack an fp ``weight`` [n, k] (AWQ scale already folded in) as W4A16_AWQ.

    ``prequant`` [k] is the activation multiplier the kernel applies first (ones when there was no
    AWQ search). Scales and prequant are returned in ``dtype``, the checkpoint's model dtype.
    """
    q, scales = quantize_groupwise(weight, group_size)
    pre = torch.ones(weight.shape[1]) if prequant is None else prequant.float()
    return W4A16Weight(pack_int4_rows(q), scales.to(dtype), pre.to(dtype))


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 weight [n, k] from signed INT4 values [n, k] and group scales [n, k/g]."""
    group = q.shape[1] // scales.shape[1]
    return q.float() * scales.float().repeat_interleave(group, dim=1)


def from_matmulnbits(
    packed: torch.Tensor,
    scales: torch.Tensor,
    in_features: int,
    zero_points: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed INT4 values [n, k] and scales [n, k/b] from ONNX MatMulNBits tensors (4-bit, symmetric).

    ``packed`` is uint8 [n, k/b, b/2] (even input column in the low nibble); the zero point must be
    the implicit 8 (or explicit 8s): TensorRT-LLM's W4A16_AWQ has no zero points, and converting an
    asymmetric weight would mean quantizing it again, which would change the model that was measured.
    """
    n, blocks, half = packed.shape
    raw = packed.view(torch.uint8).to(torch.int16)
    columns = torch.stack([raw & 0x0F, raw >> 4], dim=-1).reshape(n, blocks * half * 2)
    if zero_points is not None and not bool((_unpack_zero_points(zero_points, n, blocks) == 8).all()):
        raise ExportError(
            "this INT4 weight is asymmetric (zero points other than 8); TensorRT-LLM's W4A16_AWQ format "
            "has no zero points, and mmsdk does not quantize again at export.",
            fix="re-run int4-weight with symmetric quantization for a TensorRT-LLM export.",
        )
    if in_features > columns.shape[1]:
        raise ExportError(
            f"MatMulNBits weight holds {columns.shape[1]} input columns but the layer has {in_features}.",
            fix="the INT4 module is inconsistent; re-run int4-weight.",
        )
    return (columns[:, :in_features] - 8).to(torch.int8), scales


def _unpack_zero_points(zero_points: torch.Tensor, n: int, blocks: int) -> torch.Tensor:
    if zero_points.dtype != torch.uint8:  # float zero points [n, blocks]
        return zero_points.reshape(n, blocks).float()
    raw = zero_points.reshape(n, -1).to(torch.int16)
    both = torch.stack([raw & 0x0F, raw >> 4], dim=-1).reshape(n, -1)
    return both[:, :blocks].float()
