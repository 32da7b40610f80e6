"""The language-model stage of a dual pipeline: TensorRT-LLM where installed, else its CPU reference.

Both take one request's token ids, the visual features from the vision stage (a torch tensor that
views the vision stage's output buffer) and return the generated token ids. The reference is the
TensorRT-LLM backend's independent loader (``reference.py``): it reads ``llm/``'s checkpoint files,
INT4 bytes and INT8/FP8 KV scales included, and feeds image tokens from a prompt table exactly as
TensorRT-LLM's prompt-tuning embedding does.

The TensorRT-LLM path follows TensorRT-LLM's documented APIs (``LLM.generate`` with
``multi_modal_embeddings`` for target ``hf``; ``ModelRunner.generate`` with ``prompt_table`` for
engines built from target ``checkpoint``). It needs an NVIDIA GPU and was not executed by mmsdk's
CPU test suite.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from mmsdk.core.errors import BackendUnavailableError, ConfigError, UnsupportedInputError

__all__ = ["LLMRequest", "LLMStage", "ReferenceStage", "TensorRTLLMStage", "open_llm_stage"]

TRTLLM_INSTALL = "pip install 'mmsdk[trtllm]'"


@dataclass
class LLMRequest:
    """One prompt for the language-model stage."""

    input_ids: torch.Tensor  # [L] with the processor's image placeholder tokens
    features: torch.Tensor  # [kept image tokens, hidden]: a view of the vision stage's output
    slots: torch.Tensor | None  # kept placeholder indices among the image's tokens (token reduction)
    grids: list[tuple[int, int, int]] | None  # Qwen-VL image grids (M-RoPE)
    prompt: str
    max_new_tokens: int


class LLMStage(Protocol):
    """What the dual pipeline asks of a language-model stage."""

    name: str

    def generate(self, request: LLMRequest) -> list[int]:
        """Greedy token ids generated after the prompt (eos included when reached)."""


def open_llm_stage(folder: Path, details: Mapping[str, Any], runtime: str = "auto", **options: Any) -> LLMStage:
    """``runtime``: ``tensorrt_llm`` (required), ``reference`` (CPU torch) or ``auto`` (the first that is installed)."""
    if runtime not in ("auto", "tensorrt_llm", "reference"):
        raise ConfigError(f"runtime={runtime!r} is not one of 'auto', 'tensorrt_llm', 'reference'.",
                          fix="use 'auto' (TensorRT-LLM where installed, else the CPU reference).")
    usable = importlib.util.find_spec("tensorrt_llm") is not None and torch.cuda.is_available()
    if runtime == "tensorrt_llm" and not usable:
        raise BackendUnavailableError(
            "the language-model half (llm/) asked for TensorRT-LLM, which is not installed here (or no CUDA GPU).",
            fix=f"{TRTLLM_INSTALL} on an NVIDIA GPU machine, or load with runtime='reference' (the CPU fallback: "
            "the same llm/ files run in torch).",
        )
    if runtime == "tensorrt_llm" or (runtime == "auto" and usable):
        return TensorRTLLMStage(folder, details, **options)
    return ReferenceStage(folder, details)


class ReferenceStage:
    """llm/ in torch through the TensorRT-LLM backend's independent checkpoint reader."""

    name = "reference"

    def __init__(self, folder: Path, details: Mapping[str, Any]) -> None:
        from mmsdk.plugins.backends.tensorrt_llm.reference import load_checkpoint

        if details["llm"]["target"] != "checkpoint":
            raise BackendUnavailableError(
                "the CPU reference runs llm/ folders of target 'checkpoint'; this one is target 'hf', which only "
                "TensorRT-LLM's PyTorch backend runs.",
                fix=f"run it with runtime='tensorrt_llm' ({TRTLLM_INSTALL}, GPU), or re-export with "
                "target='checkpoint'.",
            )
        self.contract = details["contract"]
        self.eos = set(details["generation"]["eos_token_ids"])
        self.lm = load_checkpoint(folder / "llm")

    def generate(self, request: LLMRequest) -> list[int]:
        ids, positions = table_inputs(request, self.contract, self.lm.vocab_size)
        out: list[int] = []
        with torch.inference_mode():
            for _ in range(request.max_new_tokens):
                logits = self.lm.logits(ids, request.features, positions, kv_cache=True)
                token = int(logits[-1].argmax())
                out.append(token)
                if token in self.eos:
                    break
                ids = torch.cat([ids, torch.tensor([token])])
                positions = _advance(positions)
        return out


