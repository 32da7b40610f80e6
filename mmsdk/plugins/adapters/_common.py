"""Helpers shared by the built-in adapters: attribute paths and standard vision-encoder layers."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from mmsdk.core.adapter import AttentionProjections, MLPProjections, VisionBlock

__all__ = ["first_attr", "clip_like_blocks"]


def first_attr(root: Any, paths: Sequence[str]) -> Any:
    """The object at the first dotted path that exists under ``root``; AttributeError naming all tried."""
    for path in paths:
        node = root
        try:
            for part in path.split("."):
                node = getattr(node, part)
        except AttributeError:
            continue
        return node
    raise AttributeError(f"{type(root).__name__} has none of the attributes {', '.join(paths)}")


def clip_like_blocks(layers: nn.ModuleList | Sequence[nn.Module], num_heads: int) -> list[VisionBlock]:
    """VisionBlocks for CLIP/SigLIP/IDEFICS/Mllama-style layers (self_attn q/k/v + out/o, mlp fc1/fc2)."""
    blocks = []
    for layer in layers:
        attn = layer.self_attn
        out_name = "out_proj" if hasattr(attn, "out_proj") else "o_proj"
        blocks.append(
            VisionBlock(
                module=layer,
                attention=attn,
                projections=AttentionProjections(o=out_name),
                mlp=layer.mlp,
                mlp_projections=MLPProjections(up="fc1", down="fc2"),
                num_heads=getattr(attn, "num_heads", num_heads),  # fewer after vit-prune
                head_dim=getattr(attn, "head_dim", attn.q_proj.out_features // num_heads),
            )
        )
    return blocks
