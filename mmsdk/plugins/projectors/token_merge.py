"""``token-merge``: ToMe-style bipartite merging of similar vision tokens at the projector output.

Per image, tokens alternate into two sets; each token of the first proposes its most similar
token of the second (cosine of the projected features), and the most similar pairs merge into
size-weighted means, round after round, until ``keep_ratio`` (or ``keep_tokens``) of the tokens
remain. A merged token takes the place and position of its second-set member. Inline families
(LLaVA, LLaVA-NeXT, Qwen2-VL/2.5) see a shorter sequence (``generate()`` keeps working, the KV
cache shrinks); Flamingo-family models see fewer image states in every cross-attention layer.
ToMe's proportional attention (a log-size bias) is not applied: the language model's attention
stays unmodified.
"""

from __future__ import annotations

from typing import Any

import mmsdk
from mmsdk.core.passes import CheckContext, PassContext, PassSpec
from mmsdk.core.registry import Registrar
from mmsdk.plugins._runtime import runtime_of
from mmsdk.plugins._tokens import TokenBudgetConfig, ToMeReducer, group_reducer
from mmsdk.plugins.encoders.token_prune import refuse_unsupported_sequence

__all__ = ["TokenMergeConfig", "apply_token_merge"]


class TokenMergeConfig(TokenBudgetConfig):
    """How many merged tokens each image keeps."""



def check_token_merge(ctx: CheckContext) -> None:
    """Refuse models whose sequence cannot be shortened."""
    refuse_unsupported_sequence(ctx, "token-merge")


def apply_token_merge(model: Any, config: TokenMergeConfig, context: PassContext) -> dict[str, Any]:
    """Install the merging on the model; return what will happen at run time."""
    runtime = runtime_of(model, context.adapter)
    reducer = ToMeReducer(*config.budget())
    if runtime.inline:
        runtime.reducers.append(reducer)
        where = "language-model sequence (KV cache holds only the merged tokens)"
    else:
        context.adapter.install_image_state_reducer(model, group_reducer(reducer), config.kept, lambda: None)
        where = "image states read by every cross-attention layer"
    return {"metric": "cosine of projected features", "weighting": "token size", "applies_to": where}


@mmsdk.hookimpl
def mmsdk_register_projectors(register: Registrar[PassSpec]) -> None:
    register(
        PassSpec(
            name="token-merge",
            config_cls=TokenMergeConfig,
            apply=apply_token_merge,
            check=check_token_merge,
            summary="merge similar vision tokens (ToMe bipartite matching, size-weighted) at the projector output",
            fast_generate=True,  # tests/test_fast_generate.py: same tokens as transformers' loop
        )
    )
