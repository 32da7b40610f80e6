"""Combinations TensorRT-LLM cannot take are refused before anything is written, naming the alternative."""

from __future__ import annotations

import pytest
from pydantic import Field

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.config import PassConfig
from mmsdk.core.errors import ConfigError, ExportError
from mmsdk.core.passes import PassSpec
from mmsdk.plugins.backends.tensorrt_llm.families import FAMILIES
from mmsdk.plugins.backends.tensorrt_llm.options import TensorRTLLMOptions, resolve_target
from mmsdk.plugins.encoders.token_prune import TokenPruneConfig
from tests.trtllm_fakes import calibration_samples, fake_session


def _export_error(opt, tmp_path, match, **options):
    with pytest.raises(ExportError, match=match) as info:
        opt.export("tensorrt-llm", tmp_path / "out", **options)
    assert not (tmp_path / "out").exists(), "a refused export must leave nothing behind"
    return str(info.value)


def test_int4_kv_names_int8_and_fp8(tmp_path):
    session = fake_session()
    loaded = session.models.get("tiny:llava").build()
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate(calibration_samples())
    opt.apply("int4-kv")
    message = _export_error(opt, tmp_path, "no INT4 KV cache")
    assert "'int8-kv'" in message and "'fp8-kv'" in message
    # the documented opt-in: an 8-bit cache scaled from the same calibrated ranges
    result = opt.export("tensorrt-llm", tmp_path / "fallback", int4_kv_fallback="int8")
    assert result.manifest.details["kv_cache_quant_algo"] == "INT8" and result.manifest.details["kv_cache_from_int4"]


@pytest.mark.parametrize(("name", "match"), [("tiny:idefics", "no IDEFICS implementation"),
                                             ("tiny:mllama", "cross-attention decoder layers are not")])
def test_flamingo_family_is_refused_with_the_alternative(name, match, session, tiny, tmp_path):
    loaded = tiny(name)
    message = _export_error(Optimizer(loaded.model, loaded.processor, session=session), tmp_path, match)
    assert "onnxruntime" in message


def test_llava_15_is_not_on_the_pytorch_backend(session, tiny, tmp_path):
    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    _export_error(opt, tmp_path, "PyTorch backend does not run LlavaForConditionalGeneration", target="hf")
    result = opt.export("tensorrt-llm", tmp_path / "auto")  # auto falls back to the checkpoint
    assert result.manifest.details["target"] == "checkpoint"


def test_int8_kv_needs_the_checkpoint_target(tmp_path):
    session = fake_session()
    loaded = session.models.get("tiny:qwen2-vl").build()
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate(calibration_samples())
    opt.apply("int8-kv")
    message = _export_error(opt, tmp_path, "no INT8 KV cache", target="hf")
    assert "fp8-kv" in message
    auto = opt.export("tensorrt-llm", tmp_path / "auto", trtllm_version="1.2.0")
    assert auto.manifest.details["target"] == "checkpoint"
    assert auto.manifest.backend_options["trtllm_version"] == "1.2.0"
    assert auto.manifest.requirements == {"tensorrt-llm": "tensorrt-llm==1.2.*"}


def test_checkpoint_is_refused_for_versions_without_trtllm_build(session, tiny, tmp_path):
    loaded = tiny("tiny:qwen2-vl")
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    message = _export_error(opt, tmp_path, "no longer ships trtllm-build", target="A", trtllm_version="1.4.0")
    assert "target='hf'" in message


def test_kv_scales_come_from_calibration_and_int8_needs_it():
    from types import SimpleNamespace

    from mmsdk.plugins.backends.tensorrt_llm.kv_scales import kv_scales

    def context(records, calibration=None):
        result = SimpleNamespace(records=records)
        return SimpleNamespace(result=lambda name: result if name == "ptq-align" else None, calibration=calibration)

    calibrated = context({"kv_amax": {"0": {"k": [1.0, 254.0], "v": 3.0}, "1": {"k": 2.0, "v": 127.0}}})
    assert kv_scales(calibrated, "INT8", 2) == ({0: 2.0, 1: 1.0}, True)  # max(K, V) amax / 127
    assert kv_scales(calibrated, "FP8", 2)[0][0] == pytest.approx(254.0 / 448)
    assert kv_scales(context({}), "FP8", 2) == ({0: 1.0, 1: 1.0}, False)  # TensorRT-LLM's own default
    with pytest.raises(ExportError, match="INT8 KV cache needs calibrated scales"):
        kv_scales(context({}), "INT8", 2)
    with pytest.raises(ExportError, match=r"no amax for decoder layer\(s\) \[2\]"):
        kv_scales(calibrated, "INT8", 3)
    # the manifest's calibration record (what ptq-align / the KV passes write) comes first
    record = {"kv_cache": {"scales": "static", "layers": [
        {"layer": 0, "kind": "self", "k_amax": [0.5, 127.0], "v_amax": [1.0]},
        {"layer": 1, "kind": "self", "k_amax": [2.0], "v_amax": [254.0]}]}}
    assert kv_scales(context({}, record), "INT8", 2) == ({0: 1.0, 1: 2.0}, True)
    with pytest.raises(ExportError, match="dynamic per-token scales"):
        kv_scales(context({}, {"kv_cache": {**record["kv_cache"], "scales": "dynamic"}}), "INT8", 2)


