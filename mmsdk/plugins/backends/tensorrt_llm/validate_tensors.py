"""The validator's tensor checks for a checkpoint: the exact expected set per rank, shapes, dtypes,
values, replicated KV heads and the INT4 width rules (specs/tensorrt-llm.md 1.3, 1.4, 2.2, 2.6).

The expected shapes are computed here from the config alone, independently of the writer.
"""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mmsdk.plugins.backends.tensorrt_llm.validate import ValidationReport

__all__ = ["check_rank_files", "expected_tensors"]

SAFETENSORS_DTYPE = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
Spec = tuple[tuple[int, ...], str]


def expected_tensors(cfg: dict[str, Any], tp_rank: int, pp_rank: int) -> dict[str, Spec]:
    """name -> (shape, safetensors dtype) that rank (tp_rank, pp_rank) must hold."""
    from mmsdk.plugins.backends.tensorrt_llm.validate import MODEL_ARCHITECTURES

    m = cfg.get("mapping", {})
    tp, pp = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
    h, v, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_size") or h // nh
    inter = cfg.get("intermediate_size", 4 * h)
    dt = SAFETENSORS_DTYPE[cfg["dtype"]]
    qwen = MODEL_ARCHITECTURES.get(cfg["architecture"]) == "qwen"
    attn_bias = bool(cfg.get("attn_bias", qwen))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    quant = cfg.get("quantization") or {}
    out: dict[str, Spec] = {}
    if pp_rank == 0:
        out["transformer.vocab_embedding.weight"] = (_embedding_shape(cfg, v, h, tp), dt)
    qkv_rows = (nh // tp + 2 * math.ceil(nkv / tp)) * hd
    linears = {  # name -> (local out, local in, bias shape or None)
        "attention.qkv": (qkv_rows, h, (qkv_rows,) if attn_bias else None),
        "attention.dense": (h, nh * hd // tp, (h,) if attn_bias and not qwen else None),
        "mlp.fc": (inter // tp, h, (inter // tp,) if mlp_bias else None),
        "mlp.gate": (inter // tp, h, (inter // tp,) if mlp_bias else None),
        "mlp.proj": (h, inter // tp, (h,) if mlp_bias else None),
    }
    for local in range(n_layers // pp):
        prefix = f"transformer.layers.{local}."
        out[prefix + "input_layernorm.weight"] = ((h,), dt)
        out[prefix + "post_layernorm.weight"] = ((h,), dt)
        for name, (n, k, bias) in linears.items():
            out.update(_linear(prefix + name, n, k, bias, dt, quant))
        if quant.get("kv_cache_quant_algo"):
            out[prefix + "attention.kv_cache_scaling_factor"] = ((1,), "F32")
    if pp_rank == pp - 1:
        out["transformer.ln_f.weight"] = ((h,), dt)
        out["lm_head.weight"] = ((math.ceil(v / tp), h), dt)
    return out


def _embedding_shape(cfg: dict[str, Any], v: int, h: int, tp: int) -> tuple[int, ...]:
    if not cfg.get("use_parallel_embedding"):
        return (v, h)
    return (math.ceil(v / tp), h) if cfg.get("embedding_sharding_dim", 0) == 0 else (v, h // tp)


def _quantized(module: str, quant: dict[str, Any]) -> bool:
    if quant.get("quant_algo") != "W4A16_AWQ":
        return False
    excluded = quant.get("exclude_modules") or ["*lm_head", "*router", "*vocab_embedding"]
    return not any(fnmatch.fnmatchcase(module, p) for p in excluded)


def _linear(module: str, n: int, k: int, bias: tuple[int, ...] | None, dt: str,
            quant: dict[str, Any]) -> dict[str, Spec]:
    out: dict[str, Spec] = {}
    if _quantized(module, quant):
        g = int(quant.get("group_size") or 128)
        out[module + ".weight"] = ((n // 2, k), "I8")
        out[module + ".weights_scaling_factor"] = ((n, k // g), dt)
        out[module + ".prequant_scaling_factor"] = ((k,), dt)
    else:
        out[module + ".weight"] = ((n, k), dt)
    if bias is not None:
        out[module + ".bias"] = (bias, dt)
    return out


def check_rank_files(folder: Path, cfg: dict[str, Any], report: ValidationReport) -> None:
    """Compare every rank file with :func:`expected_tensors`; check values, replicated KV heads, INT4 widths."""
    from safetensors import safe_open

    m = cfg.get("mapping", {})
    tp, pp = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
    present = {p.name for p in folder.glob("rank*.safetensors")}
    wanted = {f"rank{r}.safetensors" for r in range(tp * pp)}
    for name in sorted(wanted - present):
        report.error(name, "missing (one file per rank: world_size = tp_size * pp_size)")
    for name in sorted(present - wanted):
        report.error(name, f"not a rank of world_size {tp * pp}")
    _check_int4_widths(cfg, report)
    for pp_rank in range(pp):
        stage = []
        for tp_rank in range(tp):
            path = folder / f"rank{pp_rank * tp + tp_rank}.safetensors"
            if not path.is_file():
                continue
            with safe_open(str(path), framework="pt") as handle:
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}
                codes = {key: handle.get_slice(key).get_dtype() for key in handle.keys()}
            _compare(path.name, tensors, codes, expected_tensors(cfg, tp_rank, pp_rank), report)
            stage.append(tensors)
        if len(stage) == tp:
            _check_replicated_kv(cfg, stage, report, pp_rank)
    report.checked.append(f"{tp * pp} rank file(s): names, shapes, dtypes, values")


def _compare(where: str, tensors: dict[str, torch.Tensor], codes: dict[str, str], expected: dict[str, Spec],
             report: ValidationReport) -> None:
    for name in sorted(set(expected) - set(tensors)):
        report.error(where, f"{name} is missing (required by the engine)")
    for name in sorted(set(tensors) - set(expected)):
        if name.endswith("kv_cache_rcp_scaling_factor") and name.replace("_rcp", "") in expected:
            continue
        report.error(where, f"{name} is not expected by TensorRT-LLM for this config")
    for name, tensor in tensors.items():
        shape, code = expected.get(name, (None, None))
        actual = codes[name]
        if name.endswith("prequant_scaling_factor") and shape is not None and tuple(tensor.shape) == (1, *shape):
            shape = tuple(tensor.shape)
        if shape is not None and tuple(tensor.shape) != shape:
            report.error(where, f"{name} has shape {list(tensor.shape)}, expected {list(shape)}")
        if code is not None and actual != code:
            report.error(where, f"{name} has dtype {actual}, expected {code} (TensorRT-LLM would not convert it)")
        if name.endswith("kv_cache_rcp_scaling_factor") and (tuple(tensor.shape) != (1,) or actual != "F32"):
            report.error(where, f"{name} must be float32 [1]")
        _check_values(where, name, tensor, report)


def _check_values(where: str, name: str, tensor: torch.Tensor, report: ValidationReport) -> None:
    import torch

    if not tensor.is_floating_point():
        return
    values = tensor.float()
    if not bool(torch.isfinite(values).all()):
        report.error(where, f"{name} holds NaN or Inf")
    elif "scaling_factor" in name and not name.endswith("prequant_scaling_factor"):
        if name.endswith(("kv_cache_scaling_factor", "kv_cache_rcp_scaling_factor")) and bool((values <= 0).any()):
            report.error(where, f"{name} must be > 0")
        elif bool((values == 0).any()):
            report.error(where, f"{name} has zero scales")
        elif bool((values < 0).any()):
            report.warn(where, f"{name} has negative scales")
    elif name.endswith("prequant_scaling_factor") and bool((values <= 0).any()):
        report.error(where, f"{name} must be > 0")


def _check_replicated_kv(cfg: dict[str, Any], ranks: list[dict[str, torch.Tensor]], report: ValidationReport,
                         pp_rank: int) -> None:
    import torch

    tp = len(ranks)
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    if nkv >= tp:
        return
    hd = cfg.get("head_size") or cfg["hidden_size"] // nh
    q_rows, copies = nh // tp * hd, tp // nkv
    for key in [k for k in ranks[0] if k.endswith("attention.qkv.weight") or k.endswith("qkv.weights_scaling_factor")
                or k.endswith("attention.qkv.bias")]:
        packed = 2 if ranks[0][key].dtype == torch.int8 else 1
        rows = slice(q_rows // packed, (q_rows + 2 * hd) // packed)
        for head in range(nkv):
            group = [ranks[r][key][rows] for r in range(head * copies, (head + 1) * copies)]
            if any(not torch.equal(group[0], other) for other in group[1:]):
                report.error(f"pipeline stage {pp_rank}", f"{key}: replicated KV head {head} differs between ranks")


def _check_int4_widths(cfg: dict[str, Any], report: ValidationReport) -> None:
    quant = cfg.get("quantization") or {}
    if quant.get("quant_algo") != "W4A16_AWQ":
        return
    tp = int(cfg.get("mapping", {}).get("tp_size", 1))
    g = int(quant.get("group_size") or 128)
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_size") or h // nh
    inter = cfg.get("intermediate_size", 4 * h)
    multiple = max(64, g) * tp
    widths = {"attention.qkv": ((nh // tp + 2 * math.ceil(nkv / tp)) * hd * tp, h, False),
              "attention.dense": (h, nh * hd, True), "mlp.fc": (inter, h, False), "mlp.gate": (inter, h, False),
              "mlp.proj": (h, inter, True)}
    for name, (n, k, row) in widths.items():
        if not _quantized(f"transformer.layers.0.{name}", quant):
            continue
        k_local, n_local = (k // tp, n) if row else (k, n // tp)
        if n % multiple or k % multiple:
            report.error("config.json", f"{name}: INT4 widths out={n}, in={k} must be multiples of max(64, "
                                        f"group_size)*tp_size = {multiple}, or TensorRT-LLM pads the layer and the "
                                        "checkpoint no longer fits")
        if k_local % 64 or k_local % g or n_local % 16:
            report.error("config.json", f"{name}: per-rank in {k_local} / out {n_local} break the INT4 kernel's "
                                        f"tiles (in % 64, in % {g}, out % 16)")
