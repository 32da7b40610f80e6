"""Write a dual folder: ``vision/`` (ONNX Runtime), ``llm/`` (TensorRT-LLM), the shared calibration and the contract.

Layout::

    calibration.json        the one calibration record both halves were quantized from (ptq-align)
    processor/              the host side: tokenizer and image processor
    vision/vision.onnx      vision tower + projector (+ token pruning / merging), the onnxruntime backend's graph
    vision/half.json        export id, source, calibration sha256
    llm/...                 the tensorrt-llm backend's writer: checkpoint (config.json + rank files) or HF folder
    llm/half.json           export id, source, calibration sha256, the KV scales it wrote
    README.md               build and run commands
    manifest.json           (written by the core) hashes of every file; details: contract, stamps, half hashes
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmsdk.core.backend import ExportInfo
from mmsdk.plugins.backends.dual import stamps as S
from mmsdk.plugins.backends.dual.split import Split, plan_split

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext
    from mmsdk.plugins.backends.dual.options import DualOptions

__all__ = ["PROCESSOR_DIR", "VISION_FILE", "export_dual"]

VISION_FILE = "vision.onnx"
PROCESSOR_DIR = "processor"
ORT_REQUIREMENT = ">=1.30"


def export_dual(context: ExportContext, options: DualOptions, staging: Path) -> ExportInfo:
    """Both halves, their stamps and the pipeline details (the core adds hashes and writes the manifest)."""
    split = plan_split(context, options)
    calibration = dict(context.calibration) if context.calibration else None
    digest = S.calibration_digest(calibration)
    stamp = {"export_id": uuid.uuid4().hex, "source": {"name": context.source.name,
                                                      "architecture": context.source.architecture},
             "calibration_sha256": digest, "passes": context.pass_names()}
    if calibration is not None:
        (staging / S.CALIBRATION).write_text(json.dumps(calibration, indent=1, sort_keys=True) + "\n")
    vision = _write_vision(context, split, staging / "vision")
    llm = _write_llm(context, options, split, staging / "llm")
    S.write_stamp(staging / "vision", "vision", {**stamp, "outputs": vision["outputs"]})
    S.write_stamp(staging / "llm", "llm", {**stamp, "kv_scales": llm.get("kv_scales"), "target": split.resolved.target})
    context.processor.save_pretrained(staging / PROCESSOR_DIR)
    contract = hand_off(context, split, vision, options.dtype)
    details = {"contract": contract, "stamp": stamp, "vision": vision, "llm": llm,
               "hashes": {half: S.tree_hash(staging / half) for half in S.HALVES},
               "processor": PROCESSOR_DIR, "family": context.adapter.family,
               "generation": _generation(context)}
    from mmsdk.plugins.backends.dual.readme import write_readme

    write_readme(staging, context.source.name, details, split.resolved.requirement)
    return ExportInfo(details=details, requirements={"onnxruntime": ORT_REQUIREMENT,
                                                     "tensorrt-llm": split.resolved.requirement})


def _write_vision(context: ExportContext, split: Split, folder: Path) -> dict[str, Any]:
    import onnx

    from mmsdk.plugins.backends.onnxruntime.export import sample_batch
    from mmsdk.plugins.backends.onnxruntime.vision import build_vision, image_inputs_of

    folder.mkdir()
    sample = sample_batch(context)
    graph = build_vision(context.model, context.adapter, split.vision_plan,
                         image_inputs_of(context.adapter, context.model, sample))
    onnx.save_model(graph.model, str(folder / VISION_FILE))
    return {"file": f"vision/{VISION_FILE}", **graph.details()}


def _write_llm(context: ExportContext, options: DualOptions, split: Split, folder: Path) -> dict[str, Any]:
    from mmsdk.plugins.backends.tensorrt_llm.checkpoint import plan_checkpoint, write_checkpoint
    from mmsdk.plugins.backends.tensorrt_llm.hf_export import write_hf
    from mmsdk.plugins.backends.tensorrt_llm.kv_scales import kv_scales
    from mmsdk.plugins.backends.tensorrt_llm.weights import read_language_model

    lm = read_language_model(context)
    scales, calibrated = kv_scales(context, split.kv_algo, lm.num_layers) if split.kv_algo else ({}, False)
    out: dict[str, Any] = {"target": split.resolved.target, "kv_cache_quant_algo": split.kv_algo,
                           "kv_scales_calibrated": calibrated, "kv_scales": {str(k): v for k, v in scales.items()},
                           "weights": "W4A16_AWQ" if lm.group_size() else options.dtype, "dtype": options.dtype}
    if split.resolved.target == "checkpoint":
        plan = plan_checkpoint(lm, split.family, options.tp_size, options.pp_size, options.dtype, split.kv_algo,
                               scales)
        config = write_checkpoint(lm, plan, folder)
        out.update(tp_size=plan.tp, pp_size=plan.pp, architecture=config.get("architecture"))
    else:
        folder.mkdir()
        out["hf_quant_config"] = write_hf(context, lm, folder, options.dtype, split.kv_algo, scales) or None
    return out


def hand_off(context: ExportContext, split: Split, vision: dict[str, Any], llm_dtype: str) -> dict[str, Any]:
    """The tensor contract between the halves: what the vision graph outputs and how the LLM takes it."""
    model, adapter = context.model, context.adapter
    layout = adapter.image_tokens(model)
    shape = list(vision["output_shapes"].get("image_features", []))
    head = adapter.lm_head(model)
    vocab = int(getattr(head, "out_features", 0) + getattr(head, "out_additional_features", 0))
    contract: dict[str, Any] = {
        "features": {"output": "image_features", "shape_per_image": shape, "dtype": "float32",
                     "llm_dtype": llm_dtype, "slots_output": vision["slots_output"]},
        "entry": split.entry,
        "image_token_id": layout.image_token_id,
        "vocab_size": vocab,
        "positions": split.positions,
        "tokens_per_image": shape[0] if shape else None,
    }
    if split.entry == "prompt_table":
        contract["prompt_table"] = {"fake_ids": "vocab_size + i for the i-th kept image token of the prompt",
                                    "table_shape": ["sum of kept image tokens", shape[-1] if shape else None],
                                    "tasks": 0, "prompt_vocab_size": "rows of the table"}
    else:
        contract["multi_modal_embeddings"] = {"call": "LLM.generate({'prompt': text, 'multi_modal_embeddings': "
                                                      "{'image': [features]}})"}
    if split.positions == "mrope-host":
        contract["mrope"] = {"merge_size": int(model.config.vision_config.spatial_merge_size),
                             "rule": "3-D positions from the full image grid; kept tokens keep theirs"}
    return contract


def _generation(context: ExportContext) -> dict[str, Any]:
    gen = getattr(context.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    return {"eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
            "pad_token_id": getattr(gen, "pad_token_id", None)}
