"""The memory profiler: exact accounting, independent byte counts, stages, outputs and bad input."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

import mmsdk
from mmsdk import Optimizer, PassConfig, PassSpec, Session
from mmsdk.cli import main as cli
from mmsdk.core.errors import OutputExistsError, UnsupportedInputError
from mmsdk.profiling import ProfileSample, measure_run
from mmsdk.profiling.accounting import TensorAccountant
from mmsdk.profiling.graph import module_dot
from mmsdk.profiling.kv import cache_bytes
from mmsdk.testing import sample_image

SAMPLE = ProfileSample(sample_image(0, 30), "what digit is this ?", max_new_tokens=3)


class Int8Linear(nn.Module):
    """Row-wise int8 weights + fp32 scales: a stand-in quantizer with bytes easy to count by hand."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        scale = linear.weight.detach().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        self.register_buffer("codes", torch.round(linear.weight.detach() / scale).to(torch.int8))
        self.register_buffer("scale", scale.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.codes.float() * self.scale).t()


class Int8MLPConfig(PassConfig):
    """No options."""


def _int8_mlp(model: nn.Module, config: Int8MLPConfig, context) -> dict:
    for layer in context.adapter.decoder_layers(model):
        mlp = context.adapter.mlp(layer)
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, name, Int8Linear(getattr(mlp, name)))
    return {}


class _TestPlugin:
    __name__ = "profile-test-plugin"

    @mmsdk.hookimpl
    def mmsdk_register_quantizers(self, register) -> None:
        register(PassSpec("test-int8-mlp", Int8MLPConfig, _int8_mlp, "int8 MLP weights (test)"))


@pytest.fixture
def plugin_session() -> Session:
    return Session.create(autoload=False, disabled=(), extra=[_TestPlugin()])


def _independent_weight_bytes(model: nn.Module) -> int:
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def test_accountant_counts_allocations_minus_frees():
    peaks = []
    weight = torch.ones(500)  # made before: a view of it (weight.t() in a forward) is no allocation
    accountant = TensorAccountant(lambda _delta, _serial: peaks.append(accountant.live), preexisting=[weight])
    with accountant:
        weight_view = weight[None, :]
        assert accountant.live == 0
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # +4000
        view = b.view(10, 100)  # a view: no new storage
        del b
        assert accountant.live == 8000  # the view keeps b's storage alive
        del view
        assert accountant.live == 4000
        c = torch.empty(250, dtype=torch.float64)  # +2000
    assert max(peaks) == 8000 and accountant.live == 6000
    del a, c, weight_view
    assert accountant.live == 0


def test_cache_with_nbytes_is_trusted_and_others_are_walked():
    class Packed:
        def __init__(self) -> None:
            self.codes = torch.zeros(100, dtype=torch.uint8)

        def nbytes(self) -> int:
            return 42

    class Plain:
        def __init__(self) -> None:
            self.layers = [{"k": torch.zeros(10), "v": torch.zeros(10)}, {"k": torch.zeros(5, dtype=torch.float16)}]

    assert cache_bytes(Packed()) == 42
    assert cache_bytes(Plain()) == 40 + 40 + 10


def test_waterfall_agrees_with_independent_counts(plugin_session):
    loaded = plugin_session.models.get("tiny:llava").build()
    expected_weights = _independent_weight_bytes(loaded.model)
    opt = Optimizer(loaded.model, loaded.processor, session=plugin_session).apply("test-int8-mlp")
    profile = opt.profile(SAMPLE)
    before, after = profile.runs
    assert before.label == "unoptimized" and after.label == "+ test-int8-mlp"
    assert before.weights_bytes == expected_weights
    # 2 layers x (gate 74x48 + up 74x48 + down 48x74) fp32 -> int8 codes + one fp32 scale per row
    per_layer = 3 * 74 * 48 * 4 - (3 * 74 * 48 + (74 + 74 + 48) * 4)
    assert before.weights_bytes - after.weights_bytes == 2 * per_layer
    assert after.weights_bytes == _independent_weight_bytes(opt.model)
    # KV: 2 layers x (K, V) x 1 KV head x head_dim 16 x fp32, for prompt + decoded tokens but the last
    tokens = before.prompt_tokens + before.new_tokens - 1
    assert before.kv_bytes == 2 * 2 * 16 * 4 * tokens == after.kv_bytes
    assert before.kv_prefill_bytes == 2 * 2 * 16 * 4 * before.prompt_tokens
    assert before.peak_bytes >= before.weights_bytes + before.kv_bytes
    assert {s.name for s in before.stages} >= {"vision_encode", "projector", "prefill", "decode"}
    assert before.stage("decode").calls == SAMPLE.max_new_tokens - 1
    assert before.weights_after_bytes == before.weights_bytes  # nothing built lazily


