"""Fast generate (static cache + CUDA-graph decode): same tokens as transformers' greedy generate.

On CPU the same code runs without graphs (``graphs=False``), which checks the cache, position and
end-of-sequence logic; the CUDA test runs the graphs themselves.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext

import pytest
import torch

from mmsdk import Optimizer
from mmsdk.kernels import decode_state, fast_generate
from mmsdk.kernels.decode_state import capacity_for, kept
from mmsdk.kernels.fast_generate import _Generator, release, unsupported_reason
from mmsdk.kernels.fast_generate_scope import Unsupported
from mmsdk.plugins.encoders.token_prune import TokenPruneConfig
from mmsdk.plugins.quantizers.int4_linear import Int4Linear
from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig
from mmsdk.plugins.quantizers.kv_cache import Int4KVConfig
from mmsdk.plugins.quantizers.kv_runtime import installed_state
from mmsdk.testing import tiny_inputs

QUESTIONS = ("what digit is this ?", "what digit is this ?")  # no padding: the fast path refuses padded batches


def _optimized(tiny, session, name, passes):
    """(optimizer of the tiny model ``name`` with ``passes`` applied, inputs for the test questions)."""
    loaded = tiny(name)
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    if passes:
        opt.apply(*passes)
    return opt, tiny_inputs(loaded.processor, QUESTIONS)


def _greedy(model, inputs, new_tokens, **kwargs):
    """transformers' greedy generate, its decode steps' attention as fast generate's (on CUDA, grouped-query heads
    take mmsdk.kernels.grouped_decode's kernel, checked against fp64 in tests/test_grouped_decode.py; elsewhere
    nothing changes): these tests check the static cache and the graphs, which a near-tie of a tiny random model
    between two attention kernels' roundings would hide. A model with a KV-cache pass runs the packed kernels in
    both already (and its cache is chosen by the attention implementation's name, which must stay the pass's)."""
    from mmsdk.kernels.grouped_decode import grouped_decode_steps

    scope = grouped_decode_steps(model.config.get_text_config()) if installed_state(model) is None else nullcontext()
    with scope:
        return type(model).generate(model, **inputs, max_new_tokens=new_tokens, do_sample=False, **kwargs)


# the LM head quantized too (int4-weight's lm_head=True): the step's last GEMV is an int4 one
INT4_HEAD = Int4WeightConfig(indivisible="pad", lm_head=True)


@pytest.mark.parametrize("name,passes", [("tiny:llava", ()), ("tiny:qwen2-vl", ()),
                                         ("tiny:llava", ("token-prune",)), ("tiny:llava", ("int4-kv",)),
                                         ("tiny:llava", ("fp8-kv",)), ("tiny:qwen2-vl", ("fp8-kv",)),
                                         ("tiny:qwen2-vl", (INT4_HEAD, "int4-kv"))])
def test_static_path_matches_transformers_greedy_on_cpu(name, passes, session, tiny):
    opt, inputs = _optimized(tiny, session, name, passes)
    model = opt.model
    if INT4_HEAD in passes:
        assert isinstance(model.lm_head, Int4Linear)
    expected = _greedy(model, inputs, 7)
    got = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 7}, graphs=False).run()
    assert torch.equal(got, expected)


def _cross_attention_model(tiny, session, name, passes, device="cpu", dtype=torch.float32, loaded=None):
    """A tiny cross-attention model (``loaded``, else the tiny model ``name``) with its language model's matrices
    redrawn (std 0.05, seeded) and its cross-attention gates opened (tanh 0.995): at their own initialisation every
    answer is one token whatever the image, which would hide a decode step that lost the image or its mask."""
    loaded = loaded or tiny(name)
    opt = Optimizer(loaded.model.to(device, dtype), loaded.processor, session=session)
    model, adapter = opt.model, opt.adapter
    vision = {id(p) for part in (adapter.vision_tower(model), adapter.projector(model)) if part is not None
              for p in part.parameters()}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        matrices = [p for p in adapter.language_model(model).parameters() if p.dim() == 2 and id(p) not in vision]
        for weight in [*matrices, adapter.lm_head(model).weight]:
            weight.copy_(torch.randn(weight.shape, generator=generator).to(weight) * 0.05)
        for block in adapter.cross_attention_blocks(model):
            for gate in block.gate_names:
                getattr(block.module, gate).fill_(3.0)
    if passes:
        opt.apply(*passes)
    return opt, {k: v.to(device) for k, v in tiny_inputs(loaded.processor, QUESTIONS).items()}


# per cross-attention family: the generate() input that says which text tokens see which image
IMAGE_MASKS = {"tiny:mllama": "cross_attention_mask", "tiny:idefics": "image_attention_mask"}


def _answers_with_an_image_mask(opt, inputs, key):
    """The fast path's answers (no graphs) for ``inputs`` and for a copy whose image mask ``key`` makes the second
    row's text from its third token on ignore its image; each equal to transformers' greedy generate, and the first
    row's the same in both."""
    masked = dict(inputs, **{key: inputs[key].clone()})
    masked[key][1, 3:] = 0
    answers = []
    for case in (inputs, masked):
        expected = _greedy(opt.model, case, 8)
        got = _Generator(opt.model, opt.adapter, {**case, "max_new_tokens": 8}, graphs=False).run()
        assert torch.equal(got, expected)
        answers.append(got)
    assert torch.equal(answers[0][0], answers[1][0])
    return answers


@pytest.mark.parametrize("name,passes", [("tiny:mllama", ()), ("tiny:mllama", ("gated-xattn",)),
                                         ("tiny:mllama", (INT4_HEAD,)),
                                         ("tiny:mllama", ("qkv-fuse", INT4_HEAD, "rmsnorm-rope-fusion")),
                                         ("tiny:idefics", ()),
                                         ("tiny:idefics", ("gated-xattn",))])
def test_cross_attention_models_match_transformers_greedy_on_cpu(name, passes, session, tiny):
    """Mllama keeps its image K/V in the cache (written by the prefill, read by every decode step); IDEFICS gets the
    prefill's image states again at every step. Both take a per-token image mask whose last row transformers'
    generate repeats for every new token."""
    from mmsdk.kernels.cross_attention_decode import ImageKVLayer

    opt, inputs = _cross_attention_model(tiny, session, name, passes)
    model = opt.model
    answers = _answers_with_an_image_mask(opt, inputs, IMAGE_MASKS[name])
    if INT4_HEAD not in passes:  # the mask changes these models' answers (with int4 weights the row's tokens coincide)
        assert not torch.equal(answers[0][1], answers[1][1])
    assert _reason_on_cuda(model, tiny(name).processor) is None  # generate() on CUDA takes this path
    cached = [block.decoder_index for block in opt.adapter.cross_attention_blocks(model) if block.kv_cached]
    layers = kept(model).cache.layers
    assert all(isinstance(layers[i], ImageKVLayer) == (i in cached) for i in range(len(layers)))
    assert bool(cached) == (name == "tiny:mllama")


@pytest.mark.parametrize("passes", [(), ("int4-kv",)])
def test_kept_cross_attention_state_follows_each_call_of_a_mllama(passes, session, tiny, monkeypatch):
    """Calls that reuse the kept cache: a text-only call after an image call must not see the old image (its image
    layers read as empty), and a call with more images, which the image layers must hold in new tensors, must get a
    step built for them (no cross-attention mask: nothing else in the step's inputs would tell)."""
    opt, inputs = _cross_attention_model(tiny, session, "tiny:mllama", passes)
    model = opt.model
    unmasked = {k: v for k, v in inputs.items() if k != "cross_attention_mask"}
    text_only = {k: inputs[k] for k in ("input_ids", "attention_mask")}
    generator = torch.Generator().manual_seed(5)
    second = unmasked["pixel_values"] + torch.randn(unmasked["pixel_values"].shape, generator=generator)
    two_images = dict(unmasked, pixel_values=torch.cat([unmasked["pixel_values"], second], dim=1),
                      aspect_ratio_ids=unmasked["aspect_ratio_ids"].repeat(1, 2),
                      aspect_ratio_mask=unmasked["aspect_ratio_mask"].repeat(1, 2, 1))
    counts = _count_builds(monkeypatch)
    for case, builds in ((unmasked, 1), (text_only, 2), (unmasked, 3), (two_images, 4), (two_images, 4)):
        got = _Generator(model, opt.adapter, {**case, "max_new_tokens": 6}, graphs=False).run()
        assert torch.equal(got, _greedy(model, case, 6)) and counts["build"] == builds, (case.keys(), counts)


@pytest.mark.parametrize("kv", ["int4-kv", "int8-kv", "fp8-kv", Int4KVConfig(cross_attention=False)])
def test_idefics_with_a_quantized_kv_cache_matches_transformers_greedy_on_cpu(kv, session, tiny):
    """IDEFICS recomputes its image K/V from the image states at every step; with a KV-cache pass each projection's
    memo rounds them through the pass's codes. The fast path keeps its text K/V in the packed static cache and hands
    the step the prefill's image states, as without the pass."""
    from mmsdk.plugins.quantizers.static_kv import PackedStaticLayer

    opt, inputs = _cross_attention_model(tiny, session, "tiny:idefics", (kv,))
    model = opt.model
    answers = _answers_with_an_image_mask(opt, inputs, "image_attention_mask")
    assert not torch.equal(answers[0][1], answers[1][1])  # the image mask changes the answer
    assert _reason_on_cuda(model, tiny("tiny:idefics").processor) is None
    layers = kept(model).cache.layers
    assert layers and all(isinstance(layer, PackedStaticLayer) for layer in layers)
    memos = installed_state(model).memos
    assert all(memo.computed > 0 for memo in memos) and bool(memos) != isinstance(kv, Int4KVConfig)
    # transformers' own loop (beams, padding) keeps the dequantizing cache for IDEFICS: checked on the fast path only
    cache = installed_state(model).generation_cache(torch.device("cuda"), 64)
    assert not any(isinstance(layer, PackedStaticLayer) for layer in cache.layers)


