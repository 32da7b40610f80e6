"""``mmsdk optimize MODEL --apply a,b --export BACKEND --out DIR``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mmsdk.cli._common import add_model_arguments, console, split_list
from mmsdk.core.errors import ConfigError


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("optimize", help="apply passes to a model and export it")
    add_model_arguments(parser)
    parser.add_argument("--recipe", default=None, metavar="NAME|FILE",
                        help="a recipe: the family's (default, max-memory, max-accuracy) or a .yaml/.json file; "
                        "its passes run before any --apply")
    parser.add_argument("--calibrate", default=None, metavar="DATASET",
                        help="calibration data: a dataset name (e.g. digits); needed by passes that learn from data")
    parser.add_argument("--calibration-limit", type=int, default=None, metavar="N", help="use at most N samples")
    parser.add_argument("--export", default="onnxruntime", metavar="BACKEND", help="backend (default onnxruntime)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder")
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists and is not empty")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option, e.g. --option tp_size=2 (values are JSON, else strings)")
    parser.set_defaults(handler=run)


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``["tp_size=2", "target=A"]`` -> ``{"tp_size": 2, "target": "A"}``."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option {pair!r} is not KEY=VALUE.", fix="write e.g. --option tp_size=2.")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def recipe_items(recipe: str | None) -> list[Any]:
    """``--recipe``: a file path becomes a Recipe, a name becomes ``recipe:NAME`` (nothing when None)."""
    from mmsdk.core.recipes import RECIPE_PREFIX, Recipe

    if not recipe:
        return []
    if recipe.endswith((".yaml", ".yml", ".json")) or Path(recipe).is_file():
        return [Recipe.from_file(recipe)]
    return [recipe if recipe.startswith(RECIPE_PREFIX) else RECIPE_PREFIX + recipe]


def run(args: argparse.Namespace) -> int:
    from mmsdk.core.optimizer import Optimizer

    out = console()
    options = parse_options(args.option)
    opt = Optimizer(args.model, adapter=args.adapter)
    opt.session.backends.get(args.export)  # fail on a typo before any pass runs
    if args.calibrate:
        opt.calibrate(args.calibrate, limit=args.calibration_limit)
    opt.apply(*recipe_items(args.recipe), *split_list(args.apply))
    out.print(f"[bold]{opt.source.name}[/bold] ({opt.source.architecture}, adapter {opt.adapter.name})")
    out.print(opt.report().table())
    result = opt.export(args.export, args.out, overwrite=args.overwrite, **options)
    total = sum(f.bytes for f in result.manifest.files)
    out.print(f"exported to {result.path} ({len(result.manifest.files)} files, {total / 2**20:.2f} MiB) "
              f"for backend {result.backend}")
    return 0
