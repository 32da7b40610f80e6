"""Export an optimized model through a backend into a verified folder, and load such folders back."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmsdk.core.config import make_config
from mmsdk.core.fileio import atomic_output_dir
from mmsdk.core.manifest import Manifest, PassRecord, hash_folder

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext, ExportResult
    from mmsdk.core.passes import PassResult
    from mmsdk.core.session import Session

__all__ = ["default_output_path", "export", "load", "merged_calibration", "pass_records"]


def default_output_path(model_name: str) -> Path:
    """``./mmsdk-out/<model name made safe for a folder>``."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip("-") or "model"
    return Path("mmsdk-out") / safe


def pass_records(context: ExportContext) -> list[PassRecord]:
    """The manifest's view of every applied pass."""
    return [
        PassRecord(
            name=r.name,
            kind=r.kind,
            plugin=r.plugin,
            config=r.config_dict(),
            records=r.records,
            bytes_before=r.bytes_before,
            bytes_after=r.bytes_after,
            seconds=round(r.seconds, 4),
        )
        for r in context.results
    ]


def merged_calibration(results: Sequence[PassResult]) -> dict[str, Any] | None:
    """The calibration record of an export: every pass's ``records["calibration"]`` sections, in order.

    A section (top-level key) written by a later pass replaces the same section of an earlier one.
    """
    merged: dict[str, Any] = {}
    for result in results:
        section = result.records.get("calibration")
        if isinstance(section, Mapping):
            merged.update(section)
    return merged or None


def export(
    context: ExportContext,
    backend_name: str,
    path: Path,
    *,
    overwrite: bool = False,
    options: Mapping[str, Any] | None = None,
    calibration: Mapping[str, Any] | None = None,
) -> ExportResult:
    """Check, write into a staging folder, hash, write the manifest, then rename into ``path``."""
    from mmsdk import __version__
    from mmsdk.core.backend import ExportResult
    from mmsdk.progress import progress
    from mmsdk.telemetry import span

    backend = context.session.backends.get(backend_name)
    typed = make_config(backend.options_cls, options or {}, what=f"backend {backend_name!r}")
    backend.check(context, typed)
    with (
        span("mmsdk.export", backend=backend_name, path=str(path), passes=context.pass_names()),
        progress(f"exporting for {backend_name}"),
        atomic_output_dir(Path(path), overwrite=overwrite) as staging,
    ):
        info = backend.export(context, typed, staging)
        manifest = Manifest(
            mmsdk_version=__version__,
            backend=backend_name,
            backend_options=typed.model_dump(mode="json"),
            source=context.source,
            passes=pass_records(context),
            calibration=dict(calibration) if calibration else None,
            details=dict(info.details),
            requirements=dict(info.requirements),
            files=hash_folder(staging),
        )
        manifest.write(staging)
    return ExportResult(path=Path(path), manifest=manifest, backend=backend_name)


def load(path: str | Path, *, session: Session | None = None, **options: Any) -> Any:
    """Verify an export folder against its manifest and load it with the backend that wrote it."""
    from mmsdk.core.session import Session

    folder = Path(path)
    manifest = Manifest.read(folder)
    session = session or Session.create()
    backend = session.backends.get(manifest.backend)
    own_check = getattr(backend, "verify", None)
    if own_check is not None:  # a backend's own consistency check names its problem better than a hash mismatch
        own_check(folder, manifest)
    manifest.verify(folder)
    return backend.load(folder, manifest, session=session, **options)
