"""Target B: Hugging Face folder + hf_quant_config.json, validated and reloaded through transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import mmsdk
from mmsdk import Optimizer
from mmsdk.plugins.backends.tensorrt_llm.validate import validate
from mmsdk.testing import tiny_inputs
from tests.trtllm_fakes import calibration_samples, fake_session, int4_config

HF_MODELS = ("tiny:llava-next", "tiny:qwen2-vl", "tiny:qwen2.5-vl")


def _keys(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return {k: (handle.get_slice(k).get_dtype(), handle.get_slice(k).get_shape()) for k in handle.keys()}


@pytest.mark.parametrize("name", HF_MODELS)
def test_unquantized_export_reloads_through_transformers(name, session, tiny, tmp_path):
    loaded = tiny(name)
    inputs = tiny_inputs(loaded.processor)
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply("qkv-fuse")
    with torch.no_grad():
        reference = opt.model(**inputs).logits
    result = opt.export("tensorrt-llm", tmp_path / "out")  # auto: the PyTorch backend runs these families
    assert result.manifest.details["target"] == "hf"
    assert result.manifest.requirements == {"tensorrt-llm": "tensorrt-llm>=1.0"}
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    report = validate(tmp_path / "out")
    assert report.ok, report.summary()
    keys = _keys(tmp_path / "out")
    assert all(dtype == "F16" for dtype, _ in keys.values())
    assert not any("qkv_proj" in k for k in keys), "fused q/k/v must be written back as Hugging Face's q/k/v"
    with torch.no_grad():
        reloaded = mmsdk.load(tmp_path / "out", session=session)(**inputs).logits
    assert (reloaded - reference).abs().max().item() < 3e-3  # measured 1.9e-4 .. 2.9e-4 (float16 weights)


@pytest.mark.parametrize("name", ("tiny:llava-next-tp", "tiny:qwen2-vl-tp", "tiny:qwen2.5-vl-tp"))
def test_int4_and_fp8_kv_export_reloads_and_folds_awq_scales(name, tmp_path):
    session = fake_session()
    loaded = session.models.get(name).build()
    inputs = tiny_inputs(loaded.processor)
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate(calibration_samples())
    opt.apply(int4_config(session), "fp8-kv")
    with torch.no_grad():
        reference = opt.model(**inputs).logits
    opt.export("tensorrt-llm", tmp_path / "out", target="B")
    report = validate(tmp_path / "out")
    assert report.ok, report.summary()
    quant = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "W4A16_AWQ" and quant["kv_cache_quant_algo"] == "FP8"
    assert quant["group_size"] == 64 and quant["pre_quant_scale"] is True
    assert any(p.startswith(("visual", "vision_tower")) for p in quant["exclude_modules"])
    keys = _keys(tmp_path / "out")
    attn = next(k for k in keys if k.endswith("layers.0.self_attn.q_proj.weight")).removesuffix("q_proj.weight")
    assert keys[attn + "q_proj.weight"] == ("U8", [128, 256])  # [out/2, in]: 4 heads x 64 rows, packed in pairs
    assert keys[attn + "q_proj.weight_scale"] == ("F16", [256, 4])  # [out, in / 64]
    assert attn + "q_proj.pre_quant_scale" not in keys and attn + "o_proj.pre_quant_scale" in keys
    assert keys[attn + "k_proj.k_scale"][0] == "F32"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt" and config["dtype"] == "float16"
    with torch.no_grad():
        reloaded = mmsdk.load(tmp_path / "out", session=session)(**inputs).logits
    # measured 6.7e-4 .. 1.0e-3: the AWQ scale now sits in the norms (q/k/v, gate/up) in float16
    assert (reloaded - reference).abs().max().item() < 5e-3


def test_tensor_names_keep_the_original_checkpoint_layout(session, tiny, tmp_path):
    loaded = tiny("tiny:llava-next")
    Optimizer(loaded.model, loaded.processor, session=session).export("tensorrt-llm", tmp_path / "out", target="hf")
    keys = _keys(tmp_path / "out")
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in keys  # what LLaVA-NeXT's mapper reads
    assert "image_newline" in keys and any(k.startswith("vision_tower.") for k in keys)
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "trtllm-serve ." in readme and 'model_type="llava_next"' in readme
