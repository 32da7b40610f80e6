"""Export options of the ``tensorrt-llm`` backend and the choice between its two targets.

Target ``hf`` (target B in specs/tensorrt-llm.md): a Hugging Face folder plus ``hf_quant_config.json``
for ``LLM(model=dir)`` / ``trtllm-serve dir``, TensorRT-LLM's PyTorch backend (1.0 and later).
Target ``checkpoint`` (target A): ``config.json`` + ``rank{N}.safetensors`` for ``trtllm-build``,
which TensorRT-LLM removed after the 1.3 releases, plus the vision tower as ONNX.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator

from mmsdk.core.backend import BackendOptions
from mmsdk.core.errors import ConfigError, ExportError
from mmsdk.plugins.backends.tensorrt_llm.families import Family

__all__ = ["CHECKPOINT_REMOVED_IN", "Resolved", "TensorRTLLMOptions", "parse_version", "resolve_target"]

# The TensorRT engine backend (trtllm-build) left TensorRT-LLM's main branch in June-July 2026, after
# the 1.3 release candidates; 1.4 is the first release line assumed not to ship it.
CHECKPOINT_REMOVED_IN = (1, 4)
PYTORCH_BACKEND_SINCE = (1, 0)
_ALIASES = {"A": "checkpoint", "B": "hf", "a": "checkpoint", "b": "hf"}


class TensorRTLLMOptions(BackendOptions):
    """Options of ``export("tensorrt-llm", ...)``."""

    target: Literal["auto", "hf", "checkpoint"] = Field(
        "auto",
        description="'hf': Hugging Face folder for LLM()/trtllm-serve (PyTorch backend); 'checkpoint': "
        "rank files for trtllm-build (TensorRT-LLM <= 1.3); 'auto' picks from the model, passes and version. "
        "'A'/'B' are accepted as aliases of 'checkpoint'/'hf'.",
    )
    trtllm_version: str | None = Field(
        None, description="The TensorRT-LLM release you deploy on, e.g. '1.2.0'; None means a current one."
    )
    tp_size: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks (checkpoint target).")
    pp_size: int = Field(1, ge=1, le=64, description="Pipeline-parallel ranks (checkpoint target).")
    dtype: Literal["float16", "bfloat16", "float32"] = Field("float16", description="Dtype of unquantized weights.")
    max_batch_size: int = Field(4, ge=1, description="Images per vision-engine call (README and vision/config.json).")
    int4_kv_fallback: Literal["error", "int8", "fp8"] = Field(
        "error", description="TensorRT-LLM has no INT4 KV cache: 'int8'/'fp8' store an int4-kv model's cache in "
        "that format instead (scaled from the same calibrated ranges); 'error' refuses.",
    )

    @field_validator("target", mode="before")
    @classmethod
    def _alias(cls, value: object) -> object:
        return _ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("trtllm_version")
    @classmethod
    def _version(cls, value: str | None) -> str | None:
        if value is not None:
            parse_version(value)
        return value


@dataclass(frozen=True)
class Resolved:
    """The target an export will write, and the TensorRT-LLM versions that load it."""

    target: Literal["hf", "checkpoint"]
    requirement: str
    reason: str


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a TensorRT-LLM version string such as '1.2.0rc3'."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)", text)
    if not match:
        raise ConfigError(
            f"trtllm_version {text!r} is not a version number.",
            fix="write it like '1.2.0' or '0.21' (pip show tensorrt-llm prints yours).",
        )
    return int(match[1]), int(match[2])


def resolve_target(options: TensorRTLLMOptions, family: Family, kv_algo: str | None) -> Resolved:
    """Pick (or check) the target for this model, KV format and TensorRT-LLM version."""
    version = parse_version(options.trtllm_version) if options.trtllm_version else None
    has_build = version is None or version < CHECKPOINT_REMOVED_IN
    has_pytorch = version is None or version >= PYTORCH_BACKEND_SINCE
    target = options.target
    if target == "auto":
        hf_ok = family.target_b and kv_algo != "INT8" and has_pytorch and options.tp_size == options.pp_size == 1
        target = "hf" if hf_ok or not has_build else "checkpoint"
    if target == "checkpoint":
        _check_checkpoint(options, has_build)
        return Resolved("checkpoint", _requirement(version, upper=True), "trtllm-build checkpoint")
    _check_hf(options, family, kv_algo, has_pytorch)
    return Resolved("hf", _requirement(version, upper=False), "Hugging Face folder for the PyTorch backend")


def _requirement(version: tuple[int, int] | None, *, upper: bool) -> str:
    if version is not None:
        return f"tensorrt-llm=={version[0]}.{version[1]}.*"
    if upper:
        return f"tensorrt-llm>=0.20,<{CHECKPOINT_REMOVED_IN[0]}.{CHECKPOINT_REMOVED_IN[1]}"
    return f"tensorrt-llm>={PYTORCH_BACKEND_SINCE[0]}.{PYTORCH_BACKEND_SINCE[1]}"


def _check_checkpoint(options: TensorRTLLMOptions, has_build: bool) -> None:
    if not has_build:
        removed = ".".join(map(str, CHECKPOINT_REMOVED_IN))
        raise ExportError(
            f"TensorRT-LLM {options.trtllm_version} no longer ships trtllm-build (the TensorRT engine backend was "
            f"removed; {removed} and later have only the PyTorch backend), so target='checkpoint' cannot be built.",
            fix="use target='hf' (LLM(model=dir) / trtllm-serve dir), or pin trtllm_version to a release "
            "that still has trtllm-build (1.2 or earlier).",
        )


def _check_hf(options: TensorRTLLMOptions, family: Family, kv_algo: str | None, has_pytorch: bool) -> None:
    if not family.target_b:
        raise ExportError(
            f"TensorRT-LLM's PyTorch backend does not run {family.architecture} (not in its multimodal model list).",
            fix="export with target='checkpoint' and a TensorRT-LLM release that still ships trtllm-build "
            "(trtllm_version='1.2.0'), or export to ONNX Runtime.",
        )
    if not has_pytorch:
        raise ExportError(
            f"TensorRT-LLM {options.trtllm_version} predates the PyTorch backend's LLM(model=<hf folder>) loading.",
            fix="use target='checkpoint' for this version, or upgrade TensorRT-LLM to 1.0 or later.",
        )
    if kv_algo == "INT8":
        raise ExportError(
            "TensorRT-LLM's PyTorch backend has no INT8 KV cache (its KV formats are auto, fp8 and nvfp4).",
            fix="apply 'fp8-kv' instead of 'int8-kv' for target='hf', or keep int8-kv and export "
            "target='checkpoint' with trtllm_version='1.2.0'.",
        )
    if options.tp_size != 1 or options.pp_size != 1:
        raise ExportError(
            f"tp_size={options.tp_size}, pp_size={options.pp_size} only apply to target='checkpoint': the PyTorch "
            "backend shards the Hugging Face weights itself when it loads them.",
            fix="drop tp_size/pp_size and pass them at run time (LLM(model=dir, tensor_parallel_size=N) or "
            "trtllm-serve dir --tp_size N), or export target='checkpoint'.",
        )
