"""Deciding, before anything is written, how one optimized model splits into its two halves.

The vision half (``vision/``, ONNX Runtime) takes the vision tower, the projector and every pass that
acts before the language model (ViT pruning, VisionZip pruning, token merging). The language-model
half (``llm/``, TensorRT-LLM) takes the decoder with its weight and KV quantization. A pass that acts
inside the decoder in a way TensorRT-LLM cannot express, or a model TensorRT-LLM does not run, is
refused here, naming the half that refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from mmsdk.core.backend import LowerTarget
from mmsdk.core.errors import ExportError, IncompatiblePassError, MmsdkError
from mmsdk.plugins.backends.onnxruntime.plan import ExportPlan

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext
    from mmsdk.plugins.backends.dual.options import DualOptions
    from mmsdk.plugins.backends.tensorrt_llm.families import Family
    from mmsdk.plugins.backends.tensorrt_llm.options import Resolved

__all__ = ["LLM_REFUSED", "Split", "plan_split", "refusing"]

VISION = "the vision half (vision/, ONNX Runtime)"
LLM = "the language-model half (llm/, TensorRT-LLM)"

# Passes that change how the decoder attends, which TensorRT-LLM's kernels do not express.
LLM_REFUSED: dict[str, str] = {
    "sparse-xattn": "it masks text-to-image attention blocks inside the decoder's attention, and TensorRT-LLM's "
                    "attention kernels run the prompt dense",
    "gated-xattn": "it skips gated cross-attention layers, and TensorRT-LLM runs no gated cross-attention model "
                   "from a Hugging Face export",
}


@dataclass(frozen=True)
class Split:
    """Everything both halves were decided to be."""

    vision_plan: ExportPlan
    family: Family
    kv_algo: str | None
    resolved: Resolved
    positions: Literal["contiguous", "mrope-host"]

    @property
    def entry(self) -> str:
        """How visual features enter the language model on TensorRT-LLM."""
        return "prompt_table" if self.resolved.target == "checkpoint" else "multi_modal_embeddings"


class refusing:
    """Context manager: re-raise an mmsdk error from one half with that half named first."""

    def __init__(self, half: str) -> None:
        self.half = half

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool:
        if isinstance(error, MmsdkError):
            raise type(error)(f"{self.half} refuses: {error.problem}", fix=error.fix) from error
        return False


def plan_split(context: ExportContext, options: DualOptions) -> Split:
    """The split of ``context``; raises an error naming the refusing half."""
    with refusing(LLM):
        family, kv_algo, resolved = _llm_half(context, options)
    with refusing(VISION):
        plan = _vision_plan(context, options)
    mrope = context.adapter.rotary_kind(context.model) == "mrope"
    if plan.token_reduction and mrope and resolved.target != "checkpoint":
        with refusing(LLM):
            raise ExportError(
                "token-prune / token-merge keep each kept image token at its original M-RoPE position, and "
                "TensorRT-LLM's PyTorch backend (target 'hf') computes M-RoPE positions from the full image grid.",
                fix="export with target='checkpoint' (the host passes M-RoPE positions), or without the token pass.",
            )
    if plan.token_reduction and not mrope and options.token_positions == "refuse":
        with refusing(LLM):
            raise ExportError(
                "token-prune / token-merge keep each kept image token at its original position in the torch model, "
                "and TensorRT-LLM numbers the prompt contiguously; the renumbered model answers differently "
                "(llava-digits with recipe:max-memory: 73.9% in torch, 39.6% as a dual folder, "
                "benchmarks/dual_path.py --recipe max-memory).",
                fix="export to 'onnxruntime' (it keeps the original positions), drop the token pass, or pass "
                "token_positions='contiguous' to accept the renumbered positions.",
            )
    return Split(plan, family, kv_algo, resolved, "mrope-host" if mrope else "contiguous")


def _llm_half(context: ExportContext, options: DualOptions) -> tuple[Family, str | None, Resolved]:
    from mmsdk.plugins.backends.tensorrt_llm import support
    from mmsdk.plugins.backends.tensorrt_llm.backend import check_language_model
    from mmsdk.plugins.backends.tensorrt_llm.kv_scales import kv_algorithm
    from mmsdk.plugins.backends.tensorrt_llm.options import resolve_target

    family = support.family_of(context)
    kv_algo = kv_algorithm(context.pass_names(), options.int4_kv_fallback)
    resolved = resolve_target(options, family, kv_algo)
    for result in context.results:
        if result.name in LLM_REFUSED:
            raise IncompatiblePassError(f"pass {result.name!r}: {LLM_REFUSED[result.name]}.",
                                        fix=f"drop {result.name!r} for a dual export, or export to 'onnxruntime'.")
    check_language_model(context, options, family, kv_algo, resolved)
    return family, kv_algo, resolved


def _vision_plan(context: ExportContext, options: DualOptions) -> ExportPlan:
    """The onnxruntime backend's plan, restricted to what the vision graph needs."""
    from mmsdk.plugins.backends.onnxruntime.checks import require_runtime
    from mmsdk.plugins.backends.onnxruntime.tokens import token_pass

    require_runtime()
    if context.processor is None:
        raise ExportError("the vision graph is traced on a processed sample image, and no processor was given.",
                          fix="create the Optimizer with Optimizer(model, processor) (mmsdk.load_model returns both).")
    decided: dict[str, Any] = {}
    for result in context.results:
        if result.name in ("token-prune", "token-merge"):
            token_pass(context, result, decided)
    cfg = context.adapter.text_config(context.model)
    max_positions = options.max_sequence_length or int(getattr(cfg, "max_position_embeddings", 4096))
    return ExportPlan(target=LowerTarget("onnxruntime", {"accuracy_level": 0}), max_positions=max_positions,
                      token_reduction=bool(decided.get("token_reduction")))