@pytest.mark.parametrize("kv", ["int4-kv", "int8-kv", "fp8-kv", Int4KVConfig(cross_attention=False)])
def test_mllama_with_a_quantized_kv_cache_matches_transformers_greedy_on_cpu(kv, session, tiny):
    """Mllama's image K/V go packed into the static cache (a PackedImageLayer per cross-attention layer, sized by the
    image), or stay in full precision with cross_attention=False; the cross-attention mask still drops what it
    masks. Transformers' loop on CPU runs the dequantizing cache with the same codes."""
    from mmsdk.kernels.cross_attention_decode import ImageKVLayer
    from mmsdk.plugins.quantizers.packed_image_kv import PackedImageLayer

    opt, inputs = _cross_attention_model(tiny, session, "tiny:mllama", (kv,))
    model = opt.model
    answers = _answers_with_an_image_mask(opt, inputs, "cross_attention_mask")
    if kv == "int8-kv":  # the mask changes the answer (int4 K/V make this tiny model repeat one token, mask or not)
        assert not torch.equal(answers[0][1], answers[1][1])
    assert _reason_on_cuda(model, tiny("tiny:mllama").processor) is None
    cached = {block.decoder_index for block in opt.adapter.cross_attention_blocks(model)}
    image_layer = ImageKVLayer if isinstance(kv, Int4KVConfig) else PackedImageLayer
    layers = kept(model).cache.layers
    assert cached and all(isinstance(layers[i], image_layer) == (i in cached) for i in range(len(layers)))
    if image_layer is PackedImageLayer:  # sized by the image's tokens, packed (int4: two codes per byte)
        layer = layers[min(cached)]
        vision = model.config.vision_config  # each tile: its patches and a class token
        tokens = inputs["pixel_values"].shape[1:3].numel() * ((vision.image_size // vision.patch_size) ** 2 + 1)
        per_byte = 2 if kv == "int4-kv" else 1
        assert layer.key_codes.shape[2] == tokens and layer.key_codes.shape[-1] * per_byte == layer.head_dim


def test_mllama_asks_the_packed_cache_whether_it_holds_kv_without_dequantizing_it(session, tiny, monkeypatch):
    """transformers 5.24+'s Mllama asks every cache layer ``keys.numel() > 0`` before running it; on a packed layer
    ``keys`` dequantizes the whole layer (in a captured step: a kernel per self-attention layer at every token). With a
    KV-cache pass the text model's forward asks each layer's host length instead (MllamaAdapter
    .install_packed_cache_queries): the same answers without dequantizing, in transformers' own loop too, with the same
    tokens; transformers' module keeps its own check, and installing twice rebinds once."""
    import sys

    from transformers.models.mllama import modeling_mllama

    from mmsdk.plugins._forward import body_function, referenced_global
    from mmsdk.plugins.adapters.flamingo import HOLDS_KV_CHECK
    from mmsdk.plugins.quantizers.quantized_cache import QuantizedKVLayer

    original = getattr(modeling_mllama, HOLDS_KV_CHECK, None)
    if original is None:
        pytest.skip("this transformers asks the cache's get_seq_length(idx), without reading keys")
    plain, inputs = _optimized(tiny, session, "tiny:mllama", ("int4-kv",))
    del plain.adapter.language_model(plain.model).__dict__["_mmsdk_body"]  # transformers' own check, to compare
    opt, _ = _optimized(tiny, session, "tiny:mllama", ("int4-kv",))
    text_model = opt.adapter.language_model(opt.model)
    body = text_model.__dict__["_mmsdk_body"]
    opt.adapter.install_packed_cache_queries(opt.model)  # again: nothing more to rebind
    assert text_model.__dict__["_mmsdk_body"] is body and getattr(modeling_mllama, HOLDS_KV_CHECK) is original
    by_host_length = referenced_global(body_function(text_model), HOLDS_KV_CHECK)
    assert getattr(by_host_length, "by_host_length", False)  # the rebound check, not transformers' own

    cache = installed_state(opt.model).static_cache(64, fused=True)
    with torch.inference_mode():
        opt.model(**inputs, past_key_values=cache, use_cache=True)
    empty = installed_state(opt.model).static_cache(64, fused=True)  # no prefill: every layer empty
    layers = range(len(cache.layers) + 1)  # one past the last: no such layer
    expected = [original(c, i) for c in (cache, empty) for i in layers]
    assert expected[: len(cache.layers)] == [True] * len(cache.layers) and not any(expected[len(cache.layers):])
    asked_by = []  # what read each packed layer's keys or values (the caller of the property)
    real = QuantizedKVLayer._read
    monkeypatch.setattr(QuantizedKVLayer, "_read",
                        lambda *a, **k: asked_by.append(sys._getframe(2).f_code.co_name) or real(*a, **k))
    assert [by_host_length(c, i) for c in (cache, empty) for i in layers] == expected and asked_by == []

    reference = _greedy(plain.model, inputs, 6)
    assert HOLDS_KV_CHECK in asked_by
    reads_with_the_check = len(asked_by)
    asked_by.clear()
    assert torch.equal(_greedy(opt.model, inputs, 6), reference)
    assert HOLDS_KV_CHECK not in asked_by and len(asked_by) < reads_with_the_check


def test_cross_attention_length_redirect_is_scoped_and_restored():
    from torch import nn

    from mmsdk.kernels.cross_attention_decode import cross_attention_reads_its_own_length

    class Cache:
        def get_seq_length(self, layer_idx=0):
            return f"layer {layer_idx}"

    cache, seen = Cache(), []

    class Asking(nn.Module):  # asks as transformers 5.17's Mllama cross-attention does, plus a named layer
        def forward(self, x):
            seen.append((cache.get_seq_length(), cache.get_seq_length(4)))
            return x

    first, second = Asking(), Asking()
    with cross_attention_reads_its_own_length(cache, [(3, first)]):
        with cross_attention_reads_its_own_length(cache, [(7, second)]):  # nested: each restores what it found
            second(torch.zeros(1))
        first(torch.zeros(1))
        assert cache.get_seq_length() == "layer 0"  # outside the cross-attention modules: the cache's own answer
    with pytest.raises(RuntimeError):
        with cross_attention_reads_its_own_length(cache, [(3, first)]):
            raise RuntimeError
    assert "get_seq_length" not in vars(cache) and not first._forward_pre_hooks and not first._forward_hooks
    assert seen == [("layer 7", "layer 4"), ("layer 3", "layer 4")]
    first(torch.zeros(1))
    assert seen[-1] == ("layer 0", "layer 4")


@pytest.mark.parametrize("name,passes", [("tiny:llava", ("int4-kv",)), ("tiny:qwen2-vl", ())])
def test_chunked_prefill_matches_whole_prefill_on_cpu(name, passes, session, tiny):
    opt, inputs = _optimized(tiny, session, name, passes)
    model = opt.model
    expected = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 6}, graphs=False).run()
    generator = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 6}, graphs=False)
    generator.prefill_chunk = 5  # several chunks, the last one short
    calls = []
    layer = opt.adapter.decoder_layers(model)[0]  # sees every chunk (the chunks call forward, not __call__)

    def record(module, args, kwargs):
        calls.append((args[0] if args else kwargs["hidden_states"]).shape[1])

    handle = layer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        got = generator.run()
    finally:
        handle.remove()
    assert torch.equal(got, expected)
    prefill = [n for n in calls if n > 1]
    assert len(prefill) >= 2 and max(prefill) <= 5, calls  # the prefill really ran in chunks of <= 5 tokens


@pytest.mark.parametrize("name,passes", [("tiny:llava", ()), ("tiny:qwen2-vl", ("token-prune",))])
def test_prefill_chunks_attend_over_the_tokens_written_so_far(name, passes, session, tiny, monkeypatch):
    """A static cache has room for the whole generation; each prefill chunk must attend over the tokens written
    before and in it, not over every slot (twice a causal prefill's work), and give transformers' answer."""
    import contextlib

    import torch.nn.functional as F

    opt, inputs = _optimized(tiny, session, name, passes)
    model = opt.model
    expected = _greedy(model, inputs, 6)
    keys: list[int] = []  # the keys of each causal attention call of the prefill
    prefilling = [False]
    sdpa, chunks = F.scaled_dot_product_attention, _Generator._prefill_in_chunks

    def recording(query, key, value, attn_mask=None, *args, **kwargs):
        if prefilling[0] and (attn_mask is not None or kwargs.get("is_causal", False)):  # not the vision tower's
            keys.append(key.shape[-2])
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    @contextlib.contextmanager
    def flagged(self, cache):
        prefilling[0] = True
        with chunks(self, cache):
            yield
        prefilling[0] = False

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    monkeypatch.setattr(_Generator, "_prefill_in_chunks", flagged)
    generator = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 6}, graphs=False)
    generator.prefill_chunk = 5
    assert torch.equal(generator.run(), expected)
    layers = len(opt.adapter.decoder_layers(model))
    ends = keys[::layers]  # one entry per chunk: every layer sees the same lengths
    assert keys == [end for end in ends for _ in range(layers)]
    prompt = int(kept(model).cache.get_seq_length()) - 5  # the prompt and the 5 new tokens fed back (of 6)
    assert len(ends) >= 2 and ends == [min(5 * (i + 1), prompt) for i in range(len(ends))] and ends[-1] == prompt
    assert all("update" not in vars(layer) for layer in kept(model).cache.layers)  # the layers' own methods again


def test_filled_prefix_hands_the_first_tokens_and_gives_the_layers_back():
    from transformers import LlamaConfig
    from transformers.cache_utils import StaticCache

    from mmsdk.kernels.chunked_prefill import filled_prefix

    config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                         intermediate_size=32, vocab_size=10)
    cache = StaticCache(config=config, max_cache_len=12)
    new = torch.randn(1, 1, 3, 8)
    with pytest.raises(RuntimeError, match="inside"), filled_prefix(cache, 3):
        keys, values = cache.update(new, -new, 0)
        assert torch.equal(keys, new) and torch.equal(values, -new)  # the 3 written tokens, not 12 slots
        assert cache.get_mask_sizes(3, 0) == (3, 0)
        raise RuntimeError("inside")
    assert not any({"update", "get_mask_sizes"} & set(vars(layer)) for layer in cache.layers)
    keys, _ = cache.update(new, new, 0)
    assert keys.shape[-2] == 12 and cache.get_mask_sizes(3, 0) == (12, 0)  # every slot again
    with filled_prefix(None, 3):  # no cache: nothing to do
        pass


def test_prefill_calls_read_their_query_offset_from_the_host():
    """transformers' StaticLayer counts its tokens in a device tensor, which the causal-mask maker reads (a wait for
    the GPU); each prefill call that writes into the cache gets the tokens written before it as a host int instead,
    image layers keep theirs, and the cache's own method is back afterwards. Token ids are cut like embeddings; a
    call given both, or one that writes elsewhere, is not cut, and from then on nothing is counted."""
    from transformers import LlamaConfig
    from transformers.cache_utils import StaticCache

    from mmsdk.kernels.chunked_prefill import chunked, host_query_offset
    from mmsdk.kernels.cross_attention_decode import with_image_layers

    config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3,
                         intermediate_size=32, vocab_size=10)
    cache = with_image_layers(StaticCache(config=config, max_cache_len=24), [2])
    if not hasattr(cache, "get_query_offset"):
        pytest.skip("this transformers' mask maker reads the cache's length itself (no get_query_offset)")
    seen = []  # (query offset the call saw, tokens it got)
    from_host = []  # whether that offset was a host int (the cache's own is a tensor, changed in place later)

    def forward(inputs_embeds=None, input_ids=None, past_key_values=None, **kwargs):
        count = (input_ids if inputs_embeds is None else inputs_embeds).shape[1]
        offset = cache.get_query_offset(0)
        seen.append((int(offset), count))
        from_host.append(type(offset) is int and "get_query_offset" in vars(cache))
        tokens = torch.randn(1, 1, count, 8)
        for index in (0, 1):
            past_key_values.update(tokens, -tokens, index)

    chunked(forward, 4, cache=cache, attend_filled_prefix=False)(inputs_embeds=torch.randn(1, 10, 16),
                                                                   past_key_values=cache)
    assert seen == [(0, 4), (4, 4), (8, 2)] and all(from_host)
    assert "get_query_offset" not in vars(cache) and int(cache.get_query_offset(0)) == 10

    cache.reset()
    seen.clear()
    run = chunked(forward, 4, cache=cache, attend_filled_prefix=False)
    run(input_ids=torch.ones(1, 6, dtype=torch.long), past_key_values=cache)  # token ids, cut in chunks
    # an image tensor it cannot cut (Mllama's cross-attention states): whole, still counted
    run(input_ids=torch.ones(1, 3, dtype=torch.long), cross_attention_states=torch.zeros(1, 3, 16),
        past_key_values=cache)
    assert seen == [(0, 4), (4, 2), (6, 3)] and all(from_host)
    run(input_ids=torch.ones(1, 2, dtype=torch.long), inputs_embeds=torch.randn(1, 2, 16), past_key_values=cache)
    assert seen[-1] == (9, 2) and all(from_host)  # both prompt tensors: whole
    run(input_ids=torch.ones(1, 1, dtype=torch.long), past_key_values=StaticCache(config=config, max_cache_len=24))
    run(input_ids=torch.ones(1, 5, dtype=torch.long), past_key_values=cache)  # after an uncounted call: the cache's own
    assert from_host[-3:] == [False] * 3 and seen[-3:] == [(11, 1), (11, 4), (15, 1)]  # still cut in chunks

    cache.update(torch.randn(1, 1, 7, 8), torch.randn(1, 1, 7, 8), 2)  # the image's K/V
    with pytest.raises(RuntimeError, match="inside"), host_query_offset(cache, 16):
        assert cache.get_query_offset(1) == 16 and int(cache.get_query_offset(2)) == 7
        raise RuntimeError("inside")
    assert "get_query_offset" not in vars(cache)
    with host_query_offset(None, 3):  # no cache: nothing to do
        pass


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:mllama", "tiny:idefics"])
def test_the_mask_maker_gets_a_host_query_offset_in_the_prefill(name, session, tiny, monkeypatch):
    """transformers' causal-mask maker compares the query offset with 0 to decide whether SDPA may run as causal; a
    device tensor there waits for everything queued before (on Mllama the vision encoder). In fast generate's prefill
    it gets a host int, on a kept cache too (whose length is a device tensor), also in chunks."""
    from transformers import masking_utils

    opt, inputs = _optimized(tiny, session, name, ())
    original = masking_utils._ignore_causal_mask_sdpa
    offsets = []

    def recording(padding_mask, q_length, kv_length, q_offset, *args, **kwargs):
        if q_length > 1:  # a prefill call (decode steps are captured on CUDA, where reading the offset is free)
            offsets.append(q_offset)
        return original(padding_mask, q_length, kv_length, q_offset, *args, **kwargs)

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", recording)
    expected = _Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 4}, graphs=False).run()
    generator = _Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 4}, graphs=False)
    generator.prefill_chunk = 5  # several chunks where the model's calls can be cut (LLaVA's)
    assert torch.equal(generator.run(), expected)  # the second call reuses the kept cache
    assert offsets and all(type(offset) is int for offset in offsets), offsets


