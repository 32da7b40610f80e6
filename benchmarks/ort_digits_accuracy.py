"""Held-out digits accuracy: torch vs the onnxruntime export, float and INT4, on the embedded digits models.

    python benchmarks/ort_digits_accuracy.py [--count 2075] [--markdown docs/benchmarks.md]

Needs the embedded digits models, the digits dataset and the int4-weight pass (exits saying which
is missing). Greedy answers, first word scored (mmsdk.evaluation).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import environment, write_results  # noqa: E402

MODELS = ("builtin:llava-digits", "builtin:qwen2-vl-digits", "builtin:idefics-digits")


def ort_accuracy(pipe: Any, examples: list, batch: int = 64) -> float:
    from mmsdk.evaluation import normalize_answer

    correct = 0
    for start in range(0, len(examples), batch):
        chunk = examples[start:start + batch]
        tokens = pipe.generate([e.image for e in chunk], [e.question for e in chunk], max_new_tokens=3)
        texts = pipe.processor.batch_decode(tokens, skip_special_tokens=True)
        correct += sum(normalize_answer(t) == normalize_answer(e.answer) for t, e in zip(texts, chunk))
    return correct / len(examples)


def evaluate(session: Any, name: str, examples: list, work: Path) -> dict[str, Any]:
    import mmsdk
    from mmsdk import Optimizer
    from mmsdk.evaluation import vqa_accuracy

    row: dict[str, Any] = {}
    for label, passes in (("float32", ()), ("INT4", ("int4-weight",))):
        loaded = session.models.get(name).build()
        opt = Optimizer(loaded.model, loaded.processor, session=session)
        if passes:
            opt.apply(session.passes.get("int4-weight").config_cls(group_size=32, indivisible="pad"))
        start = time.perf_counter()
        row[f"torch {label}"] = vqa_accuracy(opt.model, loaded.processor, opt.adapter, examples, max_new_tokens=3).accuracy
        row[f"torch {label} seconds"] = round(time.perf_counter() - start, 1)
        for level in ((0, 4) if passes else (0,)):
            folder = work / f"{name.replace(':', '_')}_{label}_{level}"
            opt.export("onnxruntime", folder, accuracy_level=level)
            start = time.perf_counter()
            key = f"ORT {label}" + (f" (accuracy_level {level})" if passes else "")
            row[key] = ort_accuracy(mmsdk.load(folder), examples)
            row[f"{key} seconds"] = round(time.perf_counter() - start, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=None, help="questions (default: the whole test split)")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()

    from mmsdk.core.session import Session

    session = Session.create(autoload=False)
    models = [m for m in MODELS if m in session.models]
    if "digits" not in session.datasets or not models or "int4-weight" not in session.passes:
        raise SystemExit(f"needs the digits dataset, one of {', '.join(MODELS)} and the int4-weight pass")
    examples = session.datasets.get("digits").load("test")
    examples = examples[: args.count] if args.count else examples
    rows = {}
    with tempfile.TemporaryDirectory(prefix="mmsdk-digits-") as work:
        for name in models:
            rows[name] = evaluate(session, name, list(examples), Path(work))
    results = {"environment": environment(), "questions": len(examples), "rows": rows}
    columns = [k for k in rows[models[0]] if not k.endswith("seconds")]
    table = "| model | " + " | ".join(columns) + " |\n|" + " --- |" * (len(columns) + 1) + "\n" + "\n".join(
        f"| {name} | " + " | ".join(f"{row[c]:.1%}" for c in columns) + " |" for name, row in rows.items())
    table += (f"\n\n{len(examples)} held-out digits questions, greedy, first word scored; INT4 = int4-weight "
              "(RTN, group 32, symmetric), the exported MatMulNBits copying its bytes.")
    print(table)
    write_results("ort_digits_accuracy", results, table, args.markdown)


if __name__ == "__main__":
    main()
