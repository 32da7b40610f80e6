"""``mmsdk demo``: the embedded default end to end: answers and memory before/after, then export."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

from mmsdk.cli._common import console, print_table

DEMO_MODEL = "builtin:llava-digits"
DEMO_DATASET = "digits"
# Applied in this order when the plugin providing them is present.
# token-prune is left out: on 28-pixel digits every image token matters (-23 points at keep 0.5, docs/quality.md).
DEMO_PASSES = ("qkv-fuse", "vit-prune", "int4-weight", "int4-kv")
EXPORT_PREFERENCE = ("onnxruntime", "torch")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="optimize the embedded digits model, compare, export")
    parser.add_argument("--out", type=Path, default=Path("mmsdk-out/demo"), help="export folder (replaced)")
    parser.add_argument("--eval-count", type=int, default=200, help="held-out questions to score (default 200)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from mmsdk.core.optimizer import Optimizer
    from mmsdk.core.session import Session
    from mmsdk.evaluation import vqa_accuracy

    out = console()
    session = Session.create()
    loaded = session.models.get(DEMO_MODEL).build()
    test = session.datasets.get(DEMO_DATASET).load("test")[: args.eval_count]
    baseline = copy.deepcopy(loaded.model)
    passes = [name for name in DEMO_PASSES if name in session.passes]
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    if any(session.passes.get(n).wants_calibration(session.passes.get(n).config_cls()) for n in passes):
        opt.calibrate(DEMO_DATASET)
    opt.apply(*passes)
    out.print(f"[bold]{DEMO_MODEL}[/bold]: applying {', '.join(passes)}")
    before = vqa_accuracy(baseline, loaded.processor, opt.adapter, test)
    after = vqa_accuracy(opt.model, loaded.processor, opt.adapter, test)
    _show_answers(test[:6], baseline, opt, loaded.processor)
    out.print(opt.report().table())
    out.print(f"held-out accuracy on {before.count} questions: unoptimized {before.accuracy:.1%}, "
              f"optimized {after.accuracy:.1%}")
    _show_memory(session, baseline, opt, loaded.processor)
    backend = next(name for name in EXPORT_PREFERENCE if name in session.backends)
    result = opt.export(backend, args.out, overwrite=True)
    total = sum(f.bytes for f in result.manifest.files)
    out.print(f"exported for {backend} to {result.path} ({total / 2**20:.2f} MiB, manifest.json lists every file)")
    return 0


def _show_memory(session: Any, baseline: Any, opt: Any, processor: Any) -> None:
    """Weights, KV cache and peak bytes of one profiled answer (exact tensor accounting, CPU)."""
    from mmsdk.core.memory import format_bytes
    from mmsdk.profiling import measure_run
    from mmsdk.profiling.measure import resolve_sample

    sample = resolve_sample(None, session, 8)
    runs = [measure_run(model, processor, opt.adapter, sample, modules=False) for model in (baseline, opt.model)]
    rows = [(what, format_bytes(getattr(runs[0], field)), format_bytes(getattr(runs[1], field)))
            for what, field in (("weights", "weights_bytes"), ("KV cache", "kv_bytes"), ("peak", "peak_bytes"))]
    print_table("memory of one answer (8 tokens)", ("", "unoptimized", "optimized"), rows)


def _show_answers(examples: list[Any], baseline: Any, opt: Any, processor: Any) -> None:
    from mmsdk.evaluation import answer_questions

    plain = answer_questions(baseline, processor, opt.adapter, examples)
    optimized = answer_questions(opt.model, processor, opt.adapter, examples)
    rows = [(ex.question, ex.answer, a, b) for ex, a, b in zip(examples, plain, optimized)]
    print_table("answers", ("question", "truth", "unoptimized", "optimized"), rows)
