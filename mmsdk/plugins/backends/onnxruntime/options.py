"""Export options of the onnxruntime backend."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mmsdk.core.backend import BackendOptions

__all__ = ["OrtOptions"]


class OrtOptions(BackendOptions):
    """``Optimizer.export("onnxruntime", path, **options)``."""

    max_sequence_length: int | None = Field(
        None, ge=8, le=1_048_576,
        description="Longest prompt + generated tokens the decoder accepts (size of its RoPE tables); "
        "default: the model's max_position_embeddings.",
    )
    accuracy_level: Literal[0, 1, 2, 3, 4] = Field(
        0, description="MatMulNBits accuracy_level for INT4 weights: 0 keeps activations in float (the same "
        "numbers as torch's INT4 layer); 4 lets the CPU quantize activations to int8 (its fast path, what ORT "
        "GenAI's builder writes for CPU).",
    )
    dtype: Literal["float32", "float16"] = Field(
        "float32", description="Activations and float weights of embedding.onnx and decoder.onnx (the vision graph "
        "stays float32); float16 halves the float weights and is the usual CUDA choice.",
    )
    genai: Literal["auto", "off"] = Field(
        "auto", description="Also write ONNX Runtime GenAI's genai_config.json where GenAI supports the family.",
    )
    verify: bool = Field(
        True, description="Run the exported graphs on a sample prompt and compare with the torch model before "
        "finishing; a graph that does not reproduce the model is an ExportError.",
    )
