"""The onnxruntime runtime: zero-copy hand-offs, sampling, double-buffered scheduling, M-RoPE positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmsdk
from mmsdk.runtime.pipeline import Request
from mmsdk.runtime.sessions import Bound, as_torch, to_ortvalue
from tests.ort_helpers import QUESTIONS, export_tiny, images

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava") / "out"
    export_tiny("tiny:llava", folder, verify=False)
    return mmsdk.load(folder)


def test_torch_and_ort_values_share_memory():
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    value = to_ortvalue(tensor[1:])
    assert value.data_ptr() == tensor[1:].data_ptr()  # DLPack in, no copy
    assert as_torch(value).data_ptr() == value.data_ptr()  # DLPack out, no copy


def test_vision_writes_into_the_buffer_the_embedding_reads(llava):
    prepared = llava.prepare(images(2), list(QUESTIONS), 1)
    encoded = llava.encode(prepared)
    tokens = llava.vision_output_shapes["image_features"][0]
    assert encoded.features.shape == (2 * tokens, 48)
    for index, feed in enumerate(prepared.images):  # each image's run landed in its own slice
        alone = Bound(llava.vision).inputs(feed).output("image_features").run()[0].numpy()
        np.testing.assert_array_equal(encoded.features[index * tokens:(index + 1) * tokens].numpy(), alone)


def test_ort_allocated_outputs_are_handed_on_without_copies(llava):
    prepared = llava.prepare(images(1), QUESTIONS[:1], 1)
    embeds = Bound(llava.embedding).inputs({"input_ids": prepared.input_ids,
                                            "image_features": llava.encode(prepared).features})
    value = embeds.output("inputs_embeds").run()[0]
    assert to_ortvalue(value) is value  # bound into the decoder as the very same OrtValue
    step = Bound(llava.decoder).inputs({
        "inputs_embeds": value, "attention_mask": prepared.attention_mask,
        **{f"past_key_values.{i}.{kv}": np.zeros((1, 1, 0, 16), np.float32) for i in (0, 1) for kv in ("key", "value")},
    }).output("logits").output("present.0.key").run()
    logits, present = step
    assert as_torch(logits).data_ptr() == logits.data_ptr()  # sampling reads ORT's buffer through DLPack
    assert present.shape() == [1, 1, prepared.input_ids.shape[1], 16]


def test_sampling_is_seeded_and_top_k_one_is_greedy(llava):
    imgs, prompts = images(2), list(QUESTIONS)
    greedy = llava.generate(imgs, prompts, max_new_tokens=6)
    assert llava.generate(imgs, prompts, max_new_tokens=6, do_sample=True, top_k=1, seed=3) == greedy
    first = llava.generate(imgs, prompts, max_new_tokens=6, do_sample=True, temperature=2.0, seed=7)
    assert llava.generate(imgs, prompts, max_new_tokens=6, do_sample=True, temperature=2.0, seed=7) == first
    other = [llava.generate(imgs, prompts, max_new_tokens=6, do_sample=True, temperature=2.0, seed=s) for s in range(4)]
    assert any(o != greedy for o in other), "temperature 2 sampling never left the greedy path"


def test_double_buffered_run_matches_one_by_one(llava):
    requests = [Request(image, question) for image, question in zip(images(3), (*QUESTIONS, "is it odd ?"))]
    overlapped = [r.tokens for r in llava.run_many(requests, max_new_tokens=5)]
    sequential = [r.tokens for r in llava.run_many(requests, max_new_tokens=5, overlap=False)]
    single = [llava.generate([r.image], [r.prompt], max_new_tokens=5)[0] for r in requests]
    assert overlapped == sequential == single


def test_answer_decodes_text(llava):
    text = llava.answer(images(1)[0], "what digit is this ?", max_new_tokens=4)
    assert isinstance(text, str) and text


def test_mrope_positions_match_transformers():
    from mmsdk.runtime.positions import MRope, mrope_positions

    loaded = mmsdk.load_model("tiny:qwen2-vl")
    inputs = loaded.processor(images=images(2), text=[loaded.processor.format_prompt(q) for q in QUESTIONS])
    want, deltas = loaded.model.model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"])
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    got, got_deltas = mrope_positions(inputs["input_ids"].numpy(), inputs["attention_mask"].numpy(), grids,
                                      MRope(loaded.model.config.image_token_id, 2))
    mask = inputs["attention_mask"].numpy().astype(bool)
    np.testing.assert_array_equal(got[:, mask], want.numpy()[:, mask])  # padded positions are never read
    np.testing.assert_array_equal(got_deltas, deltas.numpy().ravel())
