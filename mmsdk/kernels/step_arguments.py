"""What a language model receives on a decode step, recorded from the model's own forward (for fast generate).

The model's forward runs for the first decode token and is stopped where the language model's body would start, so
the first decode token costs a replay of a kept graph (or, on a call that builds one, its eager warm-up run) instead
of one more eager pass through every layer (on an H200, LLaVA-1.5-7B with int4 weights and KV: ~50 ms eager, ~2 ms
replayed). The arguments are taken before the passes' forward wrappers, which the step runs again (a cross-attention
reducer must see the states once); the positions after them: token pruning's wrapper renumbers a decode step's
positions to continue the unpruned prompt, which it does only inside the model's forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmsdk.kernels.fast_generate_scope import Unsupported

__all__ = ["record_step_arguments"]


class _Recorded(Exception):
    """Raised in place of the language model's body once a decode step's arguments are recorded."""


def record_step_arguments(model: nn.Module, adapter: Any, token: torch.Tensor, cache: dict[str, Any],
                          step_inputs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments the language model gets on the decode step of ``token`` ([B]), as ``model``'s forward
    makes them from ``cache`` (its keyword and the cache) and ``step_inputs`` (the adapter's decode_step_inputs),
    with the positions the passes' wrappers give it. Raises :class:`Unsupported` where a captured step could not
    stand in for that call."""
    from mmsdk.plugins._forward import innermost_override

    language = adapter.language_model(model)
    seen: dict[str, Any] = {}
    body: dict[str, Any] = {}

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.update(kwargs)

    def stop(*args: Any, **kwargs: Any) -> None:
        body.update(kwargs)
        raise _Recorded

    handle = language.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with innermost_override(language, lambda forward: stop):
            # no mask: the batch has no padding, and a 2-D mask makes some models rebuild all positions
            model(input_ids=token[:, None], **cache, use_cache=True, logits_to_keep=1, **step_inputs)
    except _Recorded:
        pass
    finally:
        handle.remove()
    if not body:
        raise Unsupported("the decode token's forward never reached the language model's body (a pass or the model "
                          "ended it early)")
    if seen.get("inputs_embeds") is None and seen.get("input_ids") is None:
        raise Unsupported("the language model got neither inputs_embeds nor input_ids on a decode step")
    mask = body.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise Unsupported("token pruning kept different numbers of tokens per row, so the cache holds padding that "
                          "the captured step (no attention mask) would attend to")
    if isinstance(body.get("position_ids"), torch.Tensor):
        seen["position_ids"] = body["position_ids"]
    return seen
