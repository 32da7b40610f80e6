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
from pathlib import Path
from typing import Any, Sequence

from mmsdk.models.training import TrainSettings

__all__ = ["RECIPES", "main", "train_and_write"]

# Per-family settings that reach the accuracy the cards report in about two minutes on 2 cores.
RECIPES: dict[str, TrainSettings] = {
    "llava": TrainSettings(steps=1000, batch_size=64, lr=3e-3),
}


def _config_sizes(model: Any) -> dict[str, Any]:
    keys = ("hidden_size", "embed_dim", "intermediate_size", "num_hidden_layers", "depth", "num_attention_heads",
            "num_heads", "num_key_value_heads", "image_size", "patch_size", "spatial_merge_size", "vocab_size")
    sizes: dict[str, Any] = {}
    for part in ("vision_config", "text_config"):
        sub = getattr(model.config, part, None)
        if sub is not None:
            sizes[part.split("_")[0]] = ", ".join(f"{k} {getattr(sub, k)}" for k in keys if hasattr(sub, k))
    return sizes


def _image_tokens(processor: Any) -> int:
    per_image = getattr(processor, "tokens_per_image", None)
    return per_image() if per_image else (processor.image_size // processor.patch_size) ** 2


def train_and_write(
    family: str, out: Path, settings: TrainSettings, *, eval_examples: int | None = None, overwrite: bool = False
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
    loaded = build_untrained(family, seed=settings.seed)
    model, processor = loaded.model, loaded.processor
    stats = train(model, processor, digits.load_split("train"), settings, log=lambda line: print(line, flush=True))
    test = digits.load_split("test")[:eval_examples]
    adapter = Session.create(autoload=False, disabled=()).adapt(model)
    result = vqa_accuracy(model, processor, adapter, test, group_by=lambda ex: digits.template_of(ex.question))
    facts = model_card.CardFacts(
        name=f"{family}-digits", architecture=type(model).__name__, family=family,
        parameters=sum(p.numel() for p in model.parameters()), components=model_card.component_sizes(model),
        config_sizes=_config_sizes(model), image_tokens=_image_tokens(processor), settings=settings, stats=stats,
        result=result, split="test", machine=model_card.machine_summary(), command=model_card.command_line(),
    )
    record = {"name": facts.name, "architecture": facts.architecture, "parameters": facts.parameters,
              "settings": dataclasses.asdict(settings), "stats": dataclasses.asdict(stats),
              "test": result.to_dict(), "machine": facts.machine, "command": facts.command}
    with atomic_output_dir(out, overwrite=overwrite) as stage:
        model.save_pretrained(stage)
        processor.save_pretrained(stage)
        (stage / "training.json").write_text(json.dumps(record, indent=1) + "\n")
        (stage / "MODEL_CARD.md").write_text(model_card.render_card(facts))
    return record


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mmsdk.models.train_digits", description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=sorted(RECIPES), help="model family to train")
    parser.add_argument("--out", required=True, type=Path, help="output folder (written atomically)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the family's recipe)")
    parser.add_argument("--batch-size", type=int, help="examples per step (default: the family's recipe)")
    parser.add_argument("--seed", type=int, help="seed for weights and batches (default: the family's recipe)")
    parser.add_argument("--eval-examples", type=int, help="score only the first N test examples (default: all)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = _parse(argv)
    overrides = {"steps": args.steps, "batch_size": args.batch_size, "seed": args.seed}
    settings = dataclasses.replace(RECIPES[args.family], **{k: v for k, v in overrides.items() if v is not None})
    record = train_and_write(args.family, args.out, settings, eval_examples=args.eval_examples,
                             overwrite=args.overwrite)
    test = record["test"]
    print(f"{record['name']}: {record['parameters']:,} parameters, {record['stats']['seconds']:.1f} s training, "
          f"test accuracy {test['accuracy']:.4f} ({test['correct']}/{test['count']}) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
