"""The validator catches what TensorRT-LLM would reject or silently mis-load, and the CLI verb reports it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from mmsdk import Optimizer
from mmsdk.cli.validate import add_parser, run
from mmsdk.plugins.backends.tensorrt_llm.validate import validate
from tests.trtllm_fakes import calibration_samples, fake_session, int4_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A valid int4 + int8-kv checkpoint at tp 4 (KV heads replicated), exported once for the module."""
    session = fake_session()
    loaded = session.models.get("tiny:qwen2-vl-tp").build()
    path = tmp_path_factory.mktemp("ckpt") / "out"
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate(calibration_samples())
    opt.apply(int4_config(session), "int8-kv").export("tensorrt-llm", path, target="checkpoint", tp_size=4)
    return path


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    session = fake_session()
    loaded = session.models.get("tiny:qwen2-vl-tp").build()
    path = tmp_path_factory.mktemp("hf") / "out"
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate(calibration_samples())
    opt.apply(int4_config(session), "fp8-kv").export("tensorrt-llm", path, target="hf")
    return path


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src / "llm", dst)
    return dst


def _edit_rank(folder: Path, rank: int, edit) -> None:
    path = folder / f"rank{rank}.safetensors"
    tensors = safetensors.torch.load_file(str(path))
    edit(tensors)
    safetensors.torch.save_file(tensors, str(path))


def _messages(folder: Path) -> str:
    report = validate(folder)
    assert not report.ok
    return "\n".join(str(f) for f in report.errors)


def test_exports_are_valid(checkpoint, hf_folder):
    assert validate(checkpoint).ok and validate(checkpoint / "llm").ok and validate(checkpoint / "vision").ok
    assert validate(hf_folder).ok


def test_a_wrong_dtype_is_an_error(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "llm")
    _edit_rank(folder, 0, lambda t: t.update({"transformer.ln_f.weight": t["transformer.ln_f.weight"].float()}))
    assert "transformer.ln_f.weight has dtype F32, expected F16" in _messages(folder)


def test_missing_extra_and_misshapen_tensors_are_errors(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "llm")

    def edit(t):
        del t["transformer.layers.0.mlp.fc.weight"]
        t["transformer.layers.0.attention.rotary_inv_freq"] = torch.ones(4)
        t["transformer.layers.1.mlp.proj.weights_scaling_factor"] = torch.ones(256, 3, dtype=torch.float16)

    _edit_rank(folder, 1, edit)
    text = _messages(folder)
    assert "transformer.layers.0.mlp.fc.weight is missing" in text
    assert "rotary_inv_freq is not expected" in text
    assert "weights_scaling_factor has shape [256, 3], expected [256, 2]" in text


def test_replicated_kv_heads_must_agree(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "llm")
    _edit_rank(folder, 1, lambda t: t["transformer.layers.0.attention.qkv.bias"][64:].add_(1.0))
    assert "replicated KV head 0 differs between ranks" in _messages(folder)


def test_config_errors_mirror_trtllm_parsing(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "llm")
    config = json.loads((folder / "config.json").read_text())
    config["mapping"]["rank"] = 0
    config["quantization"].update(kv_cache_quant_algo="INT4", group_size=32, mystery=1)
    config["quantization"]["exclude_modules"] = ["*router"]
    (folder / "config.json").write_text(json.dumps(config))
    text = _messages(folder)
    for expected in ("mapping has keys Mapping() does not take: ['rank']", "kv_cache_quant_algo 'INT4'",
                     "group_size 32", "QuantConfig() does not take: ['mystery']", "does not cover 'lm_head'"):
        assert expected in text


def test_missing_rank_file_and_bad_vision_io(checkpoint, tmp_path):
    import shutil

    root = tmp_path / "export"
    shutil.copytree(checkpoint, root)
    (root / "llm" / "rank3.safetensors").unlink()
    import onnx

    model = onnx.load(str(root / "vision" / "model.onnx"))
    model.graph.input[1].name = "rotary"
    for node in model.graph.node:
        node.input[:] = ["rotary" if i == "rotary_pos_emb" else i for i in node.input]
    onnx.save(model, str(root / "vision" / "model.onnx"))
    text = _messages(root)
    assert "rank3.safetensors: missing" in text
    assert "inputs are ['input', 'rotary', 'attention_mask']" in text


def test_hf_folder_rules(hf_folder, tmp_path):
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder, ignore=shutil.ignore_patterns("manifest.json"))
    quant = json.loads((folder / "hf_quant_config.json").read_text())
    quant["quantization"]["kv_cache_quant_algo"] = "INT8"
    (folder / "hf_quant_config.json").write_text(json.dumps(quant))
    state = safetensors.torch.load_file(str(folder / "model.safetensors"))
    state["model.layers.0.self_attn.q_proj.pre_quant_scale"] = torch.ones(256, dtype=torch.float16)
    del state["model.layers.1.self_attn.v_proj.v_scale"]
    safetensors.torch.save_file(state, str(folder / "model.safetensors"))
    text = _messages(folder)
    assert "kv_cache_quant_algo 'INT8'" in text
    assert "q_proj.pre_quant_scale: the PyTorch backend's fused qkv/gate_up loaders read no pre_quant_scale" in text
    assert "model.layers.1.self_attn.v_proj.v_scale: missing" in text