def test_the_prefill_chunk_comes_from_the_environment(session, tiny, monkeypatch):
    from mmsdk.kernels.chunked_prefill import PREFILL_ENV, PREFILL_TOKENS, prefill_tokens

    opt, inputs = _optimized(tiny, session, "tiny:llava", ())  # the fast path installed
    kwargs = {**inputs, "max_new_tokens": 2}  # 2 rows
    monkeypatch.delenv(PREFILL_ENV, raising=False)
    assert prefill_tokens() == PREFILL_TOKENS
    monkeypatch.setenv(PREFILL_ENV, "4096")
    assert prefill_tokens() == 4096
    assert _Generator(opt.model, opt.adapter, kwargs, graphs=False).prefill_chunk == 2048  # per row
    assert _Generator(opt.model, opt.adapter, kwargs, graphs=False, prefill=6).prefill_chunk == 3
    for bad in ("0", "-5", "2k", "1.5"):
        monkeypatch.setenv(PREFILL_ENV, bad)
        with pytest.raises(ValueError, match="positive integer"):
            prefill_tokens()
    monkeypatch.setattr(fast_generate, "unsupported_reason", lambda *args: None)  # as if on CUDA
    with pytest.raises(ValueError, match=PREFILL_ENV):  # the user's setting to fix: no quiet fallback
        opt.model.generate(**kwargs)


def test_a_bad_compile_ahead_setting_is_an_error_that_names_the_fix(session, tiny, monkeypatch):
    """MMSDK_COMPILE_STEP_AHEAD is read once per call, before anything runs: a value other than 0 / 1 is the user's to
    fix, not a reason to fall back to transformers' generate."""
    opt, inputs = _optimized(tiny, session, "tiny:llava", ())
    monkeypatch.setenv("MMSDK_COMPILE_STEP_AHEAD", "yes")
    with pytest.raises(ValueError, match="MMSDK_COMPILE_STEP_AHEAD='yes': set it to 1"):
        _Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 4}, graphs=False)
    assert _Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 4}, graphs=False,
                      compile_ahead=False).compile_ahead is False  # the setting given wins over the environment


def test_fast_path_refuses_what_it_does_not_do(tiny):
    model = tiny("tiny:llava").model
    inputs = tiny_inputs(tiny("tiny:llava").processor, QUESTIONS)
    assert unsupported_reason(model, (), {**inputs, "max_new_tokens": 4}) == "cpu"


FULL_STACK = ("qkv-fuse", "int4-weight", "rmsnorm-rope-fusion", "int4-kv")


@pytest.mark.parametrize("name,passes", [("tiny:llava", FULL_STACK), ("tiny:qwen2-vl", FULL_STACK),
                                         ("tiny:qwen2-vl", ("token-prune", "int8-kv")),
                                         ("tiny:llava", ("token-merge", "ptq-align", "int4-kv")),
                                         ("tiny:qwen2.5-vl", ("vit-prune", "rmsnorm-rope-fusion")),
                                         ("tiny:mllama", ()), ("tiny:mllama", ("gated-xattn",)),
                                         ("tiny:mllama", ("qkv-fuse", INT4_HEAD, "rmsnorm-rope-fusion")),
                                         ("tiny:idefics", ("gated-xattn",)), ("tiny:idefics", ("int4-kv",))])
def test_decode_step_copies_nothing_from_the_host(name, passes, session, tiny, monkeypatch):
    """A CUDA-graph capture refuses host-to-device copies and host syncs: the step must make none."""
    opt, inputs = _optimized(tiny, session, name, passes)
    assert _host_reads_in_step(monkeypatch, opt, inputs) == []  # with M-RoPE's slot map rebuilt per call:
    # ['aten.lift_fresh.default']


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl"])
def test_a_penalized_sampled_step_copies_nothing_from_the_host(name, session, tiny, monkeypatch):
    """The repetition penalty and the sampling warpers inside the step make no host copy or sync either."""
    opt, inputs = _optimized(tiny, session, name, ())
    # no top-p: its warper's scalar write reads as a host copy here, which the CUDA sampling test shows a capture takes
    options = dict(do_sample=True, temperature=0.7, top_k=20, min_p=0.05, repetition_penalty=1.05)
    assert _host_reads_in_step(monkeypatch, opt, inputs, **options) == []


def _host_reads_in_step(monkeypatch, opt, inputs, **options):
    """The host-to-device copies and host syncs (what a CUDA-graph capture refuses) that fast generate's decode step
    makes for ``inputs`` (CPU, the step run where it would be captured)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    refused: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(op in str(func) for op in ("lift_fresh", "_local_scalar_dense", "nonzero")):
                refused.append(str(func))
            return func(*args, **(kwargs or {}))

    def watched_capture(self, step, stream):
        def run():
            with Watch():
                step()
        return run

    monkeypatch.setattr(_Generator, "_capture", watched_capture)
    _Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 4, **options}, graphs=False).run()
    return refused


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name,passes", [("tiny:llava", ()), ("tiny:llava", ("int4-weight",)),
                                         ("tiny:llava", ("int4-weight", "int4-kv")), ("tiny:llava", ("int8-kv",)),
                                         ("tiny:llava", ("fp8-kv",)),
                                         ("tiny:qwen2-vl", ("qkv-fuse", "rmsnorm-rope-fusion", "fp8-kv")),
                                         ("tiny:llava", FULL_STACK), ("tiny:qwen2-vl", FULL_STACK),
                                         ("tiny:qwen2-vl", ("qkv-fuse", INT4_HEAD, "rmsnorm-rope-fusion", "int4-kv"))])
def test_cuda_graph_generate_matches_transformers(name, passes, session, tiny, monkeypatch):
    loaded = tiny(name)
    opt = Optimizer(loaded.model.cuda().to(torch.bfloat16), loaded.processor, session=session)
    if passes:  # the tiny model's 48/74-wide inputs need padding to whole 32-groups
        opt.apply(*[Int4WeightConfig(indivisible="pad") if p == "int4-weight" else p for p in passes])
    model = opt.model
    inputs = {k: v.cuda() for k, v in tiny_inputs(loaded.processor, QUESTIONS).items()}
    assert unsupported_reason(model, (), {**inputs, "max_new_tokens": 40}) is None
    counts = _count_builds(monkeypatch)
    # the generator itself, not model.generate: a capture failure must fail here, not fall back to transformers
    got = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 40}).run()
    step = kept(model).step
    assert counts == {"build": 1, "capture": 1} and step is not None
    _assert_agrees(got, _greedy(model, inputs, 40))
    # the same call again through generate(): the kept graph replays from token 1 on (the first call's token 1
    # came from the eager warm-up step: the same kernels' arithmetic, so the same tokens); the model's forward runs
    # to its end only for the prefill (the one for the first decode token stops where the language model would
    # start). The hook sits on the outer model: one on the language model would stale the kept step (its Watch sees
    # hooks).
    finished = []
    handle = model.register_forward_hook(lambda *_: finished.append(1))
    try:
        assert torch.equal(model.generate(**inputs, max_new_tokens=40), got)
    finally:
        handle.remove()
    assert len(finished) == 1 and counts == {"build": 1, "capture": 1}
    other = {k: v.cuda() for k, v in tiny_inputs(loaded.processor, QUESTIONS, seed=3).items()}
    again = _Generator(model, opt.adapter, {**other, "max_new_tokens": 33}).run()  # other images, fewer tokens
    assert kept(model).step is step and counts == {"build": 1, "capture": 1}  # reused: no warm-up, no capture
    _assert_agrees(again, _greedy(model, other, 33))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name,passes", [("tiny:mllama", ()), ("tiny:mllama", ("gated-xattn", "int4-weight")),
                                         ("tiny:mllama", ("qkv-fuse", "int4-weight", "rmsnorm-rope-fusion")),
                                         ("tiny:mllama", ("int8-kv",)), ("tiny:mllama", ("fp8-kv",)),
                                         ("tiny:mllama", ("qkv-fuse", "int4-weight", "rmsnorm-rope-fusion", "int4-kv")),
                                         ("tiny:idefics", ("gated-xattn",)),
                                         ("tiny:idefics", ("gated-xattn", "int4-kv")), ("tiny:idefics", ("int8-kv",))])
def test_cuda_graph_generate_of_cross_attention_models_matches_transformers(name, passes, session, tiny, monkeypatch):
    """The captured decode step reads Mllama's image K/V from the cache (packed, with a KV-cache pass: the packed
    kernel with the cross-attention mask's row) and IDEFICS's image states from the step's fixed inputs; a second
    call with other images and another image mask refills them in place and replays. Each answer is scored by
    transformers' forward over it (with a KV-cache pass, on the quantizing cache: SDPA over the same codes)."""
    from mmsdk.kernels.cross_attention_decode import image_layer_indices
    from mmsdk.plugins.quantizers.packed_image_kv import PackedImageLayer

    passes = tuple(Int4WeightConfig(indivisible="pad") if p == "int4-weight" else p for p in passes)
    opt, inputs = _cross_attention_model(tiny, session, name, passes, "cuda", torch.bfloat16)
    model = opt.model
    state = installed_state(model)

    def scored(got, case):
        """``got`` scored by transformers' forward (with a KV-cache pass over its quantizing cache)."""
        _assert_scored_by_reference(model, case, got,
                                    **({"past_key_values": state.new_cache()} if state else {}))

    assert unsupported_reason(model, (), {**inputs, "max_new_tokens": 24}) is None
    counts = _count_builds(monkeypatch)
    got = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 24}).run()
    assert counts == {"build": 1, "capture": 1} and kept(model).step is not None
    scored(got, inputs)
    if state is not None:
        cached = set(image_layer_indices(opt.adapter, model))  # Mllama's; IDEFICS recomputes its image K/V
        layers = kept(model).cache.layers
        assert all(isinstance(layers[i], PackedImageLayer) == (i in cached) for i in range(len(layers)))
    key = IMAGE_MASKS[name]
    loaded = tiny(name)
    other = {k: v.cuda() for k, v in tiny_inputs(loaded.processor, QUESTIONS, seed=3).items()}
    other[key][1, 3:] = 0
    again = model.generate(**other, max_new_tokens=20)
    assert counts == {"build": 1, "capture": 1}  # the kept graph, refilled
    scored(again, other)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("passes", [(), ("int4-kv",)])
def test_cuda_graph_generate_of_idefics_laid_out_as_9b(passes, session, tiny, monkeypatch):
    """IDEFICS as IDEFICS-9B (a perceiver, 2 extra tokens): the decode step is captured (its extra-token embedding
    without a host sync), reads image K/V projected once per call from states resampled once, and answers as
    transformers' forward scores it; a second call with other images refills and replays the kept graph."""
    opt, inputs = _cross_attention_model(tiny, session, "tiny:idefics", passes, "cuda", torch.bfloat16,
                                         loaded=_idefics_like_9b(tiny))
    model, state = opt.model, installed_state(opt.model)
    cache = {"past_key_values": state.new_cache()} if state else {}
    counts = _count_builds(monkeypatch)
    got = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 24}).run()
    step = kept(model).step
    assert counts == {"build": 1, "capture": 1} and step is not None and step.projections.holding
    _assert_scored_by_reference(model, inputs, got, **cache)
    other = {k: v.cuda() for k, v in tiny_inputs(opt.processor, QUESTIONS, seed=3).items()}
    again = model.generate(**other, max_new_tokens=20)
    assert counts == {"build": 1, "capture": 1} and kept(model).step is step
    _assert_scored_by_reference(model, other, again, **({"past_key_values": state.new_cache()} if state else {}))


