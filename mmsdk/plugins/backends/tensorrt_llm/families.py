"""Which Hugging Face architectures TensorRT-LLM runs, and how (specs/tensorrt-llm.md 1.2, 3.2, 4.4).

This is the backend's support matrix, so it is keyed by architecture name on purpose: the values
written into TensorRT-LLM's config (``architecture``, ``qwen_type``, the vision ``model_type``) are
themselves names of architectures.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "REFUSED", "Family", "family_for"]


@dataclass(frozen=True)
class Family:
    """How one Hugging Face architecture maps onto TensorRT-LLM."""

    architecture: str  # Hugging Face class name
    llm_architecture: str  # target A config.json "architecture"
    vision_model_type: str  # target A vision/config.json builder_config.model_type
    target_b: bool  # the PyTorch backend (LLM API) runs it
    qwen_type: str | None = None  # target A: set for the Qwen family
    position_embedding_type: str = "rope_gpt_neox"
    runner_note: str = ""  # what TensorRT-LLM's own multimodal runner does not do for this family


FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        Family("LlavaForConditionalGeneration", "LlamaForCausalLM", "llava", target_b=False),
        Family("LlavaNextForConditionalGeneration", "LlamaForCausalLM", "llava_next", target_b=True,
               runner_note="run.py's end-to-end C++ session (--session cpp) does not support LLaVA-NeXT; keep "
                           "the default session (cpp_llm_only) or --session python."),
        Family("Qwen2VLForConditionalGeneration", "Qwen2VLForConditionalGeneration", "qwen2_vl", target_b=True,
               qwen_type="qwen2_vl", position_embedding_type="mrope",
               runner_note="run.py runs Qwen2-VL in its default cpp_llm_only session only."),
        Family("Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration", "qwen2_5_vl",
               target_b=True, qwen_type="qwen2_vl", position_embedding_type="mrope",
               runner_note="TensorRT-LLM's multimodal builder and runner have no qwen2_5_vl vision type: the "
                           "language-model checkpoint builds with trtllm-build, but the vision ONNX (window "
                           "attention, mmsdk's I/O contract) must be run by your own code or mmsdk's dual "
                           "pipeline; prefer target B (hf) for Qwen2.5-VL."),
    )
}

# Architectures mmsdk knows but TensorRT-LLM (or mmsdk's exporter for it) cannot take: name -> why + what instead.
REFUSED: dict[str, str] = {
    "IdeficsForVisionText2Text": (
        "TensorRT-LLM has no IDEFICS implementation (no engine model, no PyTorch-backend model). "
        "Fix: export to ONNX Runtime instead (export('onnxruntime', ...))."
    ),
    "MllamaForConditionalGeneration": (
        "TensorRT-LLM's PyTorch backend runs Mllama as text only (its cross-attention decoder layers are not "
        "implemented there), and mmsdk does not write the legacy engine checkpoint for Mllama. "
        "Fix: export to ONNX Runtime (export('onnxruntime', ...)), or convert the unoptimized model with "
        "TensorRT-LLM <= 1.2's examples/models/core/mllama/convert_checkpoint.py."
    ),
}


def family_for(architecture: str) -> Family | None:
    """The TensorRT-LLM mapping of ``architecture``, or None."""
    return FAMILIES.get(architecture)
