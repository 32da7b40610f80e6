"""Quantized lowering: INT4 weights as MatMulNBits (bytes copied), quantized KV as GroupQueryAttention."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.session import Session
from tests import ort_standins
from tests.ort_helpers import QUESTIONS, images, torch_greedy

pytest.importorskip("onnxruntime")


def _export(tmp_path, name, passes, records=None, **options):
    session = Session.create(autoload=False, disabled=(), extra=[ort_standins.plugin(records)])
    loaded = session.models.get(name).build()
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply(*passes)
    result = opt.export("onnxruntime", tmp_path / "out", **options)
    return opt, result, tmp_path / "out"


@pytest.mark.parametrize(("name", "passes"), [("tiny:llava", ("test-int4",)), ("tiny:qwen2-vl", ("test-int4-awq",)),
                                              ("tiny:mllama", ("qkv-fuse", "test-int4"))])
def test_int4_weights_become_matmulnbits_with_the_same_bytes(name, passes, tmp_path):
    opt, result, folder = _export(tmp_path, name, passes, accuracy_level=0)
    imgs = images(2)
    assert mmsdk.load(folder).generate(imgs, list(QUESTIONS), max_new_tokens=6) == torch_greedy(opt, imgs, QUESTIONS, 6)
    model = onnx.load(str(folder / "decoder.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert "MatMulNBits" in ops and ("Mul" in ops)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    down = opt.adapter.mlp(opt.adapter.decoder_layers(opt.model)[0]).down_proj
    stored = next(v for k, v in weights.items() if k.startswith("layers.0/mlp/down_proj") and k.endswith("qweight"))
    np.testing.assert_array_equal(stored, down.qweight.numpy())  # copied, not re-quantized
    # measured: 1e-7 relative logit error (accuracy_level=0 keeps activations in float, as torch does)
    assert result.manifest.details["verification"]["relative_logit_error"] < 1e-5


def test_int8_activation_fast_path_stays_close(tmp_path):
    opt, result, folder = _export(tmp_path, "tiny:llava", ("test-int4",), accuracy_level=4)
    # measured: 1.8e-3 relative logit error with int8 activations (8.4e-4 on tiny:qwen2-vl)
    assert result.manifest.details["verification"]["relative_logit_error"] < 5e-3


def _kv_ranges(tmp_path) -> list[dict]:
    """Per-channel |K| (after RoPE) and |V| maxima of tiny:llava's float export on the sample prompts."""
    from mmsdk.runtime.generation import _decoder_step, _embed
    from mmsdk.runtime.positions import text_positions
    from mmsdk.runtime.sessions import empty_ortvalue
    from tests.ort_helpers import export_tiny

    export_tiny("tiny:llava", tmp_path / "float", verify=False)
    pipe = mmsdk.load(tmp_path / "float")
    prepared = pipe.prepare(images(2), list(QUESTIONS), 1)
    past = {f"past_key_values.{i}.{kv}": empty_ortvalue([2, 1, 0, 16], np.float32) for i in (0, 1) for kv in ("key", "value")}
    embeds = _embed(pipe, prepared.input_ids, pipe.encode(prepared).features)
    _, present = _decoder_step(pipe, embeds, prepared.attention_mask, text_positions(prepared.attention_mask), past,
                               None, None)
    layers = []
    for i in (0, 1):
        k, v = (present[f"past_key_values.{i}.{kv}"].numpy() for kv in ("key", "value"))
        layers.append({"layer": i, "kind": "self", "k_amax": np.abs(k).max((0, 2)).ravel().tolist(),
                       "v_amax": np.abs(v).max((0, 2)).ravel().tolist()})
    return layers


def _real_kv_passes() -> bool:
    return "int8-kv" in Session.create(autoload=False, disabled=()).passes


@pytest.mark.parametrize(("fmt", "dtype", "last"), [("int8", np.int8, 16), ("int4", np.uint8, 8)])
def test_quantized_kv_cache_is_gqa_with_calibrated_scales(fmt, dtype, last, tmp_path):
    if _real_kv_passes():
        pytest.skip("the KV-cache passes are installed: tests/test_ort_passes.py runs them for real")
    layers = _kv_ranges(tmp_path)
    record = {"format": fmt, "scales": "static", "method": "minmax", "num_kv_heads": 1, "head_dim": 16,
              "key_granularity": "channel", "value_granularity": "tensor", "layers": layers}
    name = f"{fmt}-kv"
    _, result, folder = _export(tmp_path, "tiny:llava", (name,), {name: record})
    model = onnx.load(str(folder / "decoder.onnx"))
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa[0].attribute}
    assert attrs["kv_cache_bit_width"] == (8 if fmt == "int8" else 4)
    # ORT's CPU kernel wants one quant type for K and V: the per-tensor V scale is widened per channel
    assert attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL"
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    qmax = 127 if fmt == "int8" else 7
    np.testing.assert_allclose(weights["layers.0/self_attn/k_scale.0"], np.asarray(layers[0]["k_amax"]) / qmax, rtol=1e-6)
    np.testing.assert_allclose(weights["layers.0/self_attn/v_scale.0"], np.full(16, max(layers[0]["v_amax"]) / qmax),
                               rtol=1e-6)
    past = {i.name: i for i in model.graph.input}["past_key_values.0.key"].type.tensor_type
    assert onnx.helper.tensor_dtype_to_np_dtype(past.elem_type) == dtype and past.shape.dim[3].dim_value == last
    pipe = mmsdk.load(folder)
    tokens = pipe.generate(images(2), list(QUESTIONS), max_new_tokens=6)
    assert all(len(row) == 6 for row in tokens)
    # measured relative last-token logit error against the float torch model: int8 1.1e-3, int4 9.2e-3
    assert result.manifest.details["verification"]["relative_logit_error"] < (0.01 if fmt == "int8" else 0.05)


def test_kv_cache_without_static_scales_is_refused(tmp_path):
    from mmsdk.core.errors import ExportError, IncompatiblePassError

    if _real_kv_passes():
        session = Session.create(autoload=False, disabled=())
        loaded = session.models.get("tiny:llava").build()
        config = session.passes.get("int8-kv").config_cls(scales="dynamic")
        opt = Optimizer(loaded.model, loaded.processor, session=session).apply(config)
        with pytest.raises(IncompatiblePassError, match="dynamic per-token scales"):
            opt.export("onnxruntime", tmp_path / "out")
    else:
        record = {"format": "int8", "scales": "dynamic", "layers": []}
        with pytest.raises(ExportError, match="no calibrated K/V ranges"):
            _export(tmp_path, "tiny:llava", ("int8-kv",), {"int8-kv": record})
    assert not (tmp_path / "out").exists()
