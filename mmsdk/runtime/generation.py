"""The decode loop: embedding and decoder sessions chained through OrtValues, KV cache handed on as is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mmsdk.runtime.compaction import compact
from mmsdk.runtime.positions import mrope_positions, step_positions, text_positions
from mmsdk.runtime.sessions import Bound, as_torch, empty_ortvalue

if TYPE_CHECKING:
    import torch

    from mmsdk.runtime.inputs import Prepared
    from mmsdk.runtime.pipeline import OrtPipeline
    from mmsdk.runtime.sampling import Sampler

__all__ = ["Encoded", "Generation", "decode"]

N_IDS, N_FEATS, N_EMBEDS = "input_ids", "image_features", "inputs_embeds"


@dataclass
class Encoded:
    """The vision stage's result for one batch, still in ORT/torch memory."""

    features: Any = None  # [N, hidden] (inline families)
    cross: dict[str, Any] | None = None  # cross_key_values.* -> [B, heads, L, D]
    slots: list[np.ndarray] | None = None  # kept image-token slots per image (token reduction)
    seconds: float = 0.0
    span: tuple[float, float] = (0.0, 0.0)  # perf_counter at start and end


@dataclass
class Generation:
    """Generated token ids per row (prompt excluded) and the prefill logits of the last prompt token."""

    tokens: list[list[int]]
    first_logits: torch.Tensor
    seconds: float = 0.0
    decode_steps: int = 0
    span: tuple[float, float] = (0.0, 0.0)  # perf_counter at start and end


@dataclass
class _State:
    """What changes from one decode step to the next."""

    embeds: Any
    mask: np.ndarray
    positions: np.ndarray
    past: dict[str, Any]
    cross_mask: np.ndarray | None
    image_mask: np.ndarray | None
    deltas: np.ndarray | None
    next_position: np.ndarray | None


def decode(pipe: OrtPipeline, prepared: Prepared, encoded: Encoded, sampler: Sampler) -> Generation:
    """Prefill then decode up to ``prepared.max_new_tokens`` tokens (stops when every row hit EOS)."""
    import time

    start = time.perf_counter()
    spec, batch = pipe.spec, prepared.batch
    bindings = (pipe.embedding.io_binding(), pipe.decoder.io_binding())  # reused by every step
    state = _prefill_state(pipe, prepared, encoded, bindings[0])
    eos = np.asarray(spec.eos_token_ids or [-1])
    pad = spec.pad_token_id if spec.pad_token_id is not None else (spec.eos_token_ids or (0,))[0]
    rows: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, dtype=bool)
    first_logits = None
    for step in range(prepared.max_new_tokens):
        logits, state.past = _decoder_step(pipe, state.embeds, state.mask, state.positions, state.past, encoded.cross,
                                           state.cross_mask, bindings[1], state.image_mask)
        last = as_torch(logits)[:, -1]
        first_logits = last.clone() if first_logits is None else first_logits
        chosen = np.where(done, pad, sampler(last).numpy())
        for row, token in zip(rows, chosen.tolist()):
            row.append(token)
        done |= np.isin(chosen, eos)
        if done.all() or step + 1 == prepared.max_new_tokens:
            break
        _advance(state, step)
        state.embeds = _embed(pipe, chosen[:, None].astype(np.int64), None, bindings[0])
    assert first_logits is not None
    end = time.perf_counter()
    return Generation(_strip(rows, spec.eos_token_ids, pad), first_logits, end - start, len(rows[0]), (start, end))


