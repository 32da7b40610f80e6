"""Writing folders and files atomically: build in a hidden sibling, then rename into place."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mmsdk.core.errors import OutputExistsError

__all__ = ["atomic_output_dir", "check_output_dir", "write_json_atomically"]


def check_output_dir(path: Path, *, overwrite: bool) -> None:
    """Refuse an existing non-empty folder (or a file) at ``path`` unless ``overwrite`` is True."""
    if path.exists() and not path.is_dir():
        raise OutputExistsError(
            f"{path} exists and is a file, not a folder.", fix="choose another output path or remove the file."
        )
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputExistsError(
            f"output folder {path} exists and is not empty.",
            fix="choose an empty or new folder, or pass overwrite=True (CLI: --overwrite) to replace it.",
        )


@contextmanager
def atomic_output_dir(path: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces ``path``, on error it is deleted.

    Nothing half-written is ever left at ``path``: readers see the old folder or the new one.
    """
    path = Path(path).absolute()
    check_output_dir(path, overwrite=overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.staging-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if path.exists():
        trash = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(path, trash)
        os.replace(staging, path)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, path)


def write_json_atomically(path: Path, data: Any) -> Path:
    """``data`` as indented JSON at ``path``, written to a temporary file beside it and renamed into place (its
    folder made if missing), so a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                     delete=False) as handle:
        try:
            json.dump(data, handle, indent=1)
        except BaseException:
            handle.close()
            os.unlink(handle.name)
            raise
    os.replace(handle.name, path)
    return path
