"""PackedImageLayer: a cross-attention layer's image K/V, packed, written by the prefill and read by every step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmsdk.plugins.quantizers.packed_image_kv import PackedImageLayer
from mmsdk.plugins.quantizers.quantized_cache import StaticCodec


def _codecs(fmt: str, heads: int, dim: int, device: str = "cpu") -> list[StaticCodec]:
    return [StaticCodec(fmt, torch.rand(heads, dim, device=device) * 0.3 + 0.05) for _ in range(2)]


def _image_kv(batch: int, heads: int, tokens: int, dim: int, device: str = "cpu", dtype=torch.float32):
    return [torch.randn(batch, heads, tokens, dim, device=device).to(dtype) for _ in range(2)]


def test_image_layer_is_refilled_in_place_reads_empty_after_reset_and_grows_new_buffers():
    torch.manual_seed(0)
    layer = PackedImageLayer(*_codecs("int4", 2, 16), fused=True)
    first = _image_kv(1, 2, 7, 16)
    key, value = layer.update(*first)
    # markers with an element: transformers 5.24's Mllama asks keys.numel() > 0 to know an image is cached
    assert layer.keys is key and layer.values is value and key.numel() == 1
    assert layer.get_seq_length() == 7 and int(layer.length) == 7 and layer.key_codes.shape == (1, 2, 7, 8)
    buffers = layer.image_buffers()
    assert [b.data_ptr() for b in buffers] == [layer.key_codes.data_ptr(), layer.value_codes.data_ptr()]
    expected = layer.key_codec.decode(layer.key_codec.encode(first[0]), torch.float32, 16)
    assert torch.equal(layer.dequantized_heads(0, 2)[0], expected)

    layer.reset()
    assert not layer.is_initialized and layer.get_seq_length() == 0 and layer.keys is None
    assert layer.image_buffers() == []

    second = _image_kv(1, 2, 7, 16)
    layer.update(*second)  # same shape: the same buffers, a captured step's addresses still hold
    assert [b.data_ptr() for b in layer.image_buffers()] == [b.data_ptr() for b in buffers]
    assert int(layer.length) == 7 and layer.get_seq_length() == 7
    assert torch.equal(layer.key_codes, layer.key_codec.encode(second[0]).data)

    layer.update(*_image_kv(1, 2, 11, 16))  # more image tokens: new buffers (the captured step's watch sees them)
    assert layer.key_codes.shape[2] == 11 and int(layer.length) == 11
    assert layer.image_buffers()[0].data_ptr() != buffers[0].data_ptr()


def test_unfused_image_layer_reads_as_the_dequantizing_layer():
    """Without the kernel (fused=False: fast generate on CPU) keys / values are the dequantized codes, as
    QuantizedKVLayer gives them to transformers' loop."""
    from mmsdk.plugins.quantizers.quantized_cache import QuantizedKVLayer

    torch.manual_seed(1)
    codecs = _codecs("int8", 2, 16)
    states = _image_kv(2, 2, 9, 16)
    ours = PackedImageLayer(*codecs, fused=False).update(*states)
    theirs = QuantizedKVLayer(*codecs).update(*states)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def _cross_mask(batch: int, tokens: int, device: str, dtype) -> torch.Tensor:
    """Mllama's additive cross-attention mask for one decode token: the last third of row 1's tokens (its padding
    tiles) dropped."""
    mask = torch.zeros(batch, 1, 1, tokens, device=device, dtype=dtype)
    mask[1, ..., 2 * tokens // 3:] = torch.finfo(dtype).min
    return mask


def _decode_through_packed_attention(layer, query, mask):
    from mmsdk.kernels import kv_decode

    key, value = layer.keys, layer.values  # what Mllama's decode step hands the attention call
    module = SimpleNamespace(num_key_value_groups=query.shape[1] // layer.key_codes.shape[1], is_causal=False,
                             training=False)
    return kv_decode._make_attention("sdpa")(module, query, key, value, mask, scaling=query.shape[-1] ** -0.5)[0]


def _reference(layer, query, mask):
    from mmsdk.kernels.kv_decode import reference_decode_attention

    keys, values = layer.dequantized_heads(0, layer.key_codes.shape[1])
    row = mask[:, 0, -1, :] > torch.finfo(mask.dtype).min / 2
    return reference_decode_attention(query, keys, values, query.shape[-1] ** -0.5, row)


def test_decode_step_without_the_kernel_attends_the_dequantized_image_with_its_mask():
    """On CPU the packed attention reads the image layer's dequantized K/V (dequantized_heads) and keeps the
    cross-attention mask."""
    torch.manual_seed(2)
    layer = PackedImageLayer(*_codecs("int4", 2, 16), fused=True)
    layer.update(*_image_kv(2, 2, 12, 16))
    query = torch.randn(2, 6, 1, 16)
    mask = _cross_mask(2, 12, "cpu", torch.float32)
    got = _decode_through_packed_attention(layer, query, mask)
    assert torch.allclose(got.double(), _reference(layer, query, mask), atol=1e-5)
    unmasked = _decode_through_packed_attention(layer, query, torch.zeros_like(mask))
    assert not torch.allclose(got[1], unmasked[1]) and torch.allclose(got[0], unmasked[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_decode_kernel_reads_the_packed_image_with_its_mask(fmt, monkeypatch):
    """On CUDA a decode step's cross-attention runs the packed kernel over the image codes (GQA, Llama-3.2-Vision's
    head size, an image length that fills no tile exactly), with the mask's row: bf16 within 1e-2 of fp64."""
    from mmsdk.kernels import kv_decode

    torch.manual_seed(3)
    heads, kv_heads, dim, tokens = 8, 2, 128, 1601
    layer = PackedImageLayer(*_codecs(fmt, kv_heads, dim, "cuda"), fused=True)
    layer.update(*_image_kv(2, kv_heads, tokens, dim, "cuda", torch.bfloat16))
    calls, original = [], kv_decode.decode_attention
    monkeypatch.setattr(kv_decode, "decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    query = torch.randn(2, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    mask = _cross_mask(2, tokens, "cuda", torch.bfloat16)
    got = _decode_through_packed_attention(layer, query, mask)
    expected = _reference(layer, query, mask)
    assert calls and got.dtype == torch.bfloat16
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-2
    assert int(layer.length) == tokens  # a decode step leaves the image as it was



@pytest.mark.parametrize("name", ["tiny:mllama", "tiny:llava"])
def test_sparse_xattn_reads_a_packed_cache(name, session, tiny):
    """transformers' generate on CUDA gets the packed static cache, whose layers hand the attention call markers;
    sparse-xattn's layout needs the keys themselves, so it reads them dequantized: the same tokens as with the
    dequantizing cache (here on CPU, the packed cache passed in as CUDA's generate would make it)."""
    from mmsdk import Optimizer
    from mmsdk.plugins.attention.sparse_xattn import SparseXAttnConfig
    from mmsdk.plugins.quantizers.calibration_stats import cache_argument
    from mmsdk.plugins.quantizers.kv_runtime import installed_state
    from mmsdk.testing import tiny_inputs

    loaded = tiny(name)
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    opt.apply("int4-kv", SparseXAttnConfig(density=0.5, block_size=4))
    state, model = installed_state(opt.model), opt.model
    inputs = tiny_inputs(loaded.processor, ("what digit is this ?", "what digit is this ?"))

    def greedy(cache):  # the cache under the keyword this transformers takes (5.25 renamed past_key_values)
        keyword = {cache_argument(model): cache}
        return type(model).generate(model, **inputs, max_new_tokens=5, do_sample=False, **keyword)

    expected = greedy(state.new_cache())
    packed = state.static_cache(inputs["input_ids"].shape[1] + 8, fused=True)
    assert torch.equal(greedy(packed), expected)
    if name == "tiny:mllama":
        assert any(isinstance(layer, PackedImageLayer) and layer.is_initialized for layer in packed.layers)


def test_a_layer_without_calibrated_ranges_keeps_the_dequantizing_cache():
    from mmsdk.plugins.quantizers.kv_runtime import KVQuantState, LayerRanges

    ranged = LayerRanges("self", torch.ones(2, 16), torch.ones(2, 16))
    state = KVQuantState(fmt="int4", scales="static", num_layers=3, head_dim=16, group_size=16, residual_length=0,
                         layers={0: ranged, 1: LayerRanges("cross"), 2: ranged},
                         attention_config=SimpleNamespace(_attn_implementation="sdpa"))
    reason = state._packs(1) and state.packed_decode_reason(torch.device("cuda"))
    if reason == "not on CUDA or no Triton":  # checked before the ranges on a machine that cannot run the kernels
        pytest.skip(reason)
    assert "[1]" in reason and "calibrated" in reason
    state.cross_attention = False  # cross-attention K/V kept in full precision: nothing unranged is packed
    assert state.packed_decode_reason(torch.device("cuda")) is None


def test_fitting_a_static_cache_to_a_call_leaves_image_layers_alone():
    from mmsdk.kernels.chunked_prefill import size_static_cache
    from mmsdk.plugins.quantizers.static_kv import PackedStaticLayer

    codecs = _codecs("int4", 2, 16)
    text, image = PackedStaticLayer(*codecs, 4096, fused=True), PackedImageLayer(*codecs, fused=True)
    image.update(*_image_kv(1, 2, 300, 16))
    image.reset()  # a kept cache: reset, its buffers sized by the last image
    size_static_cache(SimpleNamespace(layers=[text, image]), 100)
    assert text.max_cache_len < 4096 and image.max_cache_len == 300
