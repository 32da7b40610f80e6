"""CalibrationSet: real (image, text) prompts that passes needing data draw their statistics from."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmsdk.core.errors import CalibrationError

if TYPE_CHECKING:
    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.session import Session

__all__ = ["CalibrationSample", "CalibrationSet"]


@dataclass(frozen=True)
class CalibrationSample:
    """One calibration prompt: an image and the text asked about it."""

    image: Any
    text: str


class CalibrationSet:
    """A validated list of calibration samples, with a name recorded in the manifest."""

    def __init__(self, samples: Sequence[CalibrationSample], *, name: str = "custom") -> None:
        if not samples:
            raise CalibrationError(
                "the calibration set is empty.", fix="pass at least one (image, text) pair (32-128 is typical)."
            )
        self.samples = list(samples)
        self.name = name
        # Scratch space for data derived from these samples (cached vision features, statistics),
        # so passes sharing this set trace the vision tower once. Keyed by the plugin that fills it.
        self.cache: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[CalibrationSample]:
        from mmsdk.progress import track

        return track(self.samples, f"calibrating on {self.name}")

    @classmethod
    def from_any(cls, source: Any, *, session: Session, limit: int | None = None) -> CalibrationSet:
        """Build from (image, text) pairs, a Dataset of pairs or dicts, or a registered dataset name."""
        if isinstance(source, CalibrationSet):
            return source
        if isinstance(source, str):
            dataset = session.datasets.get(source)
            examples = dataset.load(dataset.default_calibration_split)
            pairs: Iterable[Any] = [(ex.image, ex.question) for ex in examples]
            name = source
        else:
            pairs, name = _iterate(source), type(source).__name__
        samples = []
        for index, item in enumerate(_track(pairs, limit if limit is not None else _length(source))):
            if limit is not None and index >= limit:
                break
            samples.append(_to_sample(item, index))
        return cls(samples, name=name)

    def prompts(self, adapter: ModelAdapter, processor: Any = None) -> list[str]:
        """Each sample's text formatted with the family's image placeholder."""
        return [adapter.format_prompt(sample.text, processor) for sample in self.samples]


def _length(source: Any) -> int | None:
    return len(source) if hasattr(source, "__len__") and not isinstance(source, str) else None


def _track(items: Iterable[Any], total: int | None) -> Iterable[Any]:
    """A progress bar over ``items`` on an interactive terminal (reading a Dataset can be slow)."""
    import sys

    if not sys.stderr.isatty():
        return items
    from rich.progress import track

    return track(items, description="reading calibration samples", total=total, transient=True)


def _iterate(source: Any) -> Iterable[Any]:
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return (source[i] for i in range(len(source)))
    if hasattr(source, "__iter__"):
        return iter(source)
    raise CalibrationError(
        f"cannot read calibration samples from {type(source).__name__}.",
        fix="pass a list of (image, text) pairs, a torch Dataset yielding them, or a dataset name such as 'digits'.",
    )


def _to_sample(item: Any, index: int) -> CalibrationSample:
    if isinstance(item, CalibrationSample):
        image, text = item.image, item.text
    elif isinstance(item, dict):
        image, text = item.get("image"), item.get("text", item.get("question"))
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        image, text = item
    else:
        raise CalibrationError(
            f"calibration sample {index} is a {type(item).__name__}, not an (image, text) pair.",
            fix="give each sample as (image, text) or {'image': ..., 'text': ...}.",
        )
    if not isinstance(text, str):
        raise CalibrationError(
            f"calibration sample {index} has text of type {type(text).__name__}; the wrong modality?",
            fix="put the image first and the prompt text second: (image, 'what digit is this ?').",
        )
    _check_image(image, index)
    return CalibrationSample(image=image, text=text)


def _check_image(image: Any, index: int) -> None:
    import numpy as np

    if image is None or isinstance(image, (str, bytes)):
        raise CalibrationError(
            f"calibration sample {index} has no image (got {type(image).__name__}); mmsdk calibrates on "
            "multimodal prompts.",
            fix="pass a PIL image, an HxW / HxWxC array or a CxHxW tensor as the first item.",
        )
    array = np.asarray(image.detach().cpu() if hasattr(image, "detach") else image, dtype=np.float64)
    if array.ndim not in (2, 3) or array.size == 0:
        raise CalibrationError(
            f"calibration sample {index} has an image of shape {array.shape}; expected HxW, HxWxC or CxHxW.",
            fix="pass one image per sample, not a batch.",
        )
    if not np.isfinite(array).all():
        bad = int((~np.isfinite(array)).sum())
        raise CalibrationError(
            f"calibration sample {index} has {bad} NaN/inf pixel value(s).",
            fix="clean the data (np.nan_to_num) or drop the sample; statistics from NaN would poison every scale.",
        )
