"""token-prune: the sequence and KV cache really shrink, generate() stays right, positions are the kept ones."""

from __future__ import annotations

import pytest
import torch

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.errors import ConfigError, IncompatiblePassError
from mmsdk.core.flops import count_prefill
from mmsdk.plugins._tokens import kept_count
from mmsdk.plugins.encoders import _fastv
from mmsdk.plugins.encoders.token_prune import TokenPruneConfig
from mmsdk.plugins.projectors.token_merge import TokenMergeConfig
from mmsdk.testing import tiny_inputs

INLINE = ("tiny:llava", "tiny:llava-next", "tiny:qwen2-vl", "tiny:qwen2.5-vl")
# image tokens per image in the tiny models
IMAGE_TOKENS = {"tiny:llava": 25, "tiny:llava-next": 55, "tiny:qwen2-vl": 9, "tiny:qwen2.5-vl": 9}
QUESTIONS = ("what digit is this ?", "is it even odd yes no how many strokes ?")  # unequal: left padding
GREEDY = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)


def _generate_both_ways(model, inputs):
    with torch.no_grad():
        cached = model.generate(**inputs, **GREEDY)
        recomputed = model.generate(**inputs, **GREEDY, use_cache=False)
    return cached, recomputed


@pytest.mark.parametrize("name", INLINE)
def test_visionzip_shrinks_the_cache_and_keeps_generate_right(name, session, tiny):
    loaded = tiny(name)
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    before = count_prefill(loaded.model, inputs)
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply(TokenPruneConfig(keep_ratio=0.5))
    after = count_prefill(opt.model, inputs)
    dropped = IMAGE_TOKENS[name] - kept_count(IMAGE_TOKENS[name], 0.5, None)
    assert after.layer_lengths == tuple(n - dropped for n in before.layer_lengths)
    assert after.kv_bytes < before.kv_bytes
    # decode steps see a cache shorter than input_ids: masks and positions must be translated, so
    # cached decoding has to agree with recomputing the whole (pruned) prompt at every step
    cached, recomputed = _generate_both_ways(opt.model, inputs)
    assert torch.equal(cached, recomputed)
    with torch.no_grad():
        first = opt.model(**inputs).logits[:, -1].argmax(-1)
    assert torch.equal(cached[:, inputs["input_ids"].shape[1]], first)


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl", "tiny:idefics"])
def test_keeping_every_token_is_exact(name, session, tiny):
    loaded = tiny(name)
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    with torch.no_grad():
        reference = loaded.model(**inputs).logits
    opt = Optimizer(loaded.model, session=session).apply(TokenPruneConfig(keep_ratio=1.0))
    with torch.no_grad():
        pruned = opt.model(**inputs).logits
    assert torch.equal(pruned, reference)  # measured: bit-identical (same ops, nothing dropped)


def _rotary_positions(model, adapter, inputs):
    seen = []
    rotary = adapter.rotary_embedding(model)
    handle = rotary.register_forward_pre_hook(lambda module, args: seen.append(args[1].clone()))
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    return seen[0]


def test_qwen_keeps_the_3d_positions_of_the_kept_tokens(session, tiny):
    loaded = tiny("tiny:qwen2-vl")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    opt = Optimizer(loaded.model, session=session).apply(TokenPruneConfig(keep_tokens=4))
    full = _rotary_positions(loaded.model, opt.adapter, inputs)
    opt.model  # noqa: B018 - runs the pass
    pruned = _rotary_positions(loaded.model, opt.adapter, inputs)
    assert full.shape[0] == pruned.shape[0] == 3 and pruned.shape[-1] == full.shape[-1] - 5
    image = (inputs["input_ids"] == loaded.model.config.image_token_id)
    for row in range(full.shape[1]):
        # every kept column is one of the original (t, h, w) columns, in order; text after the image is unchanged
        original = [tuple(c) for c in full[:, row].T.tolist()]
        kept = [tuple(c) for c in pruned[:, row, -(full.shape[-1] - 5):].T.tolist()]
        walk = iter(original)
        assert all(any(c == o for o in walk) for c in kept)
        text_after = int((~image[row]).flip(0).cumprod(0).sum())
        assert kept[-text_after:] == original[-text_after:]
        assert len({c[1:] for c, is_image in zip(original, image[row].tolist(), strict=True) if is_image}) == 9


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl"])
def test_fastv_shrinks_layers_after_k_and_decodes_right(name, session, tiny, monkeypatch):
    loaded = tiny(name)
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    before = count_prefill(loaded.model, inputs)
    opt = Optimizer(loaded.model, session=session).apply(TokenPruneConfig(strategy="fastv", keep_ratio=0.4, layer=1))
    after = count_prefill(opt.model, inputs)
    dropped = IMAGE_TOKENS[name] - kept_count(IMAGE_TOKENS[name], 0.4, None)
    assert after.layer_lengths == (before.layer_lengths[0], before.layer_lengths[1] - dropped)
    # FastV re-scores with the newest token when nothing is cached, so make the choice position-only:
    # then cached decoding (layer 0 full, layer 1 pruned) must match full recomputation
    monkeypatch.setattr(_fastv, "last_token_scores", lambda a, m, hidden, rope, mask: torch.arange(
        hidden.shape[1], dtype=torch.float32).flip(0).expand(hidden.shape[0], -1))
    cached, recomputed = _generate_both_ways(opt.model, inputs)
    assert torch.equal(cached, recomputed)


