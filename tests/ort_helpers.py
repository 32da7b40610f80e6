"""Shared helpers for the onnxruntime backend tests: export once per model, torch reference generation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmsdk import Optimizer
from mmsdk.core.session import Session
from mmsdk.testing import sample_image

QUESTIONS = ("what digit is this ?", "is it even ?")


def export_tiny(name: str, folder: Path, *passes: Any, **options: Any) -> tuple[Optimizer, Any]:
    """Build ``name``, apply ``passes``, export to onnxruntime in ``folder``; (optimizer, export result)."""
    session = Session.create(autoload=False, disabled=())
    loaded = session.models.get(name).build()
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    if passes:
        opt.apply(*passes)
    return opt, opt.export("onnxruntime", folder, **options)


def torch_greedy(opt: Optimizer, images: list[Any], questions: tuple[str, ...], steps: int) -> list[list[int]]:
    """Greedy tokens of the optimized torch model (prompt removed, cut after the first EOS)."""
    processor = opt.processor
    inputs = processor(images=images, text=[processor.format_prompt(q) for q in questions])
    with torch.no_grad():
        out = opt.model.generate(**inputs, max_new_tokens=steps, do_sample=False)
    rows = out[:, inputs["input_ids"].shape[1]:].tolist()
    eos = opt.model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]


def images(count: int = 2) -> list[Any]:
    return [sample_image(seed) for seed in range(count)]


def ort_greedy_with_logits(folder: Path, images: list[Any], questions: tuple[str, ...],
                           steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and each step's last-token logits [B, vocab] from an exported folder."""
    import mmsdk
    from mmsdk.runtime.generation import decode

    pipe = mmsdk.load(folder)
    prepared = pipe.prepare(images, list(questions), steps)
    seen: list[torch.Tensor] = []

    def greedy(logits: torch.Tensor) -> torch.Tensor:
        seen.append(logits.float().clone())
        return logits.argmax(-1)

    return decode(pipe, prepared, pipe.encode(prepared), greedy).tokens, seen
