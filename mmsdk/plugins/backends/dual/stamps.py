"""What ties the two halves of a dual folder together: one export id, one source, one calibration.

Each half carries ``half.json`` (written with it, hashed with it); the pipeline manifest repeats
those stamps and a tree hash of each half. Loading compares them before anything runs, so halves
copied in from different exports (another model, another calibration) are refused by name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmsdk.core.errors import ArtifactIntegrityError
from mmsdk.core.manifest import sha256_of

__all__ = ["CALIBRATION", "HALVES", "STAMP", "calibration_digest", "check_halves", "tree_hash", "write_stamp"]

HALVES = ("vision", "llm")
STAMP = "half.json"
CALIBRATION = "calibration.json"


def calibration_digest(record: Mapping[str, Any] | None) -> str | None:
    """sha256 of the calibration record in canonical JSON (None: nothing was calibrated)."""
    if not record:
        return None
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tree_hash(folder: Path) -> str:
    """sha256 over the relative path and sha256 of every file under ``folder``, in path order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder).as_posix()}\0{sha256_of(path)}\n".encode())
    return digest.hexdigest()


def write_stamp(folder: Path, half: str, stamp: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``folder/half.json`` and return what was written."""
    data = {"half": half, **stamp}
    (folder / STAMP).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data


def check_halves(folder: Path, details: Mapping[str, Any]) -> None:
    """Refuse a dual folder whose halves, or whose manifest, disagree on export, source or calibration."""
    expected = details.get("stamp") or {}
    stamps = {}
    for half in HALVES:
        path = folder / half / STAMP
        if not path.is_file():
            raise ArtifactIntegrityError(f"{folder}: {half}/{STAMP} is missing, so this half cannot be matched.",
                                         fix="restore the folder written by export('dual', ...), or re-export it.")
        stamps[half] = json.loads(path.read_text())
    for key, what in (("source", "model"), ("calibration_sha256", "calibration"), ("export_id", "export")):
        values = {half: stamps[half].get(key) for half in HALVES}
        if len({json.dumps(v, sort_keys=True) for v in (*values.values(), expected.get(key))}) > 1:
            raise ArtifactIntegrityError(
                f"{folder}: the two halves were exported from different {what}s "
                f"(vision/: {_short(values['vision'])}, llm/: {_short(values['llm'])}, "
                f"pipeline manifest: {_short(expected.get(key))}); their hand-off and shared scales would not match.",
                fix="export both halves together with export('dual', ...) from one optimized model, and do not mix "
                "vision/ and llm/ folders of different exports.",
            )
    for half in HALVES:
        recorded = (details.get("hashes") or {}).get(half)
        if recorded != tree_hash(folder / half):
            raise ArtifactIntegrityError(
                f"{folder}: {half}/ does not match the hash the pipeline manifest records for it.",
                fix="restore the original files of that half, or re-export the dual folder.",
            )


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."
