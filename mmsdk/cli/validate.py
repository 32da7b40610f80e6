"""``mmsdk validate DIR``: check a TensorRT-LLM export without TensorRT-LLM (exit status 1 on errors)."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check a TensorRT-LLM export (checkpoint, Hugging Face folder or vision ONNX) without TensorRT-LLM",
        description="Check config fields, tensor names, shapes, dtypes, values and divisibility of a "
        "TensorRT-LLM export against the formats TensorRT-LLM loads. Exit status 1 when there are errors.",
    )
    parser.add_argument("dir", metavar="DIR", help="an mmsdk export folder, a checkpoint folder (config.json + "
                                                   "rank*.safetensors), a Hugging Face folder or a vision folder")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the validator on ``args.dir``; print the report; return the exit status."""
    from mmsdk.plugins.backends.tensorrt_llm.validate import validate

    report = validate(args.dir)
    if args.json:
        print(json.dumps({"path": str(report.path), "kind": report.kind, "ok": report.ok, "checked": report.checked,
                          "findings": [{"level": f.level, "where": f.where, "message": f.message}
                                       for f in report.findings]}, indent=2))
    else:
        print(report.summary())
    return 0 if report.ok else 1
