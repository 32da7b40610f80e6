"""Size of decoder.onnx + its weights: INT4 (MatMulNBits) against the float16 export of the same model.

    python benchmarks/ort_size.py [--markdown docs/benchmarks.md]

Goal: INT4 <= 30% of float16. INT4 here = every decoder linear and the LM head in 4 bits (group
--block, float16 scales), embedding table in embedding.onnx (not counted, as for float16).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import environment, mid_llava, rtn_int4, write_results  # noqa: E402

FILES = ("decoder.onnx", "decoder.onnx.data")


def export_bytes(loaded: Any, folder: Path, **options: Any) -> int:
    from mmsdk import Optimizer

    Optimizer(loaded.model, loaded.processor).export("onnxruntime", folder, verify=False, **options)
    return sum((folder / name).stat().st_size for name in FILES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()

    from mmsdk.core.session import Session

    shape = dict(hidden=args.hidden, layers=args.layers, heads=16, kv_heads=4, intermediate=2816, vocab=args.vocab)
    work = Path(tempfile.mkdtemp(prefix="mmsdk-size-"))
    rows: dict[str, Any] = {}
    try:
        base = mid_llava(**shape)
        rows["float32"] = {"bytes": export_bytes(base, work / "fp32")}
        rows["float16"] = {"bytes": export_bytes(base, work / "fp16", dtype="float16")}
        for block in (32, 64, 128):
            loaded = mid_llava(**shape)
            quantizer = rtn_int4(loaded.model, Session.create(autoload=False).adapt(loaded.model), block)
            rows[f"INT4 group {block}, float16 scales"] = {
                "bytes": export_bytes(loaded, work / f"int4_{block}", dtype="float16"), "quantizer": quantizer}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    reference = rows["float16"]["bytes"]
    for row in rows.values():
        row["of_float16"] = round(row["bytes"] / reference, 4)
    results = {"environment": environment(), "model": shape, "rows": rows}
    table = "| decoder export | bytes (decoder.onnx + .data) | of float16 |\n| --- | --- | --- |\n" + "\n".join(
        f"| {name} | {row['bytes']:,} | {row['of_float16']:.1%} |" for name, row in rows.items())
    table += (f"\n\nLlama decoder hidden {args.hidden}, {args.layers} layers, 16/4 heads, MLP 2816, vocab {args.vocab}; "
              f"INT4 by: {rows['INT4 group 64, float16 scales']['quantizer']}.")
    print(table)
    write_results("ort_size", results, table, args.markdown)


if __name__ == "__main__":
    main()
