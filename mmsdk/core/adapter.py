"""The ModelAdapter base class: where a model family keeps its parts. All model knowledge lives here."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mmsdk.core.recipes import Recipe

__all__ = [
    "CROSS_ATTENTION",
    "GATED_CROSS_ATTENTION",
    "INLINE_IMAGE_TOKENS",
    "MROPE",
    "ROPE",
    "AttentionProjections",
    "CrossAttentionBlock",
    "ImageStateReducer",
    "ImageTokenLayout",
    "ImageTokenScorer",
    "KVLayout",
    "MLPProjections",
    "ModelAdapter",
    "VisionBlock",
]

# Capabilities a pass can require (PassSpec.requires) and an adapter can report.
CROSS_ATTENTION = "cross-attention"
GATED_CROSS_ATTENTION = "gated-cross-attention"
INLINE_IMAGE_TOKENS = "inline-image-tokens"
MROPE = "mrope"
ROPE = "rope"


@dataclass(frozen=True)
class KVLayout:
    """Shape of the language model's KV cache."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    self_attention_layers: tuple[int, ...]
    cross_attention_layers: tuple[int, ...] = ()

    def bytes_per_token(self, element_bytes: float = 2.0) -> float:
        """Bytes of self-attention K+V one token adds to the cache at ``element_bytes`` per value."""
        return 2 * len(self.self_attention_layers) * self.num_kv_heads * self.head_dim * element_bytes


@dataclass(frozen=True)
class ImageTokenLayout:
    """How images reach the language model.

    ``inline``: image embeddings replace placeholder tokens in the sequence (LLaVA, Qwen-VL).
    ``cross-attention``: the sequence holds a marker token, and decoder layers attend to the image
    states through separate cross-attention layers (IDEFICS, Mllama).
    """

    mode: Literal["inline", "cross-attention"]
    image_token_id: int | None


@dataclass(frozen=True)
class AttentionProjections:
    """Attribute names of an attention module's projections (any may be absent: None)."""

    q: str | None = "q_proj"
    k: str | None = "k_proj"
    v: str | None = "v_proj"
    o: str | None = "o_proj"
    qkv: str | None = None  # a projection that already computes q, k and v together

    def linears(self) -> dict[str, str]:
        """Role -> attribute name for every projection present."""
        roles = {"q": self.q, "k": self.k, "v": self.v, "o": self.o, "qkv": self.qkv}
        return {role: name for role, name in roles.items() if name is not None}


@dataclass(frozen=True)
class MLPProjections:
    """Attribute names of an MLP's projections; ``gate`` is None for non-gated MLPs."""

    up: str
    down: str
    gate: str | None = None


@dataclass(frozen=True)
class CrossAttentionBlock:
    """One cross-attention layer of a Flamingo-style model."""

    decoder_index: int
    module: nn.Module
    attention: nn.Module
    gate_names: tuple[str, ...]
    projections: AttentionProjections
    # True when the model keeps this layer's K/V in the generation Cache at ``decoder_index``
    # (Mllama); False when it recomputes them from the vision states at every step (IDEFICS).
    kv_cached: bool = True


@dataclass(frozen=True)
class VisionBlock:
    """One vision-encoder layer: its attention and MLP modules and their projection names."""

    module: nn.Module
    attention: nn.Module
    projections: AttentionProjections
    mlp: nn.Module
    mlp_projections: MLPProjections
    num_heads: int
    head_dim: int


class ImageTokenScorer(Protocol):
    """Ranks the image tokens a model call produces by the attention its vision tower pays them.

    ``capture(call_kwargs)`` is entered around one forward call that carries images; the list it
    yields receives one 1-D tensor per vision-tower run, holding a score for every image token in
    the order the language model (or its cross-attention) sees them. Higher means more important.
    """

    def capture(self, call_kwargs: Mapping[str, Any]) -> AbstractContextManager[list[torch.Tensor]]: ...


# reducer(states [groups, tokens, dim], scores [groups, tokens] or None) -> reduced states [groups, kept, dim]
ImageStateReducer = Callable[["torch.Tensor", "torch.Tensor | None"], "torch.Tensor"]


