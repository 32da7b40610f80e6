"""The modules ``rmsnorm-rope-fusion`` installs: fused norms and rotary ops, one kernel each on CUDA.

Each has a ``forward`` that runs the CUDA ops (mmsdk/kernels/norm_rope_gpu.py, torch reference
elsewhere) and, where the pass checks it against the module it replaces, a ``reference`` that runs
the torch reference ops (mmsdk/kernels/norm_rope.py). The pass itself is
:mod:`mmsdk.plugins.attention.rmsnorm_rope`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmsdk.kernels import norm_rope as reference_ops
from mmsdk.kernels import norm_rope_gpu as fast_ops

__all__ = ["DeferredRMSNorm", "FusedAddRMSNorm", "FusedMRoPEEmbedding", "FusedRMSNormRoPE", "FusedRoPE",
           "FusedRoPEEmbedding", "RoPEInAttention"]


class FusedAddRMSNorm(nn.Module):
    """``(rms_norm(x + residual), x + residual)``; with no residual, a plain RMSNorm."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, ops: Any = fast_ops) -> Any:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)

    def reference(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """The torch reference ops' result (what the probe compares with the original module)."""
        return self.forward(x, residual, reference_ops)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class FusedRoPE(nn.Module):
    """Rotates q and k with the same cos/sin in one op (no parameters)."""

    def __init__(self, head_dim: int, mrope_section: list[int] | None = None, mrope_interleaved: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.mrope_section = mrope_section
        self.mrope_interleaved = mrope_interleaved

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int = 1, ops: Any = fast_ops) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rope_qk(q, k, cos, sin, unsqueeze_dim)

    def reference(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference ops' result."""
        return self.forward(q, k, cos, sin, 1, reference_ops)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, mrope_section={self.mrope_section}"


class RoPEInAttention:
    """The rotary op of an attention forward that may leave a decode step's RoPE to a packed KV cache's kernel.

    While ``cache_layer`` is set (by the attention body rmsnorm-rope-fusion installs, for one call), the first
    call whose q and k that layer accepts (:meth:`~mmsdk.plugins.quantizers.static_kv.PackedStaticLayer.take_rope`)
    returns them unrotated: the decode kernel rotates them as it loads them. Every other call rotates with ``fused``.
    """

    def __init__(self, fused: FusedRoPE) -> None:
        self.fused = fused
        self.cache_layer: Any = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer, self.cache_layer = self.cache_layer, None
        if layer is not None and unsqueeze_dim == 1 and not args and not kwargs and layer.take_rope(q, k, cos, sin):
            return q, k
        return self.fused(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)


class DeferredRMSNorm(nn.Module):
    """Keeps a per-head RMSNorm's weight where it was; the norm itself runs inside FusedRMSNormRoPE."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """What the original norm computed (for code that needs normalized q/k outside attention)."""
        return reference_ops.rms_norm(x, self.weight, self.eps)


class FusedRMSNormRoPE(nn.Module):
    """Per-head RMSNorm of q and k, then RoPE, in one op; reads the weights of the deferred norms."""

    def __init__(self, q_norm: DeferredRMSNorm, k_norm: DeferredRMSNorm, head_dim: int,
                 mrope_section: list[int] | None = None, mrope_interleaved: bool = False) -> None:
        super().__init__()
        object.__setattr__(self, "_norms", (q_norm, k_norm))  # references, not submodules: weights stay put
        self.head_dim = head_dim
        self.mrope_section = mrope_section
        self.mrope_interleaved = mrope_interleaved

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int = 1, ops: Any = fast_ops) -> tuple[torch.Tensor, torch.Tensor]:
        qn, kn = self._norms
        return ops.rms_norm_rope_qk(q, k, qn.weight, kn.weight, (qn.eps, kn.eps), cos, sin)

    def reference(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference ops' result."""
        return self.forward(q, k, cos, sin, 1, reference_ops)


class FusedMRoPEEmbedding(nn.Module):
    """M-RoPE cos/sin for [3, B, L] positions, each frequency slot reading its own position stream."""

    def __init__(self, original: nn.Module, streams: list[int]) -> None:
        super().__init__()
        self.register_buffer("inv_freq", original.inv_freq, persistent=False)
        # the slot -> stream map as a device buffer: a list would be copied to the GPU on every call, which
        # breaks CUDA-graph capture of decode steps (mmsdk.kernels.fast_generate)
        self.register_buffer("stream_index", torch.tensor(streams, dtype=torch.int32,
                                                          device=original.inv_freq.device), persistent=False)
        self.attention_scaling = float(original.attention_scaling)
        self.streams = streams

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, ops: Any = fast_ops) -> tuple[torch.Tensor, ...]:
        positions = position_ids.expand(3, -1, -1) if position_ids.dim() == 2 else position_ids
        return ops.mrope_cos_sin(positions, self.inv_freq, self.stream_index, self.attention_scaling, x.dtype)

    def reference(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference ops' result."""
        return self.forward(x, position_ids, reference_ops)  # type: ignore[return-value]


class FusedRoPEEmbedding(FusedMRoPEEmbedding):
    """Plain RoPE cos/sin for [B, L] positions in one kernel (every frequency slot reads the one position stream);
    transformers' rotary module launches about seven small kernels per call (a matmul, cat, cos, sin, scaling, casts),
    each a launch of its own in a decode step."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__(original, [0] * original.inv_freq.shape[0])

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, ops: Any = fast_ops) -> tuple[torch.Tensor, ...]:
        # one stream: [1, B, L] is a view, where expanding to three streams would be copied by the kernel's wrapper
        return ops.mrope_cos_sin(position_ids[None], self.inv_freq, self.stream_index, self.attention_scaling, x.dtype)
