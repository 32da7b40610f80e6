"""The ``dual`` backend: vision on ONNX Runtime and the language model on TensorRT-LLM, one pipeline manifest.

``Optimizer(model).apply("recipe:default").export("dual", dir)`` writes ``vision/`` (the onnxruntime
backend's vision graph: tower + projector with pruning / merging traced in), ``llm/`` (the
tensorrt-llm backend's writer, target chosen by the same options) and a manifest holding the shared
calibration, the hand-off contract, each runtime's version requirement and the hash of each half.
``mmsdk.load(dir)`` returns a :class:`~mmsdk.runtime.dual.DualPipeline`. Registering this plugin
imports neither onnxruntime nor tensorrt_llm.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import mmsdk
from mmsdk.core.backend import Backend, BackendOptions, ExportContext, ExportInfo
from mmsdk.plugins.backends.dual.options import DualOptions

if TYPE_CHECKING:
    from mmsdk.core.manifest import Manifest
    from mmsdk.core.registry import Registrar

__all__ = ["DualBackend", "DualOptions"]


class DualBackend:
    """Splits an optimized model into an ONNX Runtime vision half and a TensorRT-LLM language-model half."""

    name: ClassVar[str] = "dual"
    summary: ClassVar[str] = ("vision/ on ONNX Runtime + llm/ on TensorRT-LLM with one pipeline manifest (shared "
                              "calibration, hand-off contract, hashes); stage-scheduled, double-buffered runtime")
    options_cls: ClassVar[type[BackendOptions]] = DualOptions

    def check(self, context: ExportContext, options: BackendOptions) -> None:
        from mmsdk.plugins.backends.dual.split import plan_split

        plan_split(context, cast(DualOptions, options))

    def export(self, context: ExportContext, options: BackendOptions, staging: Path) -> ExportInfo:
        from mmsdk.plugins.backends.dual.export import export_dual

        return export_dual(context, cast(DualOptions, options), staging)

    def verify(self, path: Path, manifest: Manifest) -> None:
        """Refuse halves from different exports (model, calibration) before the file-by-file hash check."""
        from mmsdk.plugins.backends.dual.stamps import check_halves

        check_halves(Path(path), manifest.details)

    def load(self, path: Path, manifest: Manifest, **options: Any) -> Any:
        from mmsdk.runtime.dual import DualPipeline

        options.pop("session", None)
        return DualPipeline.from_folder(path, manifest, **options)


@mmsdk.hookimpl
def mmsdk_register_backends(register: Registrar[Backend]) -> None:
    register(DualBackend())
