"""ptq-align and the calibration record: one schema, per-target scales by the specs' formulas, one shared set."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.datasets import DatasetSource, VQAExample
from mmsdk.core.errors import CalibrationError, ExportError
from mmsdk.core.session import Session
from mmsdk.plugins.quantizers.calibration_record import CalibrationRecord, to_onnxruntime, to_tensorrt_llm
from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig
from mmsdk.plugins.quantizers.kv_cache import Int4KVConfig
from mmsdk.testing import sample_image

CALIBRATION = [(sample_image(300 + i), "what digit is this ?") for i in range(4)]


def _record(fmt: str | None = "int8", scales: str = "static") -> CalibrationRecord:
    layer = {"layer": 0, "kind": "self", "k_amax": [1.4, 0.0, 7.0, 2.8], "v_amax": [0.5, 2.54, 1.0, 0.2]}
    cross = {"layer": 1, "kind": "cross", "k_amax": [8.96, 1.0, 1.0, 1.0], "v_amax": [4.48, 1.0, 1.0, 1.0]}
    kv = {"format": fmt, "scales": scales, "num_kv_heads": 2, "head_dim": 2, "layers": [layer, cross]}
    awq = {"group_size": 64, "symmetric": True, "prequant": {"model.layers.0.mlp.up_proj": [0.5, 2.0]}}
    ranges = {
        "model.layers.0.mlp.up_proj": {
            "abs_max": 12.7,
            "minimum": -3.0,
            "maximum": 12.7,
            "channel_abs_mean": [1.0, 2.0],
            "channel_abs_max": [12.7, 3.0],
        }
    }
    return CalibrationRecord.model_validate(
        {"calibration_set": "custom", "samples": 4, "ranges": ranges, "kv_cache": kv, "awq": awq}
    )


def test_onnxruntime_scales_are_amax_over_7_and_127():
    record = _record("int4")
    ort = to_onnxruntime(record)
    assert ort["kv_cache_bit_width"] == 4 and ort["cache_dtype"] == "uint8" and ort["k_quant_type"] == "PER_CHANNEL"
    assert ort["k_scale"][0] == pytest.approx([0.2, 1.0, 1.0, 0.4])  # amax/7; a zero range gives scale 1
    assert list(ort["k_scale"]) == [0]  # cross-attention runs as MultiHeadAttention: no quantized cache in ORT
    int8 = to_onnxruntime(record, "int8")
    assert int8["v_scale"][0] == pytest.approx([0.5 / 127, 0.02, 1 / 127, 0.2 / 127])
    assert int8["qdq"]["model.layers.0.mlp.up_proj"]["scale"] == pytest.approx(0.1)  # 12.7 / 127


def test_tensorrt_llm_scales_are_per_layer_amax_over_127_and_448():
    trt = to_tensorrt_llm(_record("fp8"))
    assert trt["kv_cache_quant_algo"] == "FP8"
    assert trt["layers"][1]["kv_cache_scaling_factor"] == pytest.approx(0.02)  # max(k, v) = 8.96; 8.96 / 448
    assert trt["layers"][0]["k_scale"] == pytest.approx(7.0 / 448) and trt["layers"][0]["v_scale"] == pytest.approx(
        2.54 / 448
    )
    assert to_tensorrt_llm(_record("int8"))["layers"][0]["kv_cache_scaling_factor"] == pytest.approx(7.0 / 127)
    assert trt["awq"]["pre_quant_scale"]["model.layers.0.mlp.up_proj"] == [0.5, 2.0]
    assert trt["awq"]["group_size"] == 64 and trt["awq"]["has_zero_point"] is False


def test_int4_kv_for_tensorrt_llm_is_refused_or_explicitly_requantized():
    with pytest.raises(ExportError, match="no INT4 KV cache"):
        to_tensorrt_llm(_record("int4"))
    fallback = to_tensorrt_llm(_record("int4"), int4_fallback="int8")
    assert fallback["kv_cache_quant_algo"] == "INT8" and fallback["layers"][0]["k_scale"] == pytest.approx(7.0 / 127)


def test_dynamic_scales_are_refused_by_both_exporters():
    for convert in (to_onnxruntime, to_tensorrt_llm):
        with pytest.raises(ExportError, match="dynamic per-token scales"):
            convert(_record("int4", scales="dynamic"))


def test_schema_round_trips_through_json_and_refuses_unknown_fields():
    record = _record()
    assert CalibrationRecord.model_validate_json(record.model_dump_json()) == record
    with pytest.raises(ValueError, match="extra"):
        CalibrationRecord.model_validate({"kv_scales": {}})


def test_ptq_align_ranges_are_the_ones_every_later_pass_and_the_manifest_use(session, tiny, tmp_path):
    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate(CALIBRATION)
    opt.apply("ptq-align", Int4WeightConfig(method="awq", group_size=32, indivisible="pad", awq_grid=4), "int4-kv")
    result = opt.export("torch", tmp_path / "out")
    record = CalibrationRecord.from_manifest(result.manifest.calibration)
    assert record.kv_ranges is not None and record.kv_cache is not None and record.awq is not None
    assert [layer.k_amax for layer in record.kv_cache.layers] == [layer.k_amax for layer in record.kv_ranges.layers]
    assert len(record.kv_cache.layers[0].k_amax) == 16  # 1 KV head x 16 channels
    assert set(record.ranges) >= set(record.awq.prequant)  # every AWQ linear has its input range recorded
    reloaded = mmsdk.Manifest.read(tmp_path / "out")
    assert reloaded.calibration == result.manifest.calibration


def test_vision_tower_traced_once_per_image_across_passes(session, tiny):
    loaded = tiny("tiny:qwen2-vl")
    calls = []
    loaded.model.model.visual.patch_embed.register_forward_hook(lambda *args: calls.append(1))  # inside the tower
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate(CALIBRATION)
    opt.apply("ptq-align", Int4KVConfig(calibration="ste", ste_steps=8)).model  # noqa: B018
    # ptq-align ran 4 prompts, int4-kv's STE 4 teacher + 8 student forwards: every one after the first 4 is cached
    assert len(calls) == len(CALIBRATION)


class _Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> tuple[np.ndarray, str]:
        return sample_image(index), "is it even ?"


def _digits_plugin() -> types.ModuleType:
    plugin = types.ModuleType("fake_digits")

    def load(split: str) -> list[VQAExample]:
        return [VQAExample(sample_image(400 + i), "what digit is this ?", str(i)) for i in range(3)]

    @mmsdk.hookimpl
    def mmsdk_register_datasets(register):
        register(DatasetSource(name="digits", load=load, summary="test stand-in"))

    plugin.mmsdk_register_datasets = mmsdk_register_datasets
    return plugin


def test_calibrate_takes_pairs_a_dataset_or_a_shipped_name_and_defaults_for_embedded_models(tiny):
    session = Session.create(autoload=False, disabled=())
    if "digits" not in session.datasets:  # the shipped set, or a stand-in where it is not installed
        session = Session.create(autoload=False, disabled=(), extra=[_digits_plugin()])
    loaded = session.models.get("tiny:llava").build()
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    assert len(opt.calibrate(CALIBRATION).calibration) == 4
    assert len(opt.calibrate(_Pairs()).calibration) == 3
    assert opt.calibrate("digits").calibration.name == "digits"

    fresh = session.models.get("tiny:llava").build()
    opt = Optimizer(fresh.model, fresh.processor, session=session).apply("ptq-align")
    opt.model  # noqa: B018 - no calibrate(): the embedded processor's default set is used
    assert opt.calibration is not None and opt.calibration.name == "digits"
    assert opt.export_context().calibration["calibration_set"] == "digits"


def test_wrong_modality_and_non_finite_calibration_data_are_refused(session, tiny):
    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    audio = np.random.RandomState(0).rand(16000).astype(np.float32)
    with pytest.raises(CalibrationError, match="shape"):
        opt.calibrate([(audio, "what is said ?")])
    with pytest.raises(CalibrationError, match="no image"):
        opt.calibrate([(None, "what digit is this ?")])
    image = sample_image(0).astype(np.float32)
    image[0, 0] = np.inf
    with pytest.raises(CalibrationError, match="NaN/inf"):
        opt.calibrate([(image, "what digit is this ?")])
    assert opt.calibration is None


@pytest.mark.parametrize(("fmt", "bits", "granularity"), [("int4", 4, "channel"), ("int8", 8, "tensor")])
def test_onnxruntime_gqa_stores_the_same_codes_as_the_torch_cache(fmt, bits, granularity):
    """The exported scales make ORT's GroupQueryAttention write byte-identical K/V to mmsdk's torch cache."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from mmsdk.plugins.quantizers.kv_runtime import KVQuantState, LayerRanges

    torch.manual_seed(0)
    heads, kv_heads, dim, tokens = 4, 2, 16, 5
    q, k, v = (
        torch.randn(1, tokens, heads * dim),
        torch.randn(1, tokens, kv_heads * dim),
        torch.randn(1, tokens, kv_heads * dim),
    )
    k_bnsh, v_bnsh = (t.reshape(1, tokens, kv_heads, dim).transpose(1, 2) for t in (k, v))
    k_amax, v_amax = k_bnsh.abs().amax(dim=(0, 2)), v_bnsh.abs().amax(dim=(0, 2))  # [kv_heads, dim]
    layer = {"layer": 0, "kind": "self", "k_amax": k_amax.flatten().tolist(), "v_amax": v_amax.flatten().tolist()}
    record = CalibrationRecord.model_validate(
        {
            "kv_cache": {
                "format": fmt,
                "num_kv_heads": kv_heads,
                "head_dim": dim,
                "layers": [layer],
                "key_granularity": granularity,
                "value_granularity": granularity,
            }
        }
    )
    scales = to_onnxruntime(record)
    quant = scales["k_quant_type"]
    cache_type = TensorProto.UINT8 if bits == 4 else TensorProto.INT8
    last = dim // 2 if bits == 4 else dim
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "pk", "pv", "seqlens", "total", "", "", "", "", "", "ks", "vs"],
        ["out", "present_k", "present_v"],
        domain="com.microsoft",
        num_heads=heads,
        kv_num_heads=kv_heads,
        k_quant_type=quant,
        v_quant_type=quant,
        kv_cache_bit_width=bits,
    )
    floats = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "s", w])
        for n, w in (("q", heads * dim), ("k", kv_heads * dim), ("v", kv_heads * dim))
    ]
    caches = [helper.make_tensor_value_info(n, cache_type, [1, kv_heads, "p", last]) for n in ("pk", "pv")]
    lengths = [
        helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
    ]
    outs = [
        helper.make_tensor_value_info(n, t, None)
        for n, t in (("out", TensorProto.FLOAT), ("present_k", cache_type), ("present_v", cache_type))
    ]
    inits = [
        numpy_helper.from_array(np.asarray(scales["k_scale"][0], np.float32), "ks"),
        numpy_helper.from_array(np.asarray(scales["v_scale"][0], np.float32), "vs"),
    ]
    graph = helper.make_graph([node], "g", floats + caches + lengths, outs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    empty = np.zeros((1, kv_heads, 0, last), np.uint8 if bits == 4 else np.int8)
    feeds = {
        "q": q.numpy(),
        "k": k.numpy(),
        "v": v.numpy(),
        "pk": empty,
        "pv": empty,
        "seqlens": np.array([tokens - 1], np.int32),
        "total": np.array(tokens, np.int32),
    }
    _, present_k, present_v = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )

    state = KVQuantState(
        fmt=fmt,
        scales="static",
        num_layers=1,
        head_dim=dim,
        group_size=dim,
        residual_length=0,
        key_granularity=granularity,
        value_granularity=granularity,
        layers={0: LayerRanges("self", k_amax, v_amax)},
    )
    cache_layer = state.layer(0)
    cache_layer.update(k_bnsh, v_bnsh)
    # measured: byte-identical (0 differing codes) for int4 per channel and int8 per tensor
    assert np.array_equal(cache_layer._k.data.numpy(), present_k)
    assert np.array_equal(cache_layer._v.data.numpy(), present_v)
