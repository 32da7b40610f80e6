"""Tensor- and pipeline-parallel splits of TensorRT-LLM's checkpoint (specs/tensorrt-llm.md 1.1, 1.4).

Every function here works on the *logical* tensors (float weights, or INT4 values before packing and
their group scales), so one rule serves both precisions: an INT4 weight is split first and packed per
rank afterwards, exactly as ModelOpt does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmsdk.core.errors import ExportError

__all__ = [
    "Heads",
    "check_parallelism",
    "check_quantized_widths",
    "duplicate_kv",
    "kv_heads_per_rank",
    "pad_rows",
    "pp_layer_ranges",
    "rank_of",
    "split_column",
    "split_qkv",
    "split_row",
]


@dataclass(frozen=True)
class Heads:
    """Attention head counts of the language model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each rank holds: ceil(nkv / tp) (one duplicated head when nkv < tp)."""
    return (num_kv_heads + tp - 1) // tp


def duplicate_kv(t: torch.Tensor, heads: Heads, tp: int) -> torch.Tensor:
    """Repeat each KV head tp/nkv times along dim 0 ([h0, h0, h1, h1, ...]) when nkv < tp."""
    if heads.num_kv_heads >= tp:
        return t
    reps = tp // heads.num_kv_heads
    grouped = t.reshape(heads.num_kv_heads, heads.head_dim, *t.shape[1:])
    expanded = grouped.unsqueeze(1).expand(heads.num_kv_heads, reps, *grouped.shape[1:])
    return expanded.reshape(heads.num_kv_heads * reps * heads.head_dim, *t.shape[1:])


def split_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: Heads, tp: int) -> list[torch.Tensor]:
    """Per-rank ``[q_r; k_r; v_r]`` (dim 0), KV heads duplicated first when nkv < tp.

    Works for weights [rows, in], biases [rows], INT4 values and group scales alike.
    """
    k, v = duplicate_kv(k, heads, tp), duplicate_kv(v, heads, tp)
    parts = [torch.chunk(t, tp, dim=0) for t in (q, k, v)]
    return [torch.cat([qs, ks, vs], dim=0).contiguous() for qs, ks, vs in zip(*parts, strict=True)]


def split_column(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Column-parallel split: ``tp`` equal chunks of dim 0 (output rows)."""
    return [c.contiguous() for c in torch.chunk(t, tp, dim=0)]


def split_row(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Row-parallel split: ``tp`` equal chunks of the last dim (input columns, or their groups)."""
    return [c.contiguous() for c in torch.chunk(t, tp, dim=-1)]


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of ``multiple`` (the lm_head vocab padding)."""
    rows = math.ceil(t.shape[0] / multiple) * multiple
    if rows == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def pp_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """The decoder layers of each pipeline rank (equal contiguous blocks; pp must divide the count)."""
    per = num_layers // pp
    return [range(r * per, (r + 1) * per) for r in range(pp)]


def rank_of(tp_rank: int, pp_rank: int, tp: int) -> int:
    """Global rank of a (tp_rank, pp_rank) pair: ``pp_rank * tp + tp_rank``."""
    return pp_rank * tp + tp_rank


def check_parallelism(heads: Heads, intermediate: int, num_layers: int, tp: int, pp: int) -> list[str]:
    """Reasons ``tp``/``pp`` cannot split this model (empty when they can)."""
    problems = []
    if heads.num_heads % tp:
        problems.append(f"num_attention_heads {heads.num_heads} is not divisible by tp_size {tp}")
    nkv = heads.num_kv_heads
    if nkv >= tp and nkv % tp:
        problems.append(f"num_key_value_heads {nkv} is not divisible by tp_size {tp}")
    if nkv < tp and tp % nkv:
        problems.append(f"tp_size {tp} is not a multiple of num_key_value_heads {nkv} (needed to replicate KV heads)")
    if intermediate % tp:
        problems.append(f"intermediate_size {intermediate} is not divisible by tp_size {tp}")
    if num_layers % pp:
        problems.append(f"num_hidden_layers {num_layers} is not divisible by pp_size {pp}")
    return problems


def check_quantized_widths(name: str, out_global: int, in_global: int, group_size: int, tp: int,
                           row_parallel: bool) -> list[str]:
    """Why a W4A16_AWQ linear would not load (TensorRT-LLM pads to max(64, g)*tp and its kernels need
    k % 64, k % g and n % 16 per rank); empty when it loads."""
    multiple = max(64, group_size) * tp
    problems = [
        f"{name}: {what} {width} is not a multiple of max(64, group_size={group_size}) * tp_size={tp} = {multiple}"
        for what, width in (("in_features", in_global), ("out_features", out_global))
        if width % multiple
    ]
    k_local = in_global // tp if row_parallel else in_global
    n_local = out_global if row_parallel else out_global // tp
    if k_local % 64 or k_local % group_size:
        problems.append(f"{name}: per-rank in_features {k_local} must be a multiple of 64 and of {group_size}")
    if n_local % 16:
        problems.append(f"{name}: per-rank out_features {n_local} must be a multiple of 16")
    return problems


def require(problems: list[str], fix: str) -> None:
    """Raise one ExportError listing every problem, or return when there are none."""
    if problems:
        raise ExportError("cannot shard the model: " + "; ".join(problems) + ".", fix=fix)
