"""Target A: TensorRT-LLM's checkpoint (``config.json`` + ``rank{N}.safetensors``) for ``trtllm-build``.

Each rank file holds exactly the tensors that rank's engine expects: fused QKV in ``[q_r; k_r; v_r]``
order, column/row-parallel splits, the lm_head padded to a multiple of tp_size, pipeline layers
renumbered from 0, INT4 weights in the W4A16_AWQ layout and one KV scale per attention layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.tensorrt_llm import naming
from mmsdk.plugins.backends.tensorrt_llm import sharding as sh
from mmsdk.plugins.backends.tensorrt_llm.families import Family
from mmsdk.plugins.backends.tensorrt_llm.lowering import DenseLinear, Int4Linear, LinearWeights
from mmsdk.plugins.backends.tensorrt_llm.packing import pack_int4_rows
from mmsdk.plugins.backends.tensorrt_llm.weights import LanguageModelWeights

__all__ = ["CheckpointPlan", "checkpoint_config", "plan_checkpoint", "rank_tensors", "write_checkpoint"]

_FIX_PARALLEL = "choose tp_size/pp_size that divide the model (see the numbers above), or tp_size=1, pp_size=1."


@dataclass(frozen=True)
class CheckpointPlan:
    """What goes into the checkpoint besides the weights: parallelism, dtype, quantization, KV scales."""

    family: Family
    tp: int
    pp: int
    dtype: torch.dtype
    group_size: int | None
    kv_algo: str | None
    kv_scales: dict[int, float]
    excluded: tuple[str, ...]  # TensorRT-LLM linears left in full precision next to INT4 ones


def plan_checkpoint(lm: LanguageModelWeights, family: Family, tp: int, pp: int, dtype: str,
                    kv_algo: str | None, kv_scales: dict[int, float]) -> CheckpointPlan:
    """Check that ``tp``/``pp`` divide the model and the INT4 layers fit them; return the plan."""
    sh.require(sh.check_parallelism(lm.heads, lm.intermediate_size, lm.num_layers, tp, pp), _FIX_PARALLEL)
    group = lm.group_size()
    excluded: set[str] = set()
    problems: list[str] = []
    per_stage = lm.num_layers // pp
    for index, layer in enumerate(lm.layers):
        for linear, roles in naming.LINEAR_ROLES.items():
            parts = [layer.linears()[role] for role in roles]
            kinds = {isinstance(p, Int4Linear) for p in parts}
            if len(kinds) > 1:
                raise ExportError(
                    f"layer {index}: q, k and v must all be INT4 or all full precision (one fused qkv linear).",
                    fix="quantize q/k/v together (apply qkv-fuse before int4-weight, or quantize all three).",
                )
            if True not in kinds:
                if group is not None:  # names are per rank file: layer indices restart in every stage
                    excluded.add(naming.linear_name(index % per_stage, linear))
                continue
            out_global, in_global = _global_widths(lm, linear, tp)
            problems += sh.check_quantized_widths(naming.linear_name(index, linear), out_global, in_global,
                                                  group or 0, tp, linear not in naming.COLUMN_PARALLEL)
    _check_stages_agree(lm, excluded, per_stage)
    sh.require(problems, "pick tp_size and int4-weight's group size (64 or 128) so the widths divide, or leave "
                         "these layers in full precision.")
    if group is not None and group not in (64, 128):
        raise ExportError(
            f"TensorRT-LLM's W4A16_AWQ takes group sizes 64 or 128; the INT4 layers use {group}.",
            fix="re-run int4-weight with a group (block) size of 64 or 128.",
        )
    return CheckpointPlan(family, tp, pp, getattr(torch, dtype), group, kv_algo, kv_scales, tuple(sorted(excluded)))


def _check_stages_agree(lm: LanguageModelWeights, excluded: set[str], per_stage: int) -> None:
    """exclude_modules names the layers of one rank file, so every pipeline stage must exclude the same ones."""
    for index, layer in enumerate(lm.layers):
        for linear, roles in naming.LINEAR_ROLES.items():
            dense = not isinstance(layer.linears()[roles[0]], Int4Linear)
            if lm.group_size() is not None and dense != (naming.linear_name(index % per_stage, linear) in excluded):
                raise ExportError(
                    f"layer {index}'s {linear} is {'full precision' if dense else 'INT4'} but the same layer of "
                    "another pipeline stage is not; exclude_modules cannot tell the stages apart.",
                    fix="quantize the same layers in every pipeline stage, or export with pp_size=1.",
                )


def _global_widths(lm: LanguageModelWeights, linear: str, tp: int) -> tuple[int, int]:
    h, heads = lm.hidden_size, lm.heads
    if linear == "attention.qkv":
        nkv = sh.kv_heads_per_rank(heads.num_kv_heads, tp) * tp
        return (heads.num_heads + 2 * nkv) * heads.head_dim, h
    if linear == "attention.dense":
        return h, heads.num_heads * heads.head_dim
    if linear == "mlp.proj":
        return h, lm.intermediate_size
    return lm.intermediate_size, h


def checkpoint_config(lm: LanguageModelWeights, plan: CheckpointPlan) -> dict[str, Any]:
    """The ``config.json`` TensorRT-LLM's PretrainedConfig parses (only keys its classes accept)."""
    heads, family = lm.heads, plan.family
    cfg: dict[str, Any] = {
        "architecture": family.llm_architecture,
        "dtype": str(plan.dtype).removeprefix("torch."),
        "logits_dtype": "float32",
        "vocab_size": lm.vocab_size,
        "max_position_embeddings": lm.max_position_embeddings,
        "hidden_size": lm.hidden_size,
        "num_hidden_layers": lm.num_layers,
        "num_attention_heads": heads.num_heads,
        "num_key_value_heads": heads.num_kv_heads,
        "head_size": heads.head_dim,
        "hidden_act": lm.hidden_act,
        "intermediate_size": lm.intermediate_size,
        "norm_epsilon": lm.norm_eps,
        "position_embedding_type": family.position_embedding_type,
        "rotary_base": lm.rope["theta"],
        "rotary_scaling": _rotary_scaling(lm, family),
        "mlp_bias": False,
        "attn_bias": lm.attn_bias,
        "tie_word_embeddings": lm.tie_word_embeddings,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": plan.tp * plan.pp, "tp_size": plan.tp, "pp_size": plan.pp},
        "quantization": _quantization(plan),
    }
    if family.qwen_type is not None:
        cfg["qwen_type"] = family.qwen_type
        cfg["rotary_embedding_dim"] = heads.head_dim
    return cfg