@pytest.mark.parametrize("name", ["tiny:mllama", "tiny:idefics"])
def test_reference_scoring_catches_answers_transformers_would_not_give(name, session, tiny):
    """The scoring the CUDA tests use: transformers' own greedy answer and the fast path's pass it; an answer that
    takes the runner-up at every step, or one decoded without the image, fails it."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class RunnerUp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores.scatter(1, scores.argmax(-1, keepdim=True), float("-inf"))

    opt, inputs = _cross_attention_model(tiny, session, name, ())
    model = opt.model
    _assert_scored_by_reference(model, inputs, _greedy(model, inputs, 16))
    _assert_scored_by_reference(model, inputs, _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 16},
                                                          graphs=False).run())
    second = _greedy(model, inputs, 16, logits_processor=LogitsProcessorList([RunnerUp()]))
    with pytest.raises(AssertionError, match="the reference ranks it|the reference's pick"):
        _assert_scored_by_reference(model, inputs, second)
    key = IMAGE_MASKS[name]
    blind = _greedy(model, dict(inputs, **{key: torch.zeros_like(inputs[key])}), 16)
    with pytest.raises(AssertionError, match="the reference ranks it|the reference's pick"):
        _assert_scored_by_reference(model, inputs, blind)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name,passes", [("tiny:llava", FULL_STACK), ("tiny:qwen2-vl", FULL_STACK),
                                         ("tiny:mllama", ("qkv-fuse", "int4-weight", "rmsnorm-rope-fusion", "int4-kv")),
                                         ("tiny:idefics", ("gated-xattn", "int4-kv"))])
def test_a_decode_step_compiled_ahead_in_a_dropped_capture_gives_the_same_tokens(name, passes, session, tiny,
                                                                                 monkeypatch):
    """MMSDK_COMPILE_STEP_AHEAD's dropped capture of a new decode step (before its eager warm-up) runs nothing and
    leaves nothing behind that a later step reads: each family's answer is the one it gives without it, bitwise (one
    process: the same kernels and tuner picks)."""
    passes = tuple(Int4WeightConfig(indivisible="pad") if p == "int4-weight" else p for p in passes)
    if name in IMAGE_MASKS:
        opt, inputs = _cross_attention_model(tiny, session, name, passes, "cuda", torch.bfloat16)
    else:
        loaded = tiny(name)
        opt = Optimizer(loaded.model.cuda().to(torch.bfloat16), loaded.processor, session=session)
        opt.apply(*passes)
        inputs = {k: v.cuda() for k, v in tiny_inputs(loaded.processor, QUESTIONS).items()}
    from mmsdk.kernels import step_capture

    ahead = []
    real = step_capture.compile_before_first_call
    monkeypatch.setattr(step_capture, "compile_before_first_call",
                        lambda step, stream: ahead.append(real(step, stream)) or ahead[-1])
    answers = []
    for compile_ahead in (True, False):
        release(opt.model)  # a new step each time: warmed up (and, the first time, recorded ahead), captured
        answers.append(_Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 24},
                                  compile_ahead=compile_ahead).run())
    assert len(ahead) == 1
    assert torch.equal(answers[0], answers[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("tune", ["0", "1"])
def test_on_an_empty_triton_cache_a_step_compiled_ahead_compiles_nothing_itself(tmp_path, tune):
    """In a fresh process with an empty Triton cache, the step's kernels are compiled ahead on the compile threads,
    and its eager warm-up (under weights_settled, the GEMVs launched as in its graph) and its capture compile nothing
    on the step's own thread. MMSDK_TUNE=0: each GEMV runs its first candidate untimed; 1 (with MMSDK_TUNE_MIN_BYTES=0,
    as for a bigger model's weights): the tuner's candidates for every shape were compiled ahead with the step's
    kernels, and it times them at the warm-up without compiling on that thread either. The answer is the one the same
    process gives without compiling ahead."""
    import json
    import os
    import subprocess
    import sys

    child = """
import json, threading, torch
from triton import knobs
from mmsdk import Optimizer
from mmsdk.core.session import Session
from mmsdk.kernels import fast_generate, step_capture
from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig
from mmsdk.testing import tiny_inputs

session = Session.create(autoload=False, disabled=())
loaded = session.models.get("tiny:llava").build()
opt = Optimizer(loaded.model.cuda().to(torch.bfloat16), loaded.processor, session=session)
opt.apply("qkv-fuse", Int4WeightConfig(indivisible="pad"), "rmsnorm-rope-fusion", "int4-kv")
inputs = {k: v.cuda() for k, v in tiny_inputs(loaded.processor, ("what digit is this ?",) * 2).items()}
phase, own, ahead = ["prefill"], [], []

def listener(*, src, **_):
    if phase[0] == "step" and threading.current_thread() is threading.main_thread():
        own.append(getattr(getattr(src, "fn", None), "__module__", str(src)))

knobs.compilation.listener = listener
real = step_capture.compile_before_first_call

def spied(step, stream):
    ahead.append(real(step, stream))
    phase[0] = "step"

step_capture.compile_before_first_call = spied
first = fast_generate._Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 8}, compile_ahead=True).run()
phase[0] = "done"
fast_generate.release(opt.model)
second = fast_generate._Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 8}, compile_ahead=False).run()
print(json.dumps({"ahead": ahead, "own": own, "same": bool(torch.equal(first, second))}))
"""
    # the tiny model's weights are under MMSDK_TUNE_MIN_BYTES: timed as a bigger model's are only with it 0
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), "MMSDK_TUNE": tune,
           "MMSDK_TUNE_MIN_BYTES": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["ahead"]) == 1 and report["ahead"][0] > 0, report
    assert report["own"] == [], report
    assert report["same"], report


def _bf16_decode_stack(tiny, session, name: str, fusion, questions) -> tuple:
    """(Optimizer with qkv-fuse + int4-weight + ``fusion`` + int4-kv on a bf16 tiny model on the GPU, its CUDA
    inputs for ``questions``)."""
    loaded = tiny(name)
    opt = Optimizer(loaded.model.cuda().to(torch.bfloat16), loaded.processor, session=session)
    opt.apply("qkv-fuse", Int4WeightConfig(indivisible="pad"), fusion, "int4-kv")
    return opt, {k: v.cuda() for k, v in tiny_inputs(loaded.processor, questions).items()}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl"])
def test_rope_inside_the_attention_kernel_changes_no_token(name, session, tiny, monkeypatch):
    """With int4-kv, each decode step's RoPE runs inside the attention kernel (PackedStaticLayer.take_rope): the
    same tokens, bitwise, as with a RoPE launch before it (rope_in_attention=False), through the CUDA graph."""
    from mmsdk.plugins.attention.rmsnorm_rope import RMSNormRoPEFusionConfig
    from mmsdk.plugins.quantizers.static_kv import PackedStaticLayer

    taken = []  # (query tokens, accepted) per offer
    original = PackedStaticLayer.take_rope
    monkeypatch.setattr(PackedStaticLayer, "take_rope",
                        lambda self, q, *a: taken.append((q.shape[-2], original(self, q, *a))) or taken[-1][1])
    answers = []
    for inside in (True, False):
        opt, inputs = _bf16_decode_stack(tiny, session, name, RMSNormRoPEFusionConfig(rope_in_attention=inside),
                                         QUESTIONS)
        answers.append(_Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 24}).run())
        if inside:
            # every decode step's attention took its RoPE (warm-up and capture), no prefill did
            assert any(n == 1 for n, _ in taken) and all(ok == (n == 1) for n, ok in taken), taken
            taken.clear()
    assert taken == []  # rope_in_attention=False never offers it
    assert torch.equal(answers[0], answers[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name, mlp", [("tiny:llava", True), ("tiny:qwen2-vl", True), ("tiny:qwen2-vl", False)])
def test_norms_inside_the_gemvs_keep_the_answers(name, mlp, session, tiny, monkeypatch):
    """With each decode step's RMSNorms inside the INT4 GEMVs (rmsnorm-rope-fusion's norm_in_gemv; the
    post-attention norm's statistics left by o_proj's store for the gated GEMV with ``mlp``, the input norm only
    with ``mlp`` False, mlp_norm_in_gemv=False), a decode step's logits are those of the unfolded layers up to
    bf16 rounding (not bitwise: the folded kernels skip a rounding of the activations), compared at every step while
    the two answers agree (a tiny random model has near-ties)."""
    from mmsdk.plugins.attention.rmsnorm_rope import RMSNormRoPEFusionConfig
    from mmsdk.plugins.quantizers.int4_linear import Int4Linear

    folded, left = [], []
    original, original_left = Int4Linear.input_norm, Int4Linear.left_statistics
    monkeypatch.setattr(Int4Linear, "input_norm", lambda self, norm: folded.append(1) or original(self, norm))

    def left_statistics(self):
        statistics = original_left(self)
        left.append(statistics is not None)
        return statistics

    monkeypatch.setattr(Int4Linear, "left_statistics", left_statistics)
    runs = []
    for fold in (True, False):
        # one row: the quad GEMVs fold the norms in their programs (several rows run the norm kernel first)
        fusion = RMSNormRoPEFusionConfig(norm_in_gemv=fold, mlp_norm_in_gemv=mlp)
        opt, inputs = _bf16_decode_stack(tiny, session, name, fusion, QUESTIONS[:1])
        with torch.no_grad():  # scores: transformers' loop (the fast path keeps none), the same layer bodies
            runs.append(opt.model.generate(**inputs, max_new_tokens=8, do_sample=False, output_scores=True,
                                           return_dict_in_generate=True))
        assert bool(folded) == fold
        # with the MLP's norm: o_proj's store left its statistics at every decode step's layer
        assert all(left) and bool(left) == (fold and mlp), left
        folded.clear()
        left.clear()
    _assert_same_logits_while_answers_agree(*runs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl"])
def test_integer_dot_gemvs_in_the_decode_step_keep_the_answers(name, session, tiny, monkeypatch):
    """The decode step with every batch-1 INT4 GEMV on integer dot products (kind "idot": q/k/v with the input norm
    applied by the rounding kernel, the gated MLP scaled by the statistics o_proj's store left) gives the logits of
    the float kinds ("quad", "gated") up to the activations' rounding, compared at every step while the answers
    agree. Each run's GEMVs take the first of their kinds' candidates, untimed (so nothing else launches)."""
    from mmsdk.kernels import gemv_idot, gemv_launch, w4a16, w4a16_gated, w4a16_tuning
    from mmsdk.kernels.w4a16_tuning import tuning
    from mmsdk.plugins.attention.rmsnorm_rope import RMSNormRoPEFusionConfig

    monkeypatch.setattr(w4a16_tuning, "timing_enabled", lambda: False)

    launched = []
    for function in ("launch_idot", "launch_idot_gated"):
        original = getattr(gemv_idot, function)
        spy = (lambda original, function: lambda *a, **k: launched.append(function) or original(*a, **k))(
            original, function)
        for module in (gemv_idot, gemv_launch, w4a16, w4a16_gated):  # each module that imported the launcher
            if hasattr(module, function):
                monkeypatch.setattr(module, function, spy)
    every_config, every_paired = w4a16.gemv_candidates, w4a16_gated._paired_candidates

    def integer_kind(cfg, integer):  # one-row configs only: more rows keep theirs
        return len(cfg) > 4 and (cfg[4] == "idot") == integer

    saved = dict(tuning().chosen)
    runs = []
    try:
        for integer in (False, True):
            tuning().chosen.clear()  # each run chooses its own configs
            monkeypatch.setattr(w4a16, "gemv_candidates", lambda bucket, group, integer=integer: tuple(
                c for c in every_config(bucket, group) if bucket > 1 or integer_kind(c, integer)))
            monkeypatch.setattr(w4a16_gated, "_paired_candidates", lambda group, integer=integer: tuple(
                c for c in every_paired(group) if integer_kind(c, integer)))
            opt, inputs = _bf16_decode_stack(tiny, session, name, RMSNormRoPEFusionConfig(), QUESTIONS[:1])
            with torch.no_grad():
                runs.append(opt.model.generate(**inputs, max_new_tokens=8, do_sample=False, output_scores=True,
                                               return_dict_in_generate=True))
            assert bool(launched) == integer and (not integer or {"launch_idot", "launch_idot_gated"} <= set(launched))
    finally:
        tuning().chosen.clear()
        tuning().chosen.update(saved)
    _assert_same_logits_while_answers_agree(*runs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl"])
def test_input_norm_statistics_handed_between_layers_keep_the_answers(name, session, tiny, monkeypatch):
    """With qkv_norm_statistics each layer's down-projection store leaves the next layer's input-norm statistics,
    and that layer's q/k/v GEMV (one-row GEMVs on the integer-dot kinds here) scales its sums by them instead of
    reading the row for the norm: every decode step's layers but the first took them, the q/k/v GEMVs applied them,
    and the logits are those of the run that folds the norm, compared at every step while the answers agree. With
    the float kinds, which fold the norm instead, the statistics are left for the first step only, until the next
    prompt learns it again."""
    from mmsdk.kernels import w4a16
    from mmsdk.kernels.gemv_launch import IDOT_KINDS
    from mmsdk.kernels.w4a16_tuning import tuning
    from mmsdk.plugins.attention.norm_folding import InputNormHandOff
    from mmsdk.plugins.attention.rmsnorm_rope import RMSNormRoPEFusionConfig

    every_config, take, launch = w4a16.gemv_candidates, InputNormHandOff.take, w4a16.launch_gemv

    def integer_dot_only(bucket, group):
        return tuple(c for c in every_config(bucket, group) if bucket > 1 or (len(c) > 4 and c[4] in IDOT_KINDS))

    monkeypatch.setattr(w4a16, "gemv_candidates", integer_dot_only)
    taken, applied = [], []
    monkeypatch.setattr(InputNormHandOff, "take", lambda self, x: taken.append(take(self, x)) or taken[-1])
    monkeypatch.setattr(w4a16, "launch_gemv", lambda *a, **k: applied.append(
        k.get("row_scale") is not None and k.get("second") is None) or launch(*a, **k))
    saved = dict(tuning().chosen)
    runs = []
    try:
        for handed in (False, True):
            tuning().chosen.clear()  # each run chooses its own configs, among the integer-dot kinds
            taken.clear()
            applied.clear()
            opt, inputs = _bf16_decode_stack(tiny, session, name, RMSNormRoPEFusionConfig(qkv_norm_statistics=handed),
                                             QUESTIONS[:1])
            with torch.no_grad():
                runs.append(opt.model.generate(**inputs, max_new_tokens=8, do_sample=False, output_scores=True,
                                               return_dict_in_generate=True))
            layers = len(opt.adapter.decoder_layers(opt.model))
            got = [t is not None for t in taken]
            # per decode step: the first layer finds none, each later one those its predecessor's store left
            assert got == ([False] + [True] * (layers - 1)) * (len(got) // layers) if handed else not taken, got
            assert any(applied) == handed
    finally:
        tuning().chosen.clear()
        tuning().chosen.update(saved)
    _assert_same_logits_while_answers_agree(*runs)
    monkeypatch.setattr(w4a16, "gemv_candidates", lambda bucket, group: tuple(
        c for c in every_config(bucket, group) if bucket > 1 or (len(c) > 4 and c[4] in ("quad", "quadp"))))
    try:
        tuning().chosen.clear()
        taken.clear()
        opt, inputs = _bf16_decode_stack(tiny, session, name, RMSNormRoPEFusionConfig(), QUESTIONS[:1])
        with torch.no_grad():
            opt.model.generate(**inputs, max_new_tokens=8, do_sample=False)
        layers = len(opt.adapter.decoder_layers(opt.model))
        # the first decode step's layers after the first take them, unread; no later step is handed any
        assert [t is not None for t in taken] == [False] + [True] * (layers - 1) + [False] * (len(taken) - layers)
        # the next prompt learns it again: with the integer-dot kinds back (and the kept step dropped, since its
        # GEMVs changed) every step of the next call is handed them
        monkeypatch.setattr(w4a16, "gemv_candidates", integer_dot_only)
        tuning().chosen.clear()
        taken.clear()
        release(opt.model)
        with torch.no_grad():
            opt.model.generate(**inputs, max_new_tokens=8, do_sample=False)
        got = [t is not None for t in taken]
        assert got and got == ([False] + [True] * (layers - 1)) * (len(got) // layers), got
    finally:
        tuning().chosen.clear()
        tuning().chosen.update(saved)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl"])
def test_paired_gate_up_in_the_batched_decode_step_keeps_the_answers(name, session, tiny, monkeypatch):
    """Batch-2 decode steps with each gated MLP's gate and up as one tensor-core GEMV (kind "mma", the default for
    2-16 rows) give the logits of two GEMVs, their K-slice sums, a SiLU and a multiply (``MMSDK_PAIRED_ROWS=0``),
    compared at every step while the answers agree; the paired launch ran for two rows in the first run only."""
    from mmsdk.kernels import w4a16_gated
    from mmsdk.plugins.attention.rmsnorm_rope import RMSNormRoPEFusionConfig

    rows_launched = []
    original = w4a16_gated.launch_paired_mma
    monkeypatch.setattr(w4a16_gated, "launch_paired_mma",
                        lambda x, *a, **k: rows_launched.append(x.shape[0]) or original(x, *a, **k))
    runs = []
    for paired in ("1", "0"):
        monkeypatch.setenv("MMSDK_PAIRED_ROWS", paired)
        rows_launched.clear()
        opt, inputs = _bf16_decode_stack(tiny, session, name, RMSNormRoPEFusionConfig(), QUESTIONS)
        with torch.no_grad():
            runs.append(opt.model.generate(**inputs, max_new_tokens=8, do_sample=False, output_scores=True,
                                           return_dict_in_generate=True))
        assert (2 in rows_launched) == (paired == "1"), rows_launched
    _assert_same_logits_while_answers_agree(*runs)


def _assert_same_logits_while_answers_agree(first, second) -> None:
    """Two greedy generate() results (with scores): each step's logits within 2e-2 of each other (relative norm),
    compared while the two answers agree (a tiny random model has near-ties), for at least two steps."""
    new = first.sequences.shape[1] - len(first.scores)
    compared = 0
    for step, (a, b) in enumerate(zip(first.scores, second.scores, strict=True)):
        if not torch.equal(first.sequences[:, : new + step], second.sequences[:, : new + step]):
            break
        error = float((a.double() - b.double()).norm() / b.double().norm())
        assert error < 2e-2, (step, error)
        compared += 1
    assert compared >= 2


def _assert_agrees(got, expected):
    """bf16 and other kernels: the first tokens agree; allow a late divergence after a near-tie."""
    agree = (got[:, : expected.shape[1]] == expected[:, : got.shape[1]]).float().mean().item()
    assert got.shape[0] == expected.shape[0] and agree > 0.9, (agree, got, expected)


def _forced_logits(model, inputs, sequences, **kwargs):
    """transformers' logits for every new token of ``sequences`` (the prompt of ``inputs``, then new tokens), from
    one forward over the whole sequence (teacher forcing): ``[B, new, vocab]``. Per-token image masks get their last
    row repeated for the new tokens, as transformers' generate does."""
    prompt = inputs["input_ids"].shape[1]
    new = sequences.shape[1] - prompt
    forced = dict(inputs, input_ids=sequences, attention_mask=torch.ones_like(sequences))
    for key in IMAGE_MASKS.values():
        if isinstance(inputs.get(key), torch.Tensor):
            mask = inputs[key]
            forced[key] = torch.cat([mask, mask[:, -1:].expand(-1, new, *mask.shape[2:])], dim=1)
    with torch.no_grad():
        return model(**forced, **kwargs).logits[:, prompt - 1 : -1]