def test_fastv_score_row_matches_eager_attention(session, tiny):
    loaded = tiny("tiny:llava")
    loaded.model.set_attn_implementation("eager")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    with torch.no_grad():
        out = loaded.model(**inputs, output_attentions=True)
    expected = out.attentions[0][:, :, -1].mean(dim=1)  # last row of layer 0, head-averaged
    captured = {}
    opt = Optimizer(loaded.model, session=session)
    attention = opt.adapter.self_attention(opt.adapter.decoder_layers(loaded.model)[0])

    def hook(module, args, kwargs):
        captured["scores"] = _fastv.last_token_scores(opt.adapter, module, kwargs["hidden_states"],
                                                      kwargs["position_embeddings"], kwargs["attention_mask"])

    attention.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        loaded.model(**inputs)
    torch.testing.assert_close(captured["scores"], expected, rtol=1e-4, atol=1e-6)  # measured max diff 3.7e-9


@pytest.mark.parametrize("name", ["tiny:idefics", "tiny:mllama"])
def test_cross_attention_families_read_fewer_image_states(name, session, tiny):
    loaded = tiny(name)
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    opt = Optimizer(loaded.model, session=session)
    block = opt.adapter.cross_attention_blocks(loaded.model)[0]
    widths = []
    block.attention.k_proj.register_forward_hook(lambda module, args, out: widths.append(args[0].shape[1]))
    with torch.no_grad():
        loaded.model(**inputs)
    opt.apply(TokenPruneConfig(keep_ratio=0.5)).model  # noqa: B018
    with torch.no_grad():
        loaded.model(**inputs)
    assert widths[1] == kept_count(widths[0], 0.5, None)  # 26 states (CLS + 25 patches) -> 13
    cached, recomputed = _generate_both_ways(opt.model, inputs)
    assert torch.equal(cached, recomputed)


def test_bad_input_is_refused_and_leaves_the_model_untouched(session, tiny):
    for bad in (dict(keep_ratio=0.0), dict(keep_ratio=1.5), dict(keep_ratio=0.5, keep_tokens=3)):
        with pytest.raises(ConfigError):
            TokenPruneConfig(**bad)
    loaded = tiny("tiny:idefics")
    with pytest.raises(IncompatiblePassError, match="cross-attention"):
        Optimizer(loaded.model, session=session).apply(TokenPruneConfig(strategy="fastv"))
    llava = tiny("tiny:llava")
    with pytest.raises(IncompatiblePassError, match="between 1 and 1"):
        Optimizer(llava.model, session=session).apply(TokenPruneConfig(strategy="fastv", layer=2))
    with pytest.raises(IncompatiblePassError, match="after token-merge"):
        Optimizer(llava.model, session=session).apply(TokenMergeConfig(), TokenPruneConfig())
    with pytest.raises(IncompatiblePassError, match="sparse-xattn"):
        Optimizer(llava.model, session=session).apply(TokenPruneConfig(strategy="fastv"), "sparse-xattn")
    for model in (loaded.model, llava.model):
        assert "_mmsdk_runtime" not in model.__dict__ and "forward" not in model.__dict__


def test_torch_export_round_trip(session, tiny, tmp_path):
    loaded = tiny("tiny:qwen2-vl")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply(TokenPruneConfig(keep_ratio=0.5))
    with torch.no_grad():
        pruned = opt.model(**inputs).logits
    opt.export("torch", tmp_path / "out")
    reloaded = mmsdk.load(tmp_path / "out", session=session)
    with torch.no_grad():
        again = reloaded(**inputs).logits
    assert torch.equal(again, pruned)
    assert opt.results[0].records["strategy"] == "visionzip"


def test_deep_copying_an_optimized_model_is_refused_clearly(session, tiny):
    import copy

    from mmsdk.core.errors import UnsupportedInputError

    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model, session=session).apply("token-prune")
    baseline = copy.deepcopy(loaded.model)  # before the passes run: a plain copy
    opt.model  # noqa: B018
    with pytest.raises(UnsupportedInputError, match="deep-copy the model before"):
        copy.deepcopy(loaded.model)
    assert "forward" not in baseline.__dict__


def test_dominance_rules(session, tiny):
    llava = tiny("tiny:llava")
    inputs = tiny_inputs(llava.processor, QUESTIONS)
    opt = Optimizer(llava.model, session=session).apply(TokenPruneConfig(keep_ratio=0.5, dominance="received"))
    with torch.no_grad():
        opt.model(**inputs)
    assert opt.results[0].records["dominance"] == "received"
    mllama = tiny("tiny:mllama")
    opt = Optimizer(mllama.model, session=session).apply(TokenPruneConfig(keep_tokens=7, dominance="received"))
    assert count_prefill(opt.model, tiny_inputs(mllama.processor)).layer_lengths[1] == 7
    qwen = tiny("tiny:qwen2-vl")
    with pytest.raises(IncompatiblePassError, match="dominance='cls'"):  # Qwen-VL's tower has no CLS token
        Optimizer(qwen.model, session=session).apply(TokenPruneConfig(dominance="cls"))
