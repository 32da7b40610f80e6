"""token-merge: ToMe merging shrinks sequences and cross-attention states; size-weighted; composes after token-prune."""

from __future__ import annotations

import pytest
import torch

from mmsdk import Optimizer
from mmsdk.core.errors import ConfigError
from mmsdk.core.flops import count_prefill
from mmsdk.plugins._tokens import ToMeReducer, kept_count
from mmsdk.plugins.encoders.token_prune import TokenPruneConfig
from mmsdk.plugins.projectors.token_merge import TokenMergeConfig
from mmsdk.testing import tiny_inputs

QUESTIONS = ("what digit is this ?", "is it even odd yes no how many strokes ?")
GREEDY = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)


def test_merges_are_size_weighted_means_and_meet_the_budget():
    base = torch.randn(4, 8)
    tokens = torch.cat([base.repeat_interleave(3, dim=0), torch.randn(2, 8)])  # 14 tokens, 4 values x3
    for keep in (7, 4, 1):  # 1 needs several bipartite rounds
        slots, values = ToMeReducer(None, keep)(tokens, None)
        assert values.shape == (keep, 8) and torch.equal(slots, slots.sort().values)
    # twins (a, a, b, b, ...) split across the two sets: each pair merges with its twin, in its place
    twins = torch.randn(5, 8).repeat_interleave(2, dim=0)
    slots, values = ToMeReducer(None, 5)(twins, None)
    assert torch.equal(slots, torch.arange(1, 10, 2)) and torch.allclose(values, twins[1::2])
    # sizes carry over rounds: (1, 1, 1, 5) -> one token of (1 + 1 + 1 + 5) / 4, not a mean of pair means
    slots, values = ToMeReducer(None, 1)(torch.tensor([[1.0], [1.0], [1.0], [5.0]]), None)
    assert torch.allclose(values, torch.tensor([[2.0]]))


@pytest.mark.parametrize("name", ["tiny:llava-next", "tiny:qwen2.5-vl"])
def test_inline_sequence_and_cache_shrink_and_generate_stays_right(name, session, tiny):
    loaded = tiny(name)
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    per_image = int((inputs["input_ids"][0] == loaded.model.config.image_token_id).sum())
    before = count_prefill(loaded.model, inputs)
    opt = Optimizer(loaded.model, session=session).apply(TokenMergeConfig(keep_ratio=0.25))
    after = count_prefill(opt.model, inputs)
    merged = per_image - kept_count(per_image, 0.25, None)
    assert after.layer_lengths == tuple(n - merged for n in before.layer_lengths)
    with torch.no_grad():
        cached = opt.model.generate(**inputs, **GREEDY)
        recomputed = opt.model.generate(**inputs, **GREEDY, use_cache=False)
    assert torch.equal(cached, recomputed)


def test_mllama_cross_attention_cache_holds_merged_states(session, tiny):
    loaded = tiny("tiny:mllama")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    before = count_prefill(loaded.model, inputs)
    opt = Optimizer(loaded.model, session=session).apply(TokenMergeConfig(keep_tokens=5))
    after = count_prefill(opt.model, inputs)
    assert before.layer_lengths[1] == 26 and after.layer_lengths[1] == 5  # the cross-attention layer
    assert after.kv_bytes < before.kv_bytes
    with torch.no_grad():
        cached = opt.model.generate(**inputs, **GREEDY)
        recomputed = opt.model.generate(**inputs, **GREEDY, use_cache=False)
    assert torch.equal(cached, recomputed)


def test_merge_after_prune_composes(session, tiny):
    loaded = tiny("tiny:llava")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    before = count_prefill(loaded.model, inputs)
    opt = Optimizer(loaded.model, session=session)
    opt.apply(TokenPruneConfig(keep_ratio=0.6), TokenMergeConfig(keep_ratio=0.5))
    after = count_prefill(opt.model, inputs)
    kept = kept_count(kept_count(25, 0.6, None), 0.5, None)  # 25 -> 15 pruned -> 8 merged
    assert after.layer_lengths[0] == before.layer_lengths[0] - (25 - kept)


def test_bad_budget_is_refused():
    for bad in (dict(keep_ratio=0.0), dict(keep_ratio=2.0), dict(keep_tokens=0), dict(keep_ratio=0.5, keep_tokens=4)):
        with pytest.raises(ConfigError):
            TokenMergeConfig(**bad)
