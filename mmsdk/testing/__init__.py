"""Helpers for testing mmsdk and mmsdk plugins: tiny models, sample images, numeric comparisons.

Plugin authors can reuse these from their own test suites (``from mmsdk.testing import ...``) or
load the fixtures with ``pytest_plugins = ["mmsdk.testing.fixtures"]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["TINY_MODELS", "sample_image", "tiny_inputs", "sqnr_db"]

TINY_MODELS = ("tiny:llava", "tiny:llava-next", "tiny:qwen2-vl", "tiny:qwen2.5-vl", "tiny:idefics", "tiny:mllama")


def sample_image(seed: int = 0, size: int = 8) -> Any:
    """A random grayscale uint8 image (``size`` x ``size``), different for each seed."""
    import numpy as np

    return (np.random.RandomState(seed).rand(size, size) * 255).astype(np.uint8)


def tiny_inputs(processor: Any, questions: tuple[str, ...] = ("what digit is this ?",), seed: int = 0) -> dict[str, Any]:
    """Model inputs for one random image per question, built by an embedded processor."""
    images = [sample_image(seed + i) for i in range(len(questions))]
    return processor(images=images, text=[processor.format_prompt(q) for q in questions])


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10*log10(|ref|^2 / |ref - approx|^2)."""
    import torch

    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))
