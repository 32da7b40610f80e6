"""Vision-token reduction (token-prune VisionZip, token-merge ToMe) in the exported graphs.

Those passes install, on the model, a per-model runtime whose ``reducers`` turn one image's
features into fewer ones and name the image-token slots they keep (kept tokens keep their original
positions). The vision graph runs the same reducers after the vision tower, so ``vision.onnx``
outputs the kept features and ``image_token_slots``; mmsdk's runtime drops the other image tokens
from the prompt and feeds the decoder the original positions of what is left (so the decoder takes
explicit ``position_ids``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmsdk.core.errors import IncompatiblePassError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mmsdk.core.backend import ExportContext
    from mmsdk.core.passes import PassResult

__all__ = ["SLOTS", "token_runtime", "reduce_image", "token_pass"]

SLOTS = "image_token_slots"
_RUNTIME_ATTR = "_mmsdk_runtime"  # where the token passes keep their per-model runtime


def token_runtime(model: nn.Module) -> Any | None:
    """The runtime of the token passes when it holds reducers for inline image tokens, else None."""
    runtime = model.__dict__.get(_RUNTIME_ATTR)
    return runtime if runtime is not None and getattr(runtime, "reducers", None) else None


def reduce_image(runtime: Any, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept features [k, D], their slots [k] among the image's tokens), as the passes compute them in torch."""
    import torch

    scores = runtime.current_scores()
    slots = torch.arange(features.shape[0])
    for reducer in runtime.reducers:
        picked, features = reducer(features, scores)
        slots = slots[picked]
        scores = scores[picked] if scores is not None else None
    return features, slots


def token_pass(context: ExportContext, result: PassResult, decided: dict[str, Any]) -> None:
    """token-prune / token-merge: lowered for inline image tokens, when the reduction runs before the decoder."""
    if result.records.get("strategy") == "fastv":
        raise IncompatiblePassError(
            "token-prune strategy 'fastv' drops image tokens inside the decoder after layer K (so layers keep KV "
            "caches of different lengths), which the ONNX decoder does not express.",
            fix='use token-prune strategy="visionzip" (before the decoder) or token-merge for onnxruntime exports.',
        )
    if context.adapter.image_tokens(context.model).mode != "inline":
        raise IncompatiblePassError(
            f"{result.name} on a cross-attention model reduces the image states inside the text model, which the "
            "onnxruntime backend does not lower yet.",
            fix=f"drop {result.name!r} for this export of a {context.adapter.name} model, or export to 'torch'.",
        )
    decided["token_reduction"] = True
