"""MODEL_CARD.md for a trained digit model: sizes, training run, machine, rebuild command, accuracy."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.evaluation import AccuracyResult
    from mmsdk.models.training import TrainSettings, TrainStats

__all__ = ["CardFacts", "component_sizes", "load_average", "machine_summary", "render_card"]


@dataclass(frozen=True)
class CardFacts:
    """Everything a card reports about one trained model."""

    name: str
    architecture: str
    family: str
    parameters: int
    components: dict[str, int]
    config_sizes: dict[str, Any]
    image_tokens: int
    settings: TrainSettings
    stats: TrainStats
    result: AccuracyResult
    split: str
    machine: dict[str, Any]
    command: str


def component_sizes(model: nn.Module) -> dict[str, int]:
    """Parameter count of each top-level part (vision tower, projector, language model, head)."""
    inner = getattr(model, "model", model)
    sizes = {name: sum(p.numel() for p in child.parameters()) for name, child in inner.named_children()}
    for name, child in model.named_children():
        if child is not inner:
            sizes[name] = sum(p.numel() for p in child.parameters())
    return {name: count for name, count in sizes.items() if count}


def machine_summary() -> dict[str, Any]:
    """The CPU, core count, threads and library versions a run used."""
    import torch
    import transformers

    return {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "os": platform.platform(),
        # Other work on the machine slows training; the load says how busy it was.
        "load_average_1min": load_average(),
    }


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def render_card(facts: CardFacts) -> str:
    """The card's Markdown text."""
    s, r = facts.settings, facts.result
    lines = [
        f"# {facts.name}",
        "",
        f"A tiny {facts.architecture} trained from scratch on mmsdk's `digits` dataset (scikit-learn's 8x8",
        "handwritten digits, upscaled to 48 px, with one-word answers). It exists so that optimization",
        "passes show real accuracy changes on a CPU; it is not a general model.",
        "",
        "## Size",
        f"- parameters: {facts.parameters:,} (fp32 safetensors)",
        *(f"- {name}: {count:,}" for name, count in facts.components.items()),
        f"- image tokens per image: {facts.image_tokens}",
        *(f"- {key}: {value}" for key, value in facts.config_sizes.items()),
        "",
        "## Training",
        f"- teacher forcing, loss on the answer word and `</s>` only; AdamW lr {s.lr}, weight decay {s.weight_decay},",
        f"  {s.warmup} warm-up steps then cosine decay to 10%; batch {s.batch_size}; seed {s.seed}",
        f"- steps: {facts.stats.steps} ({facts.stats.examples_seen:,} examples seen); "
        f"final loss (mean of last 50 steps): {facts.stats.final_loss:.4f}",
        f"- training time: {facts.stats.seconds:.1f} s wall clock, {facts.stats.cpu_seconds:.1f} s CPU time "
        f"({facts.machine.get('torch_threads')} torch thread(s); wall time grows with other work on the machine)",
        "- machine: " + ", ".join(f"{k} {v}" for k, v in facts.machine.items()),
        "",
        "## Held-out accuracy",
        f"Greedy decoding, first generated word vs. the answer (`mmsdk.evaluation.vqa_accuracy`), on the "
        f"`{facts.split}` split ({r.count} examples, images never seen in training):",
        "",
        f"**{r.accuracy:.4f}** ({r.correct}/{r.count})",
        "",
        "| question template | accuracy | examples |",
        "| --- | --- | --- |",
        *(f"| {name} | {g.accuracy:.4f} | {g.count} |" for name, g in r.groups.items()),
        "",
        "## Rebuild",
        "```",
        facts.command,
        "```",
        "Same seed, steps and thread count give the same weights on the same machine; other CPUs or",
        "library versions give a model of about the same accuracy.",
        "",
    ]
    return "\n".join(lines)
