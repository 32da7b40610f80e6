"""int4-weight: MatMulNBits layout checked against ONNX Runtime, accuracy on every family, memory, reload, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.errors import CalibrationError, ConfigError, IncompatiblePassError
from mmsdk.core.memory import module_bytes
from mmsdk.plugins.quantizers.int4_linear import Int4Linear
from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig, packed_linear_bytes
from mmsdk.plugins.quantizers.packing import dequantize_int4, pack_nibbles, quantize_int4, unpack_nibbles
from mmsdk.testing import TINY_MODELS, sample_image, sqnr_db, tiny_inputs

TINY = dict(group_size=32, indivisible="pad")  # tiny models have hidden 48 and MLP 74: no group size divides them
CALIBRATION = [(sample_image(100 + i), q) for i in range(3) for q in ("what digit is this ?", "is it even ?")]
FAST_AWQ = dict(method="awq", awq_grid=10, **TINY)


def _ort_matmulnbits(packed, x: np.ndarray, n: int) -> np.ndarray:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k = packed.in_features
    names = ["A", "B", "S"] + (["Z"] if packed.zero_points is not None else [])
    node = helper.make_node(
        "MatMulNBits", names, ["Y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=packed.block_size
    )
    inits = [numpy_helper.from_array(packed.qweight.numpy(), "B"), numpy_helper.from_array(packed.scales.numpy(), "S")]
    if packed.zero_points is not None:
        inits.append(numpy_helper.from_array(packed.zero_points.numpy(), "Z"))
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"A": x})[0]


@pytest.mark.parametrize(
    ("k", "n", "block", "symmetric"),
    [(96, 40, 32, True), (74, 16, 32, False), (128, 24, 64, False), (256, 8, 128, True)],
)
def test_packing_is_what_onnxruntime_matmulnbits_computes(k, n, block, symmetric):
    torch.manual_seed(0)
    weight, x = torch.randn(n, k), torch.randn(3, k)
    packed = quantize_int4(weight, block, symmetric=symmetric)
    assert packed.qweight.shape == (n, -(-k // block), block // 2) and packed.qweight.dtype == torch.uint8
    ours = (x @ dequantize_int4(packed).T).numpy()
    # measured: max |ORT - ours| 1.1e-5 (float summation order only)
    np.testing.assert_allclose(_ort_matmulnbits(packed, x.numpy(), n), ours, atol=1e-4)


def test_nibbles_low_first_and_round_trip():
    values = torch.arange(16, dtype=torch.uint8).repeat(3)
    packed = pack_nibbles(values)
    assert packed[0] == 0 | (1 << 4)  # element 0 in the low nibble, element 1 in the high one
    assert torch.equal(unpack_nibbles(packed), values)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_logits_sqnr_rtn_and_awq_on_every_family(name, session, tiny):
    import copy

    loaded = tiny(name)
    inputs = tiny_inputs(loaded.processor, ("what digit is this ?", "is it even ?"))
    with torch.no_grad():
        reference = loaded.model(**inputs).logits
    results = {}
    for config in (Int4WeightConfig(**TINY), Int4WeightConfig(**FAST_AWQ)):
        model = copy.deepcopy(loaded.model)
        opt = Optimizer(model, loaded.processor, session=session).calibrate(CALIBRATION).apply(config)
        with torch.no_grad():
            results[config.method] = sqnr_db(reference, opt.model(**inputs).logits)
    # measured (rtn / awq, dB): llava 16.2/20.4, llava-next 17.7/20.8, qwen2-vl 21.9/25.3, qwen2.5-vl 23.2/25.4,
    # idefics 19.8/22.9, mllama 19.1/25.3
    assert results["rtn"] > 14.0
    assert results["awq"] > 18.5
    assert results["awq"] > results["rtn"], results


def test_awq_output_error_below_rtn_per_layer_group(session, tiny):
    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate(CALIBRATION)
    opt.apply(Int4WeightConfig(awq_clip=False, **FAST_AWQ)).model  # noqa: B018 - runs the pass
    errors = opt.results[0].records["awq_errors"]
    assert len(errors) == 8  # qkv, o, gate/up, down in 2 layers: linears sharing an input share a scale
    assert all(e["awq"] <= e["rtn"] for e in errors.values())  # exponent 0 is RTN, so never worse by construction


@pytest.mark.parametrize(
    "config", [Int4WeightConfig(**TINY), Int4WeightConfig(symmetric=False, **TINY), Int4WeightConfig(**FAST_AWQ)]
)
def test_model_bytes_within_three_percent_of_packed_size(config, session, tiny):
    loaded = tiny("tiny:qwen2-vl")
    model = loaded.model
    opt = Optimizer(model, loaded.processor, session=session).calibrate(CALIBRATION).apply(config)
    untouched_before = module_bytes(model)
    opt.model  # noqa: B018
    records = opt.results[0].records["quantized"]
    theory = untouched_before
    for info in records.values():
        theory -= (info["in_features"] * info["out_features"] + info["out_features"] * info["bias"]) * 4
        theory += packed_linear_bytes(
            info["in_features"],
            info["out_features"],
            group_size=32,
            symmetric=config.symmetric,
            bias=info["bias"],
            prequant=info["prequant"],
            element_bytes=4,
        )
    measured = module_bytes(model)
    # measured: exactly equal (ratio 1.0000): no full-precision copy survives
    assert abs(measured - theory) / theory < 0.03
    assert all(isinstance(model.get_submodule(n), Int4Linear) for n in records)


def test_vision_tower_off_by_default_and_exclude_patterns(session, tiny):
    loaded = tiny("tiny:llava")
    model = loaded.model
    Optimizer(model, session=session).apply(Int4WeightConfig(exclude=("*.mlp.down_proj",), **TINY)).model  # noqa: B018
    names = {n for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert names and all("language_model" in n and "down_proj" not in n for n in names)
    assert isinstance(model.lm_head, torch.nn.Linear)

    other = tiny("tiny:llava").model
    Optimizer(other, session=session).apply(Int4WeightConfig(vision_tower=True, projector=True, **TINY)).model  # noqa: B018
    assert any(isinstance(m, Int4Linear) for m in other.model.vision_tower.modules())


def test_torch_export_reloads_bit_identical(session, tiny, tmp_path):
    loaded = tiny("tiny:mllama")
    inputs = tiny_inputs(loaded.processor)
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate(CALIBRATION)
    opt.apply(Int4WeightConfig(symmetric=False, **FAST_AWQ))
    with torch.no_grad():
        before = opt.model(**inputs).logits
    opt.export("torch", tmp_path / "out")
    reloaded = mmsdk.load(tmp_path / "out", session=session)
    with torch.no_grad():
        after = reloaded(**inputs).logits
    assert torch.equal(before, after)
    assert opt.export_context().calibration["awq"]["group_size"] == 32


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> bool:
    state = model.state_dict()
    return state.keys() == snapshot.keys() and all(torch.equal(state[k], v) for k, v in snapshot.items())


def test_group_size_that_does_not_divide_is_refused_untouched(session, tiny):
    loaded = tiny("tiny:llava")
    snapshot = _snapshot(loaded.model)
    with pytest.raises(ConfigError, match=r"does not divide.*in_features 48.*indivisible='pad'"):
        Optimizer(loaded.model, session=session).apply(Int4WeightConfig(group_size=32))  # chosen: refused
    assert _unchanged(loaded.model, snapshot)
    with pytest.raises(ConfigError, match=r"does not divide"):
        Optimizer(loaded.model, session=session).apply(Int4WeightConfig(indivisible="error"))
    assert Int4WeightConfig().indivisible_policy() == "pad"  # left at the default group size: padded
    assert Int4WeightConfig(group_size=64, indivisible="skip").indivisible_policy() == "skip"


def test_model_quantized_by_another_tool_is_refused(session, tiny):
    loaded = tiny("tiny:llava")
    loaded.model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(IncompatiblePassError, match=r"another tool.*gptq"):
        Optimizer(loaded.model, session=session).apply(Int4WeightConfig(**TINY))

    other = tiny("tiny:llava").model
    with torch.no_grad():
        other.model.language_model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(
            torch.zeros(74, 48, dtype=torch.int8), requires_grad=False
        )
    with pytest.raises(IncompatiblePassError, match=r"dtype torch\.int8"):
        Optimizer(other, session=session).apply(Int4WeightConfig(**TINY))


def test_int4_weight_twice_is_refused(session, tiny, tmp_path):
    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply(Int4WeightConfig(**TINY))
    with pytest.raises(IncompatiblePassError, match="already applied or planned"):
        opt.apply(Int4WeightConfig(**TINY))
    opt.export("torch", tmp_path / "out")
    reloaded = mmsdk.load(tmp_path / "out", session=session)
    snapshot = _snapshot(reloaded)
    with pytest.raises(IncompatiblePassError, match="already holds int4-weight"):
        Optimizer(reloaded, session=session).apply(Int4WeightConfig(**TINY))
    assert _unchanged(reloaded, snapshot)


def test_awq_without_calibration_and_bad_calibration_data(session, tiny):
    loaded = tiny("tiny:llava")
    loaded.processor.default_calibration = None  # no shipped fallback set for this model
    snapshot = _snapshot(loaded.model)
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply(Int4WeightConfig(**FAST_AWQ))
    with pytest.raises(CalibrationError, match="needs calibration data"):
        opt.model  # noqa: B018
    bad = sample_image(1).astype(np.float32)
    bad[2, 3] = np.nan
    with pytest.raises(CalibrationError, match="NaN"):
        opt.calibrate([(bad, "what digit is this ?")])
    with pytest.raises(CalibrationError, match="wrong modality"):
        opt.calibrate([("what digit is this ?", sample_image(2))])
    assert _unchanged(loaded.model, snapshot)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_kernel_matches_dequantized_reference_without_a_weight_copy():
    torch.manual_seed(0)
    for symmetric in (True, False):
        linear = torch.nn.Linear(256, 128, bias=True).cuda().to(torch.bfloat16)
        layer = Int4Linear.from_linear(linear, block_size=64, symmetric=symmetric)
        before = {name: b.data_ptr() for name, b in layer.named_buffers()}
        x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
        reference = torch.nn.functional.linear(x.float(), layer.dequantize(torch.float32), layer.bias.float())
        out = layer(x)
        assert {name: b.data_ptr() for name, b in layer.named_buffers()} == before, "the layer kept a weight copy"
        # bf16 activations and tensor-core products: bf16 rounding, ~1e-2 relative at most
        assert (out.float() - reference).norm() / reference.norm() < 2e-2


def test_gated_mlps_get_the_paired_kernel_body_and_keep_their_output(session, tiny, tmp_path):
    from mmsdk.plugins._forward import has_forward_body

    loaded = tiny("tiny:qwen2-vl")
    inputs = tiny_inputs(loaded.processor)
    plain = Optimizer(tiny("tiny:qwen2-vl").model, session=session).apply(Int4WeightConfig(gated_mlp_kernel=False))
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply("int4-weight")
    layers = opt.adapter.decoder_layers(opt.model)
    plain.model  # noqa: B018 - runs the pass
    records = opt.results[0].records
    assert len(records["gated_mlp"]) == len(layers) and "gated_mlp" not in plain.results[0].records
    with torch.no_grad():  # on CPU the body runs the original forward: same logits as without it
        assert torch.equal(opt.model(**inputs).logits, plain.model(**inputs).logits)
    opt.export("torch", tmp_path / "out")
    reloaded = mmsdk.load(tmp_path / "out", session=session)
    mlp = opt.adapter.mlp(opt.adapter.decoder_layers(reloaded)[0])
    assert has_forward_body(mlp)  # restore put the body back


def test_mlps_that_are_not_silu_gated_keep_their_forward(session, tiny):
    loaded = tiny("tiny:llava")
    for layer in loaded.model.model.language_model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    opt = Optimizer(loaded.model, session=session).apply("int4-weight")
    opt.model  # noqa: B018 - runs the pass
    assert opt.results[0].records["gated_mlp"] == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
# the tuner's pick, and the kind "gated" forced: one K slice (silu(gate) * up stored by the GEMV itself; 88 row
# blocks, one 64-quad step) and four (partials + epilogue)
@pytest.mark.parametrize("config", [None, (8, 64, 2, 1, "gated", 528), (8, 1, 2, 1, "gated", 528)])
def test_cuda_gated_mlp_body_matches_the_original_mlp(config, monkeypatch):
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from mmsdk.kernels import w4a16_gated
    from mmsdk.plugins.adapters.llava import LlavaAdapter
    from mmsdk.plugins.quantizers.int4_mlp import install_gated_mlp

    if config is not None:
        monkeypatch.setattr(w4a16_gated, "tuned_config", lambda *_: config)
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=256, intermediate_size=704)).cuda().to(torch.bfloat16)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, Int4Linear.from_linear(getattr(mlp, name), block_size=64))
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = mlp(x).float()
        install_gated_mlp(mlp, LlavaAdapter())
        out = mlp(x).float()
    # one bf16 rounding less than transformers (SiLU and product in fp32): ~3e-3 relative
    assert (out - reference).norm() / reference.norm() < 1e-2


def test_plus_residual_uses_a_residual_forward_only_while_nothing_else_watches():
    """``plus_residual(m, x, r)`` is ``r + m(x)``: through a module's residual forward unless hooks, forward
    wrappers or a newer body would be bypassed."""
    from mmsdk.plugins._forward import add_forward_wrapper, plus_residual, set_forward_body, set_residual_body

    class Marked(nn.Linear):
        def residual_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return residual + self(x) + 1000  # marks which path ran

    x, residual = torch.randn(2, 4), torch.randn(2, 3)
    module = Marked(4, 3)
    literal = residual + module(x)
    assert torch.equal(plus_residual(module, x, residual), literal + 1000)
    handle = module.register_forward_hook(lambda *_: None)
    assert torch.equal(plus_residual(module, x, residual), literal)  # the hook must see the call
    handle.remove()
    set_forward_body(module, lambda t: torch.zeros(2, 3))  # another pass replaced what it computes
    assert torch.equal(plus_residual(module, x, residual), residual)
    set_residual_body(module, lambda t, r: r - 1)
    assert torch.equal(plus_residual(module, x, residual), residual - 1)
    set_forward_body(module, lambda t: torch.ones(2, 3))  # a newer body: the residual body is stale
    assert torch.equal(plus_residual(module, x, residual), residual + 1)
    set_residual_body(module, lambda t, r: r - 1)
    add_forward_wrapper(module, lambda inner, t: inner(t) * 2)  # a wrapper must see the call
    assert torch.equal(plus_residual(module, x, residual), residual + 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_gated_mlp_adds_the_residual_in_its_down_projection():
    """A decoder layer's ``residual + mlp(h)`` through the gated int4 MLP: bitwise the two steps."""
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from mmsdk.plugins._forward import plus_residual
    from mmsdk.plugins.adapters.llava import LlavaAdapter
    from mmsdk.plugins.quantizers.int4_mlp import install_gated_mlp

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=256, intermediate_size=704)).cuda().to(torch.bfloat16)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, Int4Linear.from_linear(getattr(mlp, name), block_size=64))
    install_gated_mlp(mlp, LlavaAdapter())
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16) * 8
    with torch.no_grad():
        assert torch.equal(plus_residual(mlp, x, residual), residual + mlp(x))


