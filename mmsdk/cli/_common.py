"""Helpers shared by CLI verbs: parsing pass lists, loading models, printing tables."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["add_model_arguments", "console", "print_table", "prompt_sample", "split_list"]


def add_model_arguments(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    """MODEL plus --apply / --adapter, as every verb that optimizes takes them."""
    parser.add_argument(
        "model", nargs=None if model_required else "?", metavar="MODEL",
        help="a local Hugging Face folder, builtin:NAME (trained, shipped) or tiny:FAMILY (random weights)",
    )
    parser.add_argument("--apply", default="", metavar="A,B", help="passes to apply, comma separated, in order")
    parser.add_argument("--adapter", default=None, help="force an adapter instead of auto-detecting one")


def prompt_sample(image: Any, prompt: str | None, session: Any, max_new_tokens: int = 8) -> Any:
    """The ProfileSample of ``--image`` / ``--prompt``, each one left out taken from the default sample (a digits
    test example, or a synthetic image)."""
    from mmsdk.profiling.measure import ProfileSample, resolve_sample
    from mmsdk.tasks import read_image

    image = read_image(image) if image is not None else None
    if image is not None and prompt:  # both given: the default sample (a dataset read) is not needed
        return ProfileSample(image, prompt, max_new_tokens)
    default = resolve_sample(None, session, max_new_tokens)
    return ProfileSample(image if image is not None else default.image, prompt or default.question, max_new_tokens)


def split_list(text: str | None) -> list[str]:
    """``"a, b(x=1, y=2),,c"`` -> ``["a", "b(x=1, y=2)", "c"]`` (a pass may carry its config in parentheses)."""
    from mmsdk.core.config import split_pass_list

    return split_pass_list(text)


def console() -> Any:
    """A rich console on stdout (plain text when stdout is not a terminal)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=not sys.stdout.isatty())


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a table with rich."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in header:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    console().print(table)
