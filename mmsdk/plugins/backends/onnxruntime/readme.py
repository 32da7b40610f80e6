"""The README.md written into every onnxruntime export folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext

__all__ = ["write"]


def write(folder: Path, context: ExportContext, details: Mapping[str, Any]) -> None:
    """Describe the files, how to run them and what ONNX Runtime GenAI can do with them."""
    dec = details["decoder"]
    cache = dec["cache"]
    genai = details.get("genai") or {}
    passes = details.get("passes") or {}
    lines = [
        f"# {context.source.name} for ONNX Runtime",
        "",
        f"Exported by mmsdk from `{context.source.name}` ({context.source.architecture}, family "
        f"{context.source.family}). Passes: {', '.join(passes) or 'none'}.",
        "",
        "| file | what |",
        "| --- | --- |",
        "| vision.onnx | vision tower + projector, one image per run" + (
            "; also the cross-attention K/V of every open block |" if dec["cross_attention"] else " |"),
        "| embedding.onnx | token embeddings" + (" with image features scattered into the image tokens |"
                                                   if details["image_tokens"] == "inline" else " |"),
        "| decoder.onnx (+ decoder.onnx.data) | decoder with past/present KV (GroupQueryAttention) and the LM head |",
        "| processor/ | the processor that turns (image, prompt) into the graphs' inputs |",
        "| manifest.json | sha256 of every file, passes and configs, I/O description |",
        "",
        f"KV cache: {'float32' if not cache['bits'] else 'INT%d (static scales)' % cache['bits']}; "
        f"at most {dec['max_sequence_length']} tokens per sequence; position ids: {dec['position_ids']}.",
        "",
        "Run it: `mmsdk run THIS_FOLDER --image photo.png --prompt \"what is this ?\"`, or in Python "
        "`mmsdk.load(THIS_FOLDER).answer(image, \"what is this ?\")`.",
        "",
        "ONNX Runtime GenAI: " + ("this folder also holds genai_config.json; `onnxruntime_genai.Model(THIS_FOLDER)` "
                                  "loads it." if genai.get("written") else f"not supported: {genai.get('reason', '')}."),
        "",
    ]
    (folder / "README.md").write_text("\n".join(lines))