def test_target_and_version_rules():
    family = FAMILIES["Qwen2VLForConditionalGeneration"]
    assert resolve_target(TensorRTLLMOptions(), family, None).target == "hf"
    assert resolve_target(TensorRTLLMOptions(tp_size=2), family, None).target == "checkpoint"
    assert resolve_target(TensorRTLLMOptions(trtllm_version="0.21.0"), family, None).target == "checkpoint"
    assert resolve_target(TensorRTLLMOptions(target="A"), family, "FP8").target == "checkpoint"
    with pytest.raises(ExportError, match="only apply to target='checkpoint'"):
        resolve_target(TensorRTLLMOptions(target="hf", tp_size=2), family, None)
    with pytest.raises(ConfigError, match="not a version number"):
        TensorRTLLMOptions(trtllm_version="latest")
    with pytest.raises(ConfigError, match="target"):
        TensorRTLLMOptions(target="engine")


class _VitPruneConfig(PassConfig):
    heads: int = Field(1)


def _vision_pass_session():
    from mmsdk.core.session import Session

    vit = PassSpec(name="vit-prune-standin", config_cls=_VitPruneConfig, apply=lambda m, c, x: {}, summary="stand-in")
    plugin = type("P", (), {"__name__": "prune", "mmsdk_register_encoders": mmsdk.hookimpl(
        lambda register: register(vit))})
    return Session.create(autoload=False, disabled=(), extra=[plugin])


@pytest.mark.parametrize("strategy", ["visionzip", "fastv"])
def test_token_pruning_is_refused_with_the_reason(strategy, tmp_path):
    session = _vision_pass_session()
    loaded = session.models.get("tiny:qwen2-vl").build()
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply(TokenPruneConfig(strategy=strategy))
    for target in ("checkpoint", "hf"):
        message = _export_error(opt, tmp_path, f"strategy '{strategy}'", target=target)
        assert "original positions" in message and "ONNX Runtime" in message


def test_vision_tower_passes_need_the_checkpoint_target(tmp_path):
    session = _vision_pass_session()
    loaded = session.models.get("tiny:qwen2-vl").build()
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply("vit-prune-standin")
    _export_error(opt, tmp_path, "runs its own vision code", target="hf")
    opt.export("tensorrt-llm", tmp_path / "ckpt", target="checkpoint")  # the vision ONNX keeps the change


def test_a_module_nobody_lowers_is_named(session, tiny, tmp_path):
    import torch

    class Mystery(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    loaded = tiny("tiny:llava")
    mlp = loaded.model.model.language_model.layers[1].mlp
    mlp.down_proj = Mystery(mlp.down_proj)
    message = _export_error(Optimizer(loaded.model, loaded.processor, session=session), tmp_path,
                            "does not know how to write", target="checkpoint")
    assert "layers.1.mlp.down_proj (Mystery)" in message and "mmsdk_lower" in message


def test_a_plugin_module_is_written_through_mmsdk_lower(tiny, tmp_path):
    import torch

    from mmsdk.core.session import Session
    from mmsdk.plugins.backends.tensorrt_llm.lowering import DenseLinear

    class Scaled(torch.nn.Module):
        """A third-party layer: y = 2 * linear(x)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return 2 * self.inner(x)

    class Lowering:
        __name__ = "scaled-lowering"

        @mmsdk.hookimpl
        def mmsdk_lower(self, module, target):
            if target.backend == "tensorrt-llm" and isinstance(module, Scaled):
                return DenseLinear(2 * module.inner.weight.detach())
            return None

    session = Session.create(autoload=False, disabled=(), extra=[Lowering()])
    loaded = session.models.get("tiny:llava").build()
    mlp = loaded.model.model.language_model.layers[0].mlp
    mlp.down_proj = Scaled(mlp.down_proj)
    from mmsdk.testing import tiny_inputs

    inputs = tiny_inputs(loaded.processor)
    with torch.no_grad():
        reference = loaded.model(**inputs).logits
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    opt.export("tensorrt-llm", tmp_path / "out", dtype="float32")
    logits = mmsdk.load(tmp_path / "out", session=session).logits(inputs)
    assert (logits - reference).abs().max().item() < 1e-5  # measured 1.8e-7
