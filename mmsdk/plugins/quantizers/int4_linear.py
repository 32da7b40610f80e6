"""``Int4Linear``: a weight-only INT4 linear layer whose buffers are MatMulNBits' inputs, byte for byte.

Buffers (all persistent, so a torch export holds exactly what ONNX Runtime's MatMulNBits reads):
``qweight`` uint8 ``[N, k_blocks, block/2]``, ``scales`` ``[N, k_blocks]``, ``zero_points`` uint8
``[N, ceil(k_blocks/2)]`` when asymmetric, and ``prequant`` ``[K]`` when AWQ chose per-input-channel
scales (``y = (x * prequant) @ W_hat.T + bias``, TensorRT-LLM's ``prequant_scaling_factor``).

On CUDA with bf16/fp16 activations it runs mmsdk's Triton W4A16 kernel
(:mod:`mmsdk.kernels.w4a16`), which reads these packed buffers directly: no second copy of the
weight is ever kept. On CPU, without Triton, or with other dtypes, the weight is dequantized for
each call (transient memory only) and ``F.linear`` runs; the ``mmsdk.kernels`` log says so once.

A decoder layer may hand the layer its next call's RMSNorm (:meth:`Int4Linear.normalize_next`: the call then
gets the norm's input and computes ``linear(norm(x))``, the norm folded into the batch-1 GEMV on CUDA,
mmsdk.kernels.norm_fold) or a residual to add (:meth:`Int4Linear.add_next`, in the GEMV's last store, which can
also leave the statistics of the RMSNorm that reads the sum: :meth:`Int4Linear.left_statistics`):
``rmsnorm-rope-fusion``'s ``norm_in_gemv`` does, for one call at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from mmsdk.kernels.norm_fold import InputNorm, NormRequest, NormStatistics, quad_factors
from mmsdk.plugins.quantizers.packing import PackedInt4, dequantize_int4, padded_k, quantize_int4
from mmsdk.plugins.tensor_keys import being_captured

__all__ = ["Int4Linear"]


class Int4Linear(nn.Module):
    """Drop-in replacement of ``nn.Linear`` holding a packed INT4 weight in MatMulNBits layout."""

    # one call's hand-offs from the decoder layer (normalize_next / add_next) and the folded norm's factors, set on the
    # instance when used; None here, so a module pickled before they existed still runs
    _next_norm: tuple[torch.Tensor, nn.Module, NormStatistics | None] | None = None
    _next_residual: torch.Tensor | None = None
    _next_request: NormRequest | None = None
    _left: NormStatistics | None = None
    _factors: tuple[tuple[object, ...], torch.Tensor] | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        block_size: int,
        symmetric: bool = True,
        bias: bool = False,
        prequant: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_size, self.symmetric = block_size, symmetric
        k_blocks = padded_k(in_features, block_size) // block_size
        empty = dict(device=device)
        self.register_buffer(
            "qweight", torch.zeros(out_features, k_blocks, block_size // 2, dtype=torch.uint8, **empty)
        )
        self.register_buffer("scales", torch.ones(out_features, k_blocks, dtype=dtype, **empty))
        zp_shape = (out_features, -(-k_blocks // 2))
        self.register_buffer("zero_points", None if symmetric else torch.zeros(zp_shape, dtype=torch.uint8, **empty))
        self.register_buffer("prequant", torch.ones(in_features, dtype=dtype, **empty) if prequant else None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, **empty), requires_grad=False) if bias else None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        block_size: int,
        symmetric: bool = True,
        channel_scale: torch.Tensor | None = None,
        clip: torch.Tensor | None = None,
    ) -> Int4Linear:
        """Quantize ``linear``; with ``channel_scale`` s (AWQ), store ``W * s`` and ``prequant = 1 / s``."""
        weight = linear.weight.detach()
        if channel_scale is not None:
            weight = weight.float() * channel_scale.float().to(weight.device)
        packed = quantize_int4(weight, block_size, symmetric=symmetric, clip=clip, scale_dtype=linear.weight.dtype)
        module = cls(
            linear.in_features,
            linear.out_features,
            block_size=block_size,
            symmetric=symmetric,
            bias=linear.bias is not None,
            prequant=channel_scale is not None,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        module.load_packed(packed)
        with torch.no_grad():
            if linear.bias is not None:
                module.bias.copy_(linear.bias.detach())
            if channel_scale is not None:
                module.prequant.copy_((1.0 / channel_scale.float()).to(module.prequant))
        return module

    def load_packed(self, packed: PackedInt4) -> None:
        """Copy a :class:`PackedInt4` into this module's buffers."""
        with torch.no_grad():
            self.qweight.copy_(packed.qweight)
            self.scales.copy_(packed.scales)
            if self.zero_points is not None and packed.zero_points is not None:
                self.zero_points.copy_(packed.zero_points)

    def packed(self) -> PackedInt4:
        """This layer's weight as a :class:`PackedInt4` (views of the buffers, no copy)."""
        return PackedInt4(self.qweight, self.scales, self.zero_points, self.in_features, self.block_size)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ``[N, K]`` weight this layer multiplies by (AWQ scale still folded in)."""
        return dequantize_int4(self.packed(), dtype or self.scales.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = residual = request = statistics = None
        if self._next_norm is not None and self._next_norm[0] is x:
            _, norm, statistics = self._next_norm
            self._next_norm = None
        # attributes are written only when something was handed off: nn.Module's __setattr__ costs a few µs a call,
        # and an eager prefill (never replayed from a graph) pays it on every linear
        if self._next_residual is not None or self._next_request is not None:
            residual, request = self._next_residual, self._next_request
            self._next_residual = self._next_request = None
        out = self._product(x, residual, norm, request, statistics)
        self._keep_left(request)
        return out

    def residual_forward(self, x: torch.Tensor, residual: torch.Tensor, leave: nn.Module | None = None) -> torch.Tensor:
        """``residual + self(x)``, bitwise; on CUDA the batch-1 GEMV adds the residual in its last store
        (mmsdk.plugins._forward.plus_residual calls this for a decoder layer's last residual add). With ``leave``
        (the RMSNorm that reads the sum: the next layer's input norm) the store also leaves its statistics where the
        kernel can (:meth:`left_statistics`)."""
        request = None if leave is None else NormRequest(leave.weight, leave.eps)
        out = self._product(x, residual, None, request)
        self._keep_left(request)
        return out

    def _keep_left(self, request: NormRequest | None) -> None:
        """Keep what a call's store left for :meth:`left_statistics` (attributes written only when there is or was
        something to keep: see :meth:`forward`)."""
        if request is not None or self._left is not None:
            self._left = None if request is None else request.statistics

    def normalize_next(self, x: torch.Tensor, norm: nn.Module, statistics: NormStatistics | None = None) -> None:
        """Make the next call on exactly ``x`` compute ``self(norm(x))``: ``norm`` an RMSNorm with ``weight`` and
        ``eps`` (the decoder layer's, whose output only this layer reads); ``statistics``, what the store of ``x``
        left for ``norm``, let a batch-1 integer-dot GEMV apply the norm without reading the row for it (the others,
        and layers with an AWQ pre-scale, fold ``norm``). Cleared by that call or by :meth:`clear_next`; a call on
        another tensor leaves it waiting."""
        self._next_norm = (x, norm, statistics)

    def add_next(self, residual: torch.Tensor, norm: nn.Module | None = None) -> None:
        """Make the next call return ``residual + self(x)`` (the attention's residual add, in the GEMV's store); with
        ``norm`` (the RMSNorm that reads that sum) the store also leaves the norm's statistics where the kernel can
        (:meth:`left_statistics`)."""
        self._next_residual = residual
        self._next_request = None if norm is None else NormRequest(norm.weight, norm.eps)

    def left_statistics(self) -> NormStatistics | None:
        """The statistics the last call's store left for the norm :meth:`add_next` named (None where it could not),
        once: a second look gets None."""
        left, self._left = self._left, None
        return left

    def clear_next(self) -> tuple[bool, bool]:
        """Drop what :meth:`normalize_next` / :meth:`add_next` left; (a norm was left, a residual was left)."""
        left = (self._next_norm is not None, self._next_residual is not None)
        self._next_norm = self._next_residual = self._next_request = None
        return left

    def input_norm(self, norm: nn.Module) -> InputNorm:
        """``norm`` (weight, eps) as this layer's GEMV folds it, with this layer's AWQ pre-scale; the factors are
        built once per norm weight, device and version, and kept. Factors built inside a CUDA graph capture are not
        kept: a capture only records their computation, and one that is dropped (a decode step recorded for its
        kernels, mmsdk.kernels.parallel_compile.compile_before_first_call) never runs it."""
        weight = norm.weight
        key = (id(weight), weight.device, weight.dtype, weight.data_ptr(), _version(weight),
               None if self.prequant is None else (self.prequant.data_ptr(), _version(self.prequant)))
        if self._factors is None or self._factors[0] != key:
            factors = quad_factors(weight, self.prequant)
            if being_captured(weight):
                return InputNorm(weight, float(norm.eps), factors, self.prequant)
            self._factors = (key, factors)
        return InputNorm(weight, float(norm.eps), self._factors[1], self.prequant)

    def _product(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module | None = None,
                 leave: NormRequest | None = None, statistics: NormStatistics | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` (``norm(x)`` first when given; ``statistics`` as :meth:`normalize_next` takes them),
        then ``residual +`` it when given (in the GEMV's last store where it can, which fills ``leave`` where it
        can)."""
        folded = None if norm is None else self.input_norm(norm)
        if folded is None or self.prequant is not None:
            statistics = None  # they hold weight * x, without a pre-scale
        if folded is None and self.prequant is not None:
            x = x * self.prequant.to(x.dtype)
        if x.is_cuda:
            from mmsdk.kernels.w4a16 import int4_linear

            out = int4_linear(x, self.qweight, self.scales, self.zero_points, self.in_features, self.block_size,
                              self.bias, residual=residual, input_norm=folded, leave=leave,
                              input_statistics=statistics)
            if out is not None:
                return out
        if folded is not None:
            x = folded.normalize(x)  # with the pre-scale after it
        out = torch.nn.functional.linear(x, self.dequantize(x.dtype))
        out = out if self.bias is None else out + self.bias.to(out.dtype)
        return out if residual is None else residual + out

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        awq = ", awq prequant" if self.prequant is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{self.block_size} {kind}{awq}"


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification count (inference-mode tensors keep none: -1)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return -1
