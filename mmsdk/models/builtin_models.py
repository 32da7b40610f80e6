"""The trained digit models shipped inside the package (``builtin:llava-digits`` and the other families)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from mmsdk.core.errors import UnsupportedInputError
from mmsdk.core.sources import LoadedModel, ModelSource

__all__ = ["BUILTIN_MODELS", "builtin_folder", "builtin_sources", "load_builtin"]

# source name -> (folder under mmsdk/models/builtin, transformers class, what it is)
BUILTIN_MODELS: dict[str, tuple[str, str, str]] = {
    "builtin:llava-digits": ("llava-digits", "LlavaForConditionalGeneration", "LLaVA (CLIP + MLP projector + Llama)"),
    "builtin:qwen2-vl-digits": (
        "qwen2-vl-digits",
        "Qwen2VLForConditionalGeneration",
        "Qwen2-VL (ViT + 2x2 patch merger + Qwen2 decoder, M-RoPE)",
    ),
    "builtin:idefics-digits": (
        "idefics-digits",
        "IdeficsForVisionText2Text",
        "IDEFICS (CLIP + gated cross-attention into a Llama-style decoder)",
    ),
}


def builtin_folder(name: str) -> Path:
    """The package folder holding the weights of built-in model ``name``."""
    folder = BUILTIN_MODELS[name][0]
    return Path(str(resources.files("mmsdk.models").joinpath("builtin", folder)))


def load_builtin(name: str) -> LoadedModel:
    """Load built-in model ``name`` with its transformers class and its mmsdk processor."""
    import transformers

    from mmsdk.models.processing import VLProcessor

    folder = builtin_folder(name)
    if not (folder / "model.safetensors").is_file():
        family = BUILTIN_MODELS[name][0].removesuffix("-digits")
        raise UnsupportedInputError(
            f"the weights of {name} are missing from {folder} (this mmsdk install left out its package data).",
            fix=f"reinstall mmsdk from a wheel, or rebuild them: python -m mmsdk.models.train_digits "
            f"--family {family} --out {folder}",
        )
    from transformers.utils import logging as hf_logging

    # A few-MB model loads instantly; transformers' per-tensor progress bar would only clutter output.
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = getattr(transformers, BUILTIN_MODELS[name][1]).from_pretrained(folder).eval()
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    return LoadedModel(model=model, processor=VLProcessor.from_pretrained(folder), name=name)


def builtin_sources() -> list[ModelSource]:
    """One trained ModelSource per built-in model."""
    return [
        ModelSource(
            name=name,
            build=lambda name=name: load_builtin(name),
            summary=f"trained on the digits dataset: {what} (accuracy and rebuild command in its MODEL_CARD.md)",
            trained=True,
        )
        for name, (_, _, what) in BUILTIN_MODELS.items()
    ]
