"""What the ``tensorrt-llm`` backend refuses before it writes anything, each with the alternative."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.tensorrt_llm.families import FAMILIES, REFUSED, Family, family_for

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext

__all__ = ["VISION_TOKEN_PASSES", "check_passes", "family_of"]

# Passes that change how many visual tokens reach the language model.
VISION_TOKEN_PASSES = frozenset({"token-prune", "token-merge"})
# Config values that make the kept-token count depend on the image (not expressible in an engine profile).
_DYNAMIC_HINTS = ("threshold", "dynamic", "adaptive")


def family_of(context: ExportContext) -> Family:
    """The TensorRT-LLM mapping of the exported model, or an error naming what to do instead."""
    architecture = context.source.architecture
    family = family_for(architecture)
    if family is not None:
        return family
    if architecture in REFUSED:
        raise ExportError(f"{architecture} cannot be exported to TensorRT-LLM: {REFUSED[architecture]}")
    raise ExportError(
        f"the tensorrt-llm backend has no mapping for {architecture}; it writes {', '.join(sorted(FAMILIES))}.",
        fix="export to ONNX Runtime, or add the architecture to the TensorRT-LLM backend's families table.",
    )


def check_passes(context: ExportContext, target: str) -> None:
    """Refuse passes the chosen target cannot express (int4-kv is refused earlier, with the KV algorithm)."""
    for result in context.results:
        if target == "hf" and result.kind in ("encoder", "projector"):
            raise ExportError(
                f"pass {result.name!r} changes the vision tower or the visual tokens, but TensorRT-LLM's PyTorch "
                "backend runs its own vision code on the original Hugging Face weights, so the change would be lost.",
                fix="export target='checkpoint' (the vision part becomes an ONNX graph that keeps the pass), or "
                f"export to ONNX Runtime, or drop {result.name!r} for this export.",
            )
        if result.name in VISION_TOKEN_PASSES and _is_dynamic(result.config_dict()):
            raise ExportError(
                f"pass {result.name!r} keeps a number of visual tokens that depends on the image; TensorRT-LLM's "
                "vision engine and prompt table need a fixed count per image.",
                fix=f"configure {result.name!r} with a fixed keep ratio or token count, or export to ONNX Runtime, "
                "whose runner accepts a variable count.",
            )


def _is_dynamic(config: dict[str, Any]) -> bool:
    for key, value in config.items():
        if value in (None, False, 0):
            continue
        if any(hint in key.lower() for hint in _DYNAMIC_HINTS):
            return True
        if isinstance(value, str) and any(hint in value.lower() for hint in _DYNAMIC_HINTS):
            return True
    return False
