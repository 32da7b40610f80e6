"""Every bad input gets a clear error naming the fix, and leaves the model and the disk untouched."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import Field

import mmsdk
from mmsdk import Optimizer, PassConfig, PassSpec, Session
from mmsdk.core.adapter import CROSS_ATTENTION
from mmsdk.core.errors import (
    ArtifactIntegrityError,
    ConfigError,
    IncompatiblePassError,
    NoAdapterError,
    OutputExistsError,
    UnknownNameError,
)
from mmsdk.plugins.attention.qkv_fuse import QKVFuseConfig


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


class _XattnConfig(PassConfig):
    density: float = Field(0.5, gt=0, le=1)


class _XattnPlugin:
    __name__ = "xattn-test"

    @staticmethod
    @mmsdk.hookimpl
    def mmsdk_register_attention(register):
        register(PassSpec(name="needs-xattn", config_cls=_XattnConfig, apply=lambda m, c, ctx: None,
                          summary="test pass needing cross-attention", requires=frozenset({CROSS_ATTENTION})))


def test_optimizer_takes_what_load_model_returns(session):
    """``Optimizer(load_model(...))`` unwraps the model and its processor, as ``Optimizer("tiny:llava")`` does; a
    plain object that is no model still gets the adapter error with its fix."""
    loaded = mmsdk.load_model("tiny:llava", session=session)
    opt = Optimizer(loaded, session=session)
    assert opt.model is loaded.model and opt.processor is loaded.processor and opt.source.name == loaded.name
    with pytest.raises(NoAdapterError, match="Fix: pass adapter="):
        Optimizer(object(), session=session)


def test_unknown_pass_suggests_close_names_and_lists_known(session, tiny):
    loaded = tiny("tiny:llava")
    before = _state(loaded.model)
    with pytest.raises(UnknownNameError) as err:
        Optimizer(loaded.model, session=session).apply("qkv-fuse", "qkv_fuse")
    assert "Did you mean 'qkv-fuse'" in str(err.value) and "Known passes:" in str(err.value)
    assert _unchanged(loaded.model, before)


def test_unknown_backend_fails_before_any_pass_runs(session, tiny, tmp_path):
    loaded = tiny("tiny:llava")
    before = _state(loaded.model)
    opt = Optimizer(loaded.model, session=session).apply("qkv-fuse")
    with pytest.raises(UnknownNameError, match="Unknown backend 'tourch'.*Did you mean 'torch'"):
        opt.export("tourch", tmp_path / "out")
    assert _unchanged(loaded.model, before) and not (tmp_path / "out").exists()


def test_pass_that_needs_cross_attention_is_refused_on_llava(tiny):
    session = Session.create(autoload=False, extra=[_XattnPlugin()])
    loaded = tiny("tiny:llava")
    with pytest.raises(IncompatiblePassError) as err:
        Optimizer(loaded.model, session=session).apply("needs-xattn")
    assert "cross-attention" in str(err.value) and "Passes that fit this model" in str(err.value)
    Optimizer(tiny("tiny:idefics").model, session=session).apply("needs-xattn")  # fits the Flamingo family


def test_config_with_unknown_or_out_of_range_field():
    with pytest.raises(ConfigError, match="grop_size.*Extra inputs are not permitted.*Valid fields"):
        _XattnConfig(grop_size=3)
    with pytest.raises(ConfigError, match="density.*less than or equal to 1"):
        _XattnConfig(density=1.5)
    with pytest.raises(ConfigError, match="vision_tower"):
        QKVFuseConfig(vision_tower="sometimes")


def test_same_pass_twice_is_refused(session, tiny):
    loaded = tiny("tiny:llava")
    with pytest.raises(IncompatiblePassError, match="cannot run twice"):
        Optimizer(loaded.model, session=session).apply("qkv-fuse", "qkv-fuse")


def test_model_no_adapter_recognises(session):
    with pytest.raises(NoAdapterError) as err:
        Optimizer(torch.nn.Linear(3, 3), session=session)
    assert "Known adapters: " in str(err.value) and "llava" in str(err.value) and "Fix:" in str(err.value)


def test_qwen_vl_v1_remote_code_is_refused_with_a_path_forward(session):
    class QWenLMHeadModel(torch.nn.Module):  # the remote-code class name, with its visual tower
        def __init__(self):
            super().__init__()
            self.transformer = torch.nn.Module()
            self.transformer.visual = torch.nn.Linear(2, 2)

    with pytest.raises(NoAdapterError, match="remote code.*Qwen2-VL"):
        Optimizer(QWenLMHeadModel(), session=session)


def test_export_into_non_empty_folder_needs_overwrite(session, tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    opt = Optimizer(tiny("tiny:llava").model, session=session)
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        opt.export("torch", out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left behind
    opt.export("torch", out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "manifest.json").is_file()


def test_failed_export_leaves_nothing_on_disk(session, tiny, tmp_path, monkeypatch):
    from mmsdk.plugins.backends import torch as torch_backend

    def explode(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch_backend.TorchBackend, "export", explode)
    with pytest.raises(RuntimeError, match="disk full"):
        Optimizer(tiny("tiny:llava").model, session=session).export("torch", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tamper", ["change", "delete", "add"])
def test_tampered_artifact_is_refused_naming_the_file(session, tiny, tmp_path, tamper):
    out = tmp_path / "out"
    Optimizer(tiny("tiny:llava").model, session=session).apply("qkv-fuse").export("torch", out)
    if tamper == "change":
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
        match = "'config.json' was changed"
    elif tamper == "delete":
        (out / "model.safetensors").unlink()
        match = "'model.safetensors' listed in the manifest is missing"
    else:
        (out / "extra.bin").write_bytes(b"x")
        match = "not listed in the manifest: extra.bin"
    with pytest.raises(ArtifactIntegrityError, match=match):
        mmsdk.load(out, session=session)


def test_folder_without_manifest_is_not_an_artifact(session, tmp_path):
    with pytest.raises(ArtifactIntegrityError, match="no manifest.json"):
        mmsdk.load(tmp_path, session=session)


def test_apply_rejects_objects_that_are_not_passes(session, tiny):
    with pytest.raises(ConfigError, match="pass names or pass config objects"):
        Optimizer(tiny("tiny:llava").model, session=session).apply(42)


def test_a_pass_can_carry_its_config_in_its_name(session, tiny):
    from mmsdk.core.config import parse_pass_call, split_pass_list

    assert parse_pass_call("int4-weight(group_size=64, method=awq, exclude=[\"*.o_proj\"])") == (
        "int4-weight", {"group_size": 64, "method": "awq", "exclude": ["*.o_proj"]})
    assert split_pass_list("qkv-fuse, int4-weight(group_size=64, method=awq),int4-kv") == [
        "qkv-fuse", "int4-weight(group_size=64, method=awq)", "int4-kv"]
    spec, config = session.pass_spec("token-prune(keep_ratio=0.25)")
    assert spec.name == "token-prune" and config.keep_ratio == 0.25
    with pytest.raises(ConfigError, match=r"keep_ratio.*Valid fields"):
        session.pass_spec("token-prune(keep_ratio=2)")
    with pytest.raises(ConfigError, match=r"not field=value.*int4-weight\(group_size=64\)"):
        session.pass_spec("token-prune(0.25)")
    with pytest.raises(ConfigError, match=r"without closing"):
        session.pass_spec("token-prune(keep_ratio=0.25")
