"""The Backend protocol (export targets and their runtimes), its inputs and what an export returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from mmsdk.core.config import PassConfig

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.manifest import Manifest, SourceModel
    from mmsdk.core.passes import PassResult
    from mmsdk.core.session import Session

__all__ = ["Backend", "BackendOptions", "ExportContext", "ExportInfo", "ExportResult", "LowerTarget"]


class BackendOptions(PassConfig):
    """Base class of a backend's typed export options (frozen, unknown fields refused)."""


@dataclass(frozen=True)
class LowerTarget:
    """What a backend passes to the ``mmsdk_lower`` hook: which backend asks, with which options."""

    backend: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportContext:
    """Everything a backend needs: the optimized model, its adapter, and what every pass did."""

    model: nn.Module
    adapter: ModelAdapter
    results: tuple[PassResult, ...]
    source: SourceModel
    session: Session
    processor: Any = None
    calibration: Mapping[str, Any] | None = None  # the merged calibration record (Manifest.calibration)

    def pass_names(self) -> list[str]:
        """Names of the passes applied, in order."""
        return [result.name for result in self.results]

    def result(self, name: str) -> PassResult | None:
        """The result of pass ``name``, or None if it was not applied."""
        return next((r for r in self.results if r.name == name), None)


@dataclass(frozen=True)
class ExportInfo:
    """What a backend tells the manifest about the files it wrote."""

    details: Mapping[str, Any] = field(default_factory=dict)
    requirements: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportResult:
    """Where an export went and the manifest written beside it."""

    path: Path
    manifest: Manifest
    backend: str

    def __fspath__(self) -> str:
        return str(self.path)


@runtime_checkable
class Backend(Protocol):
    """An export target: writes a folder from an optimized model and loads it back for inference."""

    name: ClassVar[str]
    summary: ClassVar[str]
    options_cls: ClassVar[type[BackendOptions]]

    def check(self, context: ExportContext, options: BackendOptions) -> None:
        """Raise a clear error if this backend cannot express the model and its passes; write nothing."""

    def export(self, context: ExportContext, options: BackendOptions, staging: Path) -> ExportInfo:
        """Write the artifact files into ``staging`` (a fresh empty folder).

        The caller hashes every file, writes ``manifest.json`` and renames ``staging`` into place,
        so a failed export leaves nothing behind.
        """

    def load(self, path: Path, manifest: Manifest, **options: Any) -> Any:
        """Load a verified export folder; the return value is the backend's runtime object.

        A backend may also define ``verify(path, manifest)``: ``mmsdk.load`` calls it before the
        file-by-file hash check, so the backend can refuse an inconsistent folder by its own rules
        (the ``dual`` backend: halves from different exports) with a message that says so.
        """
