"""Which ``generate()`` calls fast generate (mmsdk.kernels.fast_generate) takes, and why it refuses the others.

The fast path decodes greedily or samples (temperature, top-k, top-p, min-p: mmsdk.kernels.sampling), with
transformers' repetition penalty where one is set (mmsdk.kernels.repetition), with or without a streamer
(mmsdk.kernels.streaming), without padding, from a prompt of ``input_ids`` (with the image inputs the model families
take) for as many new tokens as transformers would make (:func:`new_tokens`); anything else keeps transformers'
loop. Refusals are reasons, not errors: the caller logs them once and runs transformers' generate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmsdk.kernels.generation_settings import transformers_defaults
from mmsdk.kernels.repetition import repetition_reason
from mmsdk.kernels.sampling import SAMPLING_OPTIONS, Sampler, sampling_reason

__all__ = ["GENERATE_OPTIONS", "REFUSAL", "Unsupported", "new_tokens", "unsupported_reason"]

REFUSAL = "_mmsdk_fast_generate_refusal"  # the model attribute that holds why it must keep transformers' loop

# generate() options the fast path reads itself; the other arguments it takes are the model's inputs
GENERATE_OPTIONS = frozenset({
    "max_new_tokens", "max_length", "pad_token_id", "eos_token_id", "use_cache", "do_sample", "num_beams",
    "min_new_tokens", "repetition_penalty", "streamer", *SAMPLING_OPTIONS,
})
_PASSTHROUGH = {
    "input_ids", "attention_mask", "pixel_values", "image_sizes", "image_grid_thw", "pixel_values_videos",
    "video_grid_thw", "mm_token_type_ids", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask",
    "image_attention_mask", *GENERATE_OPTIONS,
}
_DEFAULTS = {"num_beams": 1, "num_return_sequences": 1, "use_cache": True, "min_new_tokens": None}
# generation-config settings that change what transformers' generate does (logits processors, stopping, outputs,
# decoding strategies); the fast path applies none of them, so any that is active keeps transformers' loop. Each is
# inactive at None and at the value named here: "unit" 1.0 (a factor), "count" 0 (a length), "flag" False or empty
_CONFIG_REFUSALS = {
    **dict.fromkeys(("encoder_repetition_penalty", "guidance_scale"), "unit"),
    **dict.fromkeys(("no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "min_length"), "count"),
    **dict.fromkeys((
        "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
        "sequence_bias", "exponential_decay_length_penalty", "watermarking_config", "remove_invalid_values",
        "renormalize_logits", "output_scores", "output_logits", "output_attentions", "output_hidden_states",
        "return_dict_in_generate", "max_time", "penalty_alpha", "stop_strings", "dola_layers",
        "prompt_lookup_num_tokens", "constraints", "force_words_ids"), "flag"),
}


class Unsupported(Exception):
    """Found while running: the fast path cannot take this call, and transformers' generate runs instead."""


def new_tokens(model: nn.Module, kwargs: dict[str, Any]) -> int | None:
    """The most tokens transformers' generate would make for this call (``_prepare_generated_length``): the call's
    ``max_new_tokens``, else the generation config's; else ``max_length`` (the call's, else the config's) less the
    prompt; else transformers' default of 20 new tokens, within the model's position table. None where transformers
    refuses the length (it raises)."""
    config = model.generation_config
    prompt = kwargs["input_ids"].shape[1]
    count = kwargs["max_new_tokens"] if "max_new_tokens" in kwargs else config.max_new_tokens
    if count is not None:
        return count if isinstance(count, int) and count >= 1 else None
    total = kwargs["max_length"] if "max_length" in kwargs else config.max_length
    if total is None:
        total = prompt + (transformers_defaults(model).get("max_length") or 20)
        positions = getattr(model.config, "max_position_embeddings", None)
        if isinstance(positions, int):
            total = min(total, positions)
    return total - prompt if isinstance(total, int) and total > prompt else None


def _active(value: Any, kind: str) -> bool:
    """Whether a generation-config setting of ``kind`` (see _CONFIG_REFUSALS) does something at ``value``."""
    if value is None or value is False:
        return False
    if kind == "unit":
        return value != 1.0
    if kind == "count":
        return value != 0
    return value is True or not isinstance(value, (list, tuple, dict, set)) or len(value) > 0


def unsupported_reason(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why this generate() call cannot take the fast path ("cpu" when not on CUDA; None when it can)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return "cpu"
    refusal = model.__dict__.get(REFUSAL)
    if refusal:
        return refusal
    if args:
        return "positional arguments to generate()"
    extra = sorted(set(kwargs) - _PASSTHROUGH)
    if extra:
        return f"generate() options {extra} (the fast path decodes greedily or samples, one sequence per prompt)"
    for key, default in _DEFAULTS.items():
        value = kwargs.get(key, getattr(model.generation_config, key, default))
        if value not in (default, None) and not (key == "min_new_tokens" and not value):
            return f"{key}={value!r}"
    config = model.generation_config
    for key, kind in _CONFIG_REFUSALS.items():
        value = getattr(config, key, None)
        if _active(value, kind):
            return f"generation_config.{key}={value!r}"
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return "no 2-D input_ids"
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        return "padded batch (attention_mask has zeros)"
    if new_tokens(model, kwargs) is None:
        given = {k: kwargs[k] for k in ("max_new_tokens", "max_length") if k in kwargs}
        return f"no new token to make for {given or 'the generation config'} (transformers' generate refuses it)"
    reason = repetition_reason(model, kwargs)
    if reason is not None:
        return reason
    if Sampler.for_call(model, kwargs) is not None:
        return sampling_reason(model, kwargs)
    return None