def _assert_scored_by_reference(model, inputs, got, near_tie=0.05, least_agreement=0.8, **kwargs):
    """The new tokens of ``got`` scored by transformers' own forward over them (:func:`_forced_logits`, ``kwargs``
    passed on, e.g. a quantized cache): every new token (up to a row's first end token) is the reference's pick or
    within ``near_tie`` of that step's logit range below it, and at least ``least_agreement`` of them are its pick.

    Two attention kernels' roundings flip the near-ties of a tiny random model, and once a row parts from the
    reference's own greedy answer the two contexts differ; teacher forcing scores every token in our context. A
    cache or graph bug picks tokens the reference ranks anywhere (the first bound: an answer that takes the
    runner-up at every step, or one decoded without the image, fails it on CPU) or keeps picking a close second
    (the second)."""
    prompt = inputs["input_ids"].shape[1]
    logits = _forced_logits(model, inputs, got, **kwargs).float()
    new = got[:, prompt:]
    eos = model.generation_config.eos_token_id
    ends = {int(e) for e in ([eos] if isinstance(eos, int) else (eos or []))}
    scored = agreed = 0
    for row in range(new.shape[0]):
        for step in range(new.shape[1]):
            token, step_logits = int(new[row, step]), logits[row, step]
            gap = float(step_logits.max() - step_logits[token])
            span = float(step_logits.max() - step_logits.min())
            assert gap <= near_tie * span, (f"row {row}, new token {step}: the reference ranks it {gap:.4g} below its "
                                            f"pick (logit range {span:.4g})", new)
            scored += 1
            agreed += int(token == int(step_logits.argmax()))
            if token in ends:
                break
    assert scored and agreed >= least_agreement * scored, (f"{agreed} of {scored} new tokens are the reference's "
                                                           "pick", new)


@pytest.mark.parametrize("name,passes", [("tiny:llava", ("token-prune",)), ("tiny:llava", ("token-merge", "int4-kv")),
                                         ("tiny:qwen2-vl", ("token-prune",))])
def test_decode_positions_continue_the_unpruned_prompt(name, passes, session, tiny):
    """Every decode token is rotated at the position transformers gives it with the passes (the prompt's length
    before pruning plus the tokens so far), not at the pruned cache's length: the logits of a tiny model can keep
    their argmax at a wrong position, so the positions themselves are compared."""
    opt, inputs = _optimized(tiny, session, name, passes)
    positions = []
    rotary = opt.adapter.language_model(opt.model).rotary_emb
    handle = rotary.register_forward_hook(  # position_ids: rotary_emb(x, position_ids), by position or by name
        lambda module, args, kwargs, out: positions.append(int((args[1:] or [kwargs["position_ids"]])[0].max())),
        with_kwargs=True)
    try:
        expected, reference = _greedy(opt.model, inputs, 5), list(positions)
        positions.clear()
        got = _Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 5}, graphs=False).run()
    finally:
        handle.remove()
    # the prefill's last position, then one more per step (LLaVA: the unpruned prompt's length - 1 first; Qwen2-VL's
    # M-RoPE numbers an image's tokens by its grid, so fewer)
    assert reference == list(range(reference[0], reference[0] + 5))
    assert name != "tiny:llava" or reference[0] == inputs["input_ids"].shape[1] - 1
    assert torch.equal(got, expected) and positions == reference


def test_rows_pruned_to_different_lengths_refuse_the_captured_step(session, tiny, monkeypatch):
    """A cache with padding inside (pruning kept fewer tokens in one row) needs the attention mask the captured
    step does not pass: the fast path refuses, so generate() runs transformers' loop."""
    from mmsdk.plugins import _runtime

    opt, inputs = _optimized(tiny, session, "tiny:llava", ("token-prune",))
    translate = _runtime.ModelRuntime._translate

    def padded(self, kwargs, *args):  # the decode step's mask as a row pruned to one token fewer leaves it
        translate(self, kwargs, *args)
        kwargs["attention_mask"] = kwargs["attention_mask"].clone()
        kwargs["attention_mask"][0, 0] = 0

    monkeypatch.setattr(_runtime.ModelRuntime, "_translate", padded)
    with pytest.raises(Unsupported, match="different numbers of tokens per row"):
        _Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": 4}, graphs=False).run()
    assert kept(opt.model) is None  # nothing half-built is kept


@pytest.mark.parametrize("passes", [("token-prune",), ("token-prune", "int4-kv"), ("token-merge", "int4-kv")])
def test_chunked_prefill_keeps_the_passes_and_their_answers(passes, session, tiny):
    """Chunks run inside the passes' wrappers (token pruning sees the whole prompt), and the wrappers survive."""
    opt, inputs = _optimized(tiny, session, "tiny:llava", passes)
    model = opt.model
    language = opt.adapter.language_model(model)
    wrapped = language.forward
    expected = _greedy(model, inputs, 6)
    for _ in range(2):  # the second call must still run the passes
        generator = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 6}, graphs=False)
        generator.prefill_chunk = 5
        assert torch.equal(generator.run(), expected)
    assert language.forward is wrapped


def _reason_on_cuda(model, processor, **options):
    """unsupported_reason as if the model were on CUDA (it looks at the first parameter's device), for a call with
    generate() ``options``."""
    fake = type("OnCuda", (), {"device": torch.device("cuda")})()
    original = model.parameters
    model.parameters = lambda *a, **k: iter([fake])  # type: ignore[method-assign]
    try:
        length = {} if {"max_new_tokens", "max_length"} & set(options) else {"max_new_tokens": 4}
        return unsupported_reason(model, (), {**tiny_inputs(processor, QUESTIONS), **length, **options})
    finally:
        model.parameters = original  # type: ignore[method-assign]


@pytest.mark.parametrize(("passes", "expected"), [
    ((TokenPruneConfig(strategy="fastv", layer=1),), "['token-prune']"),  # fastv: per-layer cache lengths
    (("sparse-xattn",), "['sparse-xattn']"),  # a layout over each call's mask and the cached keys
    (("int4-kv", "undeclared-test"), "['undeclared-test'] are not declared"),  # a plugin's pass: opt-in per pass
    (("qkv-fuse", "int4-kv", "token-prune"), None),
    (("fp8-kv",), None),
])
def test_the_fast_path_takes_only_passes_that_declared_it(passes, expected, tiny):
    import mmsdk
    from mmsdk.core.config import PassConfig
    from mmsdk.core.passes import PassSpec
    from mmsdk.core.session import Session

    class Undeclared:  # a third party's pass that says nothing about fast generate
        __name__ = "undeclared-test"

        @staticmethod
        @mmsdk.hookimpl
        def mmsdk_register_quantizers(register):
            register(PassSpec(name="undeclared-test", config_cls=PassConfig, apply=lambda m, c, ctx: None,
                              summary="a pass that does not declare fast_generate"))

    session = Session.create(autoload=False, disabled=(), extra=[Undeclared])
    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply(*passes)
    # told from the plan alone, before any pass runs (mmsdk tune refuses there, before packing weights)
    planned = opt.fast_generate_refusal()
    assert not opt.results
    assert (planned is None) if expected is None else (planned is not None and expected in planned), planned
    reason = _reason_on_cuda(opt.model, loaded.processor)
    assert (reason is None) if expected is None else (reason is not None and expected in reason), reason
    assert opt.results and opt.fast_generate_refusal() == planned  # the same once the passes have run


