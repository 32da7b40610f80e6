"""The accuracy harness: tasks, user datasets, torch models and exported folders, bad input."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import mmsdk
from mmsdk import DatasetSource, Optimizer, Session, VQAExample
from mmsdk.cli import main as cli
from mmsdk.core.backend import BackendOptions, ExportInfo
from mmsdk.core.errors import ConfigError, UnknownNameError, UnsupportedInputError
from mmsdk.harness import evaluate
from mmsdk.tasks import get_task, known_tasks, read_examples
from mmsdk.testing import sample_image

QUESTIONS = ("what digit is this ?", "is it even ?", "is it odd ?")
# Scoring uses mmsdk.evaluation (vqa_accuracy, normalize_answer), which ships with the digits dataset.
scores = pytest.mark.skipif(importlib.util.find_spec("mmsdk.evaluation") is None, reason="no mmsdk.evaluation")


def _stub_examples(count: int = 6) -> list[VQAExample]:
    # Images sized for the tiny models; answers are what the fake runtime below says for even indices.
    return [VQAExample(sample_image(i, 30), QUESTIONS[i % 3], "yes" if i % 2 == 0 else "two") for i in range(count)]


class FakeRuntime:
    """Answers 'yes' to every question: right on even-indexed stub examples, wrong on odd ones."""

    def answer(self, image: Any, prompt: str, max_new_tokens: int = 3) -> str:
        assert "<image>" in prompt  # prompts arrive formatted for the family
        return "Yes."


class LogitsRuntime:
    """A reference-style runtime: only logits(inputs), always preferring the token 'yes'."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.lengths: list[int] = []

    def logits(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = inputs["input_ids"]
        assert inputs["attention_mask"].shape == ids.shape and ids.shape[0] == 1
        self.lengths.append(ids.shape[1])
        out = torch.zeros(1, ids.shape[1], 101)
        out[0, -1, self.processor.tokenizer.token_id("yes")] = 1.0
        return out


class FakeOptions(BackendOptions):
    """No options."""


class FakeBackend:
    name: ClassVar[str] = "fake-runtime"
    summary: ClassVar[str] = "a runtime that always answers yes (test)"
    options_cls: ClassVar[type[BackendOptions]] = FakeOptions

    def check(self, context, options) -> None:
        return None

    def export(self, context, options, staging: Path) -> ExportInfo:
        (staging / "weights.bin").write_bytes(b"\0" * 16)
        return ExportInfo()

    def load(self, path: Path, manifest, **options) -> FakeRuntime:
        return FakeRuntime()


class _EvalTestPlugin:
    __name__ = "eval-test-plugin"

    @mmsdk.hookimpl
    def mmsdk_register_datasets(self, register) -> None:
        register(DatasetSource("stub", lambda split: _stub_examples(), "six tiny questions (test)"))
        register(DatasetSource("calibration-only", lambda split: [], "no test split (test)", splits=("calibration",)))

    @mmsdk.hookimpl
    def mmsdk_register_backends(self, register) -> None:
        register(FakeBackend())


@pytest.fixture
def eval_session() -> Session:
    return Session.create(autoload=False, disabled=(), extra=[_EvalTestPlugin()])


def test_every_dataset_with_a_test_split_is_a_task(eval_session):
    tasks = known_tasks(eval_session)
    assert "stub-vqa" in tasks and "calibration-only-vqa" not in tasks
    assert tasks["stub-vqa"].dataset == "stub" and tasks["stub-vqa"].split == "test"
    with pytest.raises(UnknownNameError, match=r"Unknown task 'stub-vq'. Did you mean 'stub-vqa'\?.*Known tasks"):
        get_task("stub-vq", eval_session)


@scores
def test_exported_runtime_is_scored_through_its_loader(eval_session, tmp_path):
    loaded = eval_session.models.get("tiny:llava").build()
    Optimizer(loaded.model, loaded.processor, session=eval_session).export("fake-runtime", tmp_path / "export")
    report = evaluate(tmp_path / "export", "stub-vqa", session=eval_session)
    assert report.runs_on == "export:fake-runtime" and report.task == "stub-vqa"
    assert (report.correct, report.count) == (3, 6) and report.accuracy == 0.5  # 'Yes.' normalises to 'yes'
    with pytest.raises(ConfigError, match="exported folder"):
        evaluate(tmp_path / "export", "stub-vqa", apply=["qkv-fuse"], session=eval_session)


@scores
def test_logits_only_runtime_is_decoded_greedily(eval_session, tmp_path, monkeypatch):
    loaded = eval_session.models.get("tiny:llava").build()
    Optimizer(loaded.model, loaded.processor, session=eval_session).export("fake-runtime", tmp_path / "export")
    monkeypatch.setattr(FakeBackend, "load", lambda self, path, manifest, **o: runtime)
    runtime = LogitsRuntime(loaded.processor)
    report = evaluate(tmp_path / "export", "stub-vqa", session=eval_session, max_new_tokens=2)
    assert (report.correct, report.count) == (3, 6)
    assert runtime.lengths[1] == runtime.lengths[0] + 1  # the chosen token was appended before the next step


@scores
def test_torch_export_scores_like_the_optimized_model(eval_session, tmp_path):
    loaded = eval_session.models.get("tiny:qwen2-vl").build()
    opt = Optimizer(loaded.model, loaded.processor, session=eval_session).apply("qkv-fuse")
    opt.export("torch", tmp_path / "export")
    direct = evaluate("tiny:qwen2-vl", "stub-vqa", apply=["qkv-fuse"], session=eval_session)
    exported = evaluate(tmp_path / "export", "stub-vqa", session=eval_session)
    assert direct.passes == exported.passes == ("qkv-fuse",)
    assert (direct.correct, direct.count) == (exported.correct, exported.count)
    assert exported.runs_on == "export:torch" and exported.weights_bytes == direct.weights_bytes


def test_user_dataset_file_and_missing_answers(tmp_path):
    rows = []
    for i in range(2):
        np.save(tmp_path / f"img{i}.npy", sample_image(i, 30))
        rows.append({"image": f"img{i}.npy", "question": "what digit is this ?", "answer": "two"})
    (tmp_path / "good.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    examples = read_examples(tmp_path / "good.jsonl")
    assert len(examples) == 2 and examples[0].image.shape == (30, 30)

    rows[1]["answer"] = ""
    (tmp_path / "bad.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(UnsupportedInputError, match="example 1 has no answer"):
        read_examples(tmp_path / "bad.jsonl")
    with pytest.raises(UnsupportedInputError, match="example 0 has no answer"):
        evaluate("tiny:llava", examples=[VQAExample(sample_image(0, 30), "is it even ?", None)])


@scores
def test_cli_eval_reports_and_gates_on_min_accuracy(tmp_path, capsys):
    np.save(tmp_path / "img.npy", sample_image(0, 30))
    (tmp_path / "data.jsonl").write_text(json.dumps({"image": "img.npy", "question": "is it even ?", "answer": "yes"}))
    args = ["eval", "tiny:llava", "--data", str(tmp_path / "data.jsonl")]
    assert cli([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["count"] == 1 and data["runs_on"] == "torch" and data["task"] == "custom"
    assert cli([*args, "--min-accuracy", "1.01"]) == 1  # no model reaches 101%
    assert cli(["eval", "tiny:llava", "--task", "no-such-task"]) == 2
    assert "Unknown task 'no-such-task'" in capsys.readouterr().err