def _rotary_scaling(lm: LanguageModelWeights, family: Family) -> dict[str, Any] | None:
    if family.position_embedding_type == "mrope":  # TensorRT-LLM's converter forces type "mrope"
        return {"type": "mrope", "mrope_section": lm.rope["mrope_section"]}
    if lm.rope["type"] in (None, "default"):
        return None
    return {"type": lm.rope["type"], "factor": lm.rope["factor"]}


def _quantization(plan: CheckpointPlan) -> dict[str, Any]:
    if plan.group_size is None:
        return {"quant_algo": None, "kv_cache_quant_algo": plan.kv_algo}
    return {
        "quant_algo": "W4A16_AWQ",
        "kv_cache_quant_algo": plan.kv_algo,
        "group_size": plan.group_size,
        "has_zero_point": False,
        "pre_quant_scale": True,
        "exclude_modules": ["lm_head", "*lm_head", "*vocab_embedding", "*router", *plan.excluded],
    }


def rank_tensors(lm: LanguageModelWeights, plan: CheckpointPlan, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """Every tensor of one rank file, named as TensorRT-LLM expects."""
    dt = plan.dtype
    out: dict[str, torch.Tensor] = {}
    layers = sh.pp_layer_ranges(lm.num_layers, plan.pp)[pp_rank]
    if pp_rank == 0:
        out[naming.EMBEDDING] = lm.embed.to(dt)
    for local, index in enumerate(layers):
        layer, prefix = lm.layers[index], naming.layer_prefix(local)
        out[f"{prefix}.{naming.INPUT_NORM}"] = layer.input_norm.to(dt)
        out[f"{prefix}.{naming.POST_NORM}"] = layer.post_norm.to(dt)
        for linear, roles in naming.LINEAR_ROLES.items():
            parts = [layer.linears()[role] for role in roles]
            out.update(_linear_tensors(f"{prefix}.{linear}", linear, parts, lm, plan, tp_rank))
        if plan.kv_algo is not None:
            scale = torch.tensor([plan.kv_scales[index]], dtype=torch.float32)
            out[f"{prefix}.{naming.KV_SCALE}"] = scale
            out[f"{prefix}.{naming.KV_RCP_SCALE}"] = torch.reciprocal(scale)
    if pp_rank == plan.pp - 1:
        out[naming.FINAL_NORM] = lm.final_norm.to(dt)
        head = lm.lm_head.float_weight() if isinstance(lm.lm_head, Int4Linear) else lm.lm_head.weight
        out[naming.LM_HEAD] = sh.split_column(sh.pad_rows(head, plan.tp), plan.tp)[tp_rank].to(dt)
    return out


def _split(linear: str, tensors: list[torch.Tensor], lm: LanguageModelWeights, plan: CheckpointPlan,
           rank: int) -> torch.Tensor:
    if linear == "attention.qkv":
        return sh.split_qkv(*tensors, lm.heads, plan.tp)[rank]
    if linear in naming.COLUMN_PARALLEL:
        return sh.split_column(tensors[0], plan.tp)[rank]
    return sh.split_row(tensors[0], plan.tp)[rank]


def _linear_tensors(prefix: str, linear: str, parts: list[LinearWeights], lm: LanguageModelWeights,
                    plan: CheckpointPlan, rank: int) -> dict[str, torch.Tensor]:
    column = linear in naming.COLUMN_PARALLEL
    out: dict[str, torch.Tensor] = {}
    first = parts[0]
    if isinstance(first, DenseLinear):
        out[f"{prefix}.weight"] = _split(linear, [p.weight for p in parts], lm, plan, rank).to(plan.dtype)
    else:
        int4 = [p for p in parts if isinstance(p, Int4Linear)]
        out[f"{prefix}.weight"] = pack_int4_rows(_split(linear, [p.q for p in int4], lm, plan, rank))
        scales = _split(linear, [p.scales for p in int4], lm, plan, rank)
        out[f"{prefix}.weights_scaling_factor"] = scales.to(plan.dtype)
        pre = _shared_prequant(prefix, parts)
        local = pre if column else sh.split_row(pre, plan.tp)[rank]
        out[f"{prefix}.prequant_scaling_factor"] = local.to(plan.dtype)
    if first.bias is not None:
        # Row-parallel biases are added once after the all-reduce, so every rank holds the full vector.
        bias = _split(linear, [p.bias for p in parts], lm, plan, rank) if column else first.bias
        out[f"{prefix}.bias"] = bias.to(plan.dtype)
    return out


def _shared_prequant(prefix: str, parts: list[LinearWeights]) -> torch.Tensor:
    scales = [p.prequant() for p in parts if isinstance(p, Int4Linear)]
    if any(not torch.equal(scales[0], s) for s in scales[1:]):
        raise ExportError(
            f"{prefix}: q, k and v have different AWQ pre-quant scales, but TensorRT-LLM's fused qkv takes one.",
            fix="calibrate q/k/v with one shared activation scale (AWQ groups projections that read the same input).",
        )
    return scales[0]


def write_checkpoint(lm: LanguageModelWeights, plan: CheckpointPlan, folder: Path) -> dict[str, Any]:
    """Write ``config.json`` and every ``rank{N}.safetensors`` into ``folder``; return the config."""
    import safetensors.torch

    folder.mkdir(parents=True, exist_ok=True)
    config = checkpoint_config(lm, plan)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for pp_rank in range(plan.pp):
        for tp_rank in range(plan.tp):
            tensors = rank_tensors(lm, plan, tp_rank, pp_rank)
            path = folder / f"rank{sh.rank_of(tp_rank, pp_rank, plan.tp)}.safetensors"
            safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    return config