def test_a_failing_fast_path_warns_and_answers_like_transformers(session, tiny, monkeypatch, caplog):
    import logging

    opt, inputs = _optimized(tiny, session, "tiny:llava", ("int4-kv",))
    model = opt.model
    expected = _greedy(model, inputs, 5)

    def broken(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(fast_generate, "unsupported_reason", lambda *args: None)  # as if on CUDA
    monkeypatch.setattr(_Generator, "run", broken)
    with caplog.at_level(logging.INFO, logger="mmsdk.kernels"):
        got = model.generate(**inputs, max_new_tokens=5)
    assert torch.equal(got, expected)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "fast generate" in r.getMessage()]
    assert warnings and "stream is capturing" in warnings[0].getMessage()


def _count_builds(monkeypatch):
    """{"build": decode steps built and warmed up, "capture": steps captured}, counted from now on."""
    counts = {"build": 0, "capture": 0}
    build, capture = _Generator._build_step, _Generator._capture

    def counting_build(self, *args):
        counts["build"] += 1
        return build(self, *args)

    def counting_capture(self, *args):
        counts["capture"] += 1
        return capture(self, *args)

    monkeypatch.setattr(_Generator, "_build_step", counting_build)
    monkeypatch.setattr(_Generator, "_capture", counting_capture)
    return counts


def _fast(opt, inputs, new_tokens, **kwargs):
    """The fast path's answer (without graphs), checked against transformers' greedy generate."""
    got = _Generator(opt.model, opt.adapter, {**inputs, "max_new_tokens": new_tokens, **kwargs}, graphs=False).run()
    assert torch.equal(got, _greedy(opt.model, inputs, new_tokens, **kwargs)), new_tokens
    return got


@pytest.mark.parametrize("name,passes", [("tiny:llava", ()), ("tiny:llava", ("int4-kv",)), ("tiny:qwen2-vl", ())])
def test_consecutive_calls_reuse_the_kept_state_where_it_fits(name, passes, session, tiny, monkeypatch):
    """Every call answers like transformers; a call that fits reuses the cache and step, others build anew."""
    monkeypatch.setattr(decode_state, "CAPACITY_STEP", 32)  # small capacities: short calls outgrow them
    opt, inputs = _optimized(tiny, session, name, passes)
    counts, model, prompt = _count_builds(monkeypatch), opt.model, inputs["input_ids"].shape[1]
    first_answer = _fast(opt, inputs, 7)
    kept_answer, state = first_answer.clone(), kept(model)
    assert counts == {"build": 1, "capture": 1} and state.capacity == capacity_for(prompt + 8)
    # the model's forward runs to its end for the prefill only: the one for the first decode token stops where the
    # language model would start, and the kept step makes every new token
    finished = []
    handle = model.register_forward_hook(lambda *_: finished.append(1))
    try:
        again = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 7}, graphs=False).run()
    finally:
        handle.remove()
    assert torch.equal(again, first_answer) and finished == [1] and kept(model).step is state.step
    step, cache, tokens = state.step, state.cache, state.tokens
    most = state.capacity - prompt - 1  # the most new tokens the kept cache holds for this prompt
    other_images = tiny_inputs(opt.processor, QUESTIONS, seed=3)
    shorter = tiny_inputs(opt.processor, ("odd ?", "odd ?"))
    assert shorter["input_ids"].shape[1] < prompt
    for call_inputs, new_tokens in ((other_images, most), (shorter, 5), (inputs, 1), (inputs, 2), (inputs, 3),
                                    (inputs, 4)):
        _fast(opt, call_inputs, new_tokens)
        assert kept(model) is state and state.step is step, new_tokens
        assert state.cache is cache and state.tokens is tokens  # the same tensors: a graph holds their addresses
    assert counts == {"build": 1, "capture": 1}  # no warm-up step and no capture after the first call
    assert torch.equal(first_answer, kept_answer)  # answers are copies, not views of the kept buffers
    _fast(opt, inputs, most + 1)  # one token more than the kept cache holds
    assert kept(model) is not state and kept(model).capacity > state.capacity and counts["capture"] == 2
    _fast(opt, inputs, 2 * state.capacity)
    big = kept(model)
    _fast(opt, inputs, 2)  # needs far less than the big cache: attention over it would cost more than a rebuild
    # 2 tokens: the prefill picks token 0, the warm-up step writes token 1, so nothing is replayed or captured
    assert kept(model) is not big and kept(model).capacity < big.capacity and kept(model).step is None
    single = tiny_inputs(opt.processor, QUESTIONS[:1])
    _fast(opt, single, 5)  # another batch size
    assert kept(model).tokens.shape[0] == 1 and counts == {"build": 5, "capture": 4}
    _fast(opt, single, 6)
    assert counts == {"build": 5, "capture": 4}


@pytest.mark.parametrize("name,passes", [("tiny:idefics", ("gated-xattn",)), ("tiny:mllama", ())])
def test_the_kept_step_holds_what_its_graph_reads_and_leaves_the_inputs_alone(name, passes, session, tiny,
                                                                              monkeypatch):
    """A CUDA graph keeps none of the tensors it reads alive. Here the "graph" is a weak reference to the step's
    body, so a step that held its tensors only through that body (IDEFICS's mask over the cache's slots, dropped
    once the graph replaced it, read as whatever later took its memory: on an H200 one row's self-attention changed)
    fails. A later call refills the step's inputs in place; it must not write into an earlier call's (IDEFICS's
    image mask on the step was a view of the caller's ``image_attention_mask``)."""
    def weak_capture(self, step, stream):
        body = weakref.ref(step)
        return lambda: body()()

    opt, inputs = _cross_attention_model(tiny, session, name, passes)
    model, key = opt.model, IMAGE_MASKS[name]
    other = tiny_inputs(opt.processor, QUESTIONS, seed=3)
    other[key][1, 3:] = 0  # the second row's new tokens see no image
    originals = {k: v.clone() for k, v in inputs.items()}
    expected = [_Generator(model, opt.adapter, {**case, "max_new_tokens": n}, graphs=False).run()
                for case, n in ((inputs, 12), (other, 10))]
    release(model)
    monkeypatch.setattr(_Generator, "_capture", weak_capture)  # called with graphs off too
    assert torch.equal(_Generator(model, opt.adapter, {**inputs, "max_new_tokens": 12}, graphs=False).run(),
                       expected[0])
    step = kept(model).step
    again = _Generator(model, opt.adapter, {**other, "max_new_tokens": 10}, graphs=False).run()
    assert kept(model).step is step and torch.equal(again, expected[1])
    assert all(torch.equal(inputs[k], v) for k, v in originals.items())


@pytest.mark.parametrize("passes", [(), ("gated-xattn",), ("int4-kv",)])
def test_idefics_steps_project_their_image_states_once_per_call(passes, session, tiny, monkeypatch):
    """IDEFICS's cross-attention layers project the image states at every forward. Fast generate's steps are handed
    the products of the first step (mmsdk.kernels.step_projections), through whatever stands in for the projection
    (gated-xattn's KVMemo, int4-kv's CrossKVMemo): one projection per K / V per call, however many steps. A later
    call copies its image states into the kept step's own tensors (under inference mode they keep their memo keys);
    the refill clears the memos and projects the new states once: its answers are transformers' for those images."""
    from mmsdk.kernels.step_projections import recomputed_projections

    opt, inputs = _cross_attention_model(tiny, session, "tiny:idefics", passes)
    model, projections = opt.model, recomputed_projections(opt.adapter, opt.model)
    assert projections, "tiny IDEFICS has cross-attention layers that recompute their image K/V"
    ran, weights, linear = [], [p.weight for p in projections], torch.nn.functional.linear

    def counted(x, weight, *args, **kwargs):  # how often the projections really ran, under whatever stands in
        ran.extend(1 for w in weights if w is weight)
        return linear(x, weight, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear", counted)
    first = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 6}, graphs=False).run()
    step = kept(model).step
    assert step.projections.computed == len(projections) and step.projections.holding
    prefill = len(projections)  # the prompt's forward projects each once
    assert len(ran) == prefill + len(projections), len(ran)  # and the steps once, not once per token
    assert torch.equal(first, _greedy(model, inputs, 6))
    other, ran[:] = tiny_inputs(opt.processor, QUESTIONS, seed=3), []
    again = _Generator(model, opt.adapter, {**other, "max_new_tokens": 6}, graphs=False).run()
    projected = len(ran)
    assert torch.equal(again, _greedy(model, other, 6)) and not torch.equal(first, again)
    assert kept(model).step is step and step.projections.computed == 2 * len(projections)
    assert projected == prefill + len(projections)  # the refill projects the refilled states once


def _idefics_like_9b(tiny):
    """Tiny IDEFICS laid out as IDEFICS-9B: a perceiver resampler between its vision encoder and its cross-attention,
    and 2 extra tokens past its base vocabulary (embedded from a second table, scored by a second head)."""
    from transformers import IdeficsConfig, IdeficsForVisionText2Text

    from mmsdk.core.sources import LoadedModel

    base = tiny("tiny:idefics")
    perceiver = dict(use_resampler=True, resampler_n_latents=4, resampler_depth=2, resampler_n_heads=2,
                     resampler_head_dim=8)
    config = IdeficsConfig(**{**base.model.config.to_dict(), "use_resampler": True, "perceiver_config": perceiver,
                              "additional_vocab_size": 2})
    torch.manual_seed(0)
    model = IdeficsForVisionText2Text(config).eval()
    model.generation_config = base.model.generation_config
    with torch.no_grad():  # at its own initialisation the perceiver's output hardly depends on the image
        for weight in model.model.perceiver_resampler.parameters():
            if weight.dim() == 2:
                weight.normal_(0.0, 0.3)
    return LoadedModel(model, base.processor, "tiny:idefics")


def test_idefics_extra_tokens_embed_without_a_host_sync_as_the_model_does(tiny):
    """IDEFICS's decoupled embedding finds its extra tokens with a host sync, which a CUDA-graph capture refuses;
    the decode steps' stand-in (IdeficsAdapter.decode_step_scope) gives the same rows bitwise, extra ids included."""
    from mmsdk.plugins.adapters.flamingo import IdeficsAdapter

    model = _idefics_like_9b(tiny).model
    embedding = model.model.embed_tokens
    ids = torch.tensor([[0, 5, embedding.num_embeddings - 1, embedding.num_embeddings, embedding.num_embeddings + 1,
                         3]])
    expected = embedding(ids)
    with IdeficsAdapter().decode_step_scope(model):
        assert "forward" in vars(embedding) or embedding.__dict__.get("_mmsdk_body") is not None
        got = embedding(ids)
    assert torch.equal(got, expected) and "forward" not in vars(embedding)
    assert torch.equal(got[0, 3], embedding.additional_embedding.weight[0])


@pytest.mark.parametrize("passes", [(), ("int4-kv",)])
def test_idefics_with_a_perceiver_resamples_once_per_call(passes, session, tiny, monkeypatch):
    """IDEFICS laid out as IDEFICS-9B. transformers (5.24) hands each decode step the vision encoder's states and
    runs the perceiver on them at every step. Fast generate resamples them once after the prefill and hands the steps
    the perceiver's output: the answers are transformers', with the perceiver run twice per call (the prefill, then
    once; once with releases that hand the steps its output) however many tokens, the image K/V projected once for
    the steps, on the first call and on a refilled one, and the extra-token embedding's stand-in used by every
    step."""
    from mmsdk.kernels.step_projections import recomputed_projections
    from mmsdk.plugins.adapters import flamingo

    opt, inputs = _cross_attention_model(tiny, session, "tiny:idefics", passes, loaded=_idefics_like_9b(tiny))
    model = opt.model
    perceiver, resampled, embedded = model.model.perceiver_resampler, [], []
    perceiver.register_forward_hook(lambda *_: resampled.append(1))
    without_sync = flamingo._decoupled_embedding_without_sync
    monkeypatch.setattr(flamingo, "_decoupled_embedding_without_sync",
                        lambda *a: embedded.append(1) or without_sync(*a))
    first = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 6}, graphs=False).run()
    # the prefill, then once more where this transformers release hands the steps the encoder's states (5.24; 5.17
    # hands the resampled states): not once per token
    once_per_call = len(resampled)
    assert once_per_call in (1, 2), once_per_call
    assert len(embedded) == 5  # the steps embed their tokens without a host sync (the first token's forward too)
    step, projections = kept(model).step, recomputed_projections(opt.adapter, model)
    assert "perceiver_embeddings" in step.fixed and step.projections.computed == len(projections)
    assert torch.equal(first, _greedy(model, inputs, 6))
    other, resampled[:] = tiny_inputs(opt.processor, QUESTIONS, seed=3), []
    again = _Generator(model, opt.adapter, {**other, "max_new_tokens": 6}, graphs=False).run()
    assert len(resampled) == once_per_call and kept(model).step is step
    assert step.projections.computed == 2 * len(projections)
    assert torch.equal(again, _greedy(model, other, 6)) and not torch.equal(first, again)


