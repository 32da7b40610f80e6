"""``token-prune``: drop vision tokens before they cost the language model memory and time.

Two strategies (rules and numbers in specs/techniques.md section 1):

* ``visionzip`` (default): text-agnostic. The adapter's scorer ranks each image's tokens by the
  attention the vision tower pays them (CLS row of the feature layer; attention received for
  Qwen-VL); the top ones survive as "dominant" tokens and a few "contextual" tokens average the
  rest. The language model's attention is untouched (SDPA/flash stay on).
* ``fastv``: inside the language model, after layer K, drop the image tokens the last prompt
  token attends to least (one score row at layer K-1, computed from its q/k projections).

Inline families (LLaVA, LLaVA-NeXT, Qwen2-VL/2.5) get a shorter sequence: kept tokens keep their
original positions (Qwen's 3-D M-RoPE ones included), ``generate()`` keeps working, and the KV
cache holds only the kept tokens. Flamingo-family models (IDEFICS, Mllama) get fewer image states
in every cross-attention layer (visionzip only: their image tokens are not in the sequence).
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

from pydantic import Field

import mmsdk
from mmsdk.core.adapter import INLINE_IMAGE_TOKENS
from mmsdk.core.errors import IncompatiblePassError
from mmsdk.core.passes import CheckContext, PassContext, PassSpec
from mmsdk.core.registry import Registrar
from mmsdk.plugins._runtime import runtime_of
from mmsdk.plugins._tokens import TokenBudgetConfig, VisionZipReducer, group_reducer
from mmsdk.plugins.encoders._fastv import install_fastv

__all__ = ["TokenPruneConfig", "apply_token_prune", "check_token_prune", "refuse_unsupported_sequence"]


class TokenPruneConfig(TokenBudgetConfig):
    """How many vision tokens survive and how they are chosen."""

    strategy: Literal["visionzip", "fastv"] = Field(
        "visionzip", description="visionzip: vision-tower attention, before the LLM; fastv: LLM attention at layer K."
    )
    contextual_fraction: float = Field(
        0.15, ge=0, lt=1, description="visionzip: share of the kept tokens that are merged context tokens (10/64)."
    )
    dominance: Literal["auto", "cls", "received"] = Field(
        "auto", description="visionzip: rank by the CLS row (VisionZip) or the attention a token receives; "
        "auto: CLS where the tower has one.",
    )
    layer: int | None = Field(
        None, ge=1, description="fastv: prune after this many decoder layers (K; default min(2, layers - 1))."
    )


def refuse_unsupported_sequence(ctx: CheckContext, name: str) -> None:
    """Refuse models whose language model takes per-image-token side inputs (Qwen3-VL's deepstack)."""
    language = ctx.adapter.language_model(ctx.model)
    if "deepstack_visual_embeds" in inspect.signature(language.forward).parameters:
        raise IncompatiblePassError(
            f"pass {name!r} cannot shorten this model's sequence: its language model adds deepstack vision "
            "features at the image-token positions, which mmsdk does not yet prune along with the tokens.",
            fix=f"drop {name!r} for this model (Qwen3-VL); it works on LLaVA, Qwen2-VL/2.5-VL and the Flamingo family.",
        )


def check_token_prune(ctx: CheckContext) -> None:
    """Refuse what cannot work before anything is touched."""
    config: TokenPruneConfig = ctx.config  # type: ignore[assignment]
    if "token-merge" in ctx.before:
        raise IncompatiblePassError(
            "token-prune cannot run after token-merge: it ranks the vision tower's own tokens, which token-merge "
            "has already averaged into fewer ones.",
            fix='apply "token-prune" first, then "token-merge" (or use one of them).',
        )
    refuse_unsupported_sequence(ctx, "token-prune")
    inline = INLINE_IMAGE_TOKENS in ctx.adapter.capabilities(ctx.model)
    if config.strategy == "fastv":
        _check_fastv(ctx, config, inline)
    elif ctx.adapter.image_token_scorer(ctx.model, config.dominance) is None:
        raise IncompatiblePassError(
            f"token-prune strategy 'visionzip' with dominance={config.dominance!r} needs vision-tower attention "
            f"scores the {ctx.adapter.name} adapter cannot give for this model (no CLS token for 'cls', no "
            "attention layer feeding the image features, or a resampler mixing them).",
            fix='use dominance="auto", "token-merge" (needs no scores), or strategy="fastv" on an inline-token model.',
        )


def _check_fastv(ctx: CheckContext, config: TokenPruneConfig, inline: bool) -> None:
    if "sparse-xattn" in (*ctx.before, *ctx.after):
        raise IncompatiblePassError(
            "token-prune strategy 'fastv' gives layers after K a different sequence than layers before it, and "
            "sparse-xattn needs one image layout for every layer.",
            fix='use strategy="visionzip" (or token-merge) together with sparse-xattn.',
        )
    if not inline:
        raise IncompatiblePassError(
            f"token-prune strategy 'fastv' drops image tokens from the language model's sequence, but this "
            f"{ctx.adapter.name} model feeds images through cross-attention.",
            fix='use strategy="visionzip" (prunes the image states every cross-attention layer reads).',
        )
    layers = ctx.adapter.kv_layout(ctx.model).num_layers
    layer = config.layer if config.layer is not None else min(2, layers - 1)
    if not 1 <= layer < layers:
        raise IncompatiblePassError(
            f"token-prune fastv layer={layer} is out of range: this model has {layers} decoder layers, so K must "
            f"be between 1 and {layers - 1}.",
            fix=f"set layer to a value in 1..{layers - 1} (FastV uses K=2 on 32-layer models).",
        )
    impl = str(getattr(ctx.adapter.text_config(ctx.model), "_attn_implementation", "sdpa"))
    if impl.startswith("flash"):
        raise IncompatiblePassError(
            f"token-prune fastv needs 4-D attention masks, and this model runs {impl!r}.",
            fix='load the model with attn_implementation="sdpa" or use strategy="visionzip".',
        )


def apply_token_prune(model: Any, config: TokenPruneConfig, context: PassContext) -> dict[str, Any]:
    """Install the pruning on the model; return what will happen at run time."""
    adapter = context.adapter
    runtime = runtime_of(model, adapter)
    records: dict[str, Any] = {"strategy": config.strategy, "positions": "kept tokens keep their original positions"}
    if config.strategy == "fastv":
        layers = adapter.kv_layout(model).num_layers
        layer = config.layer if config.layer is not None else min(2, layers - 1)
        install_fastv(model, adapter, runtime, layer, config.kept)
        records.update(layer=layer, kv_cache=f"layers {layer}..{layers - 1} hold only the kept tokens")
        return records
    scorer = adapter.image_token_scorer(model, config.dominance)
    assert scorer is not None  # refused in check
    runtime.scorers.append(scorer)
    records["dominance"] = getattr(scorer, "rule", "received")
    reducer = VisionZipReducer(*config.budget(), config.contextual_fraction)
    if runtime.inline:
        runtime.reducers.append(reducer)
        records["kv_cache"] = "every layer holds only the kept tokens"
    else:
        adapter.install_image_state_reducer(model, group_reducer(reducer), config.kept, runtime.current_scores)
        records["cross_attention"] = "every cross-attention layer reads only the kept image states"
    return records


@mmsdk.hookimpl
def mmsdk_register_encoders(register: Registrar[PassSpec]) -> None:
    register(
        PassSpec(
            name="token-prune",
            config_cls=TokenPruneConfig,
            apply=apply_token_prune,
            check=check_token_prune,
            summary="drop vision tokens (VisionZip in the vision tower, or FastV after LLM layer K); KV shrinks",
            # visionzip: same tokens as transformers' loop (tests/test_fast_generate.py); fastv keeps
            # caches of different lengths per layer, which the static cache cannot hold
            fast_generate=lambda config: config.strategy != "fastv",
        )
    )