def _prefill_state(pipe: OrtPipeline, prepared: Prepared, encoded: Encoded, binding: Any) -> _State:
    spec, batch = pipe.spec, prepared.batch
    mask, ids = prepared.attention_mask, prepared.input_ids
    positions, deltas = _prefill_positions(pipe, prepared)
    next_position = None
    if encoded.slots is not None:  # token reduction: keep only the kept image tokens, at their positions
        short = compact(ids, mask, positions, spec.image_token_id, encoded.slots)
        ids, mask, positions, next_position = short.input_ids, short.attention_mask, short.positions, short.next_position
    image_mask = None
    if pipe.decoder_takes_image_mask:  # sparse-xattn: which keys are image tokens (new tokens never are)
        image_mask = (ids == spec.image_token_id).astype(np.int64) * mask
    past = {name: empty_ortvalue([batch, spec.num_kv_heads, 0, spec.cache_last_dim], spec.cache_dtype)
            for layer in spec.self_layers for name in (f"past_key_values.{layer}.key", f"past_key_values.{layer}.value")}
    if spec.image_key_sums:  # handed on like the cache (present.* -> past_key_values.*)
        past.update({spec.image_key_sums % layer: empty_ortvalue([batch, spec.num_kv_heads, 0, spec.head_dim],
                                                                 np.float32) for layer in spec.self_layers})
    embeds = _embed(pipe, ids, encoded.features, binding)
    return _State(embeds, mask, positions, past, prepared.cross_mask, image_mask, deltas, next_position)


def _advance(state: _State, step: int) -> None:
    """Masks and positions for the next token."""
    batch = state.mask.shape[0]
    state.mask = np.concatenate([state.mask, np.ones((batch, 1), np.int64)], axis=1)
    if state.image_mask is not None:
        state.image_mask = np.concatenate([state.image_mask, np.zeros((batch, 1), np.int64)], axis=1)
    if state.next_position is None:
        state.positions = step_positions(state.mask, state.deltas)
    else:
        state.positions = state.next_position + step
    if state.cross_mask is not None:
        state.cross_mask = state.cross_mask[:, -1:]


def _strip(rows: list[list[int]], eos: tuple[int, ...], pad: int) -> list[list[int]]:
    """Cut each row after its first EOS (kept), dropping the padding that filled finished rows."""
    out = []
    for row in rows:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append(row[:cut])
    return out


def _prefill_positions(pipe: OrtPipeline, prepared: Prepared) -> tuple[np.ndarray, np.ndarray | None]:
    spec = pipe.spec
    if spec.mrope is None:
        return text_positions(prepared.attention_mask), None
    return mrope_positions(prepared.input_ids, prepared.attention_mask, prepared.grids, spec.mrope)


def _embed(pipe: OrtPipeline, ids: np.ndarray, features: Any, binding: Any = None) -> Any:
    feeds: dict[str, Any] = {N_IDS: np.ascontiguousarray(ids, dtype=np.int64)}
    if pipe.spec.inline_images:
        feeds[N_FEATS] = features if features is not None else pipe.no_features
    return Bound(pipe.embedding, binding).inputs(feeds).output(N_EMBEDS).run()[0]


def _decoder_step(pipe: OrtPipeline, embeds: Any, mask: np.ndarray, positions: np.ndarray, past: dict[str, Any],
                  cross: dict[str, Any] | None, cross_mask: np.ndarray | None,
                  binding: Any = None, image_mask: np.ndarray | None = None) -> tuple[Any, dict[str, Any]]:
    feeds: dict[str, Any] = {N_EMBEDS: embeds, "attention_mask": mask, **past}
    if pipe.decoder_takes_positions:
        feeds["position_ids"] = positions
    if image_mask is not None:
        feeds["image_token_mask"] = image_mask
    if cross is not None:  # blocks a pass skipped have no inputs (none at all when every block is skipped)
        feeds.update({name: value for name, value in cross.items() if name in pipe.decoder_inputs})
        if "cross_attention_mask" in pipe.decoder_inputs:
            feeds["cross_attention_mask"] = np.ascontiguousarray(cross_mask)
    bound = Bound(pipe.decoder, binding).inputs(feeds).output("logits")
    presents = [name.replace("past_key_values.", "present.") for name in past]
    for name in presents:
        bound.output(name)
    outs = bound.run()
    return outs[0], dict(zip(past, outs[1:]))