def test_folded_norm_factors_made_inside_a_capture_are_used_but_not_kept(monkeypatch):
    """A GEMV's folded-norm factors are built once per norm weight and kept, except inside a CUDA graph capture: a
    capture only records their computation, and a dropped one (a decode step recorded for its kernels) never runs it,
    so kept factors would be garbage. The factors then handed over are the same either way."""
    from mmsdk.kernels.norm_fold import quad_factors
    from mmsdk.plugins.quantizers import int4_linear

    layer = Int4Linear(16, 8, block_size=16, dtype=torch.bfloat16)
    norm = nn.RMSNorm(16, eps=1e-6, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    expected = quad_factors(norm.weight)
    monkeypatch.setattr(int4_linear, "being_captured", lambda tensor: True)
    captured = layer.input_norm(norm)
    assert torch.equal(captured.factors, expected) and layer._factors is None
    monkeypatch.setattr(int4_linear, "being_captured", lambda tensor: False)
    eager = layer.input_norm(norm)
    assert torch.equal(eager.factors, expected) and layer._factors is not None
    assert layer.input_norm(norm).factors is eager.factors  # kept: built once


def test_referenced_global_looks_through_decorators_as_rebind_global_does():
    """What a function, or the function its decorators wrap, sees under a global name; None where none refers to it;
    after rebind_global, the new value."""
    import functools

    from mmsdk.plugins._forward import rebind_global, referenced_global

    def inner(x):
        return torch.neg(x)  # the module's global torch

    @functools.wraps(inner)
    def decorated(*args):
        return inner(*args)

    assert referenced_global(decorated, "torch") is torch
    assert referenced_global(decorated, "no_such_name") is None
    stand_in = type("StandIn", (), {"neg": staticmethod(lambda x: "rebound")})()
    rebound = rebind_global(decorated, "torch", stand_in)
    assert referenced_global(rebound, "torch") is stand_in and rebound(torch.ones(1)) == "rebound"
    assert referenced_global(decorated, "torch") is torch  # the original is left as it was
