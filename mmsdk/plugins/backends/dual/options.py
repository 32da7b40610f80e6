"""Export options of the ``dual`` backend: the TensorRT-LLM half's options (same names, same target choice)."""

from __future__ import annotations

from pydantic import Field

from mmsdk.plugins.backends.tensorrt_llm.options import TensorRTLLMOptions

__all__ = ["DualOptions"]


class DualOptions(TensorRTLLMOptions):
    """``export("dual", dir, **options)``: every ``tensorrt-llm`` option applies to ``llm/``."""

    max_sequence_length: int | None = Field(
        None, ge=8, description="Longest prompt + answer the pipeline accepts (default: the model's maximum)."
    )
