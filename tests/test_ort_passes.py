"""Every built-in pass through the onnxruntime export: same greedy tokens as the optimized torch model.

Skipped where the pass's plugin is not installed (the quantizers and the vision/attention passes
are separate built-in plugins).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.errors import IncompatiblePassError
from mmsdk.core.session import Session
from mmsdk.testing import sample_image
from tests.ort_helpers import QUESTIONS, images, torch_greedy

pytest.importorskip("onnxruntime")

CALIBRATION = [(sample_image(seed), question) for seed in range(4) for question in QUESTIONS]


def _optimizer(name: str, *passes):
    session = Session.create(autoload=False, disabled=())
    wanted = [p if isinstance(p, str) else next(s.name for s in session.passes if type(p) is s.config_cls)
              for p in passes if not isinstance(p, type)]
    missing = [p for p in wanted if p not in session.passes]
    if missing:
        pytest.skip(f"pass(es) {missing} not installed")
    loaded = session.models.get(name).build()
    return Optimizer(loaded.model, loaded.processor, session=session)


def _config(name: str, **fields):
    session = Session.create(autoload=False, disabled=())
    if name not in session.passes:
        pytest.skip(f"pass {name} not installed")
    return session.passes.get(name).config_cls(**fields)


def _parity(opt, folder, steps=6):
    imgs = images(2)
    assert mmsdk.load(folder).generate(imgs, list(QUESTIONS), max_new_tokens=steps) == torch_greedy(
        opt, imgs, QUESTIONS, steps)


@pytest.mark.parametrize(("name", "passes"), [
    ("tiny:llava", ("qkv-fuse", "int4-weight", "int4-kv", "token-prune")),  # mmsdk demo's recipe
    ("tiny:qwen2-vl", ("int4-weight", "int8-kv")),
    ("tiny:qwen2.5-vl", ("rmsnorm-rope-fusion", "token-merge")),
    ("tiny:llava-next", ("token-merge",)),
    ("tiny:mllama", ("sparse-xattn", "int8-kv", "gated-xattn")),
    ("tiny:idefics", ("int4-weight", "sparse-xattn", "vit-prune")),
    ("tiny:llava", ("sparse-xattn",)),
])
def test_pass_combinations_keep_torch_tokens(name, passes, tmp_path):
    items = [_config("int4-weight", group_size=32, indivisible="pad", lm_head=True) if p == "int4-weight" else p
             for p in passes]
    opt = _optimizer(name, *passes).calibrate(CALIBRATION).apply(*items)
    result = opt.export("onnxruntime", tmp_path / "out")
    _parity(opt, tmp_path / "out")
    # measured relative last-token logit error against generate(): <= 1.5e-7 for every combination here,
    # 4/8-bit KV caches included (one K value rounding the other way would cost ~1e-3)
    assert result.manifest.details["verification"]["relative_logit_error"] < 0.05


def test_kv_scales_are_the_calibration_record_numbers(tmp_path):
    opt = _optimizer("tiny:llava", "int8-kv").calibrate(CALIBRATION).apply("int8-kv")
    result = opt.export("onnxruntime", tmp_path / "out")
    from mmsdk.plugins.quantizers.calibration_record import CalibrationRecord, to_onnxruntime

    record = CalibrationRecord.from_manifest(result.manifest.calibration)
    want = to_onnxruntime(record)
    model = onnx.load(str(tmp_path / "out" / "decoder.onnx"))
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for layer in (0, 1):
        np.testing.assert_allclose(weights[f"layers.{layer}/self_attn/k_scale.{layer}"], want["k_scale"][layer], rtol=1e-6)
        np.testing.assert_allclose(weights[f"layers.{layer}/self_attn/v_scale.{layer}"], want["v_scale"][layer], rtol=1e-6)


def test_int4_weight_bytes_are_copied(tmp_path):
    config = _config("int4-weight", group_size=32, indivisible="pad")
    opt = _optimizer("tiny:llava", "int4-weight").apply(config)
    opt.export("onnxruntime", tmp_path / "out")
    model = onnx.load(str(tmp_path / "out" / "decoder.onnx"))
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    down = opt.adapter.mlp(opt.adapter.decoder_layers(opt.model)[1]).down_proj
    stored = next(v for k, v in weights.items() if k.startswith("layers.1/mlp/down_proj") and k.endswith("qweight"))
    np.testing.assert_array_equal(stored, down.qweight.numpy())


def test_gated_xattn_skipped_layers_leave_the_graphs(tmp_path):
    config = _config("gated-xattn", gate_threshold=1.0)  # every |tanh(gate)| < 1: every layer skipped
    opt = _optimizer("tiny:idefics", "gated-xattn").apply(config)
    result = opt.export("onnxruntime", tmp_path / "out")
    assert "MultiHeadAttention" not in result.manifest.details["decoder"]["ops"]
    vision = onnx.load(str(tmp_path / "out" / "vision.onnx"))
    assert not any(o.name.startswith("cross_key_values") for o in vision.graph.output)
    _parity(opt, tmp_path / "out")


@pytest.mark.parametrize(("name", "passes", "message"), [
    ("tiny:llava", ("fp8-kv",), "no FP8 KV-cache kernel"),
    ("tiny:mllama", ("token-prune",), "cross-attention model"),
])
def test_inexpressible_combinations_are_refused_before_writing(name, passes, message, tmp_path):
    opt = _optimizer(name, *passes).calibrate(CALIBRATION).apply(*passes)
    with pytest.raises(IncompatiblePassError, match=message):
        opt.export("onnxruntime", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_exact_prefill_attention_is_refused(tmp_path):
    """GQA always attends to the quantized cache: with "exact" ORT's tokens left torch's at step 3 (tiny:qwen2-vl)."""
    config = _config("int4-kv", prefill_attention="exact")
    opt = _optimizer("tiny:qwen2-vl", "int4-kv").apply(config)
    with pytest.raises(IncompatiblePassError, match="prefill_attention='exact'") as error:
        opt.export("onnxruntime", tmp_path / "out")
    assert "prefill_attention='quantized'" in error.value.fix and "'torch' backend" in error.value.fix
    assert not (tmp_path / "out").exists()


def test_fastv_is_refused(tmp_path):
    config = _config("token-prune", strategy="fastv")
    opt = _optimizer("tiny:llava", "token-prune").apply(config)
    with pytest.raises(IncompatiblePassError, match="fastv"):
        opt.export("onnxruntime", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("kind", "queries", "keys"), [("self", 37, 37), ("self", 1, 45), ("cross", 9, 26)])
@pytest.mark.parametrize(("block", "density"), [(8, 0.5), (4, 0.3)])
def test_sparse_layout_in_the_graph_is_the_pass_rule(kind, queries, keys, block, density):
    block_sparse = pytest.importorskip("mmsdk.plugins.attention._block_sparse")
    import onnxruntime as ort
    import torch

    from mmsdk.plugins.backends.onnxruntime.graph import GraphBuilder
    from mmsdk.plugins.backends.onnxruntime.sparse import SparseRule, dropped_entries

    g = GraphBuilder("layout", modality="text", stage="decoder")
    inputs = [g.input("q", 1, ["b", 4, "s", 8]), g.input("k", 1, ["b", 4, "t", 8]), g.input("rows", 9, ["b", "s"]),
              g.input("cols", 9, ["b", "t"]), g.input("starts", 7, ["b"])]
    g.output(dropped_entries(g, *inputs, SparseRule(block, density, kind)), "dropped", 9, None)
    session = ort.InferenceSession(g.model().SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.RandomState(0)
    q, k = rng.randn(2, 4, queries, 8).astype(np.float32), rng.randn(2, 4, keys, 8).astype(np.float32)
    image = np.zeros((2, keys), bool)
    image[:, 5:20] = True
    rows, cols = (~image[:, keys - queries:], image) if kind == "self" else (np.ones((2, queries), bool), np.ones((2, keys), bool))
    starts = np.array([0, 3], np.int64)  # row 1 has 3 padding tokens: its grid starts 3 later
    got = session.run(None, {"q": q, "k": k, "rows": rows, "cols": cols, "starts": starts})[0]
    layout = block_sparse.block_layout(torch.tensor(q), torch.tensor(k), torch.tensor(rows), torch.tensor(cols),
                                       block=block, density=density, causal=kind == "self",
                                       starts=torch.tensor(starts))
    assert np.array_equal(got, block_sparse.drop_mask(layout, torch.tensor(rows), torch.tensor(cols)).numpy())
