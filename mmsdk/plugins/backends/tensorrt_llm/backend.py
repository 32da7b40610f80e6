"""The ``tensorrt-llm`` backend: Hugging Face folder (PyTorch backend) or trtllm-build checkpoint.

``export("tensorrt-llm", dir, target=..., trtllm_version=..., tp_size=..., pp_size=..., dtype=...)``.
``mmsdk.load(dir)`` gives the CPU reference of the export (``runtime="tensorrt_llm"`` asks for
TensorRT-LLM's own ``LLM`` instead, where it is installed). Nothing here imports tensorrt_llm
unless that runtime is requested.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, cast

import mmsdk
from mmsdk.core.backend import Backend, BackendOptions, ExportContext, ExportInfo
from mmsdk.core.errors import BackendUnavailableError, ConfigError
from mmsdk.core.manifest import Manifest
from mmsdk.core.registry import Registrar
from mmsdk.plugins.backends.tensorrt_llm import support
from mmsdk.plugins.backends.tensorrt_llm.checkpoint import plan_checkpoint, write_checkpoint
from mmsdk.plugins.backends.tensorrt_llm.kv_scales import kv_algorithm, kv_scales
from mmsdk.plugins.backends.tensorrt_llm.options import Resolved, TensorRTLLMOptions, resolve_target
from mmsdk.plugins.backends.tensorrt_llm.weights import read_language_model

__all__ = ["TensorRTLLMBackend", "TensorRTLLMOptions", "check_language_model"]

PROCESSOR_DIR = "processor"


class TensorRTLLMBackend:
    """Writes what TensorRT-LLM loads, checked against its formats without needing TensorRT-LLM."""

    name: ClassVar[str] = "tensorrt-llm"
    summary: ClassVar[str] = ("TensorRT-LLM: Hugging Face folder + hf_quant_config.json (LLM/trtllm-serve), or "
                              "trtllm-build checkpoint with TP/PP rank files and vision ONNX (<= 1.3)")
    options_cls: ClassVar[type[BackendOptions]] = TensorRTLLMOptions

    def _resolve(self, context: ExportContext, options: TensorRTLLMOptions) -> tuple[Any, str | None, Resolved]:
        family = support.family_of(context)
        kv_algo = kv_algorithm(context.pass_names(), options.int4_kv_fallback)
        resolved = resolve_target(options, family, kv_algo)
        support.check_passes(context, resolved.target)
        return family, kv_algo, resolved

    def check(self, context: ExportContext, options: BackendOptions) -> None:
        options = cast(TensorRTLLMOptions, options)  # the exporter validated it into options_cls
        family, kv_algo, resolved = self._resolve(context, options)
        check_language_model(context, options, family, kv_algo, resolved)

    def export(self, context: ExportContext, options: BackendOptions, staging: Path) -> ExportInfo:
        from mmsdk.plugins.backends.tensorrt_llm.runtime import host_details

        options = cast(TensorRTLLMOptions, options)
        family, kv_algo, resolved = self._resolve(context, options)
        lm = read_language_model(context)
        scales, calibrated = kv_scales(context, kv_algo, lm.num_layers) if kv_algo else ({}, False)
        details: dict[str, Any] = {"target": resolved.target, "trtllm_requirement": resolved.requirement,
                                   "kv_cache_quant_algo": kv_algo, "kv_scales_calibrated": calibrated,
                                   "kv_cache_from_int4": "int4-kv" in context.pass_names() and kv_algo is not None,
                                   "weights": "W4A16_AWQ" if lm.group_size() else options.dtype,
                                   "host": host_details(context.model, context.adapter, family.vision_model_type)}
        if resolved.target == "checkpoint":
            details.update(self._export_checkpoint(context, options, family, lm, kv_algo, scales, staging, resolved))
        else:
            details.update(self._export_hf(context, options, lm, kv_algo, scales, staging, resolved))
        return ExportInfo(details=details, requirements={"tensorrt-llm": resolved.requirement})

    def _export_checkpoint(self, context: ExportContext, options: TensorRTLLMOptions, family: Any, lm: Any,
                           kv_algo: str | None, scales: dict[int, float], staging: Path,
                           resolved: Resolved) -> dict[str, Any]:
        from mmsdk.plugins.backends.tensorrt_llm.readme import checkpoint_readme
        from mmsdk.plugins.backends.tensorrt_llm.runtime import LLM_DIR
        from mmsdk.plugins.backends.tensorrt_llm.vision_onnx import VISION_DIR, export_vision

        plan = plan_checkpoint(lm, family, options.tp_size, options.pp_size, options.dtype, kv_algo, scales)
        config = write_checkpoint(lm, plan, staging / LLM_DIR)
        vision = export_vision(context.model, context.adapter, family.vision_model_type, staging / VISION_DIR,
                               options.dtype, options.max_batch_size)
        vision["model_type"] = family.vision_model_type
        _save_processor(context, staging / PROCESSOR_DIR)
        readme = checkpoint_readme(context.source.name, config, vision, resolved.requirement, family.runner_note)
        (staging / "README.md").write_text(readme)
        return {"tp_size": plan.tp, "pp_size": plan.pp, "excluded_from_int4": list(plan.excluded), "vision": vision}

    def _export_hf(self, context: ExportContext, options: TensorRTLLMOptions, lm: Any, kv_algo: str | None,
                   scales: dict[int, float], staging: Path, resolved: Resolved) -> dict[str, Any]:
        from mmsdk.plugins.backends.tensorrt_llm.hf_export import write_hf
        from mmsdk.plugins.backends.tensorrt_llm.readme import hf_readme

        quant = write_hf(context, lm, staging, options.dtype, kv_algo, scales)
        model_type = getattr(context.model.config, "model_type", "")
        (staging / "README.md").write_text(hf_readme(context.source.name, quant, resolved.requirement, model_type))
        return {"hf_quant_config": quant or None}

    def load(self, path: Path, manifest: Manifest, **options: Any) -> Any:
        options.pop("session", None)
        runtime = options.pop("runtime", "reference")
        target = manifest.details.get("target")
        if runtime == "tensorrt_llm":
            return _tensorrt_llm(path, target, **options)
        if runtime != "reference":
            raise ConfigError(f"runtime={runtime!r} is not one of 'reference', 'tensorrt_llm'.",
                              fix="use runtime='reference' (CPU, no TensorRT-LLM) or runtime='tensorrt_llm'.")
        if target == "checkpoint":
            from mmsdk.plugins.backends.tensorrt_llm.runtime import ReferenceModel

            return ReferenceModel(path, manifest.details["host"])
        from mmsdk.plugins.backends.tensorrt_llm.hf_reload import load_hf_export

        return load_hf_export(path)


def check_language_model(context: ExportContext, options: TensorRTLLMOptions, family: Any, kv_algo: str | None,
                         resolved: Resolved) -> None:
    """Raise what writing the language model would raise (weights, KV scales, sharding, groups), writing nothing."""
    lm = read_language_model(context)
    if kv_algo is not None:
        kv_scales(context, kv_algo, lm.num_layers)
    if resolved.target == "checkpoint":
        plan_checkpoint(lm, family, options.tp_size, options.pp_size, options.dtype, kv_algo, {})
    else:
        lm.group_size()


def _save_processor(context: ExportContext, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    context.model.config.save_pretrained(folder)
    if context.processor is not None and hasattr(context.processor, "save_pretrained"):
        context.processor.save_pretrained(folder)


def _tensorrt_llm(path: Path, target: str | None, **options: Any) -> Any:
    try:
        from tensorrt_llm import LLM
    except ImportError as err:
        raise BackendUnavailableError(
            "tensorrt_llm is not installed (it needs an NVIDIA GPU and Linux).",
            fix="pip install 'mmsdk[trtllm]' on a GPU machine, or load with runtime='reference' on the CPU.",
        ) from err
    if target == "checkpoint":
        raise BackendUnavailableError(
            "a trtllm-build checkpoint must be built into engines before TensorRT-LLM can run it.",
            fix="follow the commands in the export's README.md (trtllm-build, trtexec, run.py).",
        )
    return LLM(model=str(path), **options)


@mmsdk.hookimpl
def mmsdk_register_backends(register: Registrar[Backend]) -> None:
    register(TensorRTLLMBackend())
