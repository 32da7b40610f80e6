"""Bad input to the onnxruntime backend and runtime: every case is a clear error, nothing half-written."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from torch import nn

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.errors import (
    ArtifactIntegrityError,
    BackendUnavailableError,
    ExportError,
    IncompatiblePassError,
    UnsupportedInputError,
)
from mmsdk.core.passes import PassSpec
from mmsdk.core.session import Session
from mmsdk.plugins.attention.qkv_fuse import QKVFuseConfig
from tests.ort_helpers import export_tiny, images

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    export_tiny("tiny:llava", root / "llava", verify=False, max_sequence_length=40)
    export_tiny("tiny:qwen2-vl", root / "qwen", verify=False)
    return root


def test_missing_onnxruntime_names_the_extra(monkeypatch, tmp_path, folders):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    loaded = mmsdk.load_model("tiny:llava")
    with pytest.raises(BackendUnavailableError, match=r"mmsdk\[ort\]"):
        Optimizer(loaded.model, loaded.processor).export("onnxruntime", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` now raises ImportError
    with pytest.raises(BackendUnavailableError, match=r"mmsdk\[ort\]"):
        mmsdk.load(folders / "llava")


@pytest.mark.parametrize("damage", ["change", "remove"])
def test_changed_or_missing_file_is_refused_by_name(damage, folders, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(folders / "llava", copy)
    target = copy / "embedding.onnx"
    if damage == "change":
        target.write_bytes(target.read_bytes()[:-1] + b"\x00")
    else:
        target.unlink()
    with pytest.raises(ArtifactIntegrityError, match="embedding.onnx"):
        mmsdk.runtime.load(copy)


def test_image_with_wrong_channel_count(folders):
    pipe = mmsdk.load(folders / "llava")
    two_channels = np.zeros((30, 30, 2), np.uint8)
    with pytest.raises(UnsupportedInputError, match="cannot be read"):
        pipe.answer(two_channels, "what digit is this ?")


def test_preprocessed_image_of_the_wrong_size(folders):
    from mmsdk.runtime.inputs import from_batch

    pipe = mmsdk.load(folders / "llava")
    batch = pipe.processor(images=images(1), text=[pipe.processor.format_prompt("what")])
    batch["pixel_values"] = torch.zeros(1, 3, 36, 36)  # exported for 30x30
    with pytest.raises(UnsupportedInputError, match=r"\[1, 3, 36, 36\].*\[1, 3, 30, 30\]"):
        from_batch(pipe.spec, batch, 4, pipe.vision_shapes)


def test_qwen_grid_other_than_the_traced_one(folders):
    from mmsdk.runtime.inputs import from_batch

    pipe = mmsdk.load(folders / "qwen")
    batch = pipe.processor(images=images(1), text=[pipe.processor.format_prompt("what")])
    batch["image_grid_thw"] = torch.tensor([[1, 8, 8]])
    with pytest.raises(UnsupportedInputError, match=r"image_grid_thw=\[\[1, 8, 8\]\]"):
        from_batch(pipe.spec, batch, 4, pipe.vision_shapes)


def test_prompt_longer_than_the_exported_maximum(folders):
    pipe = mmsdk.load(folders / "llava")  # 40 tokens at most; the prompt alone is 31
    with pytest.raises(UnsupportedInputError, match="at most 40 tokens"):
        pipe.answer(images(1)[0], "what digit is this ?", max_new_tokens=16)
    assert pipe.answer(images(1)[0], "what digit is this ?", max_new_tokens=9)


# --- pass combinations the backend cannot express -------------------------------------------------

class _Unknown(nn.Module):
    """A norm replacement the backend knows nothing about (not RMSNorm, no lowering)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * self.weight


def _replace_norms(model, config, context):
    for layer in context.adapter.decoder_layers(model):
        layer.post_attention_layernorm = _Unknown(layer.post_attention_layernorm.weight.shape[0])


def _hook_attention(model, config, context):
    # changes what the model computes without changing any module or weight
    layer = context.adapter.decoder_layers(model)[0]
    layer.mlp.register_forward_hook(lambda module, args, out: out * 2.0)


def _plugin():
    plugin = types.SimpleNamespace(__name__="bad-passes")
    builtin_fp8 = "fp8-kv" in Session.create(autoload=False, disabled=()).passes

    @mmsdk.hookimpl
    def mmsdk_register_attention(register):
        register(PassSpec("odd-norm", QKVFuseConfig, _replace_norms, "replace norms with tanh"))
        register(PassSpec("hooked", QKVFuseConfig, _hook_attention, "double an MLP's output with a hook"))

    @mmsdk.hookimpl
    def mmsdk_register_quantizers(register):
        register(PassSpec("fp8-kv", QKVFuseConfig, lambda m, c, x: None, "stand-in for the FP8 KV pass"))

    plugin.mmsdk_register_attention = mmsdk_register_attention
    if not builtin_fp8:  # the real fp8-kv pass is refused the same way
        plugin.mmsdk_register_quantizers = mmsdk_register_quantizers
    return plugin


@pytest.mark.parametrize(("name", "error", "message"), [
    ("fp8-kv", IncompatiblePassError, "no FP8 KV-cache kernel"),
    ("odd-norm", ExportError, r"post_attention_layernorm \(_Unknown\)"),
    ("hooked", ExportError, "do not reproduce the optimized torch model"),
])
def test_inexpressible_pass_is_refused_and_nothing_is_written(name, error, message, tmp_path):
    session = Session.create(autoload=False, disabled=(), extra=[_plugin()])
    loaded = session.models.get("tiny:llava").build()
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    opt.calibrate([(images(1)[0], "what digit is this ?")]).apply(name)  # the real fp8-kv calibrates
    with pytest.raises(error, match=message):
        opt.export("onnxruntime", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging folder left behind either


def test_unknown_pass_needs_the_export_time_check(tmp_path):
    session = Session.create(autoload=False, disabled=(), extra=[_plugin()])
    loaded = session.models.get("tiny:llava").build()
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply("hooked")
    with pytest.raises(ExportError, match="verify=False"):
        opt.export("onnxruntime", tmp_path / "out", verify=False)
    assert not (tmp_path / "out").exists()
