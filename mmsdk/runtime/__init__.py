"""mmsdk's ONNX Runtime runtime: load an export folder and generate (``mmsdk.runtime.load(dir)``).

Importing this package does not import onnxruntime; opening a folder does.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmsdk.runtime.pipeline import OrtPipeline

__all__ = ["load"]


def load(path: str | Path, **options: Any) -> OrtPipeline:
    """Verify ``path`` against its manifest (sha256 of every file) and open its sessions.

    ``options``: ``providers`` (tuple of execution providers), ``intra_op_threads``, ``inter_op_threads``.
    """
    from mmsdk.core.errors import ExportError
    from mmsdk.core.exporting import load as load_export
    from mmsdk.core.manifest import Manifest

    manifest = Manifest.read(Path(path))
    if manifest.backend != "onnxruntime":
        raise ExportError(
            f"{path} was exported for the {manifest.backend!r} backend, not onnxruntime.",
            fix="load it with mmsdk.load(path), which picks the backend that wrote it.",
        )
    return load_export(path, **options)
