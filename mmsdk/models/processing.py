"""Family-aware processors for mmsdk's embedded models: (images, text) -> the model's input tensors.

Real models come with their Hugging Face processor; mmsdk's tiny and trained embedded models use
these, which depend on nothing but torch and numpy, so they behave the same on every transformers
version and need no torchvision. Each family expands its image placeholder into exactly the tokens
its transformers model class expects.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from mmsdk.core.errors import UnsupportedInputError
from mmsdk.models.images import prepare_image
from mmsdk.models.tokenizer import WordTokenizer

__all__ = ["PROCESSOR_FILE", "VLProcessor", "load_processor_if_present", "processor_class"]

PROCESSOR_FILE = "mmsdk_processor.json"


class VLProcessor:
    """Base: tokenizes prompts, expands the image placeholder, left-pads, and prepares pixels."""

    family: ClassVar[str]
    placeholder: ClassVar[str]  # what a prompt writes where the image goes
    # The dataset Optimizer calibrates on when a pass needs data and none was given.
    default_calibration: ClassVar[str | None] = "digits"

    def __init__(self, tokenizer: WordTokenizer, image_size: int, patch_size: int, **options: Any) -> None:
        self.tokenizer = tokenizer
        self.image_size = image_size
        self.patch_size = patch_size
        self.mean: list[float] = list(options.pop("mean", (0.5, 0.5, 0.5)))
        self.std: list[float] = list(options.pop("std", (0.5, 0.5, 0.5)))
        self.options = options

    # --- family hooks ------------------------------------------------------------------------
    def image_token_ids(self) -> list[int]:
        """The ids that replace one placeholder."""
        raise NotImplementedError

    def image_tensors(self, pixels: list[torch.Tensor], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The family's image inputs for a batch (one image per prompt)."""
        raise NotImplementedError

    # --- shared ------------------------------------------------------------------------------
    def format_prompt(self, question: str) -> str:
        """``question`` with this family's image placeholder in front."""
        return f"{self.placeholder} {question}"

    def __call__(
        self, images: Any = None, text: str | Sequence[str] | None = None, return_tensors: str = "pt", **_: Any
    ) -> dict[str, torch.Tensor]:
        """Model inputs for prompts ``text`` and one image per prompt (or none for text-only)."""
        if return_tensors != "pt":
            raise UnsupportedInputError(f"return_tensors={return_tensors!r}", fix="use return_tensors='pt'.")
        prompts = [text] if isinstance(text, str) else list(text or [])
        image_list = _as_list(images)
        if not prompts:
            raise UnsupportedInputError("no prompt text was given.", fix="pass text='...' (one string per image).")
        if image_list and len(image_list) != len(prompts):
            raise UnsupportedInputError(
                f"{len(image_list)} images for {len(prompts)} prompts.", fix="pass exactly one image per prompt."
            )
        rows = [self._encode(prompt, has_image=bool(image_list)) for prompt in prompts]
        input_ids, attention_mask = _left_pad(rows, self.tokenizer.pad_token_id)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if image_list:
            pixels = [prepare_image(img, self.image_size, self.mean, self.std) for img in image_list]
            batch.update(self.image_tensors(pixels, input_ids))
        return batch

    def _encode(self, prompt: str, *, has_image: bool) -> list[int]:
        count = prompt.count(self.placeholder)
        if has_image and count != 1:
            raise UnsupportedInputError(
                f"a prompt with an image must hold the placeholder {self.placeholder!r} exactly once; got {count}: "
                f"{prompt!r}.",
                fix="build prompts with processor.format_prompt(question) (or adapter.format_prompt).",
            )
        ids = [self.tokenizer.bos_token_id]
        before, _, after = prompt.partition(self.placeholder) if count else (prompt, "", "")
        ids += self.tokenizer.encode(before)
        if count:
            ids += self.image_token_ids()
            ids += self.tokenizer.encode(after)
        return ids

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        """Text of one id sequence."""
        return self.tokenizer.decode(_ids_list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch: Any, skip_special_tokens: bool = True) -> list[str]:
        """Text of each id sequence."""
        return [self.decode(row, skip_special_tokens) for row in batch]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (family, sizes, normalization, options, tokenizer)."""
        return {
            "family": self.family,
            "image_size": self.image_size,
            "patch_size": self.patch_size,
            "mean": self.mean,
            "std": self.std,
            "options": self.options,
            "tokenizer": self.tokenizer.to_dict(),
        }

    def save_pretrained(self, folder: str | Path) -> None:
        """Write ``mmsdk_processor.json`` into ``folder``."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / PROCESSOR_FILE).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> VLProcessor:
        """Read a processor written by :meth:`save_pretrained` (any family)."""
        data = json.loads((Path(folder) / PROCESSOR_FILE).read_text())
        return processor_class(data["family"])(
            WordTokenizer.from_dict(data["tokenizer"]),
            data["image_size"],
            data["patch_size"],
            mean=data["mean"],
            std=data["std"],
            **data["options"],
        )


def processor_class(family: str) -> type[VLProcessor]:
    """The VLProcessor subclass for ``family``."""
    from mmsdk.models import family_processors

    classes = family_processors.CLASSES
    if family not in classes:
        raise UnsupportedInputError(
            f"no embedded processor for family {family!r}; known: {', '.join(sorted(classes))}.",
            fix="pass the model's own Hugging Face processor instead.",
        )
    return classes[family]


def load_processor_if_present(folder: str | Path) -> VLProcessor | None:
    """The mmsdk processor saved in ``folder``, or None if there is none."""
    if (Path(folder) / PROCESSOR_FILE).is_file():
        return VLProcessor.from_pretrained(folder)
    return None


def _as_list(images: Any) -> list[Any]:
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        return list(images)
    if isinstance(images, torch.Tensor) and images.ndim == 4:
        return list(images)
    return [images]


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[index, width - len(row) :] = 1
    return ids, mask


def _ids_list(ids: Any) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)
