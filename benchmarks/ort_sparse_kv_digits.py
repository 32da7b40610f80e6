"""Held-out digits answers of ``apply("int4-kv", "sparse-xattn")``: the optimized torch model vs its ONNX export.

    python benchmarks/ort_sparse_kv_digits.py [--count 200] [--markdown docs/benchmarks.md]

The headline one-liner (default configs, calibration on the model's default samples) on the
embedded llava- and idefics-digits models; answers in batches of 32 and one by one, scored on the
first word (mmsdk.evaluation), and how many answers differ between torch and ONNX Runtime.
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


def evaluate(session: Any, name: str, examples: list, work: Path) -> dict[str, Any]:
    import mmsdk
    from mmsdk import Optimizer
    from mmsdk.evaluation import normalize_answer

    gold = [normalize_answer(e.answer) for e in examples]

    def accuracy(answers: list[str]) -> float:
        return sum(a == g for a, g in zip(answers, gold, strict=True)) / len(gold)

    base = session.models.get(name).build()
    row: dict[str, Any] = {"torch unoptimized": accuracy(torch_answers(Optimizer(base.model, base.processor,
                                                                                 session=session),
                                                                       base.processor, examples, 32))}
    loaded = session.models.get(name).build()
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply(*PASSES)
    opt.export(path=work / name.replace(":", "_"))
    pipe = mmsdk.load(work / name.replace(":", "_"))
    for batch in (32, 1):
        want, got = torch_answers(opt, loaded.processor, examples, batch), ort_answers(pipe, examples, batch)
        row[f"torch (batch {batch})"] = accuracy(want)
        row[f"ORT (batch {batch})"] = accuracy(got)
        row[f"answers differing (batch {batch})"] = sum(a != b for a, b in zip(want, got, strict=True))
    return row


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
    with tempfile.TemporaryDirectory(prefix="mmsdk-sparse-kv-") as work:
        rows = {name: evaluate(session, name, examples, Path(work)) for name in models}
    results = {"environment": environment(), "questions": len(examples), "passes": list(PASSES), "rows": rows}
    columns = list(rows[models[0]])
    table = "| model | " + " | ".join(columns) + " |\n|" + " --- |" * (len(columns) + 1) + "\n" + "\n".join(
        f"| {name} | " + " | ".join(f"{row[c]:.1%}" if isinstance(row[c], float) else str(row[c]) for c in columns)
        + " |" for name, row in rows.items())
    table += (f"\n\n{len(examples)} held-out digits questions, greedy, first word scored; optimized = "
              "`apply(\"int4-kv\", \"sparse-xattn\")` with default configs, exported with `export()` defaults.")
    print(table)
    write_results("ort_sparse_kv_digits", results, table, args.markdown)


if __name__ == "__main__":
    main()
