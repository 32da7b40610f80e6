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

# A step is a pass name, or "name(field=value, ...)" for a non-default config (values are JSON or text).
# VARIANTS are non-default configs measured as rows of their own.
_W4 = "int4-weight"
VARIANTS: tuple[str, ...] = ("int4-weight(method=awq)", "token-prune(keep_ratio=0.25)")
# The main combinations, in application order; any whose passes are not all registered is skipped.
COMBINATIONS: tuple[tuple[str, ...], ...] = (
    (_W4, "int4-kv"),
    (_W4, "int8-kv"),
    ("token-prune", _W4, "int4-kv"),
    ("qkv-fuse", _W4, "int4-kv", "token-prune"),
    ("vit-prune", "token-merge", _W4),
    ("gated-xattn", "sparse-xattn", _W4, "int4-kv"),
    ("rmsnorm-rope-fusion", _W4, "int4-kv"),
    ("ptq-align", _W4, "int8-kv"),
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


def step_name(step: str) -> str:
    """The pass name of a step (``"int4-weight(group_size=32)"`` -> ``"int4-weight"``)."""
    return step.split("(", 1)[0].strip()


def configurations(session: Any) -> list[tuple[str, ...]]:
    """(), each registered pass alone (by name), the variants, then each combination whose passes all exist."""
    singles = [(spec.name,) for spec in sorted(session.passes, key=lambda s: s.name)]
    extra = [(step,) for step in VARIANTS if step_name(step) in session.passes]
    combos = [c for c in COMBINATIONS if all(step_name(step) in session.passes for step in c)]
    return [(), *singles, *extra, *combos]


def step_config(session: Any, step: str) -> Any:
    """A pass name as is, or the config object a ``name(field=value, ...)`` step describes."""
    name = step_name(step)
    if "(" not in step:
        return name
    fields = {}
    for item in step.split("(", 1)[1].rstrip(")").split(","):
        key, _, value = item.partition("=")
        try:
            fields[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            fields[key.strip()] = value.strip()
    return session.passes.get(name).config_cls(**fields)


def measure(session: Any, model_name: str, passes: tuple[str, ...], examples: Sequence[Any], sample: Any) -> Row:
    """Build ``model_name`` fresh, apply ``passes`` (calibrating on digits if needed), score and profile it."""
    from mmsdk.core.errors import MmsdkError
    from mmsdk.core.optimizer import Optimizer
    from mmsdk.harness import score_examples
    from mmsdk.profiling import measure_run

    start = time.perf_counter()
    try:
        loaded = session.models.get(model_name).build()
        opt = Optimizer(loaded.model, loaded.processor, session=session)
        configs = [step_config(session, step) for step in passes]
        opt.apply(*configs)
        needs = [_needs_data(session, step, c) for step, c in zip(passes, configs, strict=True)]
        if opt.calibration is None and any(needs):
            opt.calibrate("digits")
        model = opt.model
    except MmsdkError as err:
        return Row(model_name, passes, skipped=f"refused: {err.problem}")
    try:
        result = score_examples(model, loaded.processor, opt.adapter, examples)
        run = measure_run(model, loaded.processor, opt.adapter, sample, modules=False)
    except Exception as err:  # a plugin's bug must show in the report, not end it
        return Row(model_name, passes, skipped=f"failed: {type(err).__name__}: {err}")
    return Row(model_name, passes, result.accuracy, result.count, run.weights_bytes, run.kv_bytes, run.peak_bytes,
               time.perf_counter() - start)


def _needs_data(session: Any, step: str, config: Any) -> bool:
    spec = session.passes.get(step_name(step))
    wants = getattr(spec, "wants_calibration", None)  # newer PassSpec: the need may depend on the config
    if wants is not None:
        return bool(wants(config if not isinstance(config, str) else spec.config_cls()))
    return bool(spec.needs_calibration)


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
            lines.append(f"| {row.label} | n/a | | | | | {_reason(row.skipped)} |")
            continue
        compare = row is not base and not base.skipped
        delta = f"{(row.accuracy - base.accuracy) * 100:+.1f} pt" if compare else ""
        saved = f"{(1 - row.peak_bytes / base.peak_bytes) * 100:.1f}%" if compare else ""
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


def _load_rows(path: Path) -> list[Row]:
    if not path.is_file():
        return []
    return [Row(**{**data, "passes": tuple(data["passes"])}) for data in json.loads(path.read_text())]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated model names (default: every builtin:*)")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N test questions")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "quality.md")
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "quality-report.json")
    parser.add_argument("--note", default="", help="a sentence added to the header (e.g. which commits were measured)")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in --json and measure the rest")
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
    rows = _load_rows(args.json) if args.resume else []
    done = {(row.model, row.passes) for row in rows}
    for model in models:
        for passes in configurations(session):
            if (model, passes) in done:
                continue
            row = measure(session, model, passes, examples, sample)
            print(f"{model:28s} {row.label:50s} {row.skipped or f'{row.accuracy:.1%}'}", flush=True)
            rows.append(row)
            args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")  # resumable
    given = list(argv if argv is not None else sys.argv[1:])
    if "--note" in given:  # the note is printed on its own; keep the command short
        del given[given.index("--note") : given.index("--note") + 2]
    command = " ".join(["python scripts/quality_report.py", *given])
    write_section(args.out, render([r for r in rows if r.model in models], command=command, limit=args.limit,
                                   note=args.note))
    print(f"wrote {args.out} and {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
