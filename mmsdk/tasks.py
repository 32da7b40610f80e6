"""Evaluation tasks: which (image, question, answer) examples ``mmsdk eval`` scores a model on.

Every registered dataset with a ``test`` split is a task named ``<dataset>-vqa`` (the built-in
``digits`` dataset gives ``digits-vqa``), so a plugin that registers a dataset adds a task. Users can
also score their own benchmark from a JSON Lines file, one ``{"image": ..., "question": ...,
"answer": ...}`` per line, images as paths (PNG/JPEG through Pillow, or .npy) relative to the file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmsdk.core.datasets import VQAExample
from mmsdk.core.errors import UnknownNameError, UnsupportedInputError
from mmsdk.core.registry import suggest

if TYPE_CHECKING:
    from mmsdk.core.session import Session

__all__ = [
    "EVAL_SPLIT",
    "TASK_SUFFIX",
    "Task",
    "check_examples",
    "get_task",
    "known_tasks",
    "read_examples",
    "read_image",
]

TASK_SUFFIX = "-vqa"
EVAL_SPLIT = "test"


@dataclass(frozen=True)
class Task:
    """A named evaluation: exact-match accuracy on one split of one dataset."""

    name: str
    dataset: str
    split: str
    summary: str

    def examples(self, session: Session, limit: int | None = None) -> list[VQAExample]:
        """The task's examples (the first ``limit`` when given), checked for missing answers."""
        examples = list(session.datasets.get(self.dataset).load(self.split))
        examples = examples[:limit] if limit is not None else examples
        check_examples(examples, source=f"task {self.name!r}")
        return examples


def known_tasks(session: Session) -> dict[str, Task]:
    """Task name -> Task, one per registered dataset that has a test split."""
    return {
        f"{ds.name}{TASK_SUFFIX}": Task(f"{ds.name}{TASK_SUFFIX}", ds.name, EVAL_SPLIT, ds.summary)
        for ds in session.datasets
        if EVAL_SPLIT in ds.splits
    }


def get_task(name: str, session: Session) -> Task:
    """The task called ``name``; an unknown name lists the known ones and close matches."""
    tasks = known_tasks(session)
    if name in tasks:
        return tasks[name]
    known = sorted(tasks)
    raise UnknownNameError(
        f"Unknown task {name!r}.{suggest(name, known)} Known tasks: {', '.join(known) or '(none)'}.",
        fix="pick a known task, install the plugin that registers its dataset, or score your own examples "
        "with --data FILE.jsonl.",
    )


def check_examples(examples: Sequence[Any], *, source: str) -> None:
    """Refuse an empty example list, or an example without an image, a question or an answer."""
    if not examples:
        raise UnsupportedInputError(f"{source} has no examples.", fix="give at least one (image, question, answer).")
    for index, example in enumerate(examples):
        for field in ("image", "question", "answer"):
            value = getattr(example, field, None)
            if value is None or (isinstance(value, str) and not value.strip()):
                raise UnsupportedInputError(
                    f"{source}: example {index} has no {field}"
                    + (f" (question: {example.question!r})" if field == "answer" and example.question else "") + ".",
                    fix=f"give every example an image, a question and an answer; fix or drop example {index}.",
                )


def read_examples(path: str | Path) -> list[VQAExample]:
    """Examples from a JSON Lines file: ``{"image": "a.png", "question": "...", "answer": "..."}`` per line."""
    file = Path(path)
    if not file.is_file():
        raise UnsupportedInputError(f"dataset file {file} does not exist.", fix="pass the path of a .jsonl file.")
    examples = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UnsupportedInputError(f"{file}:{number} is not JSON: {err}.",
                                        fix='write one object per line: {"image": ..., "question": ..., "answer": ...}.'
                                        ) from err
        image = row.get("image")
        examples.append(VQAExample(image=read_image(file.parent / image) if isinstance(image, str) else image,
                                   question=row.get("question"), answer=row.get("answer")))
    check_examples(examples, source=str(file))
    return examples


def read_image(path: Path) -> Any:
    """An image file as an array: .npy directly, anything else through Pillow (RGB)."""
    import numpy as np

    if not path.is_file():
        raise UnsupportedInputError(f"image {path} does not exist.",
                                    fix="check the path (in a .jsonl dataset, image paths are relative to the file).")
    if path.suffix == ".npy":
        return np.load(path)
    try:
        from PIL import Image
    except ImportError as err:
        raise UnsupportedInputError(f"reading {path} needs Pillow.",
                                    fix="pip install pillow, or save images as .npy arrays.") from err
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))