def test_rows_that_end_early_are_padded_on_every_call(session, tiny):
    opt, inputs = _optimized(tiny, session, "tiny:llava", ())
    prompt = inputs["input_ids"].shape[1]
    end = int(_fast(opt, inputs, 12)[0, prompt + 3])  # row 0's fourth new token ends row 0 below
    first = _fast(opt, inputs, 12, eos_token_id=end)
    state = kept(opt.model)
    assert first.shape[1] > prompt + 4 and (first[0, prompt + 4:] == opt.model.generation_config.pad_token_id).all()
    _fast(opt, tiny_inputs(opt.processor, QUESTIONS, seed=3), 12, eos_token_id=end)  # the finished rows start over
    assert torch.equal(_fast(opt, inputs, 12, eos_token_id=end), first) and kept(opt.model) is state


def test_release_and_model_changes_drop_what_they_make_stale(session, tiny, monkeypatch):
    opt, inputs = _optimized(tiny, session, "tiny:llava", ())
    model, counts = opt.model, _count_builds(monkeypatch)

    def call():  # the generator alone, no install in between: each call checks for itself
        got = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 5}, graphs=False).run()
        assert torch.equal(got, _greedy(model, inputs, 5))
        return kept(model)

    state = call()
    assert opt.model is model and kept(model) is state  # install again (every opt.model does) keeps it
    release(model)
    assert kept(model) is None
    state = call()
    assert state is not None and counts["capture"] == 2
    head = opt.adapter.lm_head(model)
    head.weight.data = head.weight.data.clone()  # what .to() does: the same parameter, new storage
    assert call() is state and counts["capture"] == 3  # the cache still serves; the step is captured again
    opt.adapter.decoder_layers(model)[0].mlp.down_proj = torch.nn.Linear(74, 48)  # a module replaced
    assert call() is state and counts["capture"] == 4
    embed = model.get_input_embeddings()
    embed.weight.data = embed.weight.data.clone()  # the model's dtype or device may have changed: a new cache
    assert call() is not state and counts["capture"] == 5
    opt.apply("qkv-fuse", "int4-kv")
    assert opt.model is model and kept(model) is None  # the passes replaced modules: dropped at install
    assert all(type(layer).__name__ == "PackedStaticLayer" for layer in call().cache.layers)
    model.generate(**inputs, max_new_tokens=2)  # a model off the GPU: transformers' loop, and nothing stays kept
    assert kept(model) is None


def test_a_failure_while_reusing_drops_the_state_and_answers_like_transformers(session, tiny, monkeypatch):
    class OnCpu(_Generator):
        def __init__(self, model, adapter, kwargs, graphs=False, **options):
            super().__init__(model, adapter, kwargs, graphs, **options)

    opt, inputs = _optimized(tiny, session, "tiny:llava", ("int4-kv",))
    model = opt.model
    expected = _greedy(model, inputs, 6)
    monkeypatch.setattr(fast_generate, "unsupported_reason", lambda *args: None)  # as if on CUDA
    monkeypatch.setattr(fast_generate, "_Generator", OnCpu)
    assert torch.equal(model.generate(**inputs, max_new_tokens=6), expected) and kept(model) is not None

    def broken(self, *args):
        raise RuntimeError("refill failed")

    monkeypatch.setattr(_Generator, "_refill", broken)
    assert torch.equal(model.generate(**inputs, max_new_tokens=6), expected)  # transformers' generate answered
    assert kept(model) is None


def test_the_cache_is_sized_for_the_prompt_left_after_token_pruning(session, tiny, monkeypatch):
    """The cache holds the pruned prompt + new tokens, not what input_ids asked for; a kept cache too small for a
    call's pruned prompt is replaced before the prefill writes into it."""
    monkeypatch.setattr(decode_state, "CAPACITY_STEP", 8)  # small steps: the pruned and unpruned sizes differ
    opt, inputs = _optimized(tiny, session, "tiny:llava", (TokenPruneConfig(keep_ratio=0.25), "int4-kv"))
    model, prompt, heard = opt.model, inputs["input_ids"].shape[1], []
    size_cache = _Generator._size_cache
    monkeypatch.setattr(_Generator, "_size_cache", lambda self, cache, n: heard.append(n) or size_cache(self, cache, n))
    counts = _count_builds(monkeypatch)
    _fast(opt, inputs, 3)
    state, pruned = kept(model), heard[-1]
    held = state.cache.layers[0].max_cache_len
    assert pruned < prompt and held == capacity_for(pruned + 4) < state.capacity == capacity_for(prompt + 4)
    new_tokens = held - pruned  # one token more than the kept cache holds for this pruned prompt
    assert decode_state.fits(state.capacity, prompt + new_tokens + 1)  # though the unpruned bound says it fits
    _fast(opt, inputs, new_tokens)
    assert kept(model) is not state and counts["build"] == 2
    assert kept(model).cache.layers[0].max_cache_len == capacity_for(pruned + new_tokens + 1)


def test_a_released_packed_cache_frees_its_buffers_without_the_garbage_collector():
    from mmsdk.plugins.quantizers.quantized_cache import StaticCodec
    from mmsdk.plugins.quantizers.static_kv import PackedStaticLayer, packed_layer

    codec = StaticCodec("int4", torch.ones(1, 1))
    layer = PackedStaticLayer(codec, codec, 8, fused=True)
    layer.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16))
    marker, _ = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    assert packed_layer(marker) is layer
    codes = weakref.ref(layer.key_codes)
    del layer
    assert codes() is None and packed_layer(marker) is None  # freed by reference counting alone


SAMPLING = [dict(do_sample=True), dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
            dict(do_sample=True, temperature=1.3, top_k=0, min_p=0.05)]


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl", "tiny:mllama"])
def test_sampled_answers_are_the_draws_transformers_makes_from_the_seed(name, session, tiny, monkeypatch):
    """Sampling (transformers' defaults; temperature + top-k + top-p; temperature + min-p) on the fast path's step:
    from the same seed, the same tokens as transformers' generate, which samples them differently from greedy. A
    call with other settings builds its own step; one with the same settings reuses the kept one."""
    opt, inputs = _optimized(tiny, session, name, ())
    model = opt.model
    greedy = _greedy(model, inputs, 10)
    counts = _count_builds(monkeypatch)
    sampled_differs = False
    for seed, options in enumerate(SAMPLING):
        torch.manual_seed(seed)
        expected = type(model).generate(model, **inputs, max_new_tokens=10, **options)
        torch.manual_seed(seed)
        got = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 10, **options}, graphs=False).run()
        assert torch.equal(got, expected), (options, got, expected)
        sampled_differs |= not torch.equal(got, greedy)
        assert _reason_on_cuda(model, tiny(name).processor, **options) is None
    assert sampled_differs and counts["build"] == len(SAMPLING)
    torch.manual_seed(0)
    _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 10, **SAMPLING[-1]}, graphs=False).run()
    assert counts["build"] == len(SAMPLING)  # the same settings: the kept step


@pytest.mark.parametrize("option", [dict(typical_p=0.9), dict(epsilon_cutoff=3e-4), dict(eta_cutoff=3e-4)])
def test_sampling_warpers_the_fast_path_does_not_apply_keep_transformers_loop(option, session, tiny):
    opt, _ = _optimized(tiny, session, "tiny:llava", ())
    name = next(iter(option))
    assert name in (_reason_on_cuda(opt.model, tiny("tiny:llava").processor, do_sample=True, **option) or "")
    assert _reason_on_cuda(opt.model, tiny("tiny:llava").processor, **option) is None  # greedy ignores them


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name,options", [
    ("tiny:llava", dict(temperature=1.5, top_k=5)), ("tiny:mllama", dict(temperature=1.5, top_k=5)),
    ("tiny:llava", dict(temperature=1.2, top_k=0, top_p=0.8, min_p=0.05))])  # sort and min-p inside the capture
def test_cuda_graph_sampling_draws_afresh_at_every_replay(name, options, session, tiny):
    """Inside the captured step the CUDA generator advances at every replay: calls that replay the kept step from
    the same seed give the same answer, another seed another one, and with top-k every drawn token is among the top-k
    of transformers' forward over the answer (up to a near-tie at the k-th)."""
    loaded = tiny(name)
    opt = Optimizer(loaded.model.cuda().to(torch.bfloat16), loaded.processor, session=session)
    inputs = {k: v.cuda() for k, v in tiny_inputs(loaded.processor, QUESTIONS).items()}
    options = dict(do_sample=True, max_new_tokens=24, **options)
    answers = []
    for seed in (0, 0, 0, 1):  # the first call builds and captures the step; the others replay it
        torch.manual_seed(seed)
        answers.append(opt.model.generate(**inputs, **options))
        assert kept(opt.model) is not None and kept(opt.model).step is not None  # the fast path, captured
    assert torch.equal(answers[1], answers[2]) and not torch.equal(answers[2], answers[3])
    if not options.get("top_k"):
        return
    prompt = inputs["input_ids"].shape[1]
    # a drawn image token would count as a placeholder in the forward over the answer (LLaVA then refuses the
    # images): it is scored, then replaced, and the row's later tokens are not scored (their context changed)
    image_token = getattr(opt.model.config, "image_token_id", None)
    if image_token is None:
        image_token = getattr(opt.model.config, "image_token_index", None)
    answer = answers[3].clone()
    drawn_images = answer[:, prompt:] == image_token
    answer[:, prompt:][drawn_images] = 0
    logits = _forced_logits(opt.model, inputs, answer).float()
    eos = opt.model.generation_config.eos_token_id
    ends = {int(e) for e in ([eos] if isinstance(eos, int) else (eos or []))}
    scored = 0
    for row, new in enumerate(answers[3][:, prompt:].tolist()):
        for step, token in enumerate(new):
            step_logits = logits[row, step]
            kth = float(step_logits.topk(options["top_k"]).values[-1])
            span = float(step_logits.max() - step_logits.min())
            assert float(step_logits[token]) >= kth - 0.05 * span, (row, step, token)
            scored += 1
            if token in ends or token == image_token:
                break
    assert scored >= 4


@pytest.mark.parametrize("call", [{}, dict(top_p=None), dict(temperature=None), dict(top_k=None),
                                  dict(do_sample=None), dict(do_sample=False)])
def test_sampling_settings_resolve_as_in_transformers(call, session, tiny, monkeypatch):
    """A checkpoint whose generation config samples (as instruction-tuned ones do) samples on the fast path with its
    settings; a call's own None switches that warper off (do_sample=None: greedy), as transformers reads it."""
    opt, inputs = _optimized(tiny, session, "tiny:llava", ())
    model = opt.model
    for name, value in dict(do_sample=True, temperature=0.6, top_p=0.9, top_k=3).items():
        monkeypatch.setattr(model.generation_config, name, value)
    torch.manual_seed(7)
    expected = type(model).generate(model, **inputs, max_new_tokens=10, **call)
    torch.manual_seed(7)
    got = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 10, **call}, graphs=False).run()
    assert torch.equal(got, expected), (call, got, expected)
    assert _reason_on_cuda(model, tiny("tiny:llava").processor, **call) is None


@pytest.mark.parametrize("setting", [dict(num_return_sequences=2), dict(output_scores=True),
                                     dict(sequence_bias={(5,): 1.0}), dict(renormalize_logits=True)])
