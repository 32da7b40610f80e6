"""Decode-step attention over unquantized grouped-query K/V with a mask, without a copy of K/V per query head.

transformers' SDPA attention hands grouped-query K/V to ``scaled_dot_product_attention`` as they are only when the
call has no mask; with one (a static cache's empty slots, Mllama's cross-attention mask over its padding tiles) it
first repeats every KV head for each of its query heads. On a decode step that copy is most of the attention's
cost: Mllama-11B's 8 cross-attention layers copy their 6404-token image K/V four times each step. This module runs
such a step through a flash-decoding kernel on the K/V as they are (:func:`decode_attention`: the slots split over
programs, each KV head's tile loaded once for its query heads and scored on the tensor cores, the mask's row
applied), and everything else through the model's own attention.

Fast generate turns it on around its decode steps only (:func:`grouped_decode_steps`): the attention implementation
named in the model's config is swapped for one registered here, which wraps it, and put back after; prompts and
transformers' own generate never see it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["attention_implementation", "decode_attention", "grouped_decode_steps", "set_own_attention", "takes"]

_PREFIX = "mmsdk_grouped_decode_"
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux")


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     mask: torch.Tensor | None = None, block_t: int = 64, warps: int = 4,
                     stages: int = 2) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, 1, D] over every slot of ``key`` / ``value`` [B, H_kv, T, D] that ``mask``
    ([B, L >= T] nonzero = attend, or None) keeps: ``[B, 1, Hq, D]`` in the query's dtype. CUDA (or Triton's
    interpreter); the inputs as :func:`takes` describes them."""
    from mmsdk.kernels import _grouped_decode_triton, _kv_triton, _split_merge_triton, pdl_ready
    from mmsdk.kernels.kv_decode_choice import pow2, splits

    batch, heads, _, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group = heads // kv_heads
    n_splits, split_t = splits(batch * kv_heads, slots, block_t)
    partial = torch.empty(batch * heads * n_splits * dim, device=query.device, dtype=torch.float32)
    lse = torch.empty(batch * heads * n_splits, device=query.device, dtype=torch.float32)
    out = torch.empty(batch, 1, heads, dim, device=query.device, dtype=query.dtype)
    pdl = pdl_ready(query)
    _grouped_decode_triton.decode_partial_grouped[(batch * kv_heads, n_splits)](
        query, key, value, mask if mask is not None else lse, partial, lse, query.stride(0), query.stride(1),
        mask.stride(0) if mask is not None else 0, mask.shape[-1] if mask is not None else 0, kv_heads, group, slots,
        split_t, float(scaling) * _kv_triton.LOG2E, D=dim, HAS_MASK=mask is not None,
        BLOCK_G=max(16, pow2(group)), BLOCK_T=block_t, PDL=pdl, launch_pdl=pdl, num_warps=warps,
        num_stages=stages, enable_fp_fusion=True)
    # lse stands in for V's scales and the count: not read
    _split_merge_triton.decode_combine_natural[(batch * heads,)](
        partial, lse, lse, out, heads, group, n_splits, out.stride(0), out.stride(2), lse,
        BLOCK_S=pow2(n_splits), D=dim, PDL=pdl, SCALED=False, num_warps=4 if dim >= 64 else 1, enable_fp_fusion=True)
    return out


def takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the kernel computes this attention call: one query token of grouped heads, over bf16 / fp16 K/V
    ``[B, H_kv, T, D]`` stored contiguously (a packed cache's marker is not; D a power of two, at least 16), with no
    mask or a 4-D one shared by the heads over exactly those T keys, on CUDA with Triton, and nothing the kernel does
    not do (dropout, a sliding window, soft-capping, sinks)."""
    from mmsdk.kernels import triton_ready

    if query.dim() != 4 or key.dim() != 4 or query.shape[2] != 1 or key.shape != value.shape:
        return False
    batch, heads, _, dim = query.shape
    kv_heads, tokens = key.shape[1], key.shape[2]
    if key.shape[0] != batch or key.shape[-1] != dim or kv_heads >= heads or heads % kv_heads or tokens == 0:
        return False
    if dim < 16 or dim & (dim - 1):  # whole tensor-core steps over a power-of-two head
        return False
    if not (query.dtype == key.dtype == value.dtype and query.dtype in (torch.bfloat16, torch.float16)):
        return False
    if not (key.is_contiguous() and value.is_contiguous() and query.stride(-1) == 1):
        return False
    if kwargs.get("dropout") or any(kwargs.get(name) is not None for name in _UNSUPPORTED):
        return False
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == 1
                                 and mask.shape[-1] == tokens and mask.shape[0] in (1, batch)
                                 and mask.stride(-1) == 1  # the kernel reads the row's keys one after another
                                 and (mask.dtype == torch.bool or mask.dtype.is_floating_point)):
        return False
    return triton_ready(query, key, value)


def _make_attention(base: str) -> Any:
    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from mmsdk.kernels.kv_decode import _mask_row

        if not getattr(module, "training", False) and takes(query, key, value, attention_mask, kwargs):
            scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
            return decode_attention(query, key, value, scaling, _mask_row(attention_mask, query.shape[0])), None
        return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, *args, **kwargs)

    attention.__name__ = f"{_PREFIX}{base}"
    return attention


def attention_implementation(base: str) -> str | None:
    """Register (once) and return the attention implementation that runs the kernel where :func:`takes` says so and
    ``base`` otherwise; None when ``base`` is not one it wraps: SDPA, or the packed-KV wrapper (flash / flex
    implementations take no 4-D mask; "eager" is each model's own function, which the registry does not hold)."""
    if base.startswith(_PREFIX):
        return base
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from mmsdk.kernels.kv_decode import register_wrapper

    packed = base.startswith("mmsdk_packed_kv_") and base in ALL_ATTENTION_FUNCTIONS  # the packed-KV wrapper
    if base != "sdpa" and not packed:
        return None
    return register_wrapper(f"{_PREFIX}{base}", base, _make_attention)


@contextmanager
def grouped_decode_steps(config: Any) -> Iterator[None]:
    """While inside, the attention implementation named in ``config`` (the language model's) runs decode steps of
    grouped heads over unquantized K/V through the kernel; it is put back on the way out, error or not."""
    base = getattr(config, "_attn_implementation", None)
    wrapped = attention_implementation(base) if isinstance(base, str) else None
    if wrapped is None or wrapped == base:
        yield
        return
    set_own_attention(config, wrapped)
    try:
        yield
    finally:
        set_own_attention(config, base)


def set_own_attention(config: Any, name: str | None) -> None:
    """Name ``config``'s attention implementation, leaving its sub-configs' as they are.

    transformers' setter passes a plain name on to every sub-config (IDEFICS's text config is the whole model's, with
    its vision and perceiver configs under it); a ``{"": name}`` mapping names this config's alone.
    """
    from transformers import PretrainedConfig

    config._attn_implementation = {"": name} if isinstance(config, PretrainedConfig) else name
