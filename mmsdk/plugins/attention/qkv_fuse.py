"""``qkv-fuse``: one matmul for the q, k and v projections, in TensorRT-LLM's [q; k; v] order.

The fused projection is a plain ``nn.Linear`` registered as ``qkv_proj`` (``kv_proj`` for
cross-attention, whose queries read another input), so quantizers and exporters treat it like any
linear. The original ``q_proj``/``k_proj``/``v_proj`` attributes become :class:`FusedSlice`
stand-ins: the model's own attention code still calls them, the first call computes the fused
product once, and the others take their share of it. The weight rows are GQA aware: q has
``heads * head_dim`` rows, k and v ``kv_heads * head_dim`` each.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from pydantic import Field
from torch import nn

import mmsdk
from mmsdk.core.adapter import AttentionProjections, ModelAdapter
from mmsdk.core.config import PassConfig
from mmsdk.core.passes import PassContext, PassSpec
from mmsdk.core.registry import Registrar

__all__ = ["QKVFuseConfig", "FusedSlice", "fuse_projections", "apply_qkv_fuse"]


class QKVFuseConfig(PassConfig):
    """Which attention modules get their projections fused."""

    language_model: bool = Field(True, description="Fuse q/k/v of the decoder's self-attention layers.")
    cross_attention: bool = Field(True, description="Fuse k/v of cross-attention layers (Flamingo family).")
    vision_tower: bool = Field(False, description="Fuse q/k/v of the vision encoder's attention too.")


class _Memo:
    """The last fused product and which slices have not read it yet."""

    __slots__ = ("input", "outputs", "pending")

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.pending: set[str] = set()


class FusedSlice(nn.Module):
    """Stands in for one original projection: returns its rows of the fused projection's output."""

    def __init__(self, owner: nn.Module, fused_name: str, role: str, roles: tuple[str, ...], sizes: tuple[int, ...],
                 memo: _Memo) -> None:
        super().__init__()
        # Plain attributes, not submodules: the fused linear is registered once, on its owner.
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_memo", memo)
        self.fused_name, self.role, self.roles, self.sizes = fused_name, role, roles, sizes
        self.index = roles.index(role)
        self.out_features = sizes[self.index]
        self.in_features = self.fused.in_features

    @property
    def fused(self) -> nn.Module:
        """The fused linear, looked up on each call so a quantizer may replace it."""
        return getattr(self._owner, self.fused_name)

    @property
    def weight(self) -> torch.Tensor:
        """This projection's rows of the fused weight (a view; for code that inspects dtype/device)."""
        start = sum(self.sizes[: self.index])
        return self.fused.weight[start : start + self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memo: _Memo = self._memo
        if memo.input is not x or self.role not in memo.pending:
            memo.input, memo.outputs = x, self.fused(x).split(self.sizes, dim=-1)
            memo.pending = set(self.roles)
        memo.pending.discard(self.role)
        out = memo.outputs[self.index]
        if not memo.pending:  # every projection has read it: drop the references
            memo.input, memo.outputs = None, ()
        return out

    def extra_repr(self) -> str:
        return f"role={self.role}, rows={self.out_features}, of={self.fused_name}"


def fuse_projections(owner: nn.Module, names: Mapping[str, str], fused_name: str) -> nn.Linear:
    """Replace ``owner``'s projections ``names`` (role -> attribute) with one fused linear + slices."""
    parts = [getattr(owner, name) for name in names.values()]
    weight = torch.cat([p.weight.detach() for p in parts], dim=0)
    has_bias = [p.bias is not None for p in parts]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=any(has_bias), device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, device=weight.device,
                                        dtype=weight.dtype) for p in parts]))
    setattr(owner, fused_name, fused)
    roles, sizes, memo = tuple(names), tuple(p.out_features for p in parts), _Memo()
    for role, name in names.items():
        setattr(owner, name, FusedSlice(owner, fused_name, role, roles, sizes, memo))
    return fused


def _fusable(attention: nn.Module, projections: AttentionProjections, roles: tuple[str, ...]) -> dict[str, str] | None:
    names = projections.linears()
    if projections.qkv is not None or any(role not in names for role in roles):
        return None  # already fused by the model itself (Qwen's vision qkv), or a part is missing
    picked = {role: names[role] for role in roles}
    if not all(isinstance(getattr(attention, n, None), nn.Linear) for n in picked.values()):
        return None
    return picked


def _targets(model: nn.Module, adapter: ModelAdapter, config: QKVFuseConfig) -> list[tuple[nn.Module, AttentionProjections,
                                                                                              tuple[str, ...], str]]:
    targets = []
    if config.language_model:
        for layer in adapter.decoder_layers(model):
            attention = adapter.self_attention(layer)
            if attention is not None:
                targets.append((attention, adapter.attention_projections(attention), ("q", "k", "v"), "qkv_proj"))
    if config.cross_attention:
        for block in adapter.cross_attention_blocks(model):
            targets.append((block.attention, block.projections, ("k", "v"), "kv_proj"))
    if config.vision_tower:
        for block in adapter.vision_blocks(model):
            targets.append((block.attention, block.projections, ("q", "k", "v"), "qkv_proj"))
    return targets


def apply_qkv_fuse(model: nn.Module, config: QKVFuseConfig, context: PassContext) -> dict[str, Any]:
    """Fuse every targeted attention's projections; return what was fused."""
    names = {id(module): name for name, module in model.named_modules()}
    fused: list[str] = []
    for attention, projections, roles, fused_name in _targets(model, context.adapter, config):
        picked = _fusable(attention, projections, roles)
        if picked is not None:
            fuse_projections(attention, picked, fused_name)
            fused.append(f"{names[id(attention)]}.{fused_name}")
    return {"fused": fused, "order": "q,k,v (cross-attention: k,v)"}


@mmsdk.hookimpl
def mmsdk_register_attention(register: Registrar[PassSpec]) -> None:
    register(
        PassSpec(
            name="qkv-fuse",
            config_cls=QKVFuseConfig,
            apply=apply_qkv_fuse,
            summary="fuse q/k/v projections into one matmul in TensorRT-LLM's [q; k; v] order (GQA aware)",
            fast_generate=True,  # tests/test_fast_generate.py: same tokens as transformers' loop
        )
    )
