"""``vit-prune``: structured pruning of vision-encoder attention heads and MLP channels.

Importance is measured on calibration prompts: a head scores the mean norm of what it adds to
the attention output (its slice of the output projection applied to its slice of the input),
an MLP channel the mean |activation| times the norm of its column in the down projection. The
lowest-scoring heads and channels of every vision layer are removed physically: q/k/v rows (or
the fused qkv rows), output-projection columns, up/gate rows and down columns shrink, and the
attention module is told its new head count, so parameters and FLOPs both drop. The kept
indices go into the records, from which ``restore`` rebuilds the shapes when an export reloads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field
from torch import nn

import mmsdk
from mmsdk.core.adapter import ModelAdapter, VisionBlock
from mmsdk.core.config import PassConfig
from mmsdk.core.errors import CalibrationError, IncompatiblePassError
from mmsdk.core.flops import count_flops
from mmsdk.core.passes import CheckContext, PassContext, PassSpec
from mmsdk.core.registry import Registrar

__all__ = ["ViTPruneConfig", "apply_vit_prune", "check_vit_prune", "restore_vit_prune"]


class ViTPruneConfig(PassConfig):
    """How much of each vision layer goes, and how much calibration data decides it."""

    head_ratio: float = Field(0.25, ge=0, lt=1, description="Share of each layer's attention heads removed.")
    heads: int | None = Field(None, ge=0, description="Heads removed per layer (instead of head_ratio).")
    mlp_ratio: float = Field(0.25, ge=0, lt=1, description="Share of each layer's MLP hidden channels removed.")
    samples: int = Field(16, ge=1, le=4096, description="Calibration prompts used to measure importance.")

    def removed_heads(self, heads: int) -> int:
        """Heads a layer of ``heads`` loses."""
        return self.heads if self.heads is not None else math.floor(heads * self.head_ratio)


def _linear(module: nn.Module, name: str | None) -> nn.Linear | None:
    layer = getattr(module, name, None) if name else None
    return layer if type(layer) is nn.Linear else None


def check_vit_prune(ctx: CheckContext) -> None:
    """Refuse head counts a layer cannot lose and projections that are no longer plain linears."""
    config: ViTPruneConfig = ctx.config  # type: ignore[assignment]
    for index, block in enumerate(ctx.adapter.vision_blocks(ctx.model)):
        removed = config.removed_heads(block.num_heads)
        if removed >= block.num_heads:
            raise IncompatiblePassError(
                f"vit-prune would remove {removed} heads from vision layer {index}, which has {block.num_heads}; "
                "every layer must keep at least one head.",
                fix=f"set heads to at most {block.num_heads - 1} (or use head_ratio below 1).",
            )
        names = [*block.projections.linears().values(), block.mlp_projections.up, block.mlp_projections.down]
        owners = [block.attention] * len(block.projections.linears()) + [block.mlp, block.mlp]
        if block.mlp_projections.gate:
            names.append(block.mlp_projections.gate)
            owners.append(block.mlp)
        if any(_linear(owner, name) is None for owner, name in zip(owners, names, strict=True)):
            raise IncompatiblePassError(
                f"vit-prune needs plain nn.Linear projections in vision layer {index}; an earlier pass replaced them "
                "(quantized or fused).",
                fix='apply "vit-prune" before quantizers and before qkv-fuse(vision_tower=True).',
            )


def _calibration_inputs(context: PassContext, limit: int) -> dict[str, Any]:
    calibration = context.require_calibration("vit-prune")
    processor = context.processor
    if processor is None:
        raise CalibrationError(
            "vit-prune measures importance by running calibration prompts, which needs the model's processor.",
            fix="create the Optimizer with processor=... (mmsdk.load_model returns one).",
        )
    samples = calibration.samples[:limit]
    prompts = [context.adapter.format_prompt(s.text, processor) for s in samples]
    return processor(images=[s.image for s in samples], text=prompts)


def _importance(model: nn.Module, blocks: list[VisionBlock], inputs: dict[str, Any]) -> list[tuple[torch.Tensor, ...]]:
    """Per block: (head importance [H], channel importance [I])."""
    heads = [torch.zeros(b.num_heads) for b in blocks]
    channels = [torch.zeros(getattr(b.mlp, b.mlp_projections.down).in_features) for b in blocks]
    handles = []
    for i, block in enumerate(blocks):
        out = getattr(block.attention, block.projections.o)
        down = getattr(block.mlp, block.mlp_projections.down)

        def on_out(module: nn.Linear, args: Any, i: int = i, block: VisionBlock = block) -> None:
            x = args[0].reshape(-1, block.num_heads, block.head_dim).float()
            w = module.weight.float().reshape(module.out_features, block.num_heads, block.head_dim)
            heads[i] += torch.einsum("nhd,ohd->nho", x, w).norm(dim=-1).mean(dim=0).cpu()

        def on_down(module: nn.Linear, args: Any, i: int = i) -> None:
            a = args[0].reshape(-1, module.in_features).float().abs().mean(dim=0)
            channels[i] += (a * module.weight.float().norm(dim=0)).cpu()

        handles += [out.register_forward_pre_hook(on_out), down.register_forward_pre_hook(on_down)]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return list(zip(heads, channels, strict=True))


def _shrink(owner: nn.Module, name: str, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> None:
    old: nn.Linear = getattr(owner, name)
    weight = old.weight.detach()
    weight = weight[rows] if rows is not None else weight
    weight = weight[:, cols] if cols is not None else weight
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=old.bias is not None, device=weight.device,
                    dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if old.bias is not None:
            new.bias.copy_(old.bias.detach()[rows] if rows is not None else old.bias.detach())
    setattr(owner, name, new)


def _prune_block(adapter: ModelAdapter, block: VisionBlock, keep_heads: list[int], keep_channels: list[int]) -> None:
    proj, dim = block.projections, block.head_dim
    head_rows = torch.tensor([h * dim + j for h in keep_heads for j in range(dim)], dtype=torch.long)
    if proj.qkv is not None:  # fused [q; k; v], each heads x head_dim
        width = block.num_heads * dim
        _shrink(block.attention, proj.qkv, rows=torch.cat([head_rows + part * width for part in range(3)]))
    else:
        for role in ("q", "k", "v"):
            _shrink(block.attention, getattr(proj, role), rows=head_rows)
    _shrink(block.attention, proj.o, cols=head_rows)
    adapter.set_vision_head_count(block, len(keep_heads))
    channels = torch.tensor(keep_channels, dtype=torch.long)
    mlp = block.mlp_projections
    for name in (mlp.up, mlp.gate):
        if name:
            _shrink(block.mlp, name, rows=channels)
    _shrink(block.mlp, mlp.down, cols=channels)


def _vision_params(adapter: ModelAdapter, model: nn.Module) -> int:
    return sum(p.numel() for p in adapter.vision_tower(model).parameters())


def apply_vit_prune(model: nn.Module, config: ViTPruneConfig, context: PassContext) -> dict[str, Any]:
    """Measure importance on calibration prompts, remove the weakest heads and channels, record what stays."""
    adapter = context.adapter
    inputs = _calibration_inputs(context, config.samples)
    blocks = adapter.vision_blocks(model)
    scores = _importance(model, blocks, inputs)
    flops_before, params_before = count_flops(model, **_one(inputs))[0], _vision_params(adapter, model)
    layers = []
    for block, (head_scores, channel_scores) in zip(blocks, scores, strict=True):
        keep_h = _top(head_scores, block.num_heads - config.removed_heads(block.num_heads))
        keep_c = _top(channel_scores, channel_scores.numel() - math.floor(channel_scores.numel() * config.mlp_ratio))
        _prune_block(adapter, block, keep_h, keep_c)
        layers.append({"heads": keep_h, "channels": keep_c})
    flops_after, params_after = count_flops(model, **_one(inputs))[0], _vision_params(adapter, model)
    return {
        "layers": layers,
        "vision_params": {"before": params_before, "after": params_after},
        "model_flops_one_prompt": {"before": flops_before, "after": flops_after},
        "importance": "head: mean |output-projection contribution|; channel: mean |activation| x |down column|",
        "calibration_prompts": int(inputs["input_ids"].shape[0]),
    }


def _top(scores: torch.Tensor, count: int) -> list[int]:
    """Indices of the ``count`` highest scores, in ascending index order."""
    return sorted(scores.argsort(descending=True)[:count].tolist())


def _one(inputs: dict[str, Any]) -> dict[str, Any]:
    """The first calibration prompt alone, for FLOP counting (pixel tensors of the other family layouts too)."""
    batch = inputs["input_ids"].shape[0]
    out = {}
    for key, value in inputs.items():
        out[key] = value[:1] if isinstance(value, torch.Tensor) and value.shape[:1] == (batch,) else value
    if "image_grid_thw" in inputs:  # Qwen packs every image's patches into one tensor
        grid = inputs["image_grid_thw"]
        out["image_grid_thw"] = grid[:1]
        out["pixel_values"] = inputs["pixel_values"][: int(grid[0].prod())]
    return out


def restore_vit_prune(model: nn.Module, config: ViTPruneConfig, records: Any, context: PassContext) -> None:
    """Rebuild the pruned shapes from the recorded kept indices (weights come from the export)."""
    for block, layer in zip(context.adapter.vision_blocks(model), records["layers"], strict=True):
        _prune_block(context.adapter, block, layer["heads"], layer["channels"])


@mmsdk.hookimpl
def mmsdk_register_encoders(register: Registrar[PassSpec]) -> None:
    register(
        PassSpec(
            name="vit-prune",
            config_cls=ViTPruneConfig,
            apply=apply_vit_prune,
            check=check_vit_prune,
            restore=restore_vit_prune,
            needs_calibration=True,
            summary="remove the least important vision heads and MLP channels (calibrated); weights shrink",
            fast_generate=True,  # tests/test_fast_generate.py: same tokens as transformers' loop
        )
    )
