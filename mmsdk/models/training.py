"""Teacher-forced training of a vision-language model on one-word-answer VQA examples."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmsdk.core.datasets import VQAExample

__all__ = ["TrainSettings", "TrainStats", "answer_batch", "train"]


@dataclass(frozen=True)
class TrainSettings:
    """Optimizer and schedule: AdamW, linear warm-up, cosine decay to 10% of ``lr``."""

    steps: int = 1500
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    beta2: float = 0.98
    warmup: int = 100
    seed: int = 0


@dataclass(frozen=True)
class TrainStats:
    """What a training run did: steps, wall and CPU time, and the mean loss of its last 50 steps.

    ``cpu_seconds`` is the process's CPU time; with one thread it is what the run takes on an idle
    core, however busy the machine was.
    """

    steps: int
    seconds: float
    cpu_seconds: float
    final_loss: float
    examples_seen: int


def answer_batch(processor: Any, examples: Sequence[VQAExample], eos: str = "</s>") -> dict[str, torch.Tensor]:
    """Inputs for "prompt answer </s>" with labels on the answer and </s> only.

    The processor left-pads, so every row's answer and </s> are its last two tokens. Answers must
    be single tokens.
    """
    texts = [f"{processor.format_prompt(ex.question)} {ex.answer} {eos}" for ex in examples]
    batch = processor(images=[ex.image for ex in examples], text=texts, return_tensors="pt")
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, -2:] = batch["input_ids"][:, -2:]
    batch["labels"] = labels
    return batch


def _lr_factor(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup:
        return (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(
    model: torch.nn.Module,
    processor: Any,
    examples: Sequence[VQAExample],
    settings: TrainSettings,
    log: Callable[[str], None] | None = None,
) -> TrainStats:
    """Train ``model`` in place on ``examples`` (sampled with replacement by a seeded generator)."""
    torch.manual_seed(settings.seed)
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, betas=(0.9, settings.beta2), weight_decay=settings.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, settings))
    model.train()
    losses: list[float] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(settings.steps):
        picks = torch.randint(len(examples), (settings.batch_size,), generator=generator).tolist()
        loss = model(**answer_batch(processor, [examples[i] for i in picks])).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if log is not None and (step + 1) % 100 == 0:
            log(f"step {step + 1}/{settings.steps} loss {sum(losses[-100:]) / len(losses[-100:]):.4f}")
    model.eval()
    tail = losses[-50:] or [float("nan")]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return TrainStats(settings.steps, seconds, cpu_seconds, sum(tail) / len(tail), settings.steps * settings.batch_size)
