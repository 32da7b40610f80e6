"""Plugin discovery: entry points, provenance, off switches, broken plugins, duplicate names."""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest

import mmsdk
from mmsdk import Optimizer, Session
from mmsdk.core.errors import DuplicateNameError, PluginLoadError
from mmsdk.core.passes import PassSpec
from mmsdk.plugins.attention.qkv_fuse import QKVFuseConfig, apply_qkv_fuse

EXAMPLE = Path(__file__).parents[1] / "examples" / "plugin_package"


def _install_dist_info(root: Path, name: str, module_source: Path | str, module: str) -> None:
    """Make ``module`` importable from ``root`` with an ``mmsdk`` entry point, as pip would."""
    if isinstance(module_source, Path):
        shutil.copytree(module_source, root / module)
    else:
        (root / f"{module}.py").write_text(module_source)
    info = root / f"{module}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[mmsdk]\n{name} = {module}\n")


@pytest.fixture
def installed_example(tmp_path, monkeypatch):
    _install_dist_info(tmp_path, "example", EXAMPLE / "src" / "mmsdk_example_plugin", "mmsdk_example_plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MMSDK_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("MMSDK_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    importlib.invalidate_caches()
    yield "example"
    sys.modules.pop("mmsdk_example_plugin", None)


def test_entry_point_plugin_is_discovered_with_provenance(installed_example):
    session = Session.create()
    assert session.passes.plugin_of("bf16-weights") == "example"
    origin = session.origins["example"]
    assert (origin.distribution, origin.version, origin.builtin) == ("mmsdk-example-plugin", "0.1.0", False)
    info = next(i for i in session.plugin_infos() if i.origin.name == "example")
    assert ("quantizer pass", "bf16-weights") in info.contributions


def test_third_party_pass_runs_and_round_trips(installed_example, tiny, tmp_path):
    session = Session.create()
    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply("bf16-weights")
    before = opt.report().baseline_bytes
    assert opt.report().current_bytes < before  # vision linears now take 2 bytes per weight, not 4
    opt.export("torch", tmp_path / "out")
    assert mmsdk.load(tmp_path / "out", session=session) is not None


def test_disable_plugins_env_blocks_it(installed_example, monkeypatch):
    monkeypatch.setenv("MMSDK_DISABLE_PLUGINS", "example")
    assert "bf16-weights" not in Session.create().passes


def test_disable_autoload_env_skips_all_entry_points(installed_example, monkeypatch):
    monkeypatch.setenv("MMSDK_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "example" not in Session.create().origins


def test_builtin_can_be_disabled_but_essential_cannot(monkeypatch):
    monkeypatch.setenv("MMSDK_DISABLE_PLUGINS", "mmsdk.qkv_fuse")
    assert "qkv-fuse" not in Session.create(autoload=False).passes
    monkeypatch.setenv("MMSDK_DISABLE_PLUGINS", "mmsdk.torch")
    with pytest.raises(PluginLoadError, match="cannot be disabled"):
        Session.create(autoload=False)


def test_plugin_failing_on_import_names_itself_and_the_fix(tmp_path, monkeypatch):
    _install_dist_info(tmp_path, "broken", "raise RuntimeError('boom at import')\n", "mmsdk_broken_plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MMSDK_DISABLE_PLUGINS", raising=False)
    importlib.invalidate_caches()
    with pytest.raises(PluginLoadError) as err:
        Session.create()
    message = str(err.value)
    assert "'broken'" in message and "mmsdk-broken-plugin" in message and "boom at import" in message
    assert "MMSDK_DISABLE_PLUGINS=broken" in message
    monkeypatch.setenv("MMSDK_DISABLE_PLUGINS", "broken")
    Session.create()  # the named fix works


def test_unknown_hook_is_refused_by_check_pending():
    class Misspelled:
        __name__ = "misspelled"

        @staticmethod
        @mmsdk.hookimpl
        def mmsdk_register_pases(register):  # typo of mmsdk_register_passes
            pass

    with pytest.raises(PluginLoadError, match="does not define"):
        Session.create(autoload=False, extra=[Misspelled()])


def test_duplicate_pass_name_names_both_plugins():
    class Clash:
        __name__ = "clash"

        @staticmethod
        @mmsdk.hookimpl
        def mmsdk_register_attention(register):
            register(PassSpec(name="qkv-fuse", config_cls=QKVFuseConfig, apply=apply_qkv_fuse, summary="copy"))

    with pytest.raises(DuplicateNameError) as err:
        Session.create(autoload=False, extra=[Clash()])
    assert "mmsdk.qkv_fuse" in str(err.value) and "clash" in str(err.value)


def test_third_party_adapter_is_tried_before_builtins(tiny):
    from mmsdk.plugins.adapters.llava import LlavaAdapter

    class MyLlava(LlavaAdapter):
        name = "my-llava"

    class Plugin:
        __name__ = "mine"

        @staticmethod
        @mmsdk.hookimpl
        def mmsdk_register_adapters(register):
            register(MyLlava())

    session = Session.create(autoload=False, extra=[Plugin()])
    assert session.adapt(tiny("tiny:llava").model).name == "my-llava"
