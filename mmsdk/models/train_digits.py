"""Train one of the embedded digit models and write it as a Hugging Face folder with a model card.

    python -m mmsdk.models.train_digits --family llava --out mmsdk/models/builtin/llava-digits

The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (from
``save_pretrained``), ``mmsdk_processor.json``, ``training.json`` (the measured numbers) and
``MODEL_CARD.md``. It is built in a hidden sibling folder and renamed into place at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmsdk.models.training import TrainSettings, TrainStats

if TYPE_CHECKING:
    from mmsdk.evaluation import AccuracyResult
    from mmsdk.models.model_card import CardFacts

__all__ = ["RECIPES", "main", "train_and_write"]

# Per-family settings; each shipped model's MODEL_CARD.md gives the accuracy and CPU time they gave.
RECIPES: dict[str, TrainSettings] = {
    "llava": TrainSettings(steps=1200, batch_size=32, lr=1e-3),
    "idefics": TrainSettings(steps=2500, batch_size=32, lr=1e-3),
    "qwen2-vl": TrainSettings(steps=2000, batch_size=32, lr=1e-3),
}


def _config_sizes(model: Any) -> dict[str, Any]:
    keys = (
        "hidden_size",
        "embed_dim",
        "intermediate_size",
        "num_hidden_layers",
        "depth",
        "num_attention_heads",
        "num_heads",
        "num_key_value_heads",
        "image_size",
        "patch_size",
        "spatial_merge_size",
        "vocab_size",
    )
    # IDEFICS keeps its text sizes on the top-level config rather than in a text_config.
    parts = {"vision": model.config.vision_config, "text": getattr(model.config, "text_config", model.config)}
    return {name: ", ".join(f"{k} {getattr(sub, k)}" for k in keys if hasattr(sub, k)) for name, sub in parts.items()}


def train_and_write(
    family: str,
    out: Path,
    settings: TrainSettings,
    *,
    eval_examples: int | None = None,
    overwrite: bool = False,
    command: str = "",
) -> dict[str, Any]:
    """Build, train, evaluate and write one digit model; returns what ``training.json`` records."""
    import torch

    from mmsdk.core.fileio import atomic_output_dir, check_output_dir
    from mmsdk.core.session import Session
    from mmsdk.evaluation import vqa_accuracy
    from mmsdk.models import digits, model_card
    from mmsdk.models.digits_models import build_untrained
    from mmsdk.models.training import train

    check_output_dir(out, overwrite=overwrite)  # fail before training, not after
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    machine = model_card.machine_summary()  # before training, so the load is other work's alone
    model, processor = build_untrained(family, seed=settings.seed)
    stats = train(model, processor, digits.load_split("train"), settings, log=lambda line: print(line, flush=True))
    machine["load_average_1min_after_training"] = model_card.load_average()  # includes this run's threads
    test = digits.load_split("test")[:eval_examples]
    adapter = Session.create(autoload=False, disabled=()).adapt(model)
    result = vqa_accuracy(model, processor, adapter, test, group_by=lambda ex: digits.template_of(ex.question))
    facts = _facts(family, model, processor, settings, stats, result, machine, command)
    record = {
        "name": facts.name,
        "architecture": facts.architecture,
        "parameters": facts.parameters,
        "settings": dataclasses.asdict(settings),
        "stats": dataclasses.asdict(stats),
        "test": result.to_dict(),
        "machine": machine,
        "command": command,
    }
    with atomic_output_dir(out, overwrite=overwrite) as stage:
        model.save_pretrained(stage)
        processor.save_pretrained(stage)
        (stage / "training.json").write_text(json.dumps(record, indent=1) + "\n")
        (stage / "MODEL_CARD.md").write_text(model_card.render_card(facts))
    return record


def _facts(
    family: str,
    model: Any,
    processor: Any,
    settings: TrainSettings,
    stats: TrainStats,
    result: AccuracyResult,
    machine: dict[str, Any],
    command: str,
) -> CardFacts:
    from mmsdk.models.digits_models import image_tokens
    from mmsdk.models.model_card import CardFacts, component_sizes

    return CardFacts(
        name=f"{family}-digits",
        architecture=type(model).__name__,
        family=family,
        parameters=sum(p.numel() for p in model.parameters()),
        components=component_sizes(model),
        config_sizes=_config_sizes(model),
        image_tokens=image_tokens(processor),
        settings=settings,
        stats=stats,
        result=result,
        split="test",
        machine=machine,
        command=command,
    )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mmsdk.models.train_digits", description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=sorted(RECIPES), help="model family to train")
    parser.add_argument("--out", required=True, type=Path, help="output folder (written atomically)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the family's recipe)")
    parser.add_argument("--batch-size", type=int, help="examples per step (default: the family's recipe)")
    parser.add_argument("--seed", type=int, help="seed for weights and batches (default: the family's recipe)")
    parser.add_argument("--eval-examples", type=int, help="score only the first N test examples (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: same weights anywhere)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    import torch

    args = _parse(argv)
    # One thread by default: a fixed thread count keeps the reduction order, so a rebuild gives the
    # same weights, and one thread slows down least when other work shares the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    overrides = {"steps": args.steps, "batch_size": args.batch_size, "seed": args.seed}
    settings = dataclasses.replace(RECIPES[args.family], **{k: v for k, v in overrides.items() if v is not None})
    command = " ".join(["python -m mmsdk.models.train_digits", *(sys.argv[1:] if argv is None else argv)])
    record = train_and_write(
        args.family, args.out, settings, eval_examples=args.eval_examples, overwrite=args.overwrite, command=command
    )
    test = record["test"]
    print(
        f"{record['name']}: {record['parameters']:,} parameters, {record['stats']['seconds']:.1f} s training, "
        f"test accuracy {test['accuracy']:.4f} ({test['correct']}/{test['count']}) -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
