"""Accuracy, KV-cache bytes and prefill FLOPs of the vision and attention passes on the embedded digits models.

    PYTHONPATH=. python benchmarks/vision_passes.py --limit 400 --markdown vision_passes.md

For every trained embedded model (``builtin:*-digits``, or the ``--models`` given) and every
configuration below, a fresh copy of the model gets the pass, answers the digits test questions
(greedy, first word scored) and runs one prefill whose FLOPs (FlopCounterMode over the ops that
ran) and KV-cache bytes (the tensors the returned cache holds) are counted. For sparse-xattn the
share of text-to-image score entries a block-sparse kernel still computes is reported too; the
masked-SDPA path that runs on CPU computes all of them, so its counted FLOPs do not drop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from mmsdk import Optimizer
from mmsdk.core.errors import MmsdkError
from mmsdk.core.flops import count_prefill
from mmsdk.core.session import Session
from mmsdk.plugins.attention.sparse_xattn import BlockSparseSpec, SparseXAttnConfig
from mmsdk.plugins.encoders.token_prune import TokenPruneConfig
from mmsdk.plugins.encoders.vit_prune import ViTPruneConfig
from mmsdk.plugins.projectors.token_merge import TokenMergeConfig
from mmsdk.testing import sample_image


class _RandomRanks:
    """The scores a scorer found, replaced by seeded uniform noise (same shapes, drawn once each)."""

    def __init__(self, found: list[torch.Tensor], generator: torch.Generator) -> None:
        self.found, self.generator, self.drawn = found, generator, []

    def __iter__(self) -> Any:
        while len(self.drawn) < len(self.found):
            self.drawn.append(torch.rand(self.found[len(self.drawn)].shape, generator=self.generator))
        return iter(self.drawn)


class _RandomScorer:
    """Control for visionzip: the same budget and reducer, but tokens ranked at random."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.generator = torch.Generator().manual_seed(0)

    @contextlib.contextmanager
    def capture(self, call_kwargs: Any) -> Any:
        with self.inner.capture(call_kwargs) as found:
            yield _RandomRanks(found, self.generator)


def _random_control(opt: Optimizer) -> None:
    from mmsdk.plugins._runtime import runtime_of

    runtime = runtime_of(opt.model, opt.adapter)
    runtime.scorers[:] = [_RandomScorer(s) for s in runtime.scorers]


CONFIGS: list[tuple[str, tuple[Any, ...]]] = [
    ("baseline", ()),
    ("token-prune visionzip keep 0.5", (TokenPruneConfig(keep_ratio=0.5),)),
    ("token-prune visionzip keep 0.25", (TokenPruneConfig(keep_ratio=0.25),)),
    ("token-prune visionzip received keep 0.5", (TokenPruneConfig(keep_ratio=0.5, dominance="received"),)),
    ("token-prune visionzip received keep 0.25", (TokenPruneConfig(keep_ratio=0.25, dominance="received"),)),
    ("control: random ranking keep 0.5", (TokenPruneConfig(keep_ratio=0.5), _random_control)),
    ("token-prune fastv keep 0.5", (TokenPruneConfig(strategy="fastv", keep_ratio=0.5),)),
    ("token-prune fastv keep 0.25", (TokenPruneConfig(strategy="fastv", keep_ratio=0.25),)),
    ("token-merge keep 0.5", (TokenMergeConfig(keep_ratio=0.5),)),
    ("token-merge keep 0.25", (TokenMergeConfig(keep_ratio=0.25),)),
    ("sparse-xattn density 0.5", (SparseXAttnConfig(density=0.5, block_size=8),)),
    ("sparse-xattn density 0.25", (SparseXAttnConfig(density=0.25, block_size=8),)),
    ("vit-prune heads 0.25, mlp 0.25", (ViTPruneConfig(head_ratio=0.25, mlp_ratio=0.25),)),
    ("gated-xattn", ("gated-xattn",)),
    ("rmsnorm-rope-fusion", ("rmsnorm-rope-fusion",)),
]


@dataclass
class Row:
    model: str
    config: str
    accuracy: float | None
    correct: int
    count: int
    flops: int | None
    kv_bytes: int | None
    kept_entries: float | None
    note: str = ""


def _accuracy(model: Any, processor: Any, adapter: Any, examples: list[Any]) -> tuple[int, int]:
    try:
        from mmsdk.evaluation import vqa_accuracy
    except ImportError:  # older trees: score the first generated word directly
        return _first_word_accuracy(model, processor, adapter, examples)
    result = vqa_accuracy(model, processor, adapter, examples)
    return result.correct, result.count


def _first_word_accuracy(model: Any, processor: Any, adapter: Any, examples: list[Any]) -> tuple[int, int]:
    import re

    def first(text: str) -> str:
        words = re.findall(r"[\w'-]+", text.lower())
        return words[0] if words else ""

    correct = 0
    for start in range(0, len(examples), 32):
        chunk = examples[start: start + 32]
        inputs = processor(images=[e.image for e in chunk], text=[adapter.format_prompt(e.question, processor)
                                                                  for e in chunk])
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        answers = processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(first(a) == first(e.answer) for a, e in zip(answers, chunk, strict=True))
    return correct, len(examples)


