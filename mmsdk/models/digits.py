"""The ``digits`` dataset: questions about scikit-learn's bundled 8x8 handwritten digits.

scikit-learn ships the 1797 images inside its wheel, so nothing is downloaded. Each image is
upscaled bilinearly (torch's ``interpolate``, ``align_corners=False``, as mmsdk's processors resize)
and returned as a uint8 HxWx3 array, which both mmsdk's processors and Hugging Face image processors
read. Bilinear rather than nearest: with 6 px patches over 6 px source pixels, nearest would give each
vision token a single grey value, while bilinear lets every patch see the strokes around it.

Every answer is one word of :data:`VOCABULARY`. Splits are by image, decided by a hash of the
image's index (so they never depend on a random generator's version): ``test`` (415 images, every
template on each: 2075 examples), ``calibration`` (83 images, one question each: 83 examples) and
``train`` (the other 1299 images, every template on each: 6495 examples).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from mmsdk.core.datasets import DatasetSource, VQAExample
from mmsdk.core.errors import UnknownNameError
from mmsdk.models.tokenizer import WordTokenizer

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "DIGIT_WORDS",
    "IMAGE_SIZE",
    "SPLITS",
    "TEMPLATES",
    "VOCABULARY",
    "build_tokenizer",
    "dataset_source",
    "digit_images",
    "load_split",
    "questions_for",
    "template_of",
]

IMAGE_SIZE = 48  # the embedded digit models' image size (8 source pixels x 6)
SPLITS = ("train", "calibration", "test")
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# name -> question text; {k} is a digit word.
TEMPLATES: dict[str, str] = {
    "digit": "what digit is this ?",
    "even": "is this even ?",
    "odd": "is it odd ?",
    "greater": "is it greater than {k} ?",
    "is-a": "is it a {k} ?",
}
_TEMPLATE_PATTERNS = {
    name: re.compile("^" + re.escape(text).replace(re.escape("{k}"), r"\w+") + "$") for name, text in TEMPLATES.items()
}
VOCABULARY: tuple[str, ...] = tuple(
    dict.fromkeys(
        [word for text in TEMPLATES.values() for word in text.split() if word != "{k}"]
        + list(DIGIT_WORDS)
        + ["yes", "no"]
    )
)
_TEST_PERCENT = 20
_CALIBRATION_PERCENT = 5


def build_tokenizer(*specials: str) -> WordTokenizer:
    """A WordTokenizer holding every question and answer word, plus a model family's ``specials``."""
    return WordTokenizer.build(VOCABULARY, specials)


def template_of(question: str) -> str:
    """The template name a question was made from (``digit``, ``even``, ...), or ``other``."""
    return next((name for name, pattern in _TEMPLATE_PATTERNS.items() if pattern.match(question)), "other")


def _bucket(key: str, modulo: int = 100) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % modulo


def split_of(index: int) -> str:
    """The split image ``index`` belongs to (a pure function of the index)."""
    bucket = _bucket(f"digits-split:{index}")
    if bucket < _TEST_PERCENT:
        return "test"
    if bucket < _TEST_PERCENT + _CALIBRATION_PERCENT:
        return "calibration"
    return "train"


def _answer(template: str, label: int, k: int) -> str:
    truth = {
        "even": label % 2 == 0,
        "odd": label % 2 == 1,
        "greater": label > k,
        "is-a": label == k,
    }
    if template == "digit":
        return DIGIT_WORDS[label]
    return "yes" if truth[template] else "no"


def _k_for(template: str, index: int, label: int) -> int:
    if template == "greater":
        return _bucket(f"digits-k:{template}:{index}", 9)  # zero..eight: each has a yes and a no
    if template == "is-a":  # half the time the true digit, so yes and no are balanced
        pick = _bucket(f"digits-k:{template}:{index}", 18)
        return label if pick < 9 else (label + 1 + pick % 9) % 10
    return 0


def questions_for(index: int, label: int, templates: Iterable[str] = TEMPLATES) -> list[tuple[str, str]]:
    """(question, answer) pairs for image ``index`` showing ``label``, one per template."""
    pairs = []
    for name in templates:
        k = _k_for(name, index, label)
        pairs.append((TEMPLATES[name].format(k=DIGIT_WORDS[k]), _answer(name, label, k)))
    return pairs


def digit_images(image_size: int = IMAGE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """All 1797 digits as uint8 [N, S, S, 3] (bilinearly upscaled) and their int labels."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = torch.from_numpy(digits.images.astype(np.float32) / 16.0)[:, None]  # pixel values are 0..16
    big = F.interpolate(small, size=(image_size, image_size), mode="bilinear", align_corners=False)[:, 0]
    gray = (big.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    return np.repeat(gray[..., None], 3, axis=-1), digits.target.astype(np.int64)


def load_split(split: str, image_size: int = IMAGE_SIZE) -> list[VQAExample]:
    """The examples of ``split`` (``train``, ``calibration`` or ``test``), in a fixed order."""
    if split not in SPLITS:
        raise UnknownNameError(
            f"the digits dataset has no split {split!r}; it has {', '.join(SPLITS)}.",
            fix="pass one of those split names.",
        )
    images, labels = digit_images(image_size)
    names = list(TEMPLATES)
    examples = []
    for index, label in enumerate(int(x) for x in labels):
        if split_of(index) != split:
            continue
        templates = [names[_bucket(f"digits-calib:{index}", len(names))]] if split == "calibration" else names
        for question, answer in questions_for(index, label, templates):
            examples.append(VQAExample(image=images[index], question=question, answer=answer))
    return examples


def dataset_source() -> DatasetSource:
    """The ``digits`` DatasetSource (images at the embedded models' size, 48 px)."""
    return DatasetSource(
        name="digits",
        load=load_split,
        summary="questions about scikit-learn's 8x8 handwritten digits (what digit, even/odd, greater than, is it a)",
        splits=SPLITS,
        default_calibration_split="calibration",
    )