def table_inputs(request: LLMRequest, contract: Mapping[str, Any], vocab_size: int) -> tuple[torch.Tensor, Any]:
    """(ids with image placeholders replaced by prompt-table ids, positions or None) for one prompt."""
    from mmsdk.plugins.backends.tensorrt_llm.reference import mrope_positions

    ids = request.input_ids.reshape(-1).long()
    marker = ids == int(contract["image_token_id"])
    keep = torch.ones_like(marker)
    if request.slots is not None:  # drop the placeholders of the image tokens the vision stage removed
        where = marker.nonzero().reshape(-1)
        keep[where] = False
        keep[where[request.slots.long()]] = True
    kept_marker = marker[keep]
    if int(kept_marker.sum()) != request.features.shape[0]:
        raise UnsupportedInputError(
            f"the prompt has {int(kept_marker.sum())} image tokens for {request.features.shape[0]} visual features.",
            fix="give exactly one image per prompt, processed by the folder's processor/.",
        )
    fake = ids[keep].clone()
    fake[kept_marker] = vocab_size + torch.arange(int(kept_marker.sum()))
    if contract["positions"] != "mrope-host":
        return fake, None
    merge = int(contract["mrope"]["merge_size"])
    full = mrope_positions(ids, int(contract["image_token_id"]), request.grids or [], merge)
    return fake, full[:, keep]


def _advance(positions: torch.Tensor | None) -> torch.Tensor | None:
    if positions is None:
        return None
    nxt = positions.max() + 1
    return torch.cat([positions, torch.full((positions.shape[0], 1), int(nxt))], dim=1)


class TensorRTLLMStage:
    """llm/ in TensorRT-LLM (GPU). Not executable on a CPU-only machine; see the module docstring."""

    name = "tensorrt_llm"

    def __init__(self, folder: Path, details: Mapping[str, Any], engine_dir: str | None = None,
                 **llm_args: Any) -> None:
        self.contract, self.target = details["contract"], details["llm"]["target"]
        self.eos = list(details["generation"]["eos_token_ids"])
        self.pad = details["generation"].get("pad_token_id")
        self.dtype = getattr(torch, details["llm"].get("dtype", "float16"))
        if self.target == "hf":
            from tensorrt_llm import LLM

            self.llm = LLM(model=str(folder / "llm"), **llm_args)
            return
        if engine_dir is None:
            raise BackendUnavailableError(
                "llm/ is a trtllm-build checkpoint: TensorRT-LLM runs the engines built from it, not the checkpoint.",
                fix="build them with the command in README.md and load with engine_dir='<that folder>', or use "
                "runtime='reference' (the CPU fallback).",
            )
        if self.contract["positions"] == "mrope-host":
            raise BackendUnavailableError(
                "mmsdk's TensorRT-LLM stage does not pass M-RoPE positions to a ModelRunner engine yet.",
                fix="run Qwen-VL engines with TensorRT-LLM's examples/models/core/multimodal/run.py, or use "
                "runtime='reference'.",
            )
        from tensorrt_llm.runtime import ModelRunner

        self.runner = ModelRunner.from_dir(engine_dir=engine_dir, rank=0)

    def generate(self, request: LLMRequest) -> list[int]:
        features = request.features.to("cuda", self.dtype)  # already on the GPU when vision ran on CUDA: no copy
        if self.target == "hf":
            from tensorrt_llm import SamplingParams

            prompt = {"prompt": request.prompt, "multi_modal_embeddings": {"image": [features]}}
            output = self.llm.generate([prompt], SamplingParams(max_tokens=request.max_new_tokens, top_k=1))
            return list(output[0].outputs[0].token_ids)
        ids, _ = table_inputs(request, self.contract, int(self.contract["vocab_size"]))
        output = self.runner.generate(
            batch_input_ids=[ids.int()], prompt_table=features, prompt_tasks="0",
            max_new_tokens=request.max_new_tokens, end_id=self.eos[0] if self.eos else -1,
            pad_id=self.pad if self.pad is not None else 0, top_k=1, return_dict=False,
        )
        return output[0, 0, ids.numel():].tolist()
