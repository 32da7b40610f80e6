"""Export options of the ``dual`` backend: the TensorRT-LLM half's options (same names, same target choice)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mmsdk.plugins.backends.tensorrt_llm.options import TensorRTLLMOptions

__all__ = ["DualOptions"]


class DualOptions(TensorRTLLMOptions):
    """``export("dual", dir, **options)``: every ``tensorrt-llm`` option applies to ``llm/``."""

    max_sequence_length: int | None = Field(
        None, ge=8, description="Longest prompt + answer the pipeline accepts (default: the model's maximum)."
    )
    token_positions: Literal["refuse", "contiguous"] = Field(
        "refuse",
        description="1-D RoPE models with token-prune / token-merge: the torch model keeps each kept image token at "
        "its original position, TensorRT-LLM numbers the prompt contiguously. 'refuse' (default) stops the export; "
        "'contiguous' accepts the renumbered positions (measured -34 points on llava-digits).",
    )