def test_cli_verb_exit_status_and_json(checkpoint, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="mmsdk")
    add_parser(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(["validate", str(checkpoint), "--json"])
    assert args.handler(args) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert run(parser.parse_args(["validate", str(tmp_path)])) == 1
    assert "no config.json" in capsys.readouterr().out


def _spec_config(**overrides):
    # specs/tensorrt-llm.md 1.2: the example config.json of LLaVA-1.5-7B (TP=2, W4A16_AWQ + INT8 KV)
    config = {"architecture": "LlamaForCausalLM", "dtype": "float16", "vocab_size": 32064, "hidden_size": 4096,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "head_size": 128,
              "hidden_act": "silu", "intermediate_size": 11008, "position_embedding_type": "rope_gpt_neox",
              "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1},
              "quantization": {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": "INT8", "group_size": 128,
                               "has_zero_point": False, "pre_quant_scale": True,
                               "exclude_modules": ["lm_head", "*lm_head", "*vocab_embedding", "*router"]}}
    config.update(overrides)
    return config


def test_expected_shapes_reproduce_the_spec_worked_examples():
    from mmsdk.plugins.backends.tensorrt_llm.validate import ValidationReport, validate_config
    from mmsdk.plugins.backends.tensorrt_llm.validate_tensors import expected_tensors

    report = ValidationReport(Path("."), "checkpoint")
    assert validate_config(_spec_config(), report) and report.ok
    t1 = expected_tensors(_spec_config(mapping={"world_size": 1, "tp_size": 1, "pp_size": 1}), 0, 0)
    layer = "transformer.layers.0."
    assert t1[layer + "attention.qkv.weight"] == ((6144, 4096), "I8")
    assert t1[layer + "attention.qkv.weights_scaling_factor"] == ((12288, 32), "F16")
    assert t1[layer + "attention.qkv.prequant_scaling_factor"] == ((4096,), "F16")
    assert t1[layer + "attention.dense.weight"] == ((2048, 4096), "I8")
    assert t1[layer + "mlp.fc.weight"] == ((5504, 4096), "I8") == t1[layer + "mlp.gate.weight"]
    assert t1[layer + "mlp.proj.weight"] == ((2048, 11008), "I8")
    assert t1[layer + "mlp.proj.weights_scaling_factor"] == ((4096, 86), "F16")
    assert t1[layer + "attention.kv_cache_scaling_factor"] == ((1,), "F32")
    fp16 = _spec_config(quantization={"quant_algo": None, "kv_cache_quant_algo": None})
    t2 = expected_tensors(fp16, 1, 0)
    assert t2[layer + "attention.qkv.weight"] == ((6144, 4096), "F16")
    assert t2[layer + "attention.dense.weight"] == ((4096, 2048), "F16")
    assert t2["lm_head.weight"] == ((16032, 4096), "F16")
    assert t2["transformer.vocab_embedding.weight"] == ((32064, 4096), "F16")
    qwen = dict(architecture="Qwen2VLForConditionalGeneration", vocab_size=152064, hidden_size=3584,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                quantization={"quant_algo": None, "kv_cache_quant_algo": None})
    q2 = expected_tensors(_spec_config(**qwen), 0, 0)
    assert q2[layer + "attention.qkv.weight"] == ((2304, 3584), "F16")
    assert q2[layer + "attention.qkv.bias"][0] == (2304,)
    assert q2["lm_head.weight"][0] == (76032, 3584) and layer + "attention.dense.bias" not in q2
    q4 = expected_tensors(_spec_config(**qwen, mapping={"world_size": 4, "tp_size": 4, "pp_size": 1}), 0, 0)
    assert q4[layer + "attention.qkv.weight"][0] == (1152, 3584)
    bad = ValidationReport(Path("."), "checkpoint")
    validate_config(_spec_config(**qwen, mapping={"world_size": 8, "tp_size": 8, "pp_size": 1}), bad)
    assert "num_attention_heads 28 is not divisible by tp_size 8" in bad.summary()
    trap = ValidationReport(Path("."), "checkpoint")
    from mmsdk.plugins.backends.tensorrt_llm.validate_tensors import _check_int4_widths

    _check_int4_widths(_spec_config(mapping={"world_size": 4, "tp_size": 4, "pp_size": 1}), trap)
    assert "mlp.fc: INT4 widths out=11008" in trap.summary()  # 11008 / 512 = 21.5: TensorRT-LLM would pad
