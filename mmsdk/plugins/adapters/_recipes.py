"""The built-in families' recommended full builds (``recipe:default``, ``recipe:max-memory``, ``recipe:max-accuracy``).

Each recipe is data (pass names + configs, in order) chosen from measured accuracy on the embedded
digits models (docs/quality.md, docs/dual-path.md). The order is the one that works: fusions first
(they rewrite float modules), then vision-side reductions, then one ``ptq-align`` calibration whose
ranges the weight and KV quantizers (and both halves of a dual export) read.

INT4 weights go in only where TensorRT-LLM's W4A16_AWQ kernels can load them (every decoder linear's
widths a multiple of 64): the group size is the largest of 128 / 64 that divides them all; otherwise
the recipe leaves int4-weight out and its description says why. The KV cache is INT8: TensorRT-LLM has
no INT4 KV cache, so int4-kv would make the dual build refuse (or need an explicit fallback).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmsdk.core.recipes import Recipe, RecipeStep

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter

__all__ = ["family_recipes", "int4_group_size"]

_TRT_MULTIPLE = 64  # TensorRT-LLM W4A16: k % 64 and padding to max(64, group) on both widths


def int4_group_size(model: nn.Module, adapter: ModelAdapter) -> int | None:
    """128 or 64 if every decoder linear's in/out widths are multiples of it (TensorRT-LLM loads it), else None."""
    from torch import nn as tnn

    widths: set[int] = set()
    for layer in adapter.decoder_layers(model):
        for module in layer.modules():
            if isinstance(module, tnn.Linear):
                widths.update((module.in_features, module.out_features))
    for group in (128, _TRT_MULTIPLE):
        if widths and all(w % group == 0 for w in widths):
            return group
    return None


def _steps(*items: tuple[str, dict[str, Any]] | str) -> tuple[RecipeStep, ...]:
    return tuple(RecipeStep(pass_name=i, config={}) if isinstance(i, str) else RecipeStep(pass_name=i[0], config=i[1])
                 for i in items)


def family_recipes(model: nn.Module, adapter: ModelAdapter) -> dict[str, Recipe]:
    """``default`` / ``max-memory`` / ``max-accuracy`` for ``model`` as ``adapter``'s family builds it."""
    group = int4_group_size(model, adapter)
    int4 = [("int4-weight", {"method": "awq", "group_size": group})] if group else []
    weights_note = (f"INT4 AWQ weights (group {group}) in the decoder" if group else
                    "no INT4 weights: this model's decoder widths are not multiples of 64, which TensorRT-LLM's "
                    "W4A16 kernels need (the digits models are 96 wide)")
    fusions: list[Any] = ["qkv-fuse", "rmsnorm-rope-fusion"]
    flamingo = bool(adapter.cross_attention_blocks(model))
    rope = "M-RoPE" if adapter.rotary_kind(model) == "mrope" else "RoPE"
    if flamingo:
        fusions.append("gated-xattn")
    calibrated = ["ptq-align", *int4, "int8-kv"]
    common = dict(family=adapter.family)
    default = Recipe(
        name="default",
        description=f"{weights_note}; INT8 KV cache with static scales from one ptq-align calibration (the "
        f"same numbers in both halves of a dual export); fused q/k/v and fused RMSNorm + {rope}"
        + ("; gated cross-attention skipping" if flamingo else "")
        + ". Trades: within 0.4 points of the unoptimized model on the three digits models (measured, "
        "docs/dual-path.md); no vision-token reduction, because every reducer cost 3-23 points at keep 0.5 there "
        "(docs/quality.md).",
        steps=_steps(*fusions, *calibrated), **common,
    )
    reduce: list[Any] = ["vit-prune", ("token-merge", {"keep_ratio": 0.5})]
    if flamingo:
        reduce = ["vit-prune", ("sparse-xattn", {"density": 0.5})]
    max_memory = Recipe(
        name="max-memory",
        description="default plus vit-prune (25% of vision heads and MLP channels) and "
        + ("sparse-xattn (density 0.5)" if flamingo else "token-merge (half the image tokens: KV and prefill shrink)")
        + ". Trades accuracy for memory: measured -13.8 points on llava-digits, -19.0 on qwen2-vl-digits, "
        "-0.9 on idefics-digits (docs/dual-path.md).",
        steps=_steps(*fusions[:2], *reduce, *fusions[2:], *calibrated), **common,
    )
    max_accuracy = Recipe(
        name="max-accuracy",
        description=f"fused q/k/v and RMSNorm + {rope} (bit-exact) and an INT8 KV cache from one ptq-align "
        "calibration; float weights. Trades memory for accuracy: weights stay 16-bit.",
        steps=_steps(*fusions, "ptq-align", "int8-kv"), **common,
    )
    return {r.name: r for r in (default, max_memory, max_accuracy)}