class ModelAdapter:
    """Base class of model-family adapters: answers "where is X" for one family; never mutates."""

    name: ClassVar[str]
    family: ClassVar[str]
    architectures: ClassVar[frozenset[str]]
    summary: ClassVar[str] = ""

    def matches(self, model: nn.Module) -> bool:
        """True if this adapter knows ``model``'s architecture."""
        return type(model).__name__ in self.architectures

    def refuse(self, model: nn.Module) -> str | None:
        """A message explaining why a matched model cannot be optimized, or None if it can."""
        return None

    # --- parts -------------------------------------------------------------------------------
    def vision_tower(self, model: nn.Module) -> nn.Module:
        """The vision encoder."""
        raise NotImplementedError

    def projector(self, model: nn.Module) -> nn.Module | None:
        """The vision-to-language projector or resampler (None if the family has none)."""
        raise NotImplementedError

    def language_model(self, model: nn.Module) -> nn.Module:
        """The decoder stack (embeddings, layers, final norm), without the LM head."""
        raise NotImplementedError

    def lm_head(self, model: nn.Module) -> nn.Module:
        """The output projection to the vocabulary."""
        return model.lm_head

    def embed_tokens(self, model: nn.Module) -> nn.Module:
        """The token embedding table."""
        return self.language_model(model).embed_tokens

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        """Every layer of the decoder stack, in order (Mllama's cross-attention layers included)."""
        return list(self.language_model(model).layers)

    def self_attention(self, layer: nn.Module) -> nn.Module | None:
        """The self-attention module of a decoder layer (None for a pure cross-attention layer)."""
        return getattr(layer, "self_attn", None)

    def attention_projections(self, attention: nn.Module) -> AttentionProjections:
        """Names of the q/k/v/o projections of a (self- or cross-) attention module."""
        return AttentionProjections()

    def mlp(self, layer: nn.Module) -> nn.Module:
        """The MLP of a decoder layer."""
        return layer.mlp

    def mlp_projections(self, mlp: nn.Module) -> MLPProjections:
        """Names of a decoder MLP's projections."""
        return MLPProjections(gate="gate_proj", up="up_proj", down="down_proj")

    def cross_attention_blocks(self, model: nn.Module) -> list[CrossAttentionBlock]:
        """The cross-attention layers (empty for families without them)."""
        return []

    def layer_norms(self, layer: nn.Module) -> tuple[nn.Module, nn.Module]:
        """The norms before a decoder layer's attention and before its MLP."""
        return layer.input_layernorm, layer.post_attention_layernorm

    def final_norm(self, model: nn.Module) -> nn.Module:
        """The norm after the last decoder layer."""
        return self.language_model(model).norm

    def rope_sections(self, model: nn.Module) -> tuple[int, ...] | None:
        """M-RoPE's (temporal, height, width) split of the rotary frequencies; None for 1-D RoPE."""
        return None

    def vision_blocks(self, model: nn.Module) -> list[VisionBlock]:
        """The vision encoder's transformer layers."""
        raise NotImplementedError

    def text_config(self, model: nn.Module) -> Any:
        """The language model's config object."""
        return model.config.get_text_config(decoder=True)

    def components(self, model: nn.Module) -> dict[str, nn.Module]:
        """Named parts for accounting and per-component policies.

        A module nested in another part (Qwen's merger inside the vision tower, IDEFICS's vision
        model inside its decoder) belongs to the first part listed: projector, vision_tower,
        language_model, lm_head.
        """
        parts = {
            "projector": self.projector(model),
            "vision_tower": self.vision_tower(model),
            "language_model": self.language_model(model),
            "lm_head": self.lm_head(model),
        }
        return {name: module for name, module in parts.items() if module is not None}

    def component_map(self, model: nn.Module) -> dict[str, str]:
        """Qualified module name -> the component it belongs to (first-listed part wins)."""
        owner: dict[int, str] = {}
        for part, module in self.components(model).items():
            for sub in module.modules():
                owner.setdefault(id(sub), part)
        return {name: owner[id(sub)] for name, sub in model.named_modules() if id(sub) in owner}

    # --- layout ------------------------------------------------------------------------------
    def rotary_kind(self, model: nn.Module) -> Literal["rope", "mrope"]:
        """The language model's rotary embedding kind."""
        return "rope"

    def kv_layout(self, model: nn.Module) -> KVLayout:
        """Heads, KV heads, head dim and which layers hold self-/cross-attention KV."""
        cfg = self.text_config(model)
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        layers = self.decoder_layers(model)
        cross = tuple(block.decoder_index for block in self.cross_attention_blocks(model))
        return KVLayout(
            num_layers=len(layers),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=cfg.hidden_size,
            self_attention_layers=tuple(i for i, layer in enumerate(layers) if self.self_attention(layer) is not None),
            cross_attention_layers=cross,
        )

    def image_tokens(self, model: nn.Module) -> ImageTokenLayout:
        """How image features enter the language model."""
        raise NotImplementedError

    # --- images ------------------------------------------------------------------------------
    def image_input_names(self, model: nn.Module) -> tuple[str, ...]:
        """The processor outputs the vision path reads (``pixel_values`` first)."""
        return ("pixel_values",)

    def image_features(self, model: nn.Module, images: Mapping[str, Any]) -> torch.Tensor:
        """What the language model reads from the images in ``images``: ``[num_images, tokens, dim]``.

        ``images`` holds the processor outputs named by :meth:`image_input_names` (size and grid
        entries may come as nested lists). Inline families return the projected embeddings that
        replace the image tokens; cross-attention families return the states their
        cross-attention layers attend to. Exporters trace this function.
        """
        raise NotImplementedError

    def capabilities(self, model: nn.Module) -> frozenset[str]:
        """Capability tags passes can require (see the constants in this module)."""
        caps = {ROPE if self.rotary_kind(model) == "rope" else MROPE}
        if self.image_tokens(model).mode == "inline":
            caps.add(INLINE_IMAGE_TOKENS)
        blocks = self.cross_attention_blocks(model)
        if blocks:
            caps.add(CROSS_ATTENTION)
            if all(block.gate_names for block in blocks):
                caps.add(GATED_CROSS_ATTENTION)
        return frozenset(caps)


    # --- runtime knowledge used by vision-token and attention passes ---------------------------
    def image_token_scorer(self, model: nn.Module, rule: str = "auto") -> ImageTokenScorer | None:
        """A scorer ranking image tokens by vision-tower attention (VisionZip's dominance), or None.

        ``rule``: "cls" (the attention the CLS token pays each token, VisionZip's rule), "received"
        (the attention each token receives from all tokens of its image), or "auto" (CLS where the
        tower has one). None when the family cannot score with that rule.
        """
        return None

    def image_features_call(self, model: nn.Module) -> tuple[Any, str] | None:
        """(object, method name) of the call that turns pixels into the features the language model gets.

        Scorers watch the vision tower while it runs. ``generate()`` may call it before the first
        forward (transformers' ``get_image_features`` pre-encoding). None: the model's own forward.
        """
        return None

    def install_image_state_reducer(
        self,
        model: nn.Module,
        reducer: ImageStateReducer,
        kept: Callable[[int], int],
        scores: Callable[[], torch.Tensor | None],
    ) -> bool:
        """Cross-attention families: make ``reducer`` shrink the image states fed to cross-attention.

        ``kept(n)`` is how many of a group's ``n`` states the reducer keeps (so masks can follow);
        ``scores()`` gives the current call's image-token scores, flattened like the states, or None.
        Returns False if this family cannot (inline families reduce tokens in the sequence instead).
        """
        return False

    def cross_kv_cached(self, model: nn.Module) -> bool:
        """True if the family's cross-attention already caches the projected image K/V across decode steps.

        Default: every block of :meth:`cross_attention_blocks` says so (``CrossAttentionBlock.kv_cached``); False for
        a model without cross-attention.
        """
        blocks = self.cross_attention_blocks(model)
        return bool(blocks) and all(block.kv_cached for block in blocks)

    def decode_step_inputs(self, model: nn.Module, prompt_inputs: Mapping[str, Any],
                           prefill_output: Any) -> dict[str, Any]:
        """Inputs besides the token and the cache that the model's forward needs on a decode step, made from the
        prompt's ``generate()`` inputs and the prefill's output as transformers' generate makes them for the next
        token (fast generate runs the first decode token's forward with them and replays that step). Default: none."""
        return {}

    def decode_step_scope(self, model: nn.Module) -> AbstractContextManager[None]:
        """What fast generate's decode steps (eager, warm-up, captured) run inside, for a family whose modules would
        ask the host something a CUDA-graph capture cannot answer (IDEFICS's embedding of its extra tokens looks up
        which ids are extra with a host sync). Default: nothing changes."""
        from contextlib import nullcontext

        return nullcontext()

    def install_packed_cache_queries(self, model: nn.Module) -> None:
        """Called when a KV-cache pass packs the model's cache (mmsdk.plugins.quantizers.kv_runtime.install), for a
        family whose language model asks every cache layer something that a packed layer answers only by
        dequantizing the whole layer (its ``keys`` and ``values`` are dequantized on read): have it answered another
        way, from the model's own modules, so transformers' loop and fast generate's steps read no layer for it.
        Default: nothing to change."""

    def needs_decode_mask_over_cache(self, model: nn.Module) -> bool:
        """True when the language model, given no attention mask on a decode step, makes one as long as the tokens
        cached so far: a length the host reads, which a captured decode step would freeze. Fast generate's step then
        hands it an all-ones mask over the static cache's capacity (its batches have no padding), and a packed KV
        cache's layers say they are compileable, so that transformers' mask maker does not read that mask on the
        GPU."""
        return False

    def rope_function_name(self, attention: nn.Module) -> str | None:
        """Name of the module-level function the attention's forward calls to rotate q and k (None: none)."""
        # the forward may sit under several decorators (transformers >= 5.25 adds deprecate_kwarg's over its own)
        code = getattr(inspect.unwrap(type(attention).forward), "__code__", None)
        name = "apply_rotary_pos_emb"
        return name if code is not None and name in code.co_names else None

    def qk_norm_names(self, attention: nn.Module) -> tuple[str, str] | None:
        """Attribute names of the per-head RMSNorms applied to q and k right before RoPE (Qwen3), or None."""
        if hasattr(attention, "q_norm") and hasattr(attention, "k_norm") and self.rope_function_name(attention):
            return ("q_norm", "k_norm")
        return None

    def decoder_norm_names(self, layer: nn.Module) -> tuple[str, str] | None:
        """(input norm, post-attention norm) of a pre-norm self-attention decoder layer, or None.

        A layer qualifies when its forward is exactly norm -> self-attention -> add -> norm -> MLP -> add,
        so a pass may rewrite it with a fused residual-add + norm.
        """
        names = ("input_layernorm", "post_attention_layernorm")
        if self.self_attention(layer) is None or not all(hasattr(layer, n) for n in names):
            return None
        return names

    def rotary_embedding(self, model: nn.Module) -> nn.Module | None:
        """The language model's rotary-embedding module (computes cos/sin from position ids), or None."""
        return getattr(self.language_model(model), "rotary_emb", None)

    def set_vision_head_count(self, block: VisionBlock, count: int) -> None:
        """Tell a vision attention module it now has ``count`` heads (after structured pruning)."""
        for attr in ("num_heads", "num_attention_heads"):
            if hasattr(block.attention, attr):
                setattr(block.attention, attr, count)

    # --- prompts -----------------------------------------------------------------------------
    default_prompt: ClassVar[str] = "{image} {question}"
    image_placeholder: ClassVar[str] = "<image>"

    def format_prompt(self, question: str, processor: Any = None) -> str:
        """A prompt asking ``question`` about one image, in the form ``processor`` expects.

        mmsdk's embedded processors know their own form; a Hugging Face processor with a chat
        template gets it applied; otherwise the family's plain default is used.
        """
        if processor is not None and hasattr(processor, "format_prompt"):
            return processor.format_prompt(question)
        if processor is not None and getattr(processor, "chat_template", None):
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            return processor.apply_chat_template(messages, add_generation_prompt=True)
        return self.default_prompt.format(image=self.image_placeholder, question=question)

    def recipes(self, model: nn.Module) -> dict[str, Recipe]:
        """This family's recommended builds by name (``default``, ``max-memory``, ``max-accuracy``...)."""
        return {}

    def describe(self, model: nn.Module) -> dict[str, Any]:
        """A JSON-able summary of the model as this adapter sees it (used in manifests and reports)."""
        kv = self.kv_layout(model)
        return {
            "adapter": self.name,
            "family": self.family,
            "architecture": type(model).__name__,
            "rotary": self.rotary_kind(model),
            "image_tokens": self.image_tokens(model).mode,
            "decoder_layers": kv.num_layers,
            "cross_attention_layers": list(kv.cross_attention_layers),
            "heads": kv.num_heads,
            "kv_heads": kv.num_kv_heads,
            "head_dim": kv.head_dim,
            "hidden_size": kv.hidden_size,
        }
