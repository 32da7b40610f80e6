"""The manifest written next to every artifact, and its verification on load."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mmsdk.core.errors import ArtifactIntegrityError

__all__ = ["MANIFEST_NAME", "FileEntry", "Manifest", "PassRecord", "SourceModel", "hash_folder", "sha256_of"]

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FileEntry(_Frozen):
    """One file of the artifact, relative to its folder."""

    path: str
    sha256: str
    bytes: int


class SourceModel(_Frozen):
    """The model the artifact was made from."""

    name: str = Field(description="Source name (tiny:llava), folder, or class name.")
    architecture: str
    adapter: str
    family: str
    description: dict[str, Any] = Field(default_factory=dict)


class PassRecord(_Frozen):
    """One applied pass as the manifest records it."""

    name: str
    kind: str
    plugin: str
    config: dict[str, Any]
    records: dict[str, Any] = Field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0


class Manifest(_Frozen):
    """Everything needed to trust and reload an export folder."""

    format: Literal["mmsdk-artifact"] = "mmsdk-artifact"
    schema_version: int = SCHEMA_VERSION
    mmsdk_version: str
    created_utc: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    backend: str
    backend_options: dict[str, Any] = Field(default_factory=dict)
    source: SourceModel
    passes: list[PassRecord] = Field(default_factory=list)
    calibration: dict[str, Any] | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    requirements: dict[str, str] = Field(default_factory=dict)
    files: list[FileEntry] = Field(default_factory=list)

    def write(self, folder: Path) -> Path:
        """Write ``manifest.json`` into ``folder`` and return its path."""
        path = folder / MANIFEST_NAME
        path.write_text(self.model_dump_json(indent=2) + "\n")
        return path

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """Read ``folder/manifest.json``; a missing or malformed manifest is an ArtifactIntegrityError."""
        path = Path(folder) / MANIFEST_NAME
        if not path.is_file():
            raise ArtifactIntegrityError(
                f"{folder} has no {MANIFEST_NAME}, so it is not an mmsdk export (or it was damaged).",
                fix="point at the folder that Optimizer.export() or `mmsdk optimize` wrote.",
            )
        try:
            data = json.loads(path.read_text())
            return cls.model_validate(data)
        except (json.JSONDecodeError, ValidationError) as err:
            raise ArtifactIntegrityError(
                f"{path} is not a valid mmsdk manifest: {err}.",
                fix="re-export the model; manifests are written by mmsdk and should not be edited.",
            ) from err

    def verify(self, folder: Path) -> None:
        """Check that ``folder`` holds exactly the manifest's files with their hashes."""
        folder = Path(folder)
        for entry in self.files:
            path = folder / entry.path
            if not path.is_file():
                raise ArtifactIntegrityError(
                    f"{folder}: file {entry.path!r} listed in the manifest is missing.",
                    fix="restore the file from the original export, or re-export the model.",
                )
            if sha256_of(path) != entry.sha256:
                raise ArtifactIntegrityError(
                    f"{folder}: file {entry.path!r} was changed after export (sha256 mismatch).",
                    fix="restore the original file or re-export; mmsdk refuses artifacts it cannot trust.",
                )
        listed = {entry.path for entry in self.files} | {MANIFEST_NAME}
        extra = sorted(p for p in _relative_files(folder) if p not in listed)
        if extra:
            raise ArtifactIntegrityError(
                f"{folder}: files not listed in the manifest: {', '.join(extra[:5])}.",
                fix="remove the files that were added after export, or re-export.",
            )


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def hash_folder(folder: Path) -> list[FileEntry]:
    """FileEntry for every file under ``folder`` (the manifest excluded), sorted by path."""
    return [
        FileEntry(path=rel, sha256=sha256_of(folder / rel), bytes=(folder / rel).stat().st_size)
        for rel in sorted(_relative_files(folder))
        if rel != MANIFEST_NAME
    ]


def _relative_files(folder: Path) -> list[str]:
    return [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
