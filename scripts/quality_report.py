"""Accuracy and memory of every built-in pass and the main combinations on the embedded trained models.

Writes its section of docs/quality.md (between the BEGIN/END markers below, leaving every other
section of the file alone) and the raw numbers to docs/quality-report.json:

    python scripts/quality_report.py                 # every builtin:* model, every registered pass
    python scripts/quality_report.py --limit 200 --models builtin:llava-digits

For each model: the unoptimized model, each registered pass alone, and each combination in
COMBINATIONS whose passes are all registered. Accuracy is exact match on the held-out digits
questions; memory comes from one profiled generation (mmsdk.profiling: weights, KV cache, peak).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BEGIN = "<!-- BEGIN scripts/quality_report.py: generated, do not edit by hand -->"
END = "<!-- END scripts/quality_report.py -->"
ROOT = Path(__file__).resolve().parents[1]

# The main combinations, in application order; any whose passes are not all registered is skipped.
COMBINATIONS: tuple[tuple[str, ...], ...] = (
    ("int4-weight", "int4-kv"),
    ("int4-weight", "int8-kv"),
    ("token-prune", "int4-weight", "int4-kv"),
    ("qkv-fuse", "int4-weight", "int4-kv", "token-prune"),
    ("vit-prune", "token-merge", "int4-weight"),
    ("gated-xattn", "sparse-xattn", "int4-weight", "int4-kv"),
    ("rmsnorm-rope-fusion", "int4-weight", "int4-kv"),
    ("ptq-align", "int4-weight", "int8-kv"),
)


@dataclass(frozen=True)
class Row:
    """One model under one configuration: accuracy and memory, or why it could not run."""

    model: str
    passes: tuple[str, ...]
    accuracy: float | None = None
    count: int = 0
    weights_bytes: int = 0
    kv_bytes: int = 0
    peak_bytes: int = 0
    seconds: float = 0.0
    skipped: str = ""

    @property
    def label(self) -> str:
        return " + ".join(self.passes) or "unoptimized"


def configurations(session: Any) -> list[tuple[str, ...]]:
    """(), each registered pass alone (by name), then each combination whose passes all exist."""
    singles = [(spec.name,) for spec in sorted(session.passes, key=lambda s: s.name)]
    combos = [c for c in COMBINATIONS if all(name in session.passes for name in c)]
    return [(), *singles, *combos]


def measure(session: Any, model_name: str, passes: tuple[str, ...], examples: Sequence[Any], sample: Any) -> Row:
    """Build ``model_name`` fresh, apply ``passes`` (calibrating on digits if needed), score and profile it."""
    from mmsdk.core.errors import MmsdkError
    from mmsdk.core.optimizer import Optimizer
    from mmsdk.harness import score_examples
    from mmsdk.profiling import measure_run

    loaded = session.models.get(model_name).build()
    start = time.perf_counter()
    try:
        opt = Optimizer(loaded.model, loaded.processor, session=session)
        if any(session.passes.get(name).needs_calibration for name in passes):
            opt.calibrate("digits")
        model = opt.apply(*passes).model
    except MmsdkError as err:
        return Row(model_name, passes, skipped=err.problem)
    result = score_examples(model, loaded.processor, opt.adapter, examples)
    run = measure_run(model, loaded.processor, opt.adapter, sample, modules=False)
    return Row(model_name, passes, result.accuracy, result.count, run.weights_bytes, run.kv_bytes, run.peak_bytes,
               time.perf_counter() - start)


def _bytes(n: int) -> str:
    from mmsdk.core.memory import format_bytes

    return format_bytes(n)


def _reason(text: str, limit: int = 140) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def model_table(rows: Sequence[Row]) -> list[str]:
    """Markdown table of one model's rows (the first row is the unoptimized baseline)."""
    base = rows[0]
    lines = ["| passes | accuracy | vs. unoptimized | weights | KV cache | peak | peak saved |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.skipped:
            lines.append(f"| {row.label} | n/a | | | | | refused: {_reason(row.skipped)} |")
            continue
        delta = f"{(row.accuracy - base.accuracy) * 100:+.1f} pt" if row is not base else ""
        saved = f"{(1 - row.peak_bytes / base.peak_bytes) * 100:.1f}%" if row is not base else ""
        lines.append(f"| {row.label} | {row.accuracy:.1%} | {delta} | {_bytes(row.weights_bytes)} | "
                     f"{_bytes(row.kv_bytes)} | {_bytes(row.peak_bytes)} | {saved} |")
    return lines


def render(rows: Sequence[Row], *, command: str, limit: int | None, note: str = "") -> str:
    """The whole generated section, markers included."""
    import torch
    import transformers

    from mmsdk import __version__

    today = datetime.date.today().isoformat()
    out = [BEGIN, "## Accuracy and memory of every pass on the embedded models", "",
           f"Generated {today} by `{command}` (mmsdk {__version__}, torch {torch.__version__}, "
           f"transformers {transformers.__version__}, Python {platform.python_version()}, CPU). "
           f"Accuracy: exact match on {'the first ' + str(limit) if limit else 'all'} held-out digits questions "
           "(`mmsdk eval --task digits-vqa`). Memory: one profiled greedy generation of 8 tokens "
           "(`mmsdk profile`): weights = parameters + buffers, KV = cache after decoding, peak = most bytes "
           "live at once (weights included). Saved = peak relative to the unoptimized model."
           + (f" {note}" if note else ""), ""]
    for model in dict.fromkeys(row.model for row in rows):
        out += [f"### {model}", "", *model_table([r for r in rows if r.model == model]), ""]
    return "\n".join([*out, END]) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace this script's section of ``path`` (or append it), leaving other sections untouched."""
    text = path.read_text() if path.exists() else "# Quality: accuracy and memory of mmsdk's techniques\n\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section.rstrip("\n") + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated model names (default: every builtin:*)")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N test questions")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "quality.md")
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "quality-report.json")
    parser.add_argument("--note", default="", help="a sentence added to the header (e.g. which commits were measured)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing mmsdk

    from mmsdk.core.session import Session
    from mmsdk.profiling import resolve_sample
    from mmsdk.tasks import get_task

    session = Session.create()
    models = args.models.split(",") if args.models else [m.name for m in session.models if m.trained]
    if not models:
        print("no trained embedded models are registered (builtin:*); nothing to measure", file=sys.stderr)
        return 2
    examples = get_task("digits-vqa", session).examples(session, args.limit)
    sample = resolve_sample(None, session, 8)
    rows = []
    for model in models:
        for passes in configurations(session):
            row = measure(session, model, passes, examples, sample)
            print(f"{model:28s} {row.label:50s} {row.skipped or f'{row.accuracy:.1%}'}", flush=True)
            rows.append(row)
    given = list(argv if argv is not None else sys.argv[1:])
    if "--note" in given:  # the note is printed on its own; keep the command short
        del given[given.index("--note") : given.index("--note") + 2]
    command = " ".join(["python scripts/quality_report.py", *given])
    write_section(args.out, render(rows, command=command, limit=args.limit, note=args.note))
    args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    print(f"wrote {args.out} and {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
