"""Progress bars for long work (calibration, export, evaluation, profiling), silent when not a terminal.

Bars go to stderr through rich and appear only when stderr is a terminal, so logs, pipes and CI
stay clean. ``MMSDK_PROGRESS=0`` turns them off, ``MMSDK_PROGRESS=1`` forces them on.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["PROGRESS_ENV", "progress", "progress_enabled", "track"]

PROGRESS_ENV = "MMSDK_PROGRESS"
T = TypeVar("T")


def progress_enabled() -> bool:
    """True when bars should be drawn: stderr is a terminal, unless MMSDK_PROGRESS says otherwise."""
    setting = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    return sys.stderr.isatty()


@contextmanager
def progress(description: str, total: float | None = None) -> Iterator[Callable[[float], None]]:
    """Yield ``advance(n)``: a bar of ``total`` steps while the block runs (a no-op when silent)."""
    if not progress_enabled():
        yield lambda _n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate ``items`` behind a progress bar (plain iteration when silent)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with progress(description, total) as advance:
        for item in items:
            yield item
            advance(1)
