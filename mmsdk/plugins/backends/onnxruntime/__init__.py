"""The ``onnxruntime`` backend: vision.onnx + embedding.onnx + decoder.onnx, and the runtime that runs them.

Registering this plugin imports neither onnxruntime nor onnx; they load when an export or a
load happens, and a missing install is a BackendUnavailableError naming ``mmsdk[ort]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import mmsdk
from mmsdk.core.backend import Backend, BackendOptions, ExportContext, ExportInfo, LowerTarget
from mmsdk.plugins.backends.onnxruntime.options import OrtOptions

if TYPE_CHECKING:
    from mmsdk.core.manifest import Manifest
    from mmsdk.core.registry import Registrar

__all__ = ["OnnxRuntimeBackend", "OrtOptions"]


class OnnxRuntimeBackend:
    """Exports for ONNX Runtime (and ORT GenAI's layout where supported); loads into an OrtPipeline."""

    name: ClassVar[str] = "onnxruntime"
    summary: ClassVar[str] = (
        "vision/embedding/decoder ONNX graphs (GroupQueryAttention, MatMulNBits, fused RMSNorm/RoPE), "
        "zero-copy ORT runtime, ORT GenAI layout for Qwen2.5-VL"
    )
    options_cls: ClassVar[type[BackendOptions]] = OrtOptions

    def check(self, context: ExportContext, options: BackendOptions) -> None:
        from mmsdk.plugins.backends.onnxruntime.checks import make_plan, require_runtime

        require_runtime()
        assert isinstance(options, OrtOptions)
        make_plan(context, options)

    def export(self, context: ExportContext, options: BackendOptions, staging: Path) -> ExportInfo:
        from mmsdk.plugins.backends.onnxruntime.export import export_folder

        assert isinstance(options, OrtOptions)
        return export_folder(context, options, staging)

    def load(self, path: Path, manifest: Manifest, **options: Any) -> Any:
        from mmsdk.runtime.pipeline import OrtPipeline
        from mmsdk.runtime.sessions import SessionConfig

        options.pop("session", None)
        config = SessionConfig(**options) if options else None
        return OrtPipeline.from_folder(path, manifest, config)


@mmsdk.hookimpl
def mmsdk_register_backends(register: Registrar[Backend]) -> None:
    register(OnnxRuntimeBackend())


@mmsdk.hookimpl
def mmsdk_lower(module: Any, target: LowerTarget) -> Any:
    """Built-in lowering for this backend: modules exposing MatMulNBits-layout ``packed()`` weights."""
    if target.backend != OnnxRuntimeBackend.name:
        return None
    from mmsdk.plugins.backends.onnxruntime.lowering import nbits_from_packed

    return nbits_from_packed(module)
