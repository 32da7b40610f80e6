"""Emitting the fused ONNX Runtime ops the decoder is made of: linears, RMSNorm, rotary, attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.onnxruntime.lowering import DenseWeights, LinearWeights, NBitsWeights, OrtEmitter

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.backend import LowerTarget
    from mmsdk.core.session import Session
    from mmsdk.plugins.backends.onnxruntime.graph import GraphBuilder

__all__ = ["linear", "linear_group", "NormSpec", "norm_spec", "rms_norm", "skip_rms_norm", "activation", "MS"]

MS = "com.microsoft"


def linear(g: GraphBuilder, x: str, weights: LinearWeights, hint: str, *, accuracy_level: int = 0) -> str:
    """``x @ W.T (+ b)``: MatMul for float weights, MatMulNBits (bytes copied as they are) for NBits."""
    if isinstance(weights, DenseWeights):
        out = g.op("MatMul", [x, g.const(f"{hint}.weight_t", weights.weight.T)], hint=f"{hint}/MatMul")
        if weights.bias is not None:
            out = g.op("Add", [out, g.const(f"{hint}.bias", weights.bias)], hint=f"{hint}/Add")
        return out
    return _matmul_nbits(g, x, weights, hint, accuracy_level)


def linear_group(g: GraphBuilder, x: str, parts: Sequence[LinearWeights], sizes: Sequence[int], hint: str, *,
                 accuracy_level: int = 0) -> list[str]:
    """Outputs of projections sharing input ``x``: one matmul split by ``sizes``, or one matmul each."""
    if len(parts) == 1:
        out = linear(g, x, parts[0], hint, accuracy_level=accuracy_level)
        return split(g, out, sizes, f"split_{hint}")
    return [linear(g, x, part, f"{hint}.{index}", accuracy_level=accuracy_level) for index, part in enumerate(parts)]


def _matmul_nbits(g: GraphBuilder, x: str, w: NBitsWeights, hint: str, accuracy_level: int) -> str:
    if w.prequant is not None:  # AWQ: y = (x * prequant) @ W_hat.T
        x = g.op("Mul", [x, g.const(f"{hint}.prequant", w.prequant)], hint=f"{hint}/prequant")
    inputs = [x, g.const(f"{hint}.qweight", w.packed), g.const(f"{hint}.scales", w.scales)]
    optional: list[str] = []
    if w.zero_points is not None:
        optional = [g.const(f"{hint}.zero_points", w.zero_points, keep_dtype=w.zero_points.dtype == np.uint8)]
    if w.bias is not None:
        optional = [optional[0] if optional else "", "", g.const(f"{hint}.bias", w.bias)]
    return g.op("MatMulNBits", inputs + optional, domain=MS, hint=f"{hint}/MatMulNBits", K=w.in_features,
                N=w.out_features, bits=w.bits, block_size=w.block_size, accuracy_level=accuracy_level)


@dataclass(frozen=True)
class NormSpec:
    """An RMSNorm as ONNX needs it: its scale and epsilon (or a plugin's own emitter)."""

    weight: np.ndarray | None
    eps: float
    emitter: OrtEmitter | None = None


def norm_spec(module: nn.Module, session: Session, target: LowerTarget, where: str) -> NormSpec:
    """Read an RMSNorm module, after checking numerically that it computes ``w * x / rms(x)``."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if weight is not None and isinstance(eps, float) and _behaves_as_rms_norm(module, eps):
        return NormSpec(weight.detach().float().cpu().numpy(), eps)
    answer = session.lower(module, target)
    if isinstance(answer, NormSpec):
        return answer
    if isinstance(answer, OrtEmitter):
        return NormSpec(None, 0.0, answer)
    raise ExportError(
        f"the onnxruntime backend cannot emit {where} ({type(module).__name__}): it does not compute "
        "weight * x / sqrt(mean(x^2) + eps) and no plugin answered mmsdk_lower for it.",
        fix="drop the pass that replaced this norm, or have its plugin implement mmsdk_lower for 'onnxruntime'.",
    )


def _behaves_as_rms_norm(module: nn.Module, eps: float) -> bool:
    import torch

    width = module.weight.shape[-1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, width, generator=gen, dtype=module.weight.dtype, device=module.weight.device)
    with torch.no_grad():
        got = module(x).float()
        xf = x.float()
        want = module.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
    return bool(torch.allclose(got, want, rtol=1e-3, atol=1e-4))


def rms_norm(g: GraphBuilder, x: str, spec: NormSpec, hint: str) -> str:
    """SimplifiedLayerNormalization (domain ""), or the plugin's own nodes."""
    if spec.emitter is not None:
        return spec.emitter.emit(g, [x])[0]
    return g.op("SimplifiedLayerNormalization", [x, g.const(f"{hint}.weight", spec.weight)], hint=hint,
                axis=-1, epsilon=spec.eps, stash_type=1)


def skip_rms_norm(g: GraphBuilder, x: str, skip: str, spec: NormSpec, hint: str) -> tuple[str, str]:
    """(norm(x + skip), x + skip) in one SkipSimplifiedLayerNormalization."""
    if spec.emitter is not None:
        total = g.op("Add", [x, skip], hint=f"{hint}/residual")
        return spec.emitter.emit(g, [total])[0], total
    outs = g.op("SkipSimplifiedLayerNormalization", [x, skip, g.const(f"{hint}.weight", spec.weight)],
                outputs=4, domain=MS, hint=hint, epsilon=spec.eps)
    return outs[0], outs[3]


def activation(g: GraphBuilder, x: str, name: str, hint: str) -> str:
    """The MLP activation ``name`` (a transformers ACT2FN key)."""
    if name in ("silu", "swish"):
        return g.op("Mul", [x, g.op("Sigmoid", [x], hint=f"{hint}/Sigmoid")], hint=f"{hint}/Mul")
    if name in ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        approximate = "none" if name == "gelu" else "tanh"
        return g.op("Gelu", [x], hint=hint, approximate=approximate)
    if name == "relu":
        return g.op("Relu", [x], hint=hint)
    raise ExportError(
        f"MLP activation {name!r} has no ONNX lowering in the onnxruntime backend.",
        fix="use a model whose hidden_act is silu, gelu, gelu_pytorch_tanh or relu, or export to 'torch'.",
    )


def split(g: GraphBuilder, x: str, sizes: Sequence[int], hint: str) -> list[str]:
    """Split the last axis into ``sizes``."""
    return g.op("Split", [x, g.ints(f"{hint}.sizes", sizes)], outputs=len(sizes), hint=hint, axis=-1)


def float_min(g: GraphBuilder) -> float:
    """The most negative finite value of the graph's float type (additive mask value, as transformers uses)."""
    from onnx import helper

    return float(np.finfo(helper.tensor_dtype_to_np_dtype(g.float_type)).min)


def attrs_of(**attrs: Any) -> dict[str, Any]:
    """Attributes without the ones left as None."""
    return {k: v for k, v in attrs.items() if v is not None}
