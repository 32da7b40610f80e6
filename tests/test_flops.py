"""Prefill cost counting: FLOPs from the ops that ran (CPU SDPA included), KV bytes from the cache's tensors."""

from __future__ import annotations

import torch
from torch import nn

from mmsdk.core.flops import cache_bytes, count_flops, count_prefill
from mmsdk.testing import tiny_inputs


def test_attention_and_matmul_flops_are_counted():
    q, k, v = torch.randn(2, 3, 5, 16), torch.randn(2, 1, 7, 16), torch.randn(2, 1, 7, 16)
    flops, _ = count_flops(torch.nn.functional.scaled_dot_product_attention, q, k, v, enable_gqa=True)
    assert flops == 2 * (2 * 2 * 3 * 5 * 7 * 16)  # q.k^T and p.v
    linear = nn.Linear(48, 10)
    flops, _ = count_flops(linear, torch.randn(4, 48))
    assert flops == 2 * 4 * 48 * 10


def test_cache_bytes_count_every_tensor_once_and_no_weights():
    class QuantizedLike:  # a custom cache: packed tensors, scales, a view, and a pointer to a module
        def __init__(self) -> None:
            self.packed = [torch.zeros(4, 8, dtype=torch.uint8)]
            self.scales = {"k": torch.ones(4, dtype=torch.float16)}
            self.view = self.packed[0][:2]
            self.owner = nn.Linear(100, 100)

    assert cache_bytes(QuantizedLike()) == 4 * 8 + 4 * 2
    assert cache_bytes(None) == 0


def test_prefill_of_a_tiny_model(session, tiny):
    loaded = tiny("tiny:llava")
    inputs = tiny_inputs(loaded.processor)
    cost = count_prefill(loaded.model, inputs)
    length = inputs["input_ids"].shape[1]
    # 2 layers x (K + V) x 1 KV head x head_dim 16 x fp32, for every prompt token
    assert cost.layer_lengths == (length, length)
    assert cost.kv_bytes == 2 * 2 * 1 * 16 * 4 * length
    assert cost.flops > 2 * length * 48 * 101  # at least the LM head's matmul
