"""rmsnorm-rope-fusion: bit-exact on every family, fused modules really run, lowerings, composition."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.backend import LowerTarget
from mmsdk.kernels.norm_rope import add_rms_norm, mrope_cos_sin, mrope_streams
from mmsdk.plugins.attention._lowering import OnnxLowering, TrtLlmLowering
from mmsdk.plugins.attention.rmsnorm_rope import (
    FusedAddRMSNorm,
    FusedMRoPEEmbedding,
    FusedRMSNormRoPE,
    FusedRoPE,
    FusedRoPEEmbedding,
    RMSNormRoPEFusionConfig,
)
from mmsdk.plugins.encoders.token_prune import TokenPruneConfig
from mmsdk.testing import TINY_MODELS, tiny_inputs

QUESTIONS = ("what digit is this ?", "is it even odd yes no how many strokes ?")
FUSED_TYPES = (FusedAddRMSNorm, FusedRoPE, FusedRMSNormRoPE, FusedMRoPEEmbedding, FusedRoPEEmbedding)


def _count_calls(model: nn.Module) -> dict[str, int]:
    calls: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, FUSED_TYPES):
            name = type(module).__name__
            calls.setdefault(name, 0)
            module.register_forward_hook(lambda m, a, o, name=name: calls.__setitem__(name, calls[name] + 1))
    return calls


@pytest.mark.parametrize("name", [*TINY_MODELS, "tiny:qwen3-vl"])
def test_fusion_is_bit_exact_and_the_fused_modules_run(name, session, tiny):
    loaded = tiny(name)
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    greedy = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        reference = loaded.model(**inputs).logits
        reference_ids = loaded.model.generate(**inputs, **greedy)
    opt = Optimizer(loaded.model, session=session).apply("rmsnorm-rope-fusion")
    calls = _count_calls(opt.model)
    with torch.no_grad():
        fused = opt.model(**inputs).logits
        fused_ids = opt.model.generate(**inputs, **greedy)
    # measured: 0.0 difference on all seven models (same fp32 ops in the same order)
    assert torch.equal(fused, reference)
    assert torch.equal(fused_ids, reference_ids)
    records = opt.results[0].records
    assert records["residual_norm"] and records["plain_norms"] and not records["skipped"]
    assert calls["FusedAddRMSNorm"] > 0
    assert calls.get("FusedRoPE", 0) + calls.get("FusedRMSNormRoPE", 0) > 0
    if records["mrope_section"]:
        assert calls["FusedMRoPEEmbedding"] > 0
    else:  # plain RoPE: cos/sin in one op too
        assert records["rope_tables"] and calls["FusedRoPEEmbedding"] > 0


def test_qwen3_gets_the_true_rmsnorm_rope_fusion(session, tiny):
    loaded = tiny("tiny:qwen3-vl")
    opt = Optimizer(loaded.model, session=session).apply("rmsnorm-rope-fusion")
    opt.model  # noqa: B018 - runs the pass
    records = opt.results[0].records
    assert len(records["rmsnorm_rope"]) == 2 and not records["rope"]
    assert records["mrope_layout"] == "interleaved"
    attention = opt.model.model.language_model.layers[0].self_attn
    assert isinstance(attention.fused_rope, FusedRMSNormRoPE)
    assert set(opt.model.state_dict()) == set(tiny("tiny:qwen3-vl").model.state_dict())  # weights did not move


def test_reference_ops_match_transformers_modules():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    norm = LlamaRMSNorm(48, eps=1e-6)
    nn.init.normal_(norm.weight)
    x, residual = torch.randn(2, 5, 48), torch.randn(2, 5, 48)
    out, total = add_rms_norm(x, residual, norm.weight, 1e-6)
    assert torch.equal(total, residual + x) and torch.equal(out, norm(residual + x))
    config = Qwen2VLTextConfig(hidden_size=48, num_attention_heads=3, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    rotary = Qwen2VLRotaryEmbedding(config)
    positions = torch.randint(0, 50, (3, 2, 7))
    cos, sin = mrope_cos_sin(positions, rotary.inv_freq, mrope_streams([2, 3, 3]), 1.0, torch.float32)
    expected = rotary(x, positions)
    assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])


def test_lowerings_for_onnxruntime_and_tensorrt_llm(session, tiny):
    loaded = tiny("tiny:qwen2-vl")
    model = Optimizer(loaded.model, session=session).apply("rmsnorm-rope-fusion").model
    layer = model.model.language_model.layers[0]
    norm = session.lower(layer.post_attention_layernorm, LowerTarget("onnxruntime"))
    assert isinstance(norm, OnnxLowering)
    assert norm.nodes[0].op_type == "SkipSimplifiedLayerNormalization" and norm.nodes[0].domain == "com.microsoft"
    assert norm.nodes[0].attributes["epsilon"] == 1e-6
    rope = session.lower(layer.self_attn.fused_rope, LowerTarget("onnxruntime"))
    assert rope.nodes[0].op_type == "MRotaryEmbedding"
    assert rope.nodes[0].attributes["mrope_section"] == [2, 3, 3] and rope.nodes[0].attributes["mrope_layout"] == 0
    trt = session.lower(layer.post_attention_layernorm, LowerTarget("tensorrt_llm"))
    assert isinstance(trt, TrtLlmLowering) and torch.equal(trt.tensors["weight"], layer.post_attention_layernorm.weight)
    assert session.lower(layer.mlp, LowerTarget("onnxruntime")) is None  # not ours: another plugin may answer
    llava = Optimizer(tiny("tiny:llava").model, session=session).apply("rmsnorm-rope-fusion").model
    tables = llava.model.language_model.rotary_emb
    assert isinstance(tables, FusedRoPEEmbedding)
    assert "RotaryEmbedding," in session.lower(tables, LowerTarget("onnxruntime")).note
    assert session.lower(tables, LowerTarget("tensorrt_llm")).config["position_embedding_type"] == "rope_gpt_neox"


@pytest.mark.parametrize("order", ["fusion-first", "prune-first"])
def test_composes_with_fastv_in_either_order(order, session, tiny):
    prune = TokenPruneConfig(strategy="fastv", keep_ratio=0.5, layer=1)
    loaded = tiny("tiny:llava")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    with torch.no_grad():
        expected = Optimizer(loaded.model, session=session).apply(prune).model(**inputs).logits
    other = tiny("tiny:llava")
    passes = ("rmsnorm-rope-fusion", prune) if order == "fusion-first" else (prune, "rmsnorm-rope-fusion")
    with torch.no_grad():
        got = Optimizer(other.model, session=session).apply(*passes).model(**inputs).logits
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen3-vl"])
def test_runs_after_int4_weight(name, session, tiny):
    """Quantized attention modules hold packed integer buffers, not parameters; the fusion still applies."""
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    int4 = Int4WeightConfig(indivisible="pad")
    loaded = tiny(name)
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    with torch.no_grad():
        expected = Optimizer(loaded.model, session=session).apply(int4).model(**inputs).logits
    other = tiny(name)
    opt = Optimizer(other.model, session=session).apply(int4, "rmsnorm-rope-fusion")
    with torch.no_grad():
        got = opt.model(**inputs).logits
    fused = opt.results[-1].records
    assert fused["rope"] or fused["rmsnorm_rope"]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)  # measured: bit-exact on both models


def test_the_rope_call_is_found_under_stacked_decorators(session, tiny, monkeypatch):
    """transformers 5.25 put deprecate_kwarg's wrapper over its own on attention forwards, which hid the RoPE call
    from a look one wrapper deep: the pass fused nothing. Any number of functools.wraps layers must do."""

    def wrapped(function):
        @functools.wraps(function)
        def wrapper(self, *args, **kwargs):
            return function(self, *args, **kwargs)

        return wrapper

    loaded = tiny("tiny:llava")
    attention_class = type(loaded.model.model.language_model.layers[0].self_attn)
    monkeypatch.setattr(attention_class, "forward", wrapped(wrapped(wrapped(attention_class.forward))))
    inputs = tiny_inputs(loaded.processor)
    with torch.no_grad():
        reference = loaded.model(**inputs).logits
    opt = Optimizer(loaded.model, session=session).apply("rmsnorm-rope-fusion")
    with torch.no_grad():
        assert torch.equal(opt.model(**inputs).logits, reference)
    records = opt.results[0].records
    assert len(records["rope"]) == 2 and not records["skipped"], records


def test_an_inexact_norm_is_skipped_with_a_reason(session, tiny, caplog):
    class OnePlusWeightNorm(nn.Module):  # Gemma-style (1 + w): not what the fused op computes
        def __init__(self, size: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(size))
            self.variance_epsilon = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    loaded = tiny("tiny:llava")
    loaded.model.model.language_model.layers[1].post_attention_layernorm = OnePlusWeightNorm(48)
    inputs = tiny_inputs(loaded.processor)
    with torch.no_grad():
        reference = loaded.model(**inputs).logits
    opt = Optimizer(loaded.model, session=session).apply(RMSNormRoPEFusionConfig(rope=False))
    with torch.no_grad():
        assert torch.equal(opt.model(**inputs).logits, reference)
    records = opt.results[0].records
    assert len(records["residual_norm"]) == 1 and "not RMSNorm" in records["skipped"][0]
    assert any("left 1 module(s)" in r.getMessage() and "not RMSNorm" in r.getMessage() for r in caplog.records)


def test_torch_export_round_trip(session, tiny, tmp_path):
    loaded = tiny("tiny:qwen3-vl")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply("rmsnorm-rope-fusion")
    with torch.no_grad():
        fused = opt.model(**inputs).logits
    opt.export("torch", tmp_path / "out")
    reloaded = mmsdk.load(tmp_path / "out", session=session)
    assert isinstance(reloaded.model.language_model.layers[0].self_attn.fused_rope, FusedRMSNormRoPE)
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, fused)


def _fold_counter(monkeypatch) -> list[str]:
    """Records each norm handed to an INT4 q/k/v layer (Int4Linear.input_norm, "qkv"), each residual add handed to
    o_proj's store with the post-attention norm whose statistics it is to leave for the gated MLP's GEMV ("mlp"; on
    CPU no kernel leaves them and the norm runs first) or without it ("residual": fp32 and fp16 models), and each
    hand-off a layer's call left untaken ("left": o_proj's residual, a q/k/v norm)."""
    from mmsdk.plugins.quantizers.int4_linear import Int4Linear

    seen: list[str] = []
    norm_of, add_next = Int4Linear.input_norm, Int4Linear.add_next

    def input_norm(self, norm):
        seen.append("qkv")
        return norm_of(self, norm)

    def add_with_norm(self, residual, norm=None):
        seen.append("mlp" if norm is not None else "residual")
        return add_next(self, residual, norm)

    def clear_next(self):
        left = clear(self)
        seen.extend(["left"] if any(left) else [])  # a norm or residual its call did not take
        return left

    clear = Int4Linear.clear_next
    monkeypatch.setattr(Int4Linear, "input_norm", input_norm)
    monkeypatch.setattr(Int4Linear, "clear_next", clear_next)
    monkeypatch.setattr(Int4Linear, "add_next", add_with_norm)
    return seen


@pytest.mark.parametrize("name, order, mlp, dtype, chained", [
    ("tiny:llava", "int4-first", True, torch.float32, False),
    ("tiny:qwen2-vl", "int4-first", True, torch.float32, False),
    ("tiny:llava", "fusion-first", True, torch.float32, False),
    ("tiny:qwen2-vl", "int4-first", False, torch.float32, False),
    ("tiny:qwen2-vl", "int4-first", True, torch.bfloat16, False),
    ("tiny:llava", "int4-first", True, torch.bfloat16, True)])
def test_decode_steps_fold_the_norms_into_the_int4_gemvs(name, order, mlp, dtype, chained, session, tiny,
                                                         monkeypatch):
    """With INT4 projections, each decode step's input norm runs inside the q/k/v projection, the attention's residual
    add inside o_proj, whose store is asked for the post-attention norm's statistics in bf16 models (with
    ``mlp_norm_in_gemv=False``, the q/k/v part only): on CPU (reference norm first) the tokens and logits are bitwise
    those of the unfolded layers; the prompt (many positions) is not folded. int4-weight may come before or after the
    fusion (the recipes apply it after). ``chained`` (qkv_norm_statistics) changes nothing on CPU, where no store
    leaves statistics."""
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    int4 = Int4WeightConfig(indivisible="pad")
    inputs = tiny_inputs(tiny(name).processor, QUESTIONS[:1])
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    greedy = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    outputs, records = {}, {}
    for fold in (False, True):
        fusion = RMSNormRoPEFusionConfig(norm_in_gemv=fold, mlp_norm_in_gemv=mlp, qkv_norm_statistics=chained)
        passes = ("qkv-fuse", int4, fusion) if order == "int4-first" else ("qkv-fuse", fusion, int4)
        model = tiny(name).model if dtype == torch.float32 else copy.deepcopy(tiny(name).model).to(dtype)
        opt = Optimizer(model, session=session).apply(*passes)
        seen = _fold_counter(monkeypatch)
        with torch.no_grad():
            outputs[fold] = opt.model.generate(**inputs, **greedy)
        records[fold] = next(r.records for r in opt.results if r.name == "rmsnorm-rope-fusion")
        layers = len(records[fold]["residual_norm"])
        # the folded norms of every layer in each of the two decode steps after the prompt; none without the fold
        handed = ["mlp" if dtype == torch.bfloat16 else "residual", "qkv"] if mlp else ["qkv"]
        assert seen == (handed * layers * 2 if fold else []), seen
        monkeypatch.undo()
    assert torch.equal(outputs[True].sequences, outputs[False].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outputs[True].scores, outputs[False].scores, strict=True))
    expected_now = records[True]["residual_norm"] if order == "int4-first" else []
    assert records[True]["norm_in_gemv"] == expected_now and records[False]["norm_in_gemv"] == []


def test_input_norm_statistics_go_to_the_next_folded_layer_for_its_input_only():
    """qkv_norm_statistics chains consecutive folded layers through one hand-off (a layer that folds nothing breaks
    the chain); the hand-off gives the statistics a store left only to a step whose input is the tensor they were left
    for, once, and drops them at the next look either way. Whether the next layer reads them is learnt again at each
    prompt."""
    from mmsdk.plugins.attention.norm_folding import InputNormHandOff, NormFolding, chain_input_norm_statistics

    first, second, third = (NormFolding(torch.nn.Identity(), None, "input_layernorm", None) for _ in range(3))
    chain_input_norm_statistics([first, second, None, third])
    assert first.next is second and second.next is None and third.next is None
    assert first.previous is None and second.previous is first and third.previous is None
    assert all(f.leave_for_next for f in (first, second, third))  # until a reader says it did not read them
    assert first.hand_off is second.hand_off is third.hand_off and isinstance(first.hand_off, InputNormHandOff)
    hand_off, x, other, left = InputNormHandOff(), torch.zeros(1), torch.zeros(1), object()
    hand_off.put(x, left)
    assert hand_off.take(other) is None and hand_off.take(x) is None  # another input: dropped
    hand_off.put(x, left)
    assert hand_off.take(x) is left and hand_off.take(x) is None
    hand_off.put(x, None)  # the store could not leave them
    assert hand_off.take(x) is None
    first.leave_for_next = False  # the next layer's q/k/v did not read them
    assert first.step(torch.zeros(1, 4, 8), None, None, {}) is None  # a prompt: not folded, and learnt again
    assert first.leave_for_next


def test_an_int4_residual_forward_asked_to_leave_statistics_is_the_plain_sum_on_cpu():
    """Int4Linear's residual forward asked for the next norm's statistics (plus_residual's ``leave``) gives the same
    sum bitwise; on CPU no kernel leaves them, so the reader folds the norm itself."""
    from mmsdk.plugins._forward import plus_residual
    from mmsdk.plugins.quantizers.int4_linear import Int4Linear

    layer = Int4Linear.from_linear(torch.nn.Linear(64, 32), block_size=32)
    x, residual = torch.randn(1, 64), torch.randn(1, 32)
    norm = torch.nn.RMSNorm(32, eps=1e-6)
    assert torch.equal(plus_residual(layer, x, residual, norm), residual + layer(x))
    assert layer.left_statistics() is None


def test_a_folded_norm_an_attention_did_not_pass_on_is_an_error(session, tiny):
    """An attention that hands its q/k/v projections something other than its input (here a copy) would have them
    multiply an un-normalized input: the step raises, naming the switch."""
    from mmsdk.plugins._forward import module_body, set_forward_body
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    loaded = tiny("tiny:llava")
    inputs = tiny_inputs(loaded.processor, QUESTIONS[:1])
    opt = Optimizer(loaded.model, session=session).apply("qkv-fuse", Int4WeightConfig(indivisible="pad"),
                                                         RMSNormRoPEFusionConfig(norm_in_gemv=True))
    attention = opt.model.model.language_model.layers[0].self_attn
    body = module_body(attention)
    set_forward_body(attention, lambda hidden_states, **kwargs: body(hidden_states.clone(), **kwargs))
    with torch.no_grad(), pytest.raises(RuntimeError, match="norm_in_gemv=False"):
        opt.model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert all(m.clear_next() == (False, False) for m in opt.model.modules() if hasattr(m, "clear_next"))
