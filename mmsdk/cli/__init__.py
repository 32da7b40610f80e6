"""The ``mmsdk`` command: one module per verb, each exposing ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mmsdk.core.errors import MmsdkError

__all__ = ["VERBS", "build_parser", "main"]

# verb -> module under mmsdk.cli; each module has add_parser(subparsers) and run(args) -> int.
VERBS = ("plugins", "optimize", "run", "demo", "validate", "profile", "eval", "tune")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every verb's sub-parser."""
    from mmsdk import __version__

    parser = argparse.ArgumentParser(prog="mmsdk", description="Make multimodal LLMs small and fast to deploy.")
    parser.add_argument("--version", action="version", version=f"mmsdk {__version__}")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    subparsers.required = True
    for verb in VERBS:
        importlib.import_module(f"mmsdk.cli.{verb}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; mmsdk's own errors print their fix and exit with status 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except MmsdkError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
