"""ONNX Runtime GenAI: Qwen2.5-VL exports load in onnxruntime-genai and generate mmsdk's tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mmsdk
from mmsdk.plugins.backends.onnxruntime.genai_files import REQUIRED_FIELDS
from tests.ort_helpers import export_tiny, images

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen25") / "out"
    export_tiny("tiny:qwen2.5-vl", folder, verify=False)
    return folder


def test_genai_layout_has_every_required_field(qwen25):
    config = json.loads((qwen25 / "genai_config.json").read_text())
    sections = {"model": config["model"], "search": config["search"],
                **{k: config["model"][k] for k in ("decoder", "embedding", "vision")}}
    for section, fields in REQUIRED_FIELDS.items():
        assert set(fields) <= set(sections[section]), section
    assert config["model"]["type"] == "qwen2_5_vl"
    for key in ("decoder", "embedding", "vision"):
        assert (qwen25 / config["model"][key]["filename"]).is_file()
    assert json.loads((qwen25 / "processor_config.json").read_text())["processor"]["name"] == "qwen2_5_image_processor"
    manifest = json.loads((qwen25 / "manifest.json").read_text())
    assert "genai_config.json" in {f["path"] for f in manifest["files"]}  # hashed like every other file


def test_onnxruntime_genai_generates_the_same_tokens(qwen25):
    og = pytest.importorskip("onnxruntime_genai")
    pipe = mmsdk.load(qwen25)
    image, question = images(1)[0], "what digit is this ?"
    ours = pipe.generate([image], [question], max_new_tokens=8)[0]
    batch = pipe.processor(images=[image], text=[pipe.processor.format_prompt(question)])
    inputs = og.NamedTensors()
    inputs["input_ids"] = batch["input_ids"].numpy().astype(np.int32)  # GenAI's token ids are int32
    inputs["pixel_values"] = batch["pixel_values"].numpy()
    inputs["image_grid_thw"] = batch["image_grid_thw"].numpy()
    inputs["num_image_tokens"] = np.array([int((batch["input_ids"] == pipe.spec.image_token_id).sum())], np.int64)
    model = og.Model(str(qwen25))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=batch["input_ids"].shape[1] + len(ours), do_sample=False)
    generator = og.Generator(model, params)
    generator.set_inputs(inputs)
    theirs = []
    while not generator.is_done():
        generator.generate_next_token()
        theirs.append(int(generator.get_next_tokens()[0]))
    assert theirs[: len(ours)] == ours


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:idefics"])
def test_unsupported_families_say_so(name, tmp_path):
    export_tiny(name, tmp_path / "out", verify=False)
    assert not (tmp_path / "out" / "genai_config.json").exists()
    assert "ONNX Runtime GenAI: not supported" in (tmp_path / "out" / "README.md").read_text()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["details"]["genai"]["written"] is False
