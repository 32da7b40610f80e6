"""``mmsdk validate DIR``: check a TensorRT-LLM export against the formats, without TensorRT-LLM.

Pure Python (json, safetensors, onnx): it mirrors what TensorRT-LLM checks when it parses a config
and loads weights (specs/tensorrt-llm.md 6), but stricter: an extra tensor or a wrong dtype, which
TensorRT-LLM only warns about or silently converts, is an error here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["Finding", "ValidationReport", "validate", "validate_config"]

MODEL_ARCHITECTURES = {  # MODEL_MAP keys mmsdk writes or knows, -> the model class
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen",
    "Qwen2VLForConditionalGeneration": "qwen", "QWenLMHeadModel": "qwen", "MllamaForConditionalGeneration": "mllama",
}
DTYPES = {"float16", "bfloat16", "float32"}
POSITION_TYPES = {"learned_absolute", "rope_gptj", "rope_gpt_neox", "long_rope", "alibi", "alibi_with_scale",
                  "relative", "chatglm", "yarn", "mrope", "deferred"}
MAPPING_KEYS = {"world_size", "tp_size", "pp_size", "cp_size", "gpus_per_node", "moe_tp_size", "moe_ep_size"}
QUANT_KEYS = {"quant_algo", "kv_cache_quant_algo", "group_size", "smoothquant_val", "clamp_val", "use_meta_recipe",
              "has_zero_point", "pre_quant_scale", "exclude_modules"}
QUANT_ALGOS = {"W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "W8A16_GPTQ", "W4A16_GPTQ", "W8A8_SQ_PER_CHANNEL",
               "W8A8_SQ_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
               "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN",
               "W4A8_QSERVE_PER_GROUP", "W4A8_QSERVE_PER_CHANNEL", "FP8", "FP8_PER_CHANNEL_PER_TOKEN",
               "FP8_BLOCK_SCALES", "MIXED_PRECISION", "NVFP4", "W4A8_NVFP4_FP8", "W4A8_MXFP4_FP8",
               "W4A8_MXFP4_MXFP8", "W4A16_MXFP4", "NO_QUANT"}
KV_ALGOS = {"INT8", "FP8", "NVFP4", None}
REQUIRED = ("architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "hidden_act")


@dataclass(frozen=True)
class Finding:
    """One problem: ``error`` means TensorRT-LLM would fail or compute something else."""

    level: Literal["error", "warning"]
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.where}: {self.message}"


@dataclass
class ValidationReport:
    """Everything ``validate`` found in one folder."""

    path: Path
    kind: str
    findings: list[Finding] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, where: str, message: str) -> None:
        self.findings.append(Finding("error", where, message))

    def warn(self, where: str, message: str) -> None:
        self.findings.append(Finding("warning", where, message))

    def summary(self) -> str:
        """A few lines for people: verdict, what was checked, then every finding."""
        verdict = "OK" if self.ok else f"{len(self.errors)} error(s)"
        lines = [f"{self.path} ({self.kind}): {verdict}", *(f"  checked {c}" for c in self.checked)]
        return "\n".join([*lines, *(f"  {f}" for f in self.findings)])


def validate(path: str | Path) -> ValidationReport:
    """Validate an mmsdk TensorRT-LLM export, a checkpoint folder, a Hugging Face folder or a vision folder."""
    from mmsdk.plugins.backends.tensorrt_llm import validate_hf, validate_tensors, validate_vision

    folder = Path(path)
    if (folder / "manifest.json").is_file():
        return _validate_export(folder)
    config = _read_json(folder / "config.json")
    if config is None:
        report = ValidationReport(folder, "unknown")
        report.error(str(folder), "no config.json: not a TensorRT-LLM checkpoint, Hugging Face or vision folder")
        return report
    if "builder_config" in config:
        report = ValidationReport(folder, "vision")
        validate_vision.check_vision(folder, report, llm_hidden=None)
    elif "architecture" in config:
        report = ValidationReport(folder, "checkpoint")
        if validate_config(config, report):
            validate_tensors.check_rank_files(folder, config, report)
    else:
        report = ValidationReport(folder, "hf")
        validate_hf.check_hf(folder, config, report)
    return report


def _validate_export(folder: Path) -> ValidationReport:
    from mmsdk.plugins.backends.tensorrt_llm import validate_hf, validate_tensors, validate_vision

    manifest = _read_json(folder / "manifest.json") or {}
    target = (manifest.get("details") or {}).get("target")
    report = ValidationReport(folder, f"mmsdk export, target {target}")
    if manifest.get("backend") != "tensorrt-llm":
        report.error("manifest.json", f"backend is {manifest.get('backend')!r}, not 'tensorrt-llm'")
        return report
    if target == "checkpoint":
        config = _read_json(folder / "llm" / "config.json")
        if config is None:
            report.error("llm/config.json", "missing or not JSON")
            return report
        if validate_config(config, report):
            validate_tensors.check_rank_files(folder / "llm", config, report)
        validate_vision.check_vision(folder / "vision", report, llm_hidden=config.get("hidden_size"))
    else:
        validate_hf.check_hf(folder, _read_json(folder / "config.json") or {}, report)
    return report


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def validate_config(cfg: dict[str, Any], report: ValidationReport) -> bool:
    """Check a checkpoint ``config.json``; True when it is sound enough to check the tensors against."""
    before = len(report.errors)
    where = "config.json"
    for key in REQUIRED:
        if key not in cfg:
            report.error(where, f"required field {key!r} is missing")
    if len(report.errors) > before:
        return False
    if cfg["architecture"] not in MODEL_ARCHITECTURES:
        report.error(where, f"architecture {cfg['architecture']!r} is not one of {sorted(MODEL_ARCHITECTURES)}")
    if cfg["dtype"] not in DTYPES:
        report.error(where, f"dtype {cfg['dtype']!r} is not one of {sorted(DTYPES)}")
    position = cfg.get("position_embedding_type", "learned_absolute")
    if position not in POSITION_TYPES:
        report.error(where, f"position_embedding_type {position!r} is not a PositionEmbeddingType name")
    _check_mapping(cfg, report)
    _check_quantization(cfg, report)
    _check_rotary(cfg, report)
    report.checked.append("config.json fields")
    return len(report.errors) == before


def _check_mapping(cfg: dict[str, Any], report: ValidationReport) -> None:
    mapping = cfg.get("mapping", {})
    unknown = set(mapping) - MAPPING_KEYS
    if unknown:
        report.error("config.json", f"mapping has keys Mapping() does not take: {sorted(unknown)}")
    tp, pp, cp = (int(mapping.get(k, 1)) for k in ("tp_size", "pp_size", "cp_size"))
    if int(mapping.get("world_size", tp * pp * cp)) != tp * pp * cp:
        report.error("config.json", f"mapping.world_size {mapping.get('world_size')} != tp*pp*cp = {tp * pp * cp}")
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    for ok, text in (
        (nh % tp == 0, f"num_attention_heads {nh} is not divisible by tp_size {tp}"),
        (nkv < tp or nkv % tp == 0, f"num_key_value_heads {nkv} is not divisible by tp_size {tp}"),
        (nkv >= tp or tp % nkv == 0, f"tp_size {tp} is not a multiple of num_key_value_heads {nkv}"),
        (cfg["num_hidden_layers"] % pp == 0, f"num_hidden_layers {cfg['num_hidden_layers']} % pp_size {pp} != 0"),
        (cfg.get("intermediate_size", 0) % tp == 0, f"intermediate_size is not divisible by tp_size {tp}"),
    ):
        if not ok:
            report.error("config.json", text)


def _check_quantization(cfg: dict[str, Any], report: ValidationReport) -> None:
    import fnmatch

    quant = cfg.get("quantization") or {}
    unknown = set(quant) - QUANT_KEYS
    if unknown:
        report.error("config.json", f"quantization has keys QuantConfig() does not take: {sorted(unknown)}")
    algo, kv = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    if algo is not None and algo not in QUANT_ALGOS:
        report.error("config.json", f"quant_algo {algo!r} is not a weight QuantAlgo (INT8 is only a KV algorithm)")
    if kv not in KV_ALGOS:
        report.error("config.json", f"kv_cache_quant_algo {kv!r} is not one of INT8, FP8, NVFP4 or null "
                                    "(TensorRT-LLM has no INT4 KV cache)")
    if algo == "W4A16_AWQ":
        if quant.get("pre_quant_scale") is not True:
            report.error("config.json", "W4A16_AWQ needs pre_quant_scale: true (with prequant_scaling_factor tensors)")
        if quant.get("has_zero_point"):
            report.error("config.json", "W4A16_AWQ checkpoints from mmsdk must be symmetric (has_zero_point: false)")
        if quant.get("group_size") not in (64, 128):
            report.error("config.json", f"group_size {quant.get('group_size')!r} must be written and be 64 or 128")
    excluded = quant.get("exclude_modules")
    if excluded is not None:
        for module in ("lm_head", "transformer.vocab_embedding"):
            if not any(fnmatch.fnmatchcase(module, p) for p in excluded):
                report.error("config.json", f"exclude_modules replaces the defaults and does not cover {module!r}")


def _check_rotary(cfg: dict[str, Any], report: ValidationReport) -> None:
    if cfg.get("position_embedding_type") != "mrope":
        return
    scaling = cfg.get("rotary_scaling") or {}
    dim = int(cfg.get("rotary_embedding_dim") or cfg.get("head_size") or 0)
    if scaling.get("type") != "mrope":
        report.error("config.json", "mrope needs rotary_scaling.type 'mrope' (transformers rewrites it to 'default')")
    elif sum(scaling.get("mrope_section") or []) * 2 != dim:
        report.error("config.json", f"mrope_section {scaling.get('mrope_section')} does not cover rotary dim {dim}")
