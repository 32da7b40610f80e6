"""``mmsdk eval MODEL|DIR --task digits-vqa [--apply a,b]``: held-out accuracy of a model or an export."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mmsdk.cli._common import add_model_arguments, console, print_table, split_list


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("eval", help="accuracy on held-out questions (torch model or exported folder)")
    add_model_arguments(parser)
    parser.add_argument("--task", default="digits-vqa",
                        help="task to score (default digits-vqa: a registered dataset's test split)")
    parser.add_argument("--data", type=Path, default=None, metavar="FILE.jsonl",
                        help='your own examples instead of --task: {"image", "question", "answer"} per line')
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="score only the first N examples")
    parser.add_argument("--calibrate", default=None, metavar="DATASET", help="calibration data for passes that need it")
    parser.add_argument("--batch-size", type=int, default=32, metavar="N", help="questions per generate() call")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--min-accuracy", type=float, default=None, metavar="X",
                        help="exit with status 1 when accuracy is below X (0..1), e.g. in CI")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from mmsdk.core.errors import ConfigError
    from mmsdk.harness import evaluate
    from mmsdk.tasks import read_examples

    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}", fix="score at least one example (or leave --limit out).")
    examples = read_examples(args.data) if args.data is not None else None
    report = evaluate(args.model, args.task, apply=split_list(args.apply), examples=examples, limit=args.limit,
                      calibrate=args.calibrate, adapter=args.adapter, batch_size=args.batch_size)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        _print(report)
    if args.min_accuracy is not None and report.accuracy < args.min_accuracy:
        console().print(f"[red]accuracy {report.accuracy:.1%} is below --min-accuracy {args.min_accuracy:.1%}[/red]")
        return 1
    return 0


def _print(report: Any) -> None:
    rows = [(name, f"{g['accuracy']:.1%}", f"{int(g['correct'])}/{int(g['count'])}")
            for name, g in report.groups.items()]
    if len(rows) > 1:
        print_table("per question type", ("questions", "accuracy", "correct"), rows)
    from rich.markup import escape

    passes = ", ".join(report.passes) or "none"
    console().print(
        f"[bold]{escape(report.target)}[/bold] ({report.runs_on}, passes: {passes}) on {escape(report.task)}: "
        f"[bold]{report.accuracy:.1%}[/bold] ({report.correct}/{report.count}) in {report.seconds:.1f} s"
    )
