"""Named model sources (``tiny:llava``, ``builtin:llava-digits``) and loading a model by name or folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmsdk.core.errors import UnknownNameError, UnsupportedInputError

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.session import Session

__all__ = ["LoadedModel", "ModelSource", "load_model"]


@dataclass(frozen=True)
class LoadedModel:
    """A model with the processor that turns (image, text) into its inputs."""

    model: nn.Module
    processor: Any
    name: str

    def __iter__(self):  # lets callers write `model, processor = load_model(...)`
        return iter((self.model, self.processor))


@dataclass(frozen=True)
class ModelSource:
    """A named way to obtain a model: ``build(seed)`` returns the model and its processor."""

    name: str
    build: Callable[[], LoadedModel]
    summary: str
    trained: bool = False


def load_model(name_or_path: str | Path, *, session: Session | None = None) -> LoadedModel:
    """Return (model, processor) for a registered name (``tiny:*``, ``builtin:*``) or a local HF folder."""
    from mmsdk.core.session import Session

    text = str(name_or_path)
    path = Path(text)
    if path.is_dir():
        return _load_hf_folder(path)
    session = session or Session.create()
    try:
        source = session.models.get(text)
    except UnknownNameError as err:
        if ":" in text:
            raise
        msg = f"{text!r} is neither a registered model name nor an existing folder."
        fix = f"pass a local Hugging Face model folder or a name such as {', '.join(session.models.names()[:4])}."
        raise UnknownNameError(msg, fix=fix) from err
    return source.build()


def _load_hf_folder(path: Path) -> LoadedModel:
    import transformers

    config_file = path / "config.json"
    if not config_file.is_file():
        raise UnsupportedInputError(
            f"{path} has no config.json, so it is not a Hugging Face model folder.",
            fix="point at the folder that save_pretrained() wrote (it holds config.json and the weights).",
        )
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    cls = next((getattr(transformers, a) for a in architectures if hasattr(transformers, a)), None)
    if cls is None:
        raise UnsupportedInputError(
            f"{config_file} names architectures {architectures}, none of which this transformers "
            f"{transformers.__version__} provides.",
            fix="upgrade transformers, or load the model yourself and pass the module to Optimizer(...).",
        )
    model = cls.from_pretrained(path).eval()
    return LoadedModel(model=model, processor=_load_processor(path), name=str(path))


def _load_processor(path: Path) -> Any:
    from mmsdk.models.processing import load_processor_if_present

    processor = load_processor_if_present(path)
    if processor is not None:
        return processor
    try:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, ImportError):
        return None