def test_weights_built_while_generating_are_flagged(session):
    class LazyCopy(nn.Module):
        """Keeps a copy of its weight the first time it runs, as a lazily packed kernel layout would."""

        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            self.linear = linear
            self.register_buffer("packed", None, persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.packed is None:
                self.packed = self.linear.weight.detach().clone()
            return self.linear(x)

    loaded = session.models.get("tiny:llava").build()
    loaded.model.lm_head = LazyCopy(loaded.model.lm_head)
    run = measure_run(loaded.model, loaded.processor, session.adapt(loaded.model), SAMPLE, modules=False)
    assert run.weights_after_bytes - run.weights_bytes == 101 * 48 * 4  # the lm_head copy
    from mmsdk.profiling.results import Profile, waterfall_table

    table = waterfall_table(Profile("m", "llava", "cpu", "q", (run,)))
    assert "weights grew from" in table


@pytest.mark.parametrize("name", ["tiny:qwen2-vl", "tiny:mllama", "tiny:idefics"])
def test_every_family_has_vision_prefill_decode_and_kv(name, session):
    loaded = session.models.get(name).build()
    run = measure_run(loaded.model, loaded.processor, session.adapt(loaded.model), SAMPLE, modules=False)
    assert {"vision_encode", "prefill", "decode"} <= {s.name for s in run.stages}
    assert run.kv_bytes > run.kv_prefill_bytes > 0 and run.peak_activation_bytes > 0
    assert run.weights_bytes == _independent_weight_bytes(loaded.model)


def test_report_stays_cheap_unless_measured(session):
    loaded = session.models.get("tiny:llava").build()
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply("qkv-fuse")
    report = opt.report(measure=True, sample=SAMPLE)
    assert report.profile is not None and [r.label for r in report.profile.runs] == ["unoptimized", "+ qkv-fuse"]
    assert "measured (cpu)" in report.table() and "KV cache" in report.table()
    assert opt.report().profile is None


def test_module_graph_is_a_tree_coloured_by_bytes(session):
    loaded = session.models.get("tiny:llava").build()
    run = measure_run(loaded.model, loaded.processor, session.adapt(loaded.model), SAMPLE)
    dot = module_dot(run, max_depth=2)
    assert dot.startswith('digraph "unoptimized"') and dot.rstrip().endswith("}")
    assert '"(model)" -> "model"' in dot and '"model" -> "model.vision_tower"' in dot
    assert "model.vision_tower.encoder" not in dot  # deeper than max_depth: folded into its parent
    assert "fillcolor=9" in dot  # the largest module gets the darkest colour


def test_cli_profile_writes_table_json_pngs_and_dot(tmp_path, capsys):
    out = tmp_path / "profile"
    assert cli(["profile", "tiny:llava", "--apply", "qkv-fuse", "--max-new-tokens", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "unoptimized" in printed and "+ qkv-fuse" in printed and "decode" in printed
    names = {p.name for p in out.iterdir()}
    assert {"profile.json", "profile.txt", "modules.dot"} <= names
    if importlib.util.find_spec("matplotlib") is None:  # the plots extra is missing: said, not silently skipped
        assert "pip install 'mmsdk[plots]'" in printed
    else:
        assert {"waterfall.png", "timeline.png", "modules.png"} <= names
        assert (out / "waterfall.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "profile.json").read_text())
    assert [run["label"] for run in data["runs"]] == ["unoptimized", "+ qkv-fuse"]
    assert data["runs"][0]["weights_bytes"] == data["runs"][1]["weights_bytes"]  # qkv-fuse moves bytes, adds none

    assert cli(["profile", "tiny:llava", "--out", str(out)]) == 2  # exists: refused before measuring
    assert "exists and is not empty" in capsys.readouterr().err


def test_bad_input_is_refused_clearly(session, tmp_path):
    loaded = session.models.get("tiny:llava").build()
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    if not torch.cuda.is_available():
        with pytest.raises(UnsupportedInputError, match="sees no CUDA GPU"):
            opt.profile(SAMPLE, device="cuda")
    with pytest.raises(UnsupportedInputError, match="device 'tpu'"):
        opt.profile(SAMPLE, device="tpu")
    with pytest.raises(UnsupportedInputError, match="cannot profile with a sample"):
        opt.profile(42)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    from mmsdk.profiling.output import write_profile

    profile = opt.profile(SAMPLE, modules=False)
    with pytest.raises(OutputExistsError):
        write_profile(profile, tmp_path / "out")
