"""Accuracy of each family recipe on the embedded digits models (torch), and recipe:default's memory waterfall.

    PYTHONPATH=. python benchmarks/recipes_accuracy.py [--models builtin:llava-digits ...] [--limit 1000]
        [--recipes default,max-memory,max-accuracy]

For each model: the unoptimized model and each recipe answer the first ``--limit`` held-out digits
questions (greedy, ``mmsdk.evaluation.vqa_accuracy``); then ``Optimizer.profile`` measures one greedy
generation before and after every pass of ``recipe:default`` (the memory waterfall).
Writes benchmarks/results/recipes_accuracy.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import environment, write_results

MODELS = ("builtin:llava-digits", "builtin:qwen2-vl-digits", "builtin:idefics-digits")


def accuracy(name: str, recipe: str | None, examples: list[Any]) -> dict[str, Any]:
    """Held-out accuracy of ``name`` after ``recipe`` (None: unoptimized)."""
    from mmsdk import Optimizer
    from mmsdk.evaluation import vqa_accuracy

    start = time.perf_counter()
    opt = Optimizer(name)
    if recipe:
        opt.apply(f"recipe:{recipe}")
    try:
        result = vqa_accuracy(opt.model, opt.processor, opt.adapter, examples)
    except Exception as err:
        return {"recipe": recipe or "unoptimized", "error": f"{type(err).__name__}: {err}"[:300]}
    steps = [s.pass_name for s in opt.recipe().steps]
    return {"recipe": recipe or "unoptimized", "passes": steps, "accuracy": result.accuracy,
            "correct": result.correct, "count": result.count, "seconds": round(time.perf_counter() - start, 1)}


def waterfall(name: str) -> dict[str, Any]:
    """``Optimizer.profile`` of recipe:default: one measured generation before and after every pass."""
    from mmsdk import Optimizer
    from mmsdk.profiling.results import waterfall_table

    opt = Optimizer(name).apply("recipe:default")
    profile = opt.profile()
    return {"table": waterfall_table(profile), "profile": profile.to_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--recipes", default="default,max-memory,max-accuracy")
    args = parser.parse_args()
    from mmsdk import Session

    examples = Session.create().datasets.get("digits").load("test")[: args.limit]
    results: dict[str, Any] = {"environment": environment(), "limit": args.limit, "models": {}}
    lines = ["| model | build | accuracy | vs. unoptimized |", "|---|---|---|---|"]
    for name in args.models:
        rows = [accuracy(name, None, examples)]
        rows += [accuracy(name, r, examples) for r in args.recipes.split(",")]
        base = rows[0].get("accuracy")
        for row in rows:
            acc = row.get("accuracy")
            delta = f"{(acc - base) * 100:+.1f} pt" if acc is not None and base is not None else ""
            cell = f"{acc:.1%} ({row['correct']}/{row['count']})" if acc is not None else row.get("error", "")
            lines.append(f"| {name} | {row['recipe']} | {cell} | {delta} |")
            print(lines[-1], flush=True)
        results["models"][name] = {"accuracy": rows, "waterfall": waterfall(name)}
        print(results["models"][name]["waterfall"]["table"], flush=True)
    write_results("recipes_accuracy", results, "\n".join(lines), None)


if __name__ == "__main__":
    main()
