"""Export-time check: the written graphs must reproduce the optimized torch model on a sample prompt."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from mmsdk.core.errors import ExportError

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext

__all__ = ["verify_against_torch", "tolerance_for", "LOGIT_TOLERANCE", "QUANTIZED_KV_TOLERANCE"]

# Largest |logit difference| / max(1, max |logit|) accepted for the last prompt token.
LOGIT_TOLERANCE = 1e-3
# float16 activations through every layer.
FLOAT16_TOLERANCE = 2e-2
# MatMulNBits with accuracy_level 4 quantizes activations to int8 on the CPU (torch's INT4 layer does not).
INT8_ACTIVATION_TOLERANCE = 2e-2
# With a quantized KV cache a K value on a rounding boundary may round the other way in ORT than in
# torch (another CPU's RoPE rounding): the two then differ by quantization noise at that position.
# (prefill_attention="exact", which attends the prompt's own K/V in float, is refused at export.)
QUANTIZED_KV_TOLERANCE = 0.25
STEPS = 4


def tolerance_for(decoder: Mapping[str, Any]) -> float:
    """The relative logit tolerance for a decoder description (its cache and weight formats)."""
    if decoder["cache"]["bits"]:
        return QUANTIZED_KV_TOLERANCE
    if decoder.get("dtype") == "float16":
        return FLOAT16_TOLERANCE
    if decoder.get("ops", {}).get("MatMulNBits") and decoder.get("accuracy_level", 0) == 4:
        return INT8_ACTIVATION_TOLERANCE
    return LOGIT_TOLERANCE


def verify_against_torch(context: ExportContext, staging: Path, details: Mapping[str, Any],
                         sample: Mapping[str, Any]) -> dict[str, Any]:
    """Compare prefill logits (raising on a mismatch) and report greedy agreement over a few steps."""
    import torch

    from mmsdk.runtime.inputs import from_batch
    from mmsdk.runtime.pipeline import OrtPipeline
    from mmsdk.runtime.sessions import SessionConfig, open_session
    from mmsdk.runtime.spec import ExportSpec

    spec = ExportSpec.from_details(details)
    sessions = {k: open_session(staging / spec.files[k], SessionConfig()) for k in ("vision", "embedding", "decoder")}
    pipe = OrtPipeline(spec, sessions, context.processor)
    prepared = from_batch(spec, sample, STEPS, pipe.vision_shapes)
    generation = pipe.decode(prepared, pipe.encode(prepared))
    with torch.no_grad():  # generate(), not forward(): a KV pass's quantized cache is only used by generate
        out = context.model.generate(**sample, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
    reference, expected = out.logits[0].float(), out.sequences
    scale = max(1.0, float(reference.abs().max()))
    error = float((generation.first_logits.float() - reference).abs().max()) / scale
    tolerance = tolerance_for(details["decoder"])
    if not error <= tolerance:
        passes = context.pass_names()
        cause = (f"one of the passes ({', '.join(passes)}) changes the model in a way the backend does not express; "
                 "drop it for this export, or" if passes else "this model computes something the backend's graph "
                 "builder does not express;")
        raise ExportError(
            f"the exported graphs do not reproduce the optimized torch model: last-token logits differ by "
            f"{error:.3g} (relative; allowed {tolerance}).",
            fix=f"{cause} export to the 'torch' backend, and report the model and passes.",
        )
    torch_tokens = expected[0, sample["input_ids"].shape[1]:].tolist()
    ort_tokens = generation.tokens[0]
    agree = sum(1 for a, b in zip(torch_tokens, ort_tokens) if a == b)
    return {"prompt_tokens": int(sample["input_ids"].shape[1]), "relative_logit_error": error,
            "tolerance": tolerance, "greedy_tokens_torch": torch_tokens, "greedy_tokens_onnxruntime": ort_tokens,
            "greedy_agreement": f"{agree}/{min(len(torch_tokens), len(ort_tokens))}"}
