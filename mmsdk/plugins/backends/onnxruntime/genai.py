"""ONNX Runtime GenAI's folder layout (genai_config.json, processor and tokenizer files) where GenAI runs the family."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext

__all__ = ["GENAI_MODEL_TYPES", "genai_model_type", "write_if_supported", "UNSUPPORTED_REASON"]

# GenAI 0.18's VLM model types that map to an mmsdk family (src/models/model_type.h).
GENAI_MODEL_TYPES = {"Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
UNSUPPORTED_REASON = (
    "ONNX Runtime GenAI (0.18) has no model type for this architecture (it runs Qwen2.5-VL among mmsdk's "
    "families; not LLaVA, LLaVA-NeXT, Qwen2-VL, IDEFICS or Mllama); use mmsdk's own runtime (mmsdk.load / mmsdk run)"
)


def genai_model_type(context: ExportContext) -> str | None:
    """GenAI's model type for the exported architecture, or None."""
    return GENAI_MODEL_TYPES.get(type(context.model).__name__)


def write_if_supported(context: ExportContext, details: Mapping[str, Any], staging: Path, *, enabled: bool) -> dict:
    """Write the GenAI files when supported and enabled; return what the manifest records."""
    model_type = genai_model_type(context)
    if not enabled:
        return {"written": False, "reason": "disabled by the genai='off' export option"}
    if model_type is None:
        return {"written": False, "reason": UNSUPPORTED_REASON}
    if details["vision"].get("slots_output"):
        return {"written": False, "reason": "vision-token reduction (token-prune / token-merge) shortens the prompt, "
                "which ORT GenAI's Qwen2.5-VL pipeline does not do; use mmsdk's runtime"}
    sparse = details["decoder"].get("sparse_xattn")
    if sparse:
        carried = (" and, with a quantized KV cache, carries the image keys' block sums between steps as extra "
                   "past/present tensors" if sparse.get("image_key_sums") else "")
        return {"written": False, "reason": "sparse-xattn's decoder takes image_token_mask" + carried + ", which ORT "
                "GenAI's Qwen2.5-VL pipeline does not feed (it passes only the KV cache between steps); use "
                "mmsdk's runtime"}
    from mmsdk.plugins.backends.onnxruntime.genai_files import write_genai_files

    return write_genai_files(context, details, staging, model_type)
