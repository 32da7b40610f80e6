"""The validator's checks of a target-B folder: architecture, hf_quant_config.json and the tensors
TensorRT-LLM's PyTorch backend reads (specs/tensorrt-llm.md 4.2-4.4)."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmsdk.plugins.backends.tensorrt_llm.validate import ValidationReport

__all__ = ["PYTORCH_VLMS", "check_hf"]

PYTORCH_VLMS = {"LlavaNextForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                "Qwen2_5_VLForConditionalGeneration"}
HF_QUANT_ALGOS = {"FP8", "NVFP4", "W4A8_AWQ", "W4A16_AWQ", "W8A16", "W8A8_SQ_PER_CHANNEL", "FP8_PER_CHANNEL_PER_TOKEN",
                  "NVFP4_AWQ", "W4A8_NVFP4_FP8", "W4A8_MXFP4_FP8", "MIXED_PRECISION", "FP8_BLOCK_SCALES", None}
HF_KV_ALGOS = {"FP8", "NVFP4", "NVFP4_AFFINE", None}
QUANT_FIELDS = {"quant_algo", "kv_cache_quant_algo", "group_size", "has_zero_point", "pre_quant_scale",
                "exclude_modules"}
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "visual.", "model.visual.", "model.vision_tower.",
                   "model.multi_modal_projector.")
FUSED_INPUTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
DTYPE_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def check_hf(folder: Path, config: dict[str, Any], report: ValidationReport) -> None:
    """Check a Hugging Face folder meant for ``LLM(model=folder)``."""
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in PYTORCH_VLMS:
        report.error("config.json", f"architecture {architecture!r} is not a VLM TensorRT-LLM's PyTorch backend runs "
                                    f"({sorted(PYTORCH_VLMS)})")
    quant = _quant_section(folder, report)
    dtype = DTYPE_CODES.get(str(config.get("dtype") or config.get("torch_dtype")))
    if dtype is None:
        report.error("config.json", f"dtype {config.get('dtype')!r} is not float16, bfloat16 or float32")
    tensors = _tensors(folder)
    if not tensors:
        report.error(str(folder), "no *.safetensors weights")
        return
    _check_tensors(tensors, quant, dtype, report)
    report.checked.append(f"{len(tensors)} tensors: names, shapes, dtypes, values")


def _quant_section(folder: Path, report: ValidationReport) -> dict[str, Any]:
    path = folder / "hf_quant_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        quant = data["quantization"]
    except (ValueError, KeyError, TypeError):
        report.error(path.name, "must be JSON with a 'quantization' object")
        return {}
    unknown = set(data) - {"producer", "quantization"}
    unknown_fields = set(quant) - QUANT_FIELDS
    if unknown or unknown_fields:
        report.error(path.name, f"unknown keys {sorted(unknown | unknown_fields)}")
    if quant.get("quant_algo") not in HF_QUANT_ALGOS:
        report.error(path.name, f"quant_algo {quant.get('quant_algo')!r} is not a ModelOpt algorithm")
    if quant.get("kv_cache_quant_algo") not in HF_KV_ALGOS:
        report.error(path.name, f"kv_cache_quant_algo {quant.get('kv_cache_quant_algo')!r}: the PyTorch backend "
                                "takes FP8 or NVFP4 (no INT8, no INT4 KV cache)")
    if quant.get("quant_algo") == "W4A16_AWQ" and quant.get("group_size") not in (64, 128):
        report.error(path.name, f"group_size {quant.get('group_size')!r} must be 64 or 128 for W4A16_AWQ")
    report.checked.append("hf_quant_config.json")
    return quant


def _tensors(folder: Path) -> dict[str, tuple[list[int], str, Any]]:
    from safetensors import safe_open

    out: dict[str, tuple[list[int], str, Any]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                sl = handle.get_slice(key)
                out[key] = (list(sl.get_shape()), sl.get_dtype(), handle.get_tensor(key))
    return out


def _excluded(module: str, quant: dict[str, Any]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in quant.get("exclude_modules") or [])


def _check_tensors(tensors: dict[str, tuple[list[int], str, Any]], quant: dict[str, Any], dtype: str | None,
                   report: ValidationReport) -> None:
    import torch

    algo, kv = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    group = int(quant.get("group_size") or 128)
    for key, (shape, code, value) in tensors.items():
        module = key.rsplit(".", 1)[0]
        if code in ("U8", "I8") and key.endswith(".weight"):
            _check_int4(key, shape, tensors, group, dtype, algo, report)
            if key.startswith(VISION_PREFIXES):
                report.error(key, "the vision tower must stay in full precision for TensorRT-LLM")
        elif key.endswith((".k_scale", ".v_scale")):
            if code != "F32" or shape not in ([], [1]) or float(value.reshape(-1)[0]) <= 0:
                report.error(key, f"KV scale must be a positive float32 scalar (got {code} {shape})")
        elif code in ("F16", "BF16", "F32") and not key.endswith("_scale"):
            if dtype is not None and code != dtype:
                report.error(key, f"dtype {code}, expected {dtype} (config dtype)")
            if not bool(torch.isfinite(value.float()).all()):
                report.error(key, "holds NaN or Inf")
            if algo and key.endswith(("_proj.weight", "lm_head.weight")) and not _excluded(module, quant):
                report.error(key, "full-precision linear not listed in exclude_modules: TensorRT-LLM would expect "
                                  f"{algo} tensors for it")
        if key.endswith(".pre_quant_scale") and module.endswith(FUSED_INPUTS):
            report.error(key, "the PyTorch backend's fused qkv/gate_up loaders read no pre_quant_scale: fold it into "
                              "the norm in front")
    _check_kv_scales(tensors, kv, report)


def _check_int4(key: str, shape: list[int], tensors: dict[str, Any], group: int, dtype: str | None,
                algo: str | None, report: ValidationReport) -> None:
    if algo != "W4A16_AWQ":
        report.error(key, f"packed integer weight but quant_algo is {algo!r}")
        return
    scale = tensors.get(key + "_scale")
    if scale is None:
        report.error(key, "INT4 weight without weight_scale")
        return
    rows, k = shape
    if scale[0] != [2 * rows, k // group] or k % group:
        report.error(key, f"weight {shape} / weight_scale {scale[0]} do not form [out/2, in] / [out, in/{group}]")
    if dtype is not None and scale[1] != dtype:
        report.error(key + "_scale", f"dtype {scale[1]}, expected {dtype}")


def _check_kv_scales(tensors: dict[str, Any], kv: str | None, report: ValidationReport) -> None:
    attentions = [k.removesuffix(".k_proj.weight") for k in tensors
                  if k.endswith("self_attn.k_proj.weight") and not k.startswith(VISION_PREFIXES)]
    for attention in attentions:
        for name in ("k_proj.k_scale", "v_proj.v_scale"):
            present = f"{attention}.{name}" in tensors
            if kv and not present:
                report.error(f"{attention}.{name}", f"missing (kv_cache_quant_algo is {kv})")
            if not kv and present:
                report.error(f"{attention}.{name}", "present but hf_quant_config.json sets no kv_cache_quant_algo")
