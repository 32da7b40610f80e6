"""gated-xattn: image K/V once per image, closed gates skipped, latency budget, refusal on inline models."""

from __future__ import annotations

import pytest
import torch

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.errors import CalibrationError, IncompatiblePassError
from mmsdk.plugins.attention.gated_xattn import GatedXAttnConfig, _budget_skips
from mmsdk.testing import sample_image, tiny_inputs

QUESTIONS = ("what digit is this ?", "is it even odd yes no how many strokes ?")
GREEDY = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)


def test_idefics_image_kv_are_computed_once_and_outputs_do_not_change(session, tiny):
    loaded = tiny("tiny:idefics")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    with torch.no_grad():
        reference = loaded.model.generate(**inputs, **GREEDY)
    opt = Optimizer(loaded.model, session=session).apply("gated-xattn")
    projections = []
    for block in opt.adapter.cross_attention_blocks(loaded.model):
        projections += [block.attention.k_proj, block.attention.v_proj]
    with torch.inference_mode():  # inference tensors carry no version counter: the memo must cope
        again = opt.model.generate(**inputs, **GREEDY)
    assert torch.equal(again, reference)
    # each projection computed once for the prompt; the 4 decode steps reused the stored product
    assert [(p.kv_memo.misses, p.kv_memo.hits) for p in projections] == [(1, 4)] * len(projections)
    assert opt.results[0].records["kv_cache"] == "memoized 4 K/V projections"


def test_a_memo_projects_again_while_a_decode_step_is_captured(session, tiny, monkeypatch):
    """A captured decode step replays with each call's image states copied into its inputs: the capture must record
    the projection itself, not the stored product of the call that captured it (the next image replaces it)."""
    from mmsdk.plugins.attention import gated_xattn

    loaded = tiny("tiny:idefics")
    opt = Optimizer(loaded.model, session=session).apply("gated-xattn")
    projection = opt.adapter.cross_attention_blocks(opt.model)[0].attention.k_proj
    states = torch.randn(2, 5, projection.in_features)
    with torch.inference_mode():
        stored = projection(states)
        assert projection(states) is stored  # a hit
        monkeypatch.setattr(gated_xattn, "being_captured", lambda x: True)
        captured = projection(states)
    assert captured is not stored and torch.equal(captured, stored)
    assert (projection.kv_memo.misses, projection.kv_memo.hits) == (1, 1) and projection.kv_memo.output is stored


def test_closed_gates_are_skipped_exactly(session, tiny):
    loaded = tiny("tiny:mllama")
    layer = loaded.model.model.language_model.layers[1]
    with torch.no_grad():
        layer.cross_attn_attn_gate.fill_(1e-5)
        layer.cross_attn_mlp_gate.fill_(-2e-5)
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    with torch.no_grad():
        reference = loaded.model(**inputs).logits
    opt = Optimizer(loaded.model, session=session).apply(GatedXAttnConfig(gate_threshold=1e-4))
    with torch.no_grad():
        skipped = opt.model(**inputs).logits
    records = opt.results[0].records
    assert records["skipped"] == [1] and "tanh" in records["reasons"]["1"]
    torch.testing.assert_close(skipped, reference, rtol=0, atol=1e-4)  # measured 8.6e-7: the gates were ~0
    assert records["kv_cache"].startswith("native")


def test_latency_budget_skips_the_weakest_gates_first(session, tiny, tmp_path):
    assert _budget_skips([0.9, 0.1, 0.5], [1.0, 1.0, 1.0], [0, 1, 2], budget=1.5) == [1, 2]
    assert _budget_skips([0.9, 0.1, 0.5], [1.0, 1.0, 1.0], [0, 2], budget=5.0) == []
    loaded = tiny("tiny:idefics")
    with torch.no_grad():  # layer 1 gets the weaker gates
        loaded.model.model.gated_cross_attn_layers[1].alpha_cross_attn.fill_(0.05)
        loaded.model.model.gated_cross_attn_layers[1].alpha_dense.fill_(0.05)
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    opt.calibrate([(sample_image(7), "what digit is this ?")])
    opt.apply(GatedXAttnConfig(latency_budget_ms=1e-6, repeats=2)).model  # noqa: B018
    records = opt.results[0].records
    assert records["skipped"][0] == 1 and len(records["layer_ms"]) == 2 and records["layer_ms"][0] > 0
    assert records["cross_attention_ms_after"] < records["cross_attention_ms"]
    # the torch export replays the skips from the records: no timing, no calibration data on load
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    with torch.no_grad():
        before = opt.model(**inputs).logits
    opt.export("torch", tmp_path / "out")
    reloaded = mmsdk.load(tmp_path / "out", session=session)
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, before)


def test_refusals(session, tiny):
    llava = tiny("tiny:llava")
    with pytest.raises(IncompatiblePassError, match="cross-attention"):
        Optimizer(llava.model, session=session).apply("gated-xattn")
    assert "forward" not in llava.model.__dict__
    idefics = tiny("tiny:idefics")
    opt = Optimizer(idefics.model, session=session).apply(GatedXAttnConfig(latency_budget_ms=1.0))
    with pytest.raises(CalibrationError, match="calibrat"):
        opt.model  # noqa: B018
