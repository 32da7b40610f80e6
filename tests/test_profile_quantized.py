"""The profile of int4 weights + int4 KV agrees with bytes counted by hand (runs once the quantizers exist)."""

from __future__ import annotations

import pytest
import torch

from mmsdk import Optimizer, Session
from mmsdk.profiling import ProfileSample
from mmsdk.testing import sample_image

_PASSES = Session.create(autoload=False, disabled=()).passes
pytestmark = pytest.mark.skipif(
    not all(name in _PASSES for name in ("int4-weight", "int4-kv")), reason="int4-weight / int4-kv not registered"
)


def _stored_bytes(model: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def test_int4_weight_and_int4_kv_waterfall_matches_hand_counts(session):
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    loaded = session.models.get("tiny:llava").build()
    # hidden 48 is no multiple of any supported group size, so K is zero-padded to 64
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    opt.apply(Int4WeightConfig(group_size=32, indivisible="pad"), "int4-kv")
    opt.calibrate([(sample_image(i, 30), "what digit is this ?") for i in range(8)])
    base, weights4, kv4 = opt.profile(ProfileSample(sample_image(0, 30), "what digit is this ?", 8)).runs
    assert [r.label for r in (base, weights4, kv4)] == ["unoptimized", "+ int4-weight", "+ int4-kv"]
    assert weights4.weights_bytes == kv4.weights_bytes == _stored_bytes(opt.model) < base.weights_bytes
    tokens = base.prompt_tokens + base.new_tokens - 1
    # 2 layers x (K, V) x 1 KV head x head_dim 16: fp32 = 4 B a value, int4 = 1/2 B (static scales are per model)
    assert base.kv_bytes == 2 * 2 * 16 * 4 * tokens
    assert kv4.kv_bytes == 2 * 2 * 16 * tokens // 2  # measured: 1216 B vs 9728 B for 38 tokens
    assert kv4.peak_bytes < base.peak_bytes