def _entries(model: torch.nn.Module) -> float | None:
    specs = [m for m in model.modules() if isinstance(m, BlockSparseSpec)]
    total = sum(s.score_entries[0] for s in specs)
    return sum(s.score_entries[1] for s in specs) / total if total else None


def measure(session: Session, name: str, label: str, passes: tuple[Any, ...], examples: list[Any] | None) -> Row:
    """One model x one configuration (``examples`` None: count costs only, on a random image)."""
    model, processor = session.models.get(name).build()
    opt = Optimizer(model, processor, session=session)
    hooks = [p for p in passes if callable(p)]  # benchmark controls, run after the passes
    passes = tuple(p for p in passes if not callable(p))
    try:
        if any(session.pass_spec(p)[0].needs_calibration for p in passes):
            opt.calibrate(_calibration(session, examples))
        opt.apply(*passes)
        model = opt.model
        for hook in hooks:
            hook(opt)
    except MmsdkError as err:
        reason = err.problem.split(";")[0].split(", but")[0].rstrip(".")
        return Row(name, label, None, 0, 0, None, None, None, note=f"refused: {reason}")
    image, question = (examples[0].image, examples[0].question) if examples else (sample_image(0), "is it even ?")
    cost = count_prefill(model, processor(images=[image], text=[opt.adapter.format_prompt(question, processor)]))
    if examples is None:
        return Row(name, label, None, 0, 0, cost.flops, cost.kv_bytes, _entries(model), note="costs only")
    for spec in (m for m in model.modules() if isinstance(m, BlockSparseSpec)):
        spec.reset_score_entries()
    correct, count = _accuracy(model, processor, opt.adapter, examples)
    return Row(name, label, correct / count, correct, count, cost.flops, cost.kv_bytes, _entries(model))


def _calibration(session: Session, examples: list[Any] | None) -> list[tuple[Any, str]]:
    if examples is None:
        return [(sample_image(i), "what digit is this ?") for i in range(8)]
    return [(e.image, e.question) for e in session.datasets.get("digits").load("calibration")[:64]]


def markdown(rows: list[Row]) -> str:
    """A table per model: accuracy (and share of baseline), KV bytes and prefill FLOPs relative to baseline."""
    scored = any(r.accuracy is not None for r in rows)
    head = ["configuration", *(["accuracy", "of baseline"] if scored else []), "KV bytes", "KV vs base",
            "prefill FLOPs", "FLOPs vs base", "text-to-image score entries kept"]
    lines = []
    for name in dict.fromkeys(r.model for r in rows):
        group = [r for r in rows if r.model == name]
        base = group[0]
        lines += [f"### {name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in group:
            if r.kv_bytes is None:
                lines.append(f"| {r.config} | {r.note} |" + " |" * (len(head) - 2))
                continue
            kept = f"{r.kept_entries:.0%}" if r.kept_entries is not None else ""
            kv, flops = f"{r.kv_bytes / base.kv_bytes:.0%}", f"{r.flops / base.flops:.0%}"
            accuracy = [f"{r.accuracy:.1%} ({r.correct}/{r.count})", f"{r.accuracy / base.accuracy:.1%}"] \
                if scored and r.accuracy is not None and base.accuracy else []
            cells = (r.config, *accuracy, r.kv_bytes, kv, f"{r.flops:,}", flops, kept)
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="model names (default: every builtin:*-digits model)")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--limit", type=int, default=400, help="test questions per configuration")
    parser.add_argument("--costs-only", action="store_true", help="count KV bytes and FLOPs only (no accuracy)")
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument("--json", help="also write the rows as JSON")
    parser.add_argument("--from-json", help="only render the tables of rows written earlier with --json")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as handle:
            print(markdown([Row(**row) for row in json.load(handle)]))
        return 0
    torch.manual_seed(0)
    session = Session.create(autoload=False)
    names = args.models or [n for n in session.models.names() if n.startswith("builtin:") and n.endswith("-digits")]
    if not names:
        print("no builtin:*-digits model is registered in this tree", file=sys.stderr)
        return 1
    examples = None if args.costs_only else session.datasets.get(args.dataset).load("test")[: args.limit]
    rows = []
    for name in names:
        for label, passes in CONFIGS:
            start = time.perf_counter()
            rows.append(measure(session, name, label, passes, examples))
            print(f"{name} | {label}: {rows[-1].accuracy} ({time.perf_counter() - start:.1f}s)", file=sys.stderr)
        session = Session.create(autoload=False)  # fresh registries, so no pass state leaks between models
    text = markdown(rows)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([r.__dict__ for r in rows], handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
