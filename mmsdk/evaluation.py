"""Scoring a vision-language model on (image, question, one-word answer) examples."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.datasets import VQAExample

__all__ = ["AccuracyResult", "GroupAccuracy", "answer_questions", "normalize_answer", "vqa_accuracy"]


@dataclass(frozen=True)
class GroupAccuracy:
    """Correct answers out of ``count`` for one group of questions."""

    correct: int
    count: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else 0.0


@dataclass(frozen=True)
class AccuracyResult:
    """Exact-match accuracy of the first generated word, overall and per question group."""

    accuracy: float
    correct: int
    count: int
    groups: dict[str, GroupAccuracy] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "accuracy": self.accuracy,
            "correct": self.correct,
            "count": self.count,
            "groups": {
                name: {"accuracy": g.accuracy, "correct": g.correct, "count": g.count}
                for name, g in self.groups.items()
            },
        }


def normalize_answer(text: str) -> str:
    """The first word of ``text``, lower-cased, without surrounding punctuation ('' if none)."""
    words = re.findall(r"[\w'-]+", text.lower())
    return words[0] if words else ""


def vqa_accuracy(
    model: nn.Module,
    processor: Any,
    adapter: ModelAdapter,
    examples: Sequence[VQAExample],
    *,
    batch_size: int = 32,
    max_new_tokens: int = 3,
    group_by: Callable[[VQAExample], str] | None = None,
) -> AccuracyResult:
    """Greedy-decode an answer for each example and score its first word against ``example.answer``.

    Works with mmsdk's processors and Hugging Face processors alike: prompts come from
    ``adapter.format_prompt(question, processor)`` and answers from ``processor.batch_decode``.
    ``group_by`` names each example's group (e.g. its question template) for a per-group breakdown.
    """
    tally: dict[str, list[int]] = {}
    correct = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        answers = _generate_answers(model, processor, adapter, chunk, max_new_tokens)
        for example, answer in zip(chunk, answers, strict=True):
            hit = int(normalize_answer(answer) == normalize_answer(example.answer))
            correct += hit
            counts = tally.setdefault(group_by(example) if group_by else "all", [0, 0])
            counts[0] += hit
            counts[1] += 1
    groups = {name: GroupAccuracy(c, n) for name, (c, n) in sorted(tally.items())}
    return AccuracyResult(correct / len(examples) if examples else 0.0, correct, len(examples), groups)


def answer_questions(
    model: nn.Module,
    processor: Any,
    adapter: ModelAdapter,
    examples: Sequence[VQAExample],
    *,
    batch_size: int = 32,
    max_new_tokens: int = 3,
) -> list[str]:
    """The model's greedy answer (decoded text) to each example's question about its image."""
    answers: list[str] = []
    for start in range(0, len(examples), batch_size):
        answers += _generate_answers(model, processor, adapter, examples[start : start + batch_size], max_new_tokens)
    return answers


def _generate_answers(
    model: nn.Module, processor: Any, adapter: ModelAdapter, chunk: Sequence[VQAExample], max_new_tokens: int
) -> list[str]:
    import torch

    prompts = [adapter.format_prompt(ex.question, processor) for ex in chunk]
    with _left_padding(processor):
        inputs = processor(images=[ex.image for ex in chunk], text=prompts, return_tensors="pt", padding=True)
    device = next(model.parameters()).device
    inputs = {key: value.to(device) if hasattr(value, "to") else value for key, value in inputs.items()}
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new_tokens = output[:, inputs["input_ids"].shape[1] :]
    return processor.batch_decode(new_tokens, skip_special_tokens=True)


@contextmanager
def _left_padding(processor: Any) -> Iterator[None]:
    # Batched generation needs every prompt to end at the last column; Hugging Face tokenizers
    # often pad on the right by default. mmsdk's processors always pad on the left.
    tokenizer = getattr(processor, "tokenizer", None)
    side = getattr(tokenizer, "padding_side", None)
    if side is None:
        yield
        return
    tokenizer.padding_side = "left"
    try:
        yield
    finally:
        tokenizer.padding_side = side