def test_generation_config_settings_the_fast_path_does_not_apply_keep_transformers_loop(setting, session, tiny,
                                                                                         monkeypatch):
    opt, _ = _optimized(tiny, session, "tiny:llava", ())
    name, value = next(iter(setting.items()))
    monkeypatch.setattr(opt.model.generation_config, name, value)
    for sampled in (False, True):
        assert name in (_reason_on_cuda(opt.model, tiny("tiny:llava").processor, do_sample=sampled) or "")


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl", "tiny:mllama"])
def test_repetition_penalty_gives_the_answers_transformers_gives(name, session, tiny, monkeypatch):
    """transformers' repetition penalty on the fast path's step, greedy (a penalty and a reward) and sampled with a
    generation config as instruction-tuned checkpoints ship (repetition_penalty 1.05): the same tokens as
    transformers' generate (from the same seed), which the penalty changes. A call with another penalty builds its
    own step (the step bakes it in); one with the same penalty reuses the kept step, its record of the ids seen
    refilled for the new prompt."""
    if name == "tiny:mllama":  # gates opened: the image reaches the answer
        opt, inputs = _cross_attention_model(tiny, session, name, ())
    else:
        opt, inputs = _optimized(tiny, session, name, ())
    model, processor = opt.model, tiny(name).processor
    other = {k: v.to(inputs["input_ids"].device) for k, v in tiny_inputs(processor, QUESTIONS, seed=3).items()}
    counts = _count_builds(monkeypatch)
    changed = False
    # the second call, 1.5 again, replays the first one's step with another prompt's ids; the third builds its own
    for case, penalty in ((inputs, 1.5), (other, 1.5), (inputs, 0.6)):
        expected = _greedy(model, case, 12, repetition_penalty=penalty)
        got = _Generator(model, opt.adapter, {**case, "max_new_tokens": 12, "repetition_penalty": penalty},
                         graphs=False).run()
        assert torch.equal(got, expected), (penalty, got, expected)
        changed |= not torch.equal(got, _greedy(model, case, 12))
        assert _reason_on_cuda(model, processor, repetition_penalty=penalty) is None
    assert changed and counts["build"] == 2
    for key, value in dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05).items():
        monkeypatch.setattr(model.generation_config, key, value)
    assert _reason_on_cuda(model, processor) is None  # a checkpoint's own penalty no longer keeps transformers' loop
    torch.manual_seed(3)
    expected = type(model).generate(model, **inputs, max_new_tokens=12)
    torch.manual_seed(3)
    assert torch.equal(_Generator(model, opt.adapter, {**inputs, "max_new_tokens": 12}, graphs=False).run(), expected)


@pytest.mark.parametrize("value", [2, -1.0, 0.0])
def test_a_repetition_penalty_transformers_refuses_keeps_its_loop(value, session, tiny):
    """A value transformers' processor refuses (it takes a positive float) is left to transformers, which raises."""
    opt, _ = _optimized(tiny, session, "tiny:llava", ())
    assert f"repetition_penalty={value!r}" in (_reason_on_cuda(opt.model, tiny("tiny:llava").processor,
                                                               repetition_penalty=value) or "")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl"])
def test_cuda_graph_repetition_penalty_matches_transformers(name, session, tiny, monkeypatch):
    """The captured step penalizes at every replay and marks each new token: transformers' greedy answer with the
    same penalty (up to a late bf16 near-tie, as in the other CUDA tests); a second call replays the kept graph."""
    loaded = tiny(name)
    opt = Optimizer(loaded.model.cuda().to(torch.bfloat16), loaded.processor, session=session)
    model = opt.model
    inputs = {k: v.cuda() for k, v in tiny_inputs(loaded.processor, QUESTIONS).items()}
    counts = _count_builds(monkeypatch)
    got = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 24, "repetition_penalty": 1.5}).run()
    assert counts == {"build": 1, "capture": 1}
    _assert_agrees(got, _greedy(model, inputs, 24, repetition_penalty=1.5))
    assert torch.equal(model.generate(**inputs, max_new_tokens=24, repetition_penalty=1.5), got)
    assert counts == {"build": 1, "capture": 1}


class _RecordingStreamer:
    """A transformers streamer that keeps what it is handed."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1

    def same_as(self, other):
        return (len(self.puts) == len(other.puts) and self.ends == other.ends == 1
                and all(torch.equal(a, b) for a, b in zip(self.puts, other.puts, strict=True)))


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:idefics"])
def test_a_streamer_gets_what_transformers_generate_hands_it(name, session, tiny, monkeypatch):
    """The prompt, then each step's tokens (pad for a row that ended), then end(), stopping where transformers'
    loop stops. Tiny IDEFICS's first row ends at its first token and, for the second prompt (row 1's image cut), the
    other row at its fifth: the stream stops there, where without a streamer the fast path would run on."""
    if name == "tiny:idefics":
        opt, inputs = _cross_attention_model(tiny, session, name, ())
    else:
        opt, inputs = _optimized(tiny, session, name, ())
    model, processor = opt.model, tiny(name).processor
    other = tiny_inputs(processor, QUESTIONS, seed=3)
    if name == "tiny:idefics":
        other["image_attention_mask"][1, 3:] = 0
    counts = _count_builds(monkeypatch)
    for case, new in ((inputs, 1), (inputs, 2), (inputs, 12), (other, 12)):
        ours, theirs = _RecordingStreamer(), _RecordingStreamer()
        expected = _greedy(model, case, new, streamer=theirs)
        got = _Generator(model, opt.adapter, {**case, "max_new_tokens": new, "streamer": ours}, graphs=False).run()
        assert torch.equal(got, expected) and ours.same_as(theirs), (new, len(ours.puts), len(theirs.puts))
    assert counts["build"] == 2  # max_new_tokens 2 builds one (not kept without a replay), 12 builds and keeps one
    if name == "tiny:idefics":  # the second prompt's answer ended before max_new_tokens
        assert len(theirs.puts) < 1 + 12
    assert _reason_on_cuda(model, processor, streamer=_RecordingStreamer()) is None
    # every row ends at its first token, then (end tokens chosen so) every row at its second: transformers' loop
    # stops there, on the call that builds the step and on the one that reuses it
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)  # the answers' first tokens, unstopped
    plain = _greedy(model, inputs, 3)[:, inputs["input_ids"].shape[1]:]
    first, second = sorted(set(plain[:, 0].tolist())), sorted(set(plain[:, 1].tolist()))
    # IDEFICS's second row repeats its first token, so only its first-token stop can be set up
    assert name != "tiny:llava" or not set(first) & set(second)
    for eos in (first, second) if not set(first) & set(second) else (first,):
        for _ in range(2):
            ours, theirs = _RecordingStreamer(), _RecordingStreamer()
            expected = _greedy(model, inputs, 6, streamer=theirs, eos_token_id=eos)
            got = _Generator(model, opt.adapter, {**inputs, "max_new_tokens": 6, "streamer": ours,
                                                  "eos_token_id": eos}, graphs=False).run()
            assert torch.equal(got, expected) and ours.same_as(theirs), (eos, len(ours.puts), len(theirs.puts))
            assert len(theirs.puts) == 1 + (1 if eos == first else 2)


def test_a_streamed_call_falls_back_only_before_it_streams(session, tiny, monkeypatch):
    """An error while the decode step is made (before anything is streamed) reruns transformers' generate, which
    streams the whole answer once; an error after streaming started is raised, not streamed again."""
    from mmsdk.kernels.streaming import TokenStream

    opt, inputs = _optimized(tiny, session, "tiny:llava", ())
    model = opt.model
    theirs = _RecordingStreamer()
    expected = _greedy(model, inputs, 6, streamer=theirs)

    class Eager(_Generator):  # the CPU's eager steps behind model.generate
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.graphs = False

    def failed_warm_up(self, step):
        raise RuntimeError("the warm-up step failed")

    monkeypatch.setattr(fast_generate, "unsupported_reason", lambda *args: None)  # as if on CUDA
    monkeypatch.setattr(fast_generate, "_Generator", Eager)
    with monkeypatch.context() as patch:
        patch.setattr(_Generator, "_warm_up", failed_warm_up)
        ours = _RecordingStreamer()
        assert torch.equal(model.generate(**inputs, max_new_tokens=6, streamer=ours), expected)
        assert ours.same_as(theirs)
    release(model)
    put = TokenStream.put

    def failing_put(self, token, finished):
        put(self, token, finished)
        raise RuntimeError("the streamer's reader went away")

    monkeypatch.setattr(TokenStream, "put", failing_put)
    ours = _RecordingStreamer()
    with pytest.raises(RuntimeError, match="reader went away"):
        model.generate(**inputs, max_new_tokens=6, streamer=ours)
    assert len(ours.puts) == 1 + 3 and ours.ends == 0  # the prompt, tokens 0 and 1 held, then the first step's


def test_a_streamed_step_reads_its_tokens_and_the_rows_ends_in_one_copy(monkeypatch):
    """TokenStream.put hands the streamer the step's tokens and says whether every row has ended, from one copy to
    the host (on CUDA each copy waits for the step)."""
    from mmsdk.kernels.streaming import TokenStream

    copies = []
    cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self: copies.append(1) or cpu(self))
    streamer = _RecordingStreamer()
    stream = TokenStream(streamer, torch.tensor([[5, 6], [7, 8]]))
    stream.start()
    copies.clear()
    token = torch.tensor([11, 0])
    assert stream.put(token, torch.tensor([False, True])) is False and len(copies) == 1
    assert stream.put(torch.tensor([3, 0]), torch.tensor([True, True])) is True and len(copies) == 2
    assert [p.tolist() for p in streamer.puts[1:]] == [[11, 0], [3, 0]] and streamer.puts[1].dtype == token.dtype


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_graph_generate_streams_its_answer(session, tiny):
    """With a streamer the captured step's tokens reach the host step by step: what was streamed is the answer, on
    the call that captures the step and on the one that replays it."""
    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model.cuda().to(torch.bfloat16), loaded.processor, session=session)
    inputs = {k: v.cuda() for k, v in tiny_inputs(loaded.processor, QUESTIONS).items()}
    for _ in range(2):
        streamer = _RecordingStreamer()
        got = opt.model.generate(**inputs, max_new_tokens=24, streamer=streamer)
        assert kept(opt.model) is not None and kept(opt.model).step is not None and streamer.ends == 1
        streamed = torch.cat([p.reshape(got.shape[0], -1) for p in streamer.puts], dim=1)
        assert torch.equal(streamed, got.cpu())


def test_the_repetition_penalty_is_transformers_processor_element_for_element():
    """Against transformers' RepetitionPenaltyLogitsProcessor on fresh random logits: a penalty and a reward, repeated
    ids, bf16 logits scored in fp32; ids the logits do not cover (Llama-3.2-Vision's image token is one past its
    LM head) are left out, as transformers 5.24 leaves them out (5.17's gather raises on them)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from mmsdk.kernels.repetition import RepetitionPenalty

    generator = torch.Generator().manual_seed(0)
    vocab = 50
    ids = torch.randint(0, vocab, (3, 17), generator=generator)
    ids[:, 5] = ids[:, 4]  # a repeated id is penalized once
    outside = torch.cat([ids, torch.full((3, 2), vocab)], dim=1)  # one past the logits, as Mllama's image token
    for penalty in (1.3, 0.7):
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(3, vocab, generator=generator) * 4).to(dtype)
            step = RepetitionPenalty(penalty)
            expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.float())
            assert torch.equal(step.apply(logits, step.occurred(ids, vocab)), expected)
            assert torch.equal(step.apply(logits, step.occurred(outside, vocab)), expected)


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:idefics"])
def test_the_answer_is_as_long_as_transformers_makes_it(name, session, tiny, monkeypatch):
    """Without max_new_tokens in the call: the generation config's, else max_length (the call's or the config's) less
    the prompt, else transformers' default of 20 new tokens (IDEFICS: within its 512 positions). A length transformers
    refuses (no new token) keeps its loop, which raises."""
    opt, inputs = _optimized(tiny, session, name, ())
    model, processor = opt.model, tiny(name).processor
    prompt = inputs["input_ids"].shape[1]
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)  # full-length answers: the lengths show
    cases = [({}, {}), ({}, {"max_length": prompt + 7}), ({"max_new_tokens": 9}, {}),
             ({"max_length": prompt + 5}, {}),
             ({"max_new_tokens": 9}, {"max_new_tokens": None}),  # the call's None overrides the config's 9, as there
             ({"max_new_tokens": 4}, {"max_length": prompt + 30})]
    for config, call in cases:
        with monkeypatch.context() as patch:
            for key, value in config.items():
                patch.setattr(model.generation_config, key, value)
            expected = type(model).generate(model, **inputs, do_sample=False, **call)
            got = _Generator(model, opt.adapter, {**inputs, **call}, graphs=False).run()
            assert torch.equal(got, expected), (config, call, got.shape, expected.shape)
            assert _reason_on_cuda(model, processor, **{"max_new_tokens": None, **call}) is None
    assert expected.shape[1] == prompt + 4  # the call's max_new_tokens over its max_length, as in transformers
    for call in ({"max_new_tokens": 0}, {"max_length": prompt}):
        assert "no new token to make" in (_reason_on_cuda(model, processor, **call) or "")
        with pytest.raises(ValueError):
            type(model).generate(model, **inputs, **call)
