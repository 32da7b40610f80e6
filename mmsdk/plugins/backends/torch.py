"""The ``torch`` backend: safetensors + config + processor, reloaded into the same optimized module.

Export writes the Hugging Face config, the optimized state dict and the processor. Load rebuilds
the unoptimized architecture from the config, replays every pass's structural change (its
``restore``, or ``apply`` for data-free passes), then loads the saved tensors strictly, so a
missing or unexpected tensor is an error rather than a silently random weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import mmsdk
from mmsdk.core.backend import Backend, BackendOptions, ExportContext, ExportInfo
from mmsdk.core.config import make_config
from mmsdk.core.errors import ArtifactIntegrityError, ExportError
from mmsdk.core.manifest import Manifest
from mmsdk.core.passes import PassContext
from mmsdk.core.registry import Registrar

WEIGHTS = "model.safetensors"
PROCESSOR_DIR = "processor"


class TorchOptions(BackendOptions):
    """The torch backend takes no options."""


class TorchBackend:
    """Writes the optimized torch model; ``mmsdk.load(dir)`` gives the same module back."""

    name: ClassVar[str] = "torch"
    summary: ClassVar[str] = "safetensors + config + processor; reloads into the optimized torch module"
    options_cls: ClassVar[type[BackendOptions]] = TorchOptions

    def check(self, context: ExportContext, options: BackendOptions) -> None:
        session = context.session
        for result in context.results:
            spec = session.passes.get(result.name)
            if spec.restore is None and spec.wants_calibration(result.config):
                raise ExportError(
                    f"pass {result.name!r} learns from data but gives no way to rebuild its modules on load, "
                    "so the torch export could not be reloaded.",
                    fix=f"ask the plugin {result.plugin!r} to provide PassSpec.restore, or export to another backend.",
                )

    def export(self, context: ExportContext, options: BackendOptions, staging: Path) -> ExportInfo:
        import safetensors.torch
        import torch
        import transformers

        model = context.model
        model.config.save_pretrained(staging)
        safetensors.torch.save_model(model, str(staging / WEIGHTS), metadata={"format": "pt"})
        if context.processor is not None and hasattr(context.processor, "save_pretrained"):
            context.processor.save_pretrained(staging / PROCESSOR_DIR)
        # The embedding table keeps the model's working dtype whatever passes did to other weights.
        dtype = str(context.adapter.embed_tokens(model).weight.dtype).removeprefix("torch.")
        return ExportInfo(
            details={"architecture": type(model).__name__, "dtype": dtype, "weights": WEIGHTS,
                     "exported_with": {"torch": torch.__version__, "transformers": transformers.__version__}},
            requirements={"torch": ">=2.6", "transformers": ">=5.0"},
        )

    def load(self, path: Path, manifest: Manifest, **options: Any) -> Any:
        import safetensors.torch
        import torch

        session = options.pop("session")
        with_processor = bool(options.pop("with_processor", False))
        dtype = getattr(torch, manifest.details.get("dtype", "float32"))
        model = _build_empty(path, manifest.details["architecture"], dtype)
        adapter = session.adapt(model, manifest.source.adapter)
        context = PassContext(adapter=adapter, session=session)
        for record in manifest.passes:
            spec = session.passes.get(record.name)
            config = make_config(spec.config_cls, record.config, what=f"pass {record.name!r} in {path}")
            if spec.restore is not None:
                spec.restore(model, config, record.records, context)
            else:
                spec.apply(model, config, context)
        missing, unexpected = safetensors.torch.load_model(model, str(path / WEIGHTS), strict=False)
        if missing or unexpected:
            raise ArtifactIntegrityError(
                f"{path}: the saved tensors do not fit the rebuilt model (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}).",
                fix="load it with the mmsdk version and plugins that exported it (see manifest.json), or re-export.",
            )
        model.eval()
        if not with_processor:
            return model
        from mmsdk.core.sources import LoadedModel, _load_processor

        return LoadedModel(model=model, processor=_load_processor(path / PROCESSOR_DIR), name=str(path))


def _build_empty(path: Path, architecture: str, dtype: Any) -> Any:
    import torch
    import transformers
    from transformers import AutoConfig

    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise ArtifactIntegrityError(
            f"{path} holds a {architecture}, which transformers {transformers.__version__} does not provide.",
            fix="install the transformers version recorded in manifest.json (details.exported_with).",
        )
    config = AutoConfig.from_pretrained(path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the saved dtype so passes restore mixed-precision modules as saved
    try:
        return cls(config)
    finally:
        torch.set_default_dtype(previous)


@mmsdk.hookimpl
def mmsdk_register_backends(register: Registrar[Backend]) -> None:
    register(TorchBackend())
