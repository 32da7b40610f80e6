"""Named (image, question, answer) datasets used for calibration and evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DatasetSource", "VQAExample"]


@dataclass(frozen=True)
class VQAExample:
    """One visual question: an image (HxW or HxWxC array, PIL image or tensor), a question and its answer."""

    image: Any
    question: str
    answer: str


@dataclass(frozen=True)
class DatasetSource:
    """A named dataset: ``load(split)`` returns its examples for one of ``splits``."""

    name: str
    load: Callable[[str], list[VQAExample]]
    summary: str
    splits: tuple[str, ...] = ("calibration", "test")
    default_calibration_split: str = "calibration"
