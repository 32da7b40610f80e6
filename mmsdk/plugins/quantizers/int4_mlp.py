"""Gated MLPs whose gate and up projections are both INT4: one kernel for both at batch-1 decode.

transformers' gated MLP (LLaMA, Qwen2) computes ``down(act(gate(x)) * up(x))``; for one token on
CUDA that is two W4A16 GEMVs with their K-split sums, a SiLU and a multiply: six short kernels,
each costing about as much in launch gap as in work. When ``int4-weight`` has packed both
projections alike, the MLP's body runs :func:`mmsdk.kernels.w4a16_gated.w4a16_gated_silu` instead
(one GEMV launch over both weights that stores ``silu(gate) * up`` itself when K needs no split,
else that launch and one epilogue) and the original forward for everything else (CPU, prompts,
AWQ pre-scales, biases). The two linears stay separate modules with their own buffers, so exports
see exactly what they saw before. A decoder layer whose last residual add goes through
``plus_residual`` (``rmsnorm-rope-fusion``'s layer body) gets it from the down projection's GEMV, and one
that folds its post-attention RMSNorm (``normed_residual_body``) gets the norm inside the paired GEMV, or only
the norm's scale where o_proj's store left the norm's statistics.

Only MLPs that compute ``down(silu(gate(x)) * up(x))`` get the body: checked on a probe, bitwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmsdk.core.adapter import ModelAdapter
from mmsdk.kernels.norm_fold import NormStatistics
from mmsdk.plugins._forward import (
    has_forward_body,
    module_body,
    plus_residual,
    set_forward_body,
    set_normed_residual_body,
    set_residual_body,
)
from mmsdk.plugins.quantizers.int4_linear import Int4Linear

__all__ = ["fuse_gated_mlps", "install_gated_mlp"]


def _projections(mlp: nn.Module, adapter: ModelAdapter) -> tuple[Int4Linear, Int4Linear, nn.Module] | None:
    """(gate, up, down) when gate and up are INT4 linears the paired kernel can take together, else None."""
    names = adapter.mlp_projections(mlp)
    if names.gate is None:
        return None
    gate, up, down = (getattr(mlp, name, None) for name in (names.gate, names.up, names.down))
    if not (isinstance(gate, Int4Linear) and isinstance(up, Int4Linear) and isinstance(down, nn.Module)):
        return None
    plain = all(m.prequant is None and m.bias is None for m in (gate, up))
    same = (gate.in_features, gate.out_features, gate.block_size, gate.symmetric) == (
        up.in_features, up.out_features, up.block_size, up.symmetric)
    return (gate, up, down) if plain and same else None


def _gated_silu(x: torch.Tensor, gate: Int4Linear, up: Int4Linear, norm: nn.Module | None = None,
                statistics: NormStatistics | None = None) -> torch.Tensor | None:
    """``silu(gate(x)) * up(x)`` from the paired kernel, or None where it cannot run; with ``norm`` (an RMSNorm)
    of ``norm(x)``, the norm inside the kernel; with ``statistics`` (what the store of ``x`` left for that norm)
    of ``norm(x)`` too, the kernel reading ``statistics.scaled`` and scaling its sums."""
    if not x.is_cuda:
        return None
    from mmsdk.kernels.w4a16_gated import w4a16_gated_silu

    return w4a16_gated_silu(x if statistics is None else statistics.scaled.view_as(x),
                            (gate.qweight, gate.scales, gate.zero_points), (up.qweight, up.scales, up.zero_points),
                            gate.in_features, gate.block_size, norm=None if norm is None else gate.input_norm(norm),
                            statistics=statistics)


def install_gated_mlp(mlp: nn.Module, adapter: ModelAdapter) -> None:
    """Give ``mlp`` a body that runs the paired kernel where it can and the original forward elsewhere."""
    original = module_body(mlp)

    def paired(x: torch.Tensor, norm: nn.Module | None = None,
               statistics: NormStatistics | None = None) -> tuple[torch.Tensor, nn.Module] | None:
        """(``silu(gate(x)) * up(x)`` from the paired kernel, the down projection), or None where it cannot run
        (``norm``, ``statistics``: of ``norm(x)``, as :func:`_gated_silu` takes them)."""
        parts = _projections(mlp, adapter)
        if parts is None:
            return None
        gate, up, down = parts
        hidden = _gated_silu(x, gate, up, norm, statistics)
        return None if hidden is None else (hidden, down)

    def body(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        done = None if args or kwargs else paired(x)
        return original(x, *args, **kwargs) if done is None else done[1](done[0])

    def residual_body(x: torch.Tensor, residual: torch.Tensor) -> Any:
        """``residual + body(x)``; with the paired kernel the down projection adds the residual itself."""
        done = paired(x)
        return residual + original(x) if done is None else plus_residual(done[1], done[0], residual)

    def normed_residual_body(x: torch.Tensor, norm: nn.Module, residual: torch.Tensor,
                             statistics: NormStatistics | None = None, leave: nn.Module | None = None) -> Any:
        """``residual + body(norm(x))``; with the paired kernel the norm runs inside it (with ``statistics``, what
        the store of ``x`` left for ``norm``: only its scale, after the K loop) and the down projection adds the
        residual (its store leaving the statistics of ``leave``, the RMSNorm that reads the sum, where it can: ask
        it only of an INT4 down projection), elsewhere ``norm`` runs first."""
        done = paired(x, None, statistics) if statistics is not None else paired(x, norm)
        return residual_body(norm(x), residual) if done is None else plus_residual(done[1], done[0], residual, leave)

    set_forward_body(mlp, body)
    set_residual_body(mlp, residual_body)
    set_normed_residual_body(mlp, normed_residual_body)


def _computes_gated_silu(mlp: nn.Module, parts: tuple[Int4Linear, Int4Linear, nn.Module]) -> bool:
    """True when the MLP's forward equals ``down(silu(gate(x)) * up(x))`` on a probe (bitwise)."""
    gate, up, down = parts
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, gate.in_features, generator=generator).to(gate.scales.device, gate.scales.dtype)
    with torch.no_grad():
        expected = down(torch.nn.functional.silu(gate(x)) * up(x))
        got = module_body(mlp)(x)
    return isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.equal(got, expected)


def fuse_gated_mlps(model: nn.Module, adapter: ModelAdapter) -> list[str]:
    """Install the paired-kernel body on every decoder MLP that qualifies; return their names."""
    names = {id(m): n for n, m in model.named_modules()}
    fused = []
    for layer in adapter.decoder_layers(model):
        mlp = adapter.mlp(layer)
        parts = _projections(mlp, adapter)
        if parts is None or has_forward_body(mlp) or not _computes_gated_silu(mlp, parts):
            continue  # another pass already replaced what this MLP computes, or it is not a SiLU-gated MLP
        install_gated_mlp(mlp, adapter)
        fused.append(names[id(mlp)])
    return fused
