"""What the ``tensorrt-llm`` backend refuses before it writes anything, each with the alternative."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.tensorrt_llm.families import FAMILIES, REFUSED, Family, family_for

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext

__all__ = ["VISION_TOKEN_PASSES", "check_passes", "family_of"]

# Passes that shorten the visual-token sequence inside the language model's forward, keeping each kept
# token at its original position -> why TensorRT-LLM cannot run that (per strategy where it differs).
VISION_TOKEN_PASSES: dict[str, str] = {
    "token-prune": "its kept image tokens keep their original positions (gaps in the sequence) and, with "
                   "strategy 'fastv', are dropped inside the decoder after layer K; TensorRT-LLM numbers the "
                   "prompt contiguously (M-RoPE positions from the full image grid) and runs every token "
                   "through every layer",
    "token-merge": "its merged image tokens keep their original positions (gaps in the sequence), while "
                   "TensorRT-LLM numbers the prompt contiguously (M-RoPE positions from the full image grid)",
}


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
        if result.name in VISION_TOKEN_PASSES:
            strategy = result.config_dict().get("strategy")
            raise ExportError(
                f"pass {result.name!r}{f' (strategy {strategy!r})' if strategy else ''} cannot be expressed in "
                f"TensorRT-LLM: {VISION_TOKEN_PASSES[result.name]}.",
                fix=f"export to ONNX Runtime, whose runner reproduces {result.name!r}, or export without it.",
            )
        if target == "hf" and result.kind in ("encoder", "projector"):
            raise ExportError(
                f"pass {result.name!r} changes the vision tower or the visual tokens, but TensorRT-LLM's PyTorch "
                "backend runs its own vision code on the original Hugging Face weights, so the change would be lost.",
                fix="export target='checkpoint' (the vision part becomes an ONNX graph that keeps the pass), or "
                f"export to ONNX Runtime, or drop {result.name!r} for this export.",
            )
