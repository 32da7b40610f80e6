"""W4A16_AWQ packing: pinned to the spec's worked bytes, round trips, and the MatMulNBits conversion."""

from __future__ import annotations

import pytest
import torch

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.tensorrt_llm.packing import (
    dequantize,
    from_matmulnbits,
    pack_int4_rows,
    pack_w4a16_awq,
    quantize_groupwise,
    unpack_int4_rows,
)
from mmsdk.plugins.backends.tensorrt_llm.reference import unpack_int4


def test_golden_bytes_of_the_spec_example():
    # specs/tensorrt-llm.md 7.2: q = [[-8, 7], [1, -1]] (rows = out, cols = in)
    q = torch.tensor([[-8, 7], [1, -1]], dtype=torch.int8)
    packed = pack_int4_rows(q)
    assert packed.dtype == torch.int8 and list(packed.shape) == [1, 2]
    assert packed.view(torch.uint8).tolist() == [[0x18, 0xF7]]
    assert packed.tolist() == [[24, -9]]


def test_pack_w4a16_awq_from_a_float_weight_follows_the_same_bytes():
    # Symmetric amax/7 scales never produce -8, so the float path is pinned with -7 in the first slot:
    # row 0 = 0.5 * [-7, 7, 0...] (scale 0.5), row 1 = 0.25 * [1, -1, 7, 0...] (scale 0.25).
    weight = torch.zeros(2, 64)
    weight[0, :2] = torch.tensor([-7.0, 7.0]) * 0.5
    weight[1, :3] = torch.tensor([1.0, -1.0, 7.0]) * 0.25
    packed = pack_w4a16_awq(weight, group_size=64)
    assert list(packed.weight.shape) == [1, 64] and packed.weight.dtype == torch.int8
    assert packed.scales.flatten().tolist() == [0.5, 0.25] and packed.scales.dtype == torch.float16
    assert packed.prequant.dtype == torch.float16 and bool((packed.prequant == 1).all())
    assert packed.weight.view(torch.uint8)[0, :3].tolist() == [0x19, 0xF7, 0x70]  # (-7 | 1<<4), (7 | -1<<4), (0 | 7<<4)


def test_round_trip_is_exact_with_two_independent_unpackers():
    q = torch.randint(-8, 8, (64, 128), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4_rows(q)
    assert torch.equal(unpack_int4_rows(packed), q)
    assert torch.equal(unpack_int4(packed), q)  # the reference loader's own arithmetic


def test_dequantized_weight_is_within_half_a_step():
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))
    q, scales = quantize_groupwise(weight, 64)
    error = (dequantize(q, scales) - weight).abs()
    assert bool((error <= scales.repeat_interleave(64, dim=1) / 2 + 1e-6).all())
    assert int(q.min()) >= -8 and int(q.max()) <= 7


def test_odd_rows_and_out_of_range_values_are_refused():
    with pytest.raises(ExportError, match="odd"):
        pack_int4_rows(torch.zeros(3, 4, dtype=torch.int8))
    with pytest.raises(ExportError, match=r"\[-8, 7\]"):
        pack_int4_rows(torch.full((2, 4), 9, dtype=torch.int8))


def _matmulnbits(q: torch.Tensor, block: int) -> torch.Tensor:
    u = (q.to(torch.int16) + 8).reshape(q.shape[0], -1, block)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).to(torch.uint8)


def test_matmulnbits_layout_converts_without_requantizing():
    q = torch.randint(-8, 8, (16, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    scales = torch.rand(16, 2) + 0.1
    packed = _matmulnbits(q, 32)
    # MatMulNBits: element k of a block is in byte k // 2, even k in the low nibble, zero point 8.
    assert packed[0, 0, 0].item() == (int(q[0, 0]) + 8) | ((int(q[0, 1]) + 8) << 4)
    values, same_scales = from_matmulnbits(packed, scales, in_features=64)
    assert torch.equal(values, q) and same_scales is scales
    rows = pack_int4_rows(values)  # TensorRT-LLM: two output rows per byte instead of two input columns
    assert torch.equal(unpack_int4(rows), q)


def test_asymmetric_matmulnbits_is_refused():
    q = torch.zeros(2, 32, dtype=torch.int8)
    zero_points = torch.tensor([[0x07], [0x08]], dtype=torch.uint8)  # row 0 has zero point 7
    with pytest.raises(ExportError, match="asymmetric"):
        from_matmulnbits(_matmulnbits(q, 32), torch.ones(2, 1), 32, zero_points=zero_points)
    values, _ = from_matmulnbits(_matmulnbits(q, 32), torch.ones(2, 1), 32, zero_points=torch.full((2, 1), 8.0))
    assert torch.equal(values, q)
