"""Turning (images, prompts) into checked per-stage inputs: processor, shape checks, length limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from mmsdk.core.errors import UnsupportedInputError

if TYPE_CHECKING:
    from mmsdk.runtime.spec import ExportSpec

__all__ = ["Prepared", "prepare", "from_batch", "load_image"]


@dataclass
class Prepared:
    """One batch of requests, ready for the vision and decoder stages."""

    input_ids: np.ndarray  # [B, S] int64
    attention_mask: np.ndarray  # [B, S] int64
    images: list[dict[str, np.ndarray]]  # vision feeds, one dict per image
    grids: list[tuple[int, int, int]] = field(default_factory=list)
    cross_mask: np.ndarray | None = None  # [B, S, groups] int64
    max_new_tokens: int = 0

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])


def load_image(image: Any) -> Any:
    """A path is opened with Pillow (RGB); anything else is passed on to the processor."""
    from pathlib import Path

    if isinstance(image, (str, Path)):
        path = Path(image)
        if not path.is_file():
            raise UnsupportedInputError(f"image file {path} does not exist.", fix="pass an existing image file.")
        try:
            from PIL import Image
        except ImportError as err:
            raise UnsupportedInputError("reading image files needs Pillow.", fix="pip install pillow") from err
        with Image.open(path) as opened:
            return np.asarray(opened.convert("RGB"))
    return image


def prepare(spec: ExportSpec, processor: Any, images: Sequence[Any], prompts: Sequence[str], max_new_tokens: int,
            vision_shapes: dict[str, list[Any]]) -> Prepared:
    """Run the processor and check everything the graphs would otherwise reject obscurely."""
    if len(images) != len(prompts) or not prompts:
        raise UnsupportedInputError(
            f"{len(images)} images for {len(prompts)} prompts.", fix="pass one image per prompt (at least one)."
        )
    texts = [_format(processor, p) for p in prompts]
    batch = processor(images=[load_image(i) for i in images], text=texts, return_tensors="pt")
    return from_batch(spec, batch, max_new_tokens, vision_shapes)


def from_batch(spec: ExportSpec, batch: Any, max_new_tokens: int, vision_shapes: dict[str, list[Any]]) -> Prepared:
    """A Prepared from processor outputs (torch tensors), with the same checks as :func:`prepare`."""
    ids = batch["input_ids"].numpy().astype(np.int64)
    _check_length(spec, ids.shape[1], max_new_tokens)
    feeds = _split_images(spec, batch, ids.shape[0], vision_shapes)
    prepared = Prepared(ids, batch["attention_mask"].numpy().astype(np.int64), feeds, max_new_tokens=max_new_tokens)
    if "image_grid_thw" in batch:
        prepared.grids = [tuple(int(x) for x in row) for row in batch["image_grid_thw"].tolist()]
    if spec.cross_mask_input is not None:
        mask = batch[spec.cross_mask_input].numpy().astype(np.int64)
        prepared.cross_mask = mask.reshape(mask.shape[0], mask.shape[1], -1)
    return prepared


def _format(processor: Any, prompt: str) -> str:
    placeholder = getattr(processor, "placeholder", None)
    if hasattr(processor, "format_prompt") and placeholder and placeholder not in prompt:
        return processor.format_prompt(prompt)
    return prompt


def _check_length(spec: ExportSpec, prompt_tokens: int, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise UnsupportedInputError(f"max_new_tokens={max_new_tokens}; it must be at least 1.", fix="ask for 1 or more.")
    limit = spec.max_sequence_length
    if prompt_tokens + max_new_tokens > limit:
        raise UnsupportedInputError(
            f"the prompt has {prompt_tokens} tokens and {max_new_tokens} new tokens were asked for, but this export "
            f"handles at most {limit} tokens in total.",
            fix=f"shorten the prompt or lower max_new_tokens to {max(limit - prompt_tokens, 0)}, or re-export with "
            "a larger max_sequence_length.",
        )


def _split_images(spec: ExportSpec, batch: Any, count: int, shapes: dict[str, list[Any]]) -> list[dict[str, np.ndarray]]:
    feeds = []
    for index in range(count):
        feed = {}
        for name in spec.vision_inputs:
            if name not in batch:
                raise UnsupportedInputError(
                    f"the processor gave no {name!r}, which this export's vision graph needs.",
                    fix="use the processor saved with the export (mmsdk.load does).",
                )
            value = batch[name]
            value = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
            part = value[index * (len(value) // count):(index + 1) * (len(value) // count)]
            feed[name] = _checked(spec, name, part, shapes.get(name))
        feeds.append(feed)
    return feeds


def _checked(spec: ExportSpec, name: str, value: np.ndarray, shape: list[Any] | None) -> np.ndarray:
    if name in spec.fixed_inputs and value.tolist() != spec.fixed_inputs[name]:
        raise UnsupportedInputError(
            f"image input {name}={value.tolist()} differs from the {spec.fixed_inputs[name]} this export was traced "
            "for (a different image size or tiling).",
            fix="let the export's own processor resize the image (pass the image, not preprocessed tensors).",
        )
    if shape is not None and (len(shape) != value.ndim or any(
            isinstance(d, int) and d != v for d, v in zip(shape, value.shape))):
        raise UnsupportedInputError(
            f"image tensor {name} has shape {list(value.shape)}, but the vision graph takes {shape} "
            "(wrong image size or channel count).",
            fix="pass an RGB or grayscale image and let the export's processor resize it.",
        )
    return value
