"""Counting what a prefill costs: the KV-cache bytes it leaves and the FLOPs of the ops it ran.

Counted, not estimated: bytes come from the tensors the returned cache object actually holds
(any Cache subclass, quantized ones included: every tensor reachable from it, shared storage
once), and FLOPs from ``torch.utils.flop_counter.FlopCounterMode`` over the shapes that ran
(matmuls, convolutions, attention; CPU SDPA is added here because torch does not count it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from mmsdk.core.memory import tensor_bytes

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["PrefillCost", "cache_bytes", "cache_tensors", "count_flops", "count_prefill"]


@dataclass(frozen=True)
class PrefillCost:
    """One prefill: FLOPs run, bytes its cache holds, and the sequence length each cache layer stores."""

    flops: int
    kv_bytes: int
    layer_lengths: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"flops": self.flops, "kv_bytes": self.kv_bytes, "layer_lengths": list(self.layer_lengths)}


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """Every tensor reachable from a cache object (attributes, lists, tuples, dicts), each once."""
    import torch

    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [cache]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.Tensor):
            found.append(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend(node)
        elif isinstance(node, torch.nn.Module) or isinstance(node, type):
            continue  # a module the cache points at owns weights, not cache entries
        elif hasattr(node, "__dict__"):
            stack.extend(vars(node).values())
    return found


def cache_bytes(cache: Any) -> int:
    """Bytes held by the tensors of ``cache`` (0 for None)."""
    return 0 if cache is None else tensor_bytes(cache_tensors(cache))


def _layer_lengths(cache: Any) -> tuple[int, ...]:
    layers = getattr(cache, "layers", None)
    if layers is None or not hasattr(cache, "get_seq_length"):
        return ()
    return tuple(int(cache.get_seq_length(index)) for index in range(len(layers)))


def _cpu_sdpa_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    batch, heads, q_len, dim = query_shape
    k_len, v_dim = key_shape[-2], value_shape[-1]
    return 2 * batch * heads * q_len * k_len * dim + 2 * batch * heads * q_len * k_len * v_dim


def count_flops(fn: Any, *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """(FLOPs, result) of running ``fn(*args, **kwargs)`` without gradients."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    # FlopCounterMode passes tensor shapes (and out_shape) to custom counters
    custom = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=custom) as counter:
        result = fn(*args, **kwargs)
    return int(counter.get_total_flops()), result


def count_prefill(model: nn.Module, inputs: Mapping[str, Any]) -> PrefillCost:
    """Run one prefill and count its FLOPs and the cache it leaves.

    Models that generate do it through ``generate(max_new_tokens=1)``: exactly one forward, with
    the cache ``generate`` would use (a quantizer's cache included); others through ``forward``.
    """
    if hasattr(model, "generate"):
        flops, output = count_flops(model.generate, **inputs, max_new_tokens=1, do_sample=False,
                                    return_dict_in_generate=True)
    else:
        flops, output = count_flops(model, **inputs, use_cache=True)
    cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
    return PrefillCost(flops=flops, kv_bytes=cache_bytes(cache), layer_lengths=_layer_lengths(cache))
