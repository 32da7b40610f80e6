"""Held-out digits answers of sparse-xattn (alone and with int4-kv): torch vs ONNX Runtime, batch 32 vs 1.

    python benchmarks/ort_sparse_kv_digits.py [--count 200] [--markdown docs/benchmarks.md]

``apply("sparse-xattn")`` and the headline one-liner ``apply("int4-kv", "sparse-xattn")`` (default
configs, calibration on the model's default samples) on the embedded llava- and idefics-digits
models; answers in batches of 32 (left padded) and one by one, scored on the first word
(mmsdk.evaluation); how many answers differ between torch and ONNX Runtime, and between the two
batch sizes (a prompt's answer should not depend on what else is in its batch).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import environment, write_results  # noqa: E402

MODELS = ("builtin:llava-digits", "builtin:idefics-digits")
CONFIGS = {"sparse-xattn": ("sparse-xattn",), "int4-kv + sparse-xattn": ("int4-kv", "sparse-xattn")}
PASSES = ("int4-kv", "sparse-xattn")


def torch_answers(opt: Any, processor: Any, examples: list, batch: int) -> list[str]:
    import torch

    from mmsdk.evaluation import normalize_answer

    out = []
    for start in range(0, len(examples), batch):
        chunk = examples[start:start + batch]
        inputs = processor(images=[e.image for e in chunk],
                           text=[opt.adapter.format_prompt(e.question, processor) for e in chunk])
        with torch.no_grad():
            tokens = opt.model.generate(**inputs, max_new_tokens=3, do_sample=False)
        texts = processor.batch_decode(tokens[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        out += [normalize_answer(t) for t in texts]
    return out


def ort_answers(pipe: Any, examples: list, batch: int) -> list[str]:
    from mmsdk.evaluation import normalize_answer

    out = []
    for start in range(0, len(examples), batch):
        chunk = examples[start:start + batch]
        tokens = pipe.generate([e.image for e in chunk], [e.question for e in chunk], max_new_tokens=3)
        out += [normalize_answer(t) for t in pipe.processor.batch_decode(tokens, skip_special_tokens=True)]
    return out


def evaluate(session: Any, name: str, passes: tuple[str, ...], examples: list, work: Path) -> dict[str, Any]:
    import mmsdk
    from mmsdk import Optimizer
    from mmsdk.evaluation import normalize_answer

    gold = [normalize_answer(e.answer) for e in examples]

    def accuracy(answers: list[str]) -> float:
        return sum(a == g for a, g in zip(answers, gold, strict=True)) / len(gold)

    def differing(a: list[str], b: list[str]) -> int:
        return sum(x != y for x, y in zip(a, b, strict=True))

    loaded = session.models.get(name).build()
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply(*passes)
    folder = work / f"{name.replace(':', '_')}-{'-'.join(passes)}"
    opt.export(path=folder)
    pipe = mmsdk.load(folder)
    answers = {(kind, batch): (torch_answers(opt, loaded.processor, examples, batch) if kind == "torch"
                               else ort_answers(pipe, examples, batch))
               for kind in ("torch", "ORT") for batch in (32, 1)}
    row: dict[str, Any] = {f"{kind} (batch {batch})": accuracy(got) for (kind, batch), got in answers.items()}
    for kind in ("torch", "ORT"):
        row[f"{kind}: batch 32 vs 1 differing"] = differing(answers[(kind, 32)], answers[(kind, 1)])
    for batch in (32, 1):
        row[f"torch vs ORT differing (batch {batch})"] = differing(answers[("torch", batch)], answers[("ORT", batch)])
    return row


def unoptimized(session: Any, name: str, examples: list) -> float:
    from mmsdk import Optimizer
    from mmsdk.evaluation import normalize_answer

    base = session.models.get(name).build()
    answers = torch_answers(Optimizer(base.model, base.processor, session=session), base.processor, examples, 32)
    return sum(a == normalize_answer(e.answer) for a, e in zip(answers, examples, strict=True)) / len(examples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200, help="questions from the start of the test split")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()

    from mmsdk.core.session import Session

    session = Session.create(autoload=False)
    models = [m for m in MODELS if m in session.models]
    if "digits" not in session.datasets or not models or not all(p in session.passes for p in PASSES):
        raise SystemExit(f"needs the digits dataset, one of {', '.join(MODELS)} and the passes {', '.join(PASSES)}")
    examples = list(session.datasets.get("digits").load("test")[: args.count])
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="mmsdk-sparse-kv-") as work:
        for name in models:
            base = unoptimized(session, name, examples)
            for label, passes in CONFIGS.items():
                rows[f"{name} | {label}"] = {"torch unoptimized": base,
                                             **evaluate(session, name, passes, examples, Path(work))}
                print(label, name, rows[f"{name} | {label}"], flush=True)
    results = {"environment": environment(), "questions": len(examples), "configs": {k: list(v) for k, v in
                                                                                     CONFIGS.items()}, "rows": rows}
    columns = list(next(iter(rows.values())))
    table = "| model | passes | " + " | ".join(columns) + " |\n|" + " --- |" * (len(columns) + 2) + "\n" + "\n".join(
        f"| {key} | " + " | ".join(f"{row[c]:.1%}" if isinstance(row[c], float) else str(row[c]) for c in columns)
        + " |" for key, row in rows.items())
    table += (f"\n\n{len(examples)} held-out digits questions, greedy, first word scored; default configs "
              "(sparse-xattn: block 16, density 0.5), exported with `export()` defaults; batch 32 rows are "
              "left padded.")
    print(table)
    write_results("ort_sparse_kv_digits", results, table, args.markdown)


if __name__ == "__main__":
    main()
