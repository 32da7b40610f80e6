"""Greedy or sampled generation on CUDA with a static KV cache and one CUDA graph per decode step.

``install(model, adapter)`` overrides ``generate`` on the model instance. On CUDA, for greedy or sampled
(temperature, top-k, top-p, min-p: :mod:`mmsdk.kernels.sampling`) decoding without padding, with or without a
repetition penalty (:mod:`mmsdk.kernels.repetition`) and a streamer (:mod:`mmsdk.kernels.streaming`), it runs:

1. the prefill through the model's own forward (images, token pruning, M-RoPE offsets: everything
   the model and mmsdk's runtimes do stays in charge), into a static cache (mmsdk's packed KV layers
   when a KV-cache pass is installed, else transformers' ``StaticCache``). The language model's
   prefill runs in chunks of tokens over all rows of the batch (mmsdk.kernels.chunked_prefill.prefill_tokens;
   only the last position's logits are kept), so the prefill's transient activations (attention scores, MLP
   intermediates) scale with the chunk, not with the prompt or the batch;
2. the model's forward once more for the first decode token, stopped where the language model's own
   body would run: what the language model receives on a decode step (embeddings, cross-attention
   inputs) and the positions the passes' wrappers give it (token pruning's continue the prompt as it
   was before pruning) are recorded, without running the language model eagerly;
3. every decode token from the first on by one CUDA graph that embeds the last token, runs the
   language model and the LM head, takes the argmax (or draws the token) and advances the positions, all on the
   device
   (replayed; on a call that builds the graph, its eager warm-up run makes the first token); the host
   checks for end-of-sequence every ``CHECK_EVERY`` steps (with a streamer, at every step, which hands the host
   each step's tokens anyway). In these steps grouped-query attention with a mask
   (a static cache's empty slots, Mllama's image mask) runs a flash-decoding kernel over the K/V as they are
   (:mod:`mmsdk.kernels.grouped_decode`) instead of transformers' SDPA call, which copies them per query head.

The static cache, the step's buffers and its graph stay on the model for the next call whose
shapes fit (:mod:`mmsdk.kernels.decode_state`), which then pays only for its prefill and the graph's
replays; :func:`release` frees them.

Anything else (CPU, beams, other sampling warpers, padding, extra logits processors, a cache passed in, a capture
that fails) runs transformers' ``generate`` unchanged, and the ``mmsdk.kernels`` log says
why once. The output equals transformers' output (greedy: bitwise on CPU; on CUDA the decode kernels round
differently from SDPA, so tokens may part after a near-tie; sampled: the same draws from the same seed on CPU,
the same distribution on CUDA): prompt ids followed by new ids, sequences that finished early padded with the pad
token.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from mmsdk.kernels import note_fallback
from mmsdk.kernels.chunked_prefill import Regrow, chunked, prefill_tokens, size_static_cache
from mmsdk.kernels.decode_state import (
    DecodeState,
    Step,
    Watch,
    cache_objects,
    capacity_for,
    fits,
    keep,
    kept,
    release,
    signature,
    step_objects,
)
from mmsdk.kernels.fast_generate_scope import GENERATE_OPTIONS, Unsupported, new_tokens, unsupported_reason
from mmsdk.kernels.fast_generate_scope import REFUSAL as _REFUSAL
from mmsdk.kernels.parallel_compile import compile_step_ahead
from mmsdk.kernels.repetition import RepetitionPenalty
from mmsdk.kernels.sampling import Sampler, choose_step
from mmsdk.kernels.step_arguments import record_step_arguments
from mmsdk.kernels.step_capture import captured_replay, warm_up
from mmsdk.kernels.step_projections import StepProjections, recomputed_projections
from mmsdk.kernels.streaming import TokenStream
from mmsdk.plugins.tensor_keys import input_memos

__all__ = ["CHECK_EVERY", "install", "release", "unsupported_reason"]

CHECK_EVERY = 16
ATTRIBUTE = "_mmsdk_fast_generate"
# language-model arguments of a decode step that the captured step makes itself
_STEP_ARGUMENTS = ("inputs_embeds", "input_ids", "attention_mask", "position_ids", "cache_position")


def install(model: nn.Module, adapter: Any, refusal: str | None = None) -> None:
    """Make ``model.generate`` take the CUDA-graph path where it can (idempotent).

    ``refusal`` (why this model must keep transformers' loop, e.g. a pass not declared safe for the
    fast path) is kept on the model and re-read on every call, so a later install can change it.
    A kept decode state is dropped here when the passes that just ran changed what it was built for
    (each call checks that too, but this frees the memory at once), or when the model is refused.
    """
    model.__dict__[_REFUSAL] = refusal
    state = kept(model)
    if state is not None and (refusal or not state.watch.matches(cache_objects(model)) or (
            state.step is not None and not state.step.watch.matches(step_objects(model, adapter, state.cache)))):
        release(model)
    del state
    if getattr(model, ATTRIBUTE, None) is not None:
        return
    original = model.generate

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        reason = unsupported_reason(model, args, kwargs)
        if reason is not None:
            if reason != "cpu":
                note_fallback("fast generate", reason)
            else:  # a model moved off the GPU: what was kept for it there can only be stale
                release(model)
            return original(*args, **kwargs)
        # bad settings are the user's to fix, not a reason to fall back
        chunk, ahead = prefill_tokens(), compile_step_ahead()
        generator = None
        try:
            generator = _Generator(model, adapter, kwargs, prefill=chunk, compile_ahead=ahead)
            return generator.run()
        except Exception as error:  # never a wrong answer: anything unexpected reruns transformers' generate
            if generator is not None and generator.stream is not None and generator.stream.started:
                raise  # the streamer has had tokens: transformers' generate would stream the answer again
            # a warning: the user asked for the fast path and gets a slower one (a failed capture, a model quirk)
            note_fallback("fast generate", f"{type(error).__name__}: {error}", warn=True)
            return original(*args, **kwargs)

    object.__setattr__(model, ATTRIBUTE, original)
    model.generate = generate  # type: ignore[method-assign]


def pick(logits: torch.Tensor, finished: torch.Tensor, eos: torch.Tensor, pad: int,
         sampler: Sampler | None = None) -> torch.Tensor:
    """Greedy (or ``sampler``'s) token per row (pad where finished); marks rows that produced an end token."""
    token = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    choose_step(sampler, logits, finished, eos, pad, token)
    return token


class _Generator:
    """One fast generate() call: static cache, eager prefill, graph-replayed decode.

    The cache, the decode step's buffers and its graph stay on the model (:mod:`mmsdk.kernels.decode_state`)
    for the next call whose shapes fit, which then skips the warm-up step and the capture.
    """

    def __init__(self, model: nn.Module, adapter: Any, kwargs: dict[str, Any], graphs: bool = True,
                 prefill: int | None = None, compile_ahead: bool | None = None) -> None:
        self.model, self.adapter, self.graphs = model, adapter, graphs
        # a new decode step's kernels compiled side by side before its first call (None: MMSDK_COMPILE_STEP_AHEAD)
        self.compile_ahead = compile_step_ahead() if compile_ahead is None else compile_ahead
        self.cache_name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        self.first_position = 0
        # the prompt's generate() inputs, as the adapter's decode_step_inputs takes them
        self.inputs = {k: v for k, v in kwargs.items() if k not in GENERATE_OPTIONS}
        # what the prefill's forward gets: the inputs without a 2-D attention mask. unsupported_reason refused
        # batches with padding, so that mask is all ones and says nothing; given one, transformers' causal-mask
        # maker sums it on the GPU (to decide whether SDPA may run as causal), which waits for everything queued
        # before it: Mllama's whole vision encoder (~50 ms on an H200), after which the text prefill's launches no
        # longer overlap GPU work. (Token pruning makes its own mask; IDEFICS sizes its mask from the cache's
        # length, a device tensor on a kept cache: those still wait.)
        mask = self.inputs.get("attention_mask")
        self.kwargs = {k: v for k, v in self.inputs.items()
                       if not (k == "attention_mask" and isinstance(mask, torch.Tensor) and mask.dim() == 2)}
        self.ids: torch.Tensor = kwargs["input_ids"]
        self.prefill_chunk = max(1, (prefill or prefill_tokens()) // self.ids.shape[0])  # tokens per row
        self.new_tokens = new_tokens(model, kwargs) or 0  # unsupported_reason refused calls without one
        self.sampler = Sampler.for_call(model, kwargs)  # None: greedy
        self.penalty = RepetitionPenalty.for_call(model, kwargs)  # None: no repetition penalty
        streamer = kwargs.get("streamer")
        self.stream = TokenStream(streamer, self.ids) if streamer is not None else None
        config = model.generation_config
        eos = kwargs.get("eos_token_id", config.eos_token_id)
        self.eos_ids = tuple(int(e) for e in ([eos] if isinstance(eos, int) else list(eos or [])))
        pad = kwargs.get("pad_token_id", config.pad_token_id)
        self.pad = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))

    def _cache(self, max_len: int) -> Any:
        from mmsdk.plugins.quantizers.kv_runtime import installed_state

        state = installed_state(self.model)
        if state is not None:
            reason = state.packed_decode_reason(self.ids.device) if self.graphs else None
            if reason is not None:
                raise Unsupported(f"the quantized KV cache cannot be static here ({reason})")
            from mmsdk.kernels.cross_attention_decode import holds_image_kv

            cache = state.static_cache(max_len, fused=self.graphs)
            # a step that gets a mask over the cache's slots (IDEFICS, step_mask) would have transformers' mask
            # maker ask the GPU whether that mask is all ones, unless the cache says it is compileable (which it
            # asks of every layer: IDEFICS's cache holds self-attention layers only, all marked here)
            compileable = self.adapter.needs_decode_mask_over_cache(self.model)
            for layer in cache.layers:  # the batch has no padding (checked before); an image's mask drops its
                layer.unpadded = not holds_image_kv(layer)  # padding tiles, so image layers keep it
                if compileable and layer.unpadded:
                    # the mask it then builds is read only by the dequantizing fallback, where it is right: the
                    # packed kernel takes none on unpadded steps
                    layer.is_compileable = True
            return cache
        from transformers.cache_utils import StaticCache

        from mmsdk.kernels.cross_attention_decode import image_layer_indices, with_image_layers

        cache = StaticCache(config=self.adapter.text_config(self.model), max_cache_len=max_len)
        # Mllama: image K/V written by the prefill, read by each step
        return with_image_layers(cache, image_layer_indices(self.adapter, self.model))

    def _key(self) -> tuple[Any, ...]:
        """The plain values a kept decode state must share with this call."""
        attention = getattr(self.adapter.text_config(self.model), "_attn_implementation", None)
        return (self.ids.shape[0], self.ids.dtype, str(self.ids.device), self.graphs, self.cache_name,
                self.eos_ids, self.pad, attention)

    def _state(self, needed: int) -> DecodeState:
        """The kept decode state with its cache reset when it serves ``needed`` tokens; else a new one."""
        watched = cache_objects(self.model)
        state = kept(self.model)
        if (state is not None and state.key == self._key() and fits(state.capacity, needed)
                and state.watch.matches(watched)):
            state.cache.reset()  # in place: a captured graph reads the addresses of the cache's tensors
            return state
        del state
        release(self.model)  # before allocating, so the old cache's memory can serve the new one
        capacity = capacity_for(needed)
        cache = self._cache(capacity)
        batch, device = self.ids.shape[0], self.ids.device
        state = DecodeState(
            key=self._key(),  # after _cache, which may wrap the attention implementation
            watch=Watch(watched), capacity=capacity, cache=cache,
            tokens=torch.empty(batch, capacity, dtype=self.ids.dtype, device=device),
            finished=torch.empty(batch, dtype=torch.bool, device=device),
            eos=torch.tensor(self.eos_ids, dtype=torch.long, device=device), pad=self.pad,
        )
        keep(self.model, state)
        return state

    def _prefill_in_chunks(self, cache: Any) -> AbstractContextManager[None]:
        """Chunk the language model's prefill inside the passes' wrappers (token pruning sees the whole prompt).

        Each chunk's query offset comes from the host. Where the cache holds only the language model's own tokens (no
        cross-attention states), each chunk attends over the tokens written so far, not the whole capacity.
        """
        from mmsdk.core.adapter import CROSS_ATTENTION, INLINE_IMAGE_TOKENS
        from mmsdk.plugins._forward import innermost_override

        language = self.adapter.language_model(self.model)
        capabilities = self.adapter.capabilities(self.model)
        own_tokens_only = INLINE_IMAGE_TOKENS in capabilities and CROSS_ATTENTION not in capabilities
        return innermost_override(
            language, lambda forward: chunked(forward, self.prefill_chunk, lambda n: self._size_cache(cache, n),
                                              cache, attend_filled_prefix=own_tokens_only))

    def _size_cache(self, cache: Any, prompt: int) -> None:
        """Fit the static cache to the prompt the language model gets (see :func:`size_static_cache`)."""
        size_static_cache(cache, prompt + self.new_tokens + 1)

    @torch.inference_mode()
    def run(self) -> torch.Tensor:
        if self.new_tokens <= 0:
            return self.ids
        needed = self.ids.shape[1] + self.new_tokens + 1  # at most: the passes may prune prompt tokens
        try:
            try:
                return self._generate(self._state(needed))
            except Regrow:  # a kept cache sized for a more pruned prompt: a new one, sized in the prefill
                release(self.model)
                return self._generate(self._state(needed))
        except BaseException:
            release(self.model)  # never reuse what a failed call may have left half-written
            raise

    def _generate(self, state: DecodeState) -> torch.Tensor:
        """Prefill through the model, then the decode steps: prompt + new tokens."""
        tokens = state.tokens[:, : self.new_tokens]
        state.tokens.fill_(state.pad)  # columns after an early stop stay pad
        state.finished.zero_()
        with self._prefill_in_chunks(state.cache):
            out = self.model(**self.kwargs, **{self.cache_name: state.cache}, use_cache=True, logits_to_keep=1)
        logits, occurred = out.logits[:, -1], None
        if self.penalty is not None:  # the prompt's ids, then each new token (the step keeps marking them)
            occurred = self.penalty.occurred(self.ids, logits.shape[-1])
            logits = self.penalty.apply(logits, occurred)
        token = pick(logits, state.finished, state.eos, state.pad, self.sampler)
        tokens[:, 0] = token
        if occurred is not None:
            self.penalty.record(occurred, token)
        stream = self.stream
        if stream is not None:  # put once the decode step is ready (mmsdk.kernels.streaming)
            stream.hold(token)
        # a streamer sees transformers' stop: after the first token when every row ended there
        if self.new_tokens > 1 and not (stream is not None and bool(state.finished.all())):
            self._decode(state, self._step_arguments(token, state.cache, out), occurred)
        if stream is not None:
            stream.end()
        return self._finish(tokens, state.eos)

    def _step_arguments(self, token: torch.Tensor, cache: Any, prefill_output: Any) -> dict[str, Any]:
        """What the language model receives on the decode step of ``token`` (:func:`record_step_arguments`)."""
        self.first_position = int(cache.get_seq_length())
        return record_step_arguments(self.model, self.adapter, token, {self.cache_name: cache},
                                     self.adapter.decode_step_inputs(self.model, self.inputs, prefill_output))

    @contextmanager
    def _step_scope(self, cache: Any, step: Step) -> Iterator[None]:
        """What decode steps (eager, warm-up, captured) run inside: cross-attention layers read their own image
        layer's length, image K/V that a layer would project at every step are the step's kept products,
        grouped-query attention with a mask takes the kernel without copying K/V per head, and the adapter's
        capture-safe stand-ins are in (``ModelAdapter.decode_step_scope``)."""
        from mmsdk.kernels.cross_attention_decode import own_lengths_for_cross_attention
        from mmsdk.kernels.grouped_decode import grouped_decode_steps

        with own_lengths_for_cross_attention(self.adapter, self.model, cache), step.projections.standing_in():
            with grouped_decode_steps(self.adapter.text_config(self.model)), self.adapter.decode_step_scope(self.model):
                yield

    def _decode(self, state: DecodeState, seen: dict[str, Any], occurred: torch.Tensor | None) -> None:
        """Tokens 1.. : the kept graph refilled and replayed, or a new step warmed up once and captured.

        ``occurred`` marks the ids the sequence holds so far, for a repetition penalty (None without one)."""
        # a captured step bakes its sampling settings and repetition penalty in
        step, wanted, stream = state.step, (signature(seen), self.sampler, self.penalty), self.stream
        # the watch is read after this call's prefill and forward, which could have re-registered a buffer
        if (step is not None and step.signature == wanted
                and step.watch.matches(step_objects(self.model, self.adapter, state.cache))):
            self._refill(step, state, seen, occurred)
            replays = self.new_tokens - 1  # no warm-up step: the first replay writes token 1
        else:
            state.step = None  # a stale graph goes before another is captured
            step = self._build_step(state, seen, wanted, occurred)
            with self._step_scope(state.cache, step):
                side = self._warm_up(step.replay)
                if stream is not None:
                    stream.hold(step.token)  # token 1
                replays = self.new_tokens - 2  # the warm-up step wrote token 1
                if replays <= 0:
                    return
                step.replay = self._capture(step.replay, side)
            step.watch = Watch(step_objects(self.model, self.adapter, state.cache))  # what the graph captured reads
            state.step = step
            if stream is not None and bool(state.finished.all()):
                return  # every row ended at token 1, where transformers' loop stops (_generate ends the stream)
        if stream is not None:
            stream.start()
        with self._step_scope(state.cache, step):  # eager steps as captured ones
            for i in range(replays):
                step.replay()
                if stream is not None:  # each step's tokens to the host, and transformers' stop
                    if stream.put(step.token, state.finished):
                        break
                elif (i + 1) % CHECK_EVERY == 0 and bool(state.finished.all()):
                    break

    def _build_step(self, state: DecodeState, seen: dict[str, Any], wanted: tuple[Any, ...],
                    occurred: torch.Tensor | None) -> Step:
        """A decode step over new buffers: embeds the last token, runs the language model and head, applies the
        repetition penalty, chooses the next token, advances."""
        from mmsdk.kernels.cross_attention_decode import step_mask

        language = self.adapter.language_model(self.model)
        embed = self.model.get_input_embeddings()
        head = self.adapter.lm_head(self.model)
        positions = seen.get("position_ids")
        if isinstance(positions, torch.Tensor):
            positions = positions.clone()  # advanced in place by every step
        else:  # the language model counts positions from the cache; in a graph they must live on the device
            positions = torch.full((1, 1), self.first_position, dtype=torch.long, device=self.ids.device)
        # the step's own copies: a later call refills them in place, which must not write into this call's inputs
        # (IDEFICS's image mask is a view of the caller's image_attention_mask)
        fixed = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in seen.items()
                 if k not in _STEP_ARGUMENTS}
        token, index = state.tokens[:, 0].clone(), torch.tensor([1], device=self.ids.device)
        tokens, finished, eos, pad = state.tokens, state.finished, state.eos, state.pad
        takes_ids = seen.get("inputs_embeds") is None  # a language model that embeds its tokens itself (Mllama)
        mask = step_mask(self.adapter, self.model, state.cache, self.ids)  # None: the batch has no padding
        sampler, penalty = self.sampler, self.penalty
        warpers = None if sampler is None else sampler.warpers()  # built once, not at every step

        def run() -> None:  # refers to no Step / state / model: nothing here forms a reference cycle
            ids = token[:, None]
            given = {"input_ids": ids} if takes_ids else {"inputs_embeds": embed(ids)}
            hidden = language(**given, attention_mask=mask, position_ids=positions, **fixed)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden.last_hidden_state
            logits = head(hidden[:, -1])
            if penalty is not None:
                logits = penalty.apply(logits, occurred)
            choose_step(sampler, logits, finished, eos, pad, token, tokens, index, warpers)
            if penalty is not None:
                penalty.record(occurred, token)
            index.add_(1)
            positions.add_(1)

        return Step(wanted, Watch([]), token, index, positions, fixed, run, occurred, body=run,
                    memos=tuple(input_memos(self.model)),
                    projections=StepProjections(recomputed_projections(self.adapter, self.model)))

    def _refill(self, step: Step, state: DecodeState, seen: dict[str, Any], occurred: torch.Tensor | None) -> None:
        """This call's values into the kept step's inputs, in place (the graph reads their addresses)."""
        step.token.copy_(state.tokens[:, 0])
        if occurred is not None:  # the signatures matched: the kept step has a mask of this shape
            step.occurred.copy_(occurred)
        step.index.fill_(1)
        positions = seen.get("position_ids")
        if isinstance(positions, torch.Tensor):
            step.positions.copy_(positions)
        else:
            step.positions.fill_(self.first_position)
        for name, value in step.fixed.items():  # the step's own copies; same shapes: the signatures matched
            if isinstance(value, torch.Tensor):
                value.copy_(seen[name])
        # under inference mode a tensor refilled in place keeps its memo key (no version counter): an eager step
        # would be served the last call's image K/V (a captured one bypasses the memos)
        for memo in step.memos:
            memo.clear()
        step.projections.refresh()  # the image K/V the steps read, from the refilled image states

    def _warm_up(self, step: Any) -> torch.cuda.Stream | None:
        """Run ``step`` once eagerly: on a side stream, returned for the capture (:func:`warm_up`; its kernels compiled
        ahead with ``compile_ahead``), or as it is when graphs are off (None)."""
        if not self.graphs:
            step()
            return None
        return warm_up(step, self.ids.device, self.compile_ahead)

    def _capture(self, step: Any, stream: torch.cuda.Stream | None) -> Any:
        """``step`` as a CUDA graph replay (captured on ``stream``), or ``step`` itself when graphs are off."""
        return captured_replay(step, stream) if self.graphs else step

    def _finish(self, tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
        """Prompt + new tokens (a new tensor), cut where every row has finished (as transformers stops)."""
        if eos.numel():
            ended = torch.isin(tokens, eos)
            done_at = torch.where(ended.any(1), ended.int().argmax(1), tokens.shape[1] - 1)
            tokens = tokens[:, : int(done_at.max().item()) + 1]
        return torch.cat([self.ids, tokens], dim=1)
