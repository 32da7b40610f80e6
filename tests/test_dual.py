"""Dual-path builds: family recipes, the dual export (vision/ on ORT + llm/ for TensorRT-LLM) and its runtime."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import mmsdk
from mmsdk import Optimizer, Recipe
from mmsdk.core.errors import (
    ArtifactIntegrityError,
    BackendUnavailableError,
    ExportError,
    IncompatiblePassError,
    UnknownNameError,
)
from mmsdk.runtime.pipeline import Request
from mmsdk.testing import TINY_MODELS, sample_image

pytest.importorskip("onnxruntime")

QUESTIONS = ("what digit is this ?", "is it even ?", "what is this ?")


def _calibration(count: int = 4) -> list[tuple[object, str]]:
    return [(sample_image(seed=100 + i), QUESTIONS[i % len(QUESTIONS)]) for i in range(count)]


def _dual(tmp_path_factory: pytest.TempPathFactory, model: str, *passes: object, seed: int = 100) -> tuple:
    loaded = mmsdk.load_model(model)
    opt = Optimizer(loaded.model, loaded.processor)
    opt.calibrate([(sample_image(seed=seed + i), QUESTIONS[i % 3]) for i in range(4)])
    opt.apply(*passes)
    out = tmp_path_factory.mktemp("dual") / model.replace(":", "-")
    return opt, opt.export("dual", out, dtype="float32")


@pytest.fixture(scope="module")
def qwen_dual(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """tiny:qwen2-vl with token-merge (kept tokens keep their M-RoPE positions), ptq-align and int8-kv."""
    return _dual(tmp_path_factory, "tiny:qwen2-vl", "qkv-fuse", "rmsnorm-rope-fusion",
                 mmsdk.plugins.projectors.token_merge.TokenMergeConfig(keep_ratio=0.5), "ptq-align", "int8-kv")


@pytest.fixture(scope="module")
def llava_dual(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """tiny:llava with fused q/k/v and a ptq-align calibration (float KV: the LLM stage must match torch exactly)."""
    return _dual(tmp_path_factory, "tiny:llava", "qkv-fuse", "rmsnorm-rope-fusion", "ptq-align")


# --- recipes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY_MODELS)
def test_family_recipes_plan_as_a_whole(name: str, tiny) -> None:
    opt = Optimizer(tiny(name).model)
    recipes = opt.adapter.recipes(opt.model)
    assert set(recipes) == {"default", "max-memory", "max-accuracy"}
    assert all(r.description and r.family == opt.adapter.family for r in recipes.values())
    for recipe in recipes:  # apply validates every step against the model and the others, then plans
        planned = Optimizer(tiny(name).model).apply(f"recipe:{recipe}").recipe()
        assert [s.pass_name for s in planned.steps] == [s.pass_name for s in recipes[recipe].steps]
    steps = [s.pass_name for s in recipes["default"].steps]
    assert steps[-2:] == ["ptq-align", "int8-kv"] and "qkv-fuse" in steps
    assert ("gated-xattn" in steps) == (name in ("tiny:idefics", "tiny:mllama"))


def test_int4_weights_only_where_tensorrt_llm_loads_them(tiny) -> None:
    from mmsdk.plugins.adapters._recipes import int4_group_size

    opt = Optimizer(tiny("tiny:llava").model)
    assert int4_group_size(opt.model, opt.adapter) is None  # hidden 48: TensorRT-LLM's W4A16 needs multiples of 64
    assert "no INT4 weights" in opt.adapter.recipes(opt.model)["default"].description
    for layer in opt.adapter.decoder_layers(opt.model):  # widen every linear to 128 (shapes only matter here)
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.in_features, module.out_features = 128, 256
    default = opt.adapter.recipes(opt.model)["default"]
    assert ("int4-weight", {"method": "awq", "group_size": 128}) in [(s.pass_name, s.config) for s in default.steps]


def test_unknown_family_recipe_lists_the_known_ones(tiny) -> None:
    with pytest.raises(UnknownNameError, match="Known recipes: default, max-accuracy, max-memory"):
        Optimizer(tiny("tiny:llava").model).apply("recipe:max-speed")


def test_recipe_round_trips_through_a_file(tmp_path, tiny) -> None:
    opt = Optimizer(tiny("tiny:qwen2-vl").model).apply("recipe:max-memory")
    saved = opt.recipe("shipped").save(tmp_path / "shipped.yaml")
    again = Recipe.from_file(saved)
    pairs = [(s.pass_name, s.config) for s in again.steps]
    assert pairs == [(s.pass_name, s.config) for s in opt.recipe("shipped").steps] and again.family == "qwen-vl"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"steps": [{"pass": "qkv-fuse"}, {"pass": "token-merge", "config": {"keep": 2}}]}))
    with pytest.raises(mmsdk.ConfigError, match=r"step 2, pass 'token-merge'.*keep"):
        Optimizer(tiny("tiny:qwen2-vl").model).apply(Recipe.from_file(bad))


# --- the dual export ---------------------------------------------------------------------------

def test_dual_folder_layout_contract_and_requirements(qwen_dual) -> None:
    _, result = qwen_dual
    files = {f.path for f in result.manifest.files}
    assert {"vision/vision.onnx", "vision/half.json", "llm/config.json", "llm/rank0.safetensors", "llm/half.json",
            "calibration.json", "README.md"} <= files
    details = result.manifest.details
    contract = details["contract"]
    assert contract["entry"] == "prompt_table" and contract["positions"] == "mrope-host"
    assert contract["features"]["slots_output"] == "image_token_slots"
    assert set(result.manifest.requirements) == {"onnxruntime", "tensorrt-llm"}
    assert set(details["hashes"]) == {"vision", "llm"}


def test_both_halves_read_the_same_calibration(qwen_dual) -> None:
    """ptq-align's promise across the split: one record, its digest in both halves, llm/'s KV scales from it."""
    import hashlib

    import safetensors.torch

    folder = qwen_dual[1].path
    record = json.loads((folder / "calibration.json").read_text())
    digest = hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    stamps = {half: json.loads((folder / half / "half.json").read_text()) for half in ("vision", "llm")}
    assert stamps["vision"]["calibration_sha256"] == stamps["llm"]["calibration_sha256"] == digest
    rank = safetensors.torch.load_file(str(folder / "llm" / "rank0.safetensors"))
    for layer in record["kv_cache"]["layers"]:
        amax = max(max(layer["k_amax"]), max(layer["v_amax"]))
        written = float(rank[f"transformer.layers.{layer['layer']}.attention.kv_cache_scaling_factor"].reshape(-1)[0])
        assert written == pytest.approx(amax / 127, rel=1e-6)
        assert stamps["llm"]["kv_scales"][str(layer["layer"])] == pytest.approx(written, rel=1e-6)


@pytest.mark.parametrize("which", ["qwen_dual", "llava_dual"])
def test_dual_pipeline_answers_like_the_optimized_torch_model(which: str, request: pytest.FixtureRequest) -> None:
    opt, result = request.getfixturevalue(which)
    pipe = mmsdk.load(result.path, runtime="reference")
    assert pipe.llm.name == "reference"
    for seed, question in enumerate(QUESTIONS):
        image = sample_image(seed=seed)
        inputs = opt.processor(images=[image], text=[opt.adapter.format_prompt(question, opt.processor)],
                               return_tensors="pt")
        with torch.inference_mode():
            want = opt.model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        prepared = pipe.prepare([image], [question], 4)
        got = pipe.decode(prepared, pipe.encode(prepared)).tokens[0]
        # float32 llm/: identical greedy tokens on all 3 prompts. qwen_dual also has INT8 KV, which torch scales
        # per channel and TensorRT-LLM per layer; these 3 prompts still agree (measured), digits accuracy in docs
        assert got == want.tolist()[: len(got)]


def test_features_reach_the_llm_stage_without_a_copy(qwen_dual) -> None:
    pipe = mmsdk.load(qwen_dual[1].path, runtime="reference")
    prepared = pipe.prepare([sample_image(seed=1)], ["what is this ?"], 2)
    encoded = pipe.encode(prepared)
    assert encoded.features.data_ptr() == prepared.keep[0].data_ptr()  # torch view of the ORT-allocated output


def test_double_buffered_run_matches_back_to_back(llava_dual) -> None:
    pipe = mmsdk.load(llava_dual[1].path, runtime="reference")
    requests = [Request(sample_image(seed=s), QUESTIONS[s % 3]) for s in range(4)]
    overlapped = [r.tokens for r in pipe.run_many(requests, max_new_tokens=3, overlap=True)]
    sequential = [r.tokens for r in pipe.run_many(requests, max_new_tokens=3, overlap=False)]
    assert overlapped == sequential and all(overlapped)


# --- bad input ---------------------------------------------------------------------------------

def test_halves_from_different_calibrations_are_refused(llava_dual, tmp_path_factory) -> None:
    _, other = _dual(tmp_path_factory, "tiny:llava", "qkv-fuse", "rmsnorm-rope-fusion", "ptq-align", seed=200)
    mixed = tmp_path_factory.mktemp("mixed") / "mixed"
    shutil.copytree(llava_dual[1].path, mixed)
    shutil.rmtree(mixed / "llm")
    shutil.copytree(other.path / "llm", mixed / "llm")
    with pytest.raises(ArtifactIntegrityError, match=r"different calibrations.*vision/: [0-9a-f]+.*llm/: [0-9a-f]+"):
        mmsdk.load(mixed)


def test_a_missing_runtime_names_the_extra_and_the_fallback(llava_dual, monkeypatch) -> None:
    with pytest.raises(BackendUnavailableError, match=r"mmsdk\[trtllm\].*runtime='reference'"):
        mmsdk.load(llava_dual[1].path, runtime="tensorrt_llm")
    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)
    with pytest.raises(BackendUnavailableError, match=r"vision half.*mmsdk\[ort\].*no fallback"):
        mmsdk.load(llava_dual[1].path)


@pytest.mark.parametrize(("model", "passes", "match"), [
    ("tiny:idefics", (), r"language-model half \(llm/, TensorRT-LLM\) refuses: IdeficsForVisionText2Text"),
    ("tiny:llava", ("sparse-xattn",), r"language-model half .* refuses: pass 'sparse-xattn'"),
    ("tiny:llava", ("token-merge",), r"language-model half .* refuses: token-prune / token-merge .* contiguously"),
])
def test_a_combination_that_cannot_split_names_the_refusing_half(model, passes, match, tiny, tmp_path) -> None:
    opt = Optimizer(tiny(model).model, tiny(model).processor).apply(*passes)
    with pytest.raises((ExportError, IncompatiblePassError), match=match):
        opt.export("dual", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_renumbered_token_positions_are_an_explicit_choice(tiny, tmp_path) -> None:
    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model, loaded.processor).apply("token-merge")
    result = opt.export("dual", tmp_path / "out", token_positions="contiguous")
    assert result.manifest.details["contract"]["positions"] == "contiguous"


def test_cli_optimize_with_a_recipe_file_then_run(tmp_path, capsys) -> None:
    from mmsdk.cli import main

    image_module = pytest.importorskip("PIL.Image")  # `mmsdk run` opens image files with Pillow
    recipe = tmp_path / "fuse.yaml"
    recipe.write_text("name: fuse\nsteps:\n  - pass: qkv-fuse\n  - pass: rmsnorm-rope-fusion\n")
    assert main(["optimize", "tiny:llava", "--recipe", str(recipe), "--export", "dual", "--out",
                 str(tmp_path / "d"), "--option", "dtype=float32"]) == 0
    image = tmp_path / "x.png"
    image_module.fromarray(sample_image(seed=3)).save(image)
    capsys.readouterr()
    assert main(["run", str(tmp_path / "d"), "--image", str(image), "--prompt", "what is this ?",
                 "--max-new-tokens", "2", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert answer["prompt"] == "what is this ?" and 1 <= len(answer["tokens"]) <= 2
