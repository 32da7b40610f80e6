"""The onnxruntime export: plan, build the three graphs in memory, verify them, then write the folder."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mmsdk.core.backend import ExportInfo
from mmsdk.plugins.backends.onnxruntime import names as N
from mmsdk.plugins.backends.onnxruntime.annotate import model_metadata, node_stage_counts
from mmsdk.plugins.backends.onnxruntime.checks import PASS_SUPPORT, make_plan
from mmsdk.plugins.backends.onnxruntime.graph import float_type_of
from mmsdk.plugins.backends.onnxruntime.kvcache import cache_last_dim

if TYPE_CHECKING:
    import onnx
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.backend import ExportContext
    from mmsdk.plugins.backends.onnxruntime.options import OrtOptions
    from mmsdk.plugins.backends.onnxruntime.plan import ExportPlan
    from mmsdk.plugins.backends.onnxruntime.vision import VisionGraph

__all__ = ["export_folder", "build_graphs", "sample_batch", "FILES", "PROCESSOR_DIR"]

FILES = {"vision": "vision.onnx", "embedding": "embedding.onnx", "decoder": "decoder.onnx"}
DECODER_DATA = "decoder.onnx.data"
PROCESSOR_DIR = "processor"
SAMPLE_QUESTION = "what is this ?"


def sample_batch(context: ExportContext) -> dict[str, Any]:
    """The processor's output for one deterministic sample image and question."""
    image = (np.add.outer(np.arange(32), np.arange(32)) * 4 % 256).astype(np.uint8)
    prompt = context.adapter.format_prompt(SAMPLE_QUESTION, context.processor)
    return dict(context.processor(images=[image], text=[prompt], return_tensors="pt"))


def build_graphs(context: ExportContext, plan: ExportPlan, sample: dict[str, Any]) -> dict[str, Any]:
    """vision / embedding / decoder ModelProtos plus the runtime description (nothing written yet)."""
    from mmsdk.plugins.backends.onnxruntime.decoder import DecoderBuilder
    from mmsdk.plugins.backends.onnxruntime.embedding import build_embedding
    from mmsdk.plugins.backends.onnxruntime.vision import build_vision, image_inputs_of

    model, adapter = context.model, context.adapter
    decoder = DecoderBuilder(model, adapter, context.session, plan).build()
    model_metadata(decoder, "decoder", "text")
    embedding = build_embedding(model, adapter, float_type_of(plan.dtype))
    model_metadata(embedding, "embedding", "multimodal")
    vision = build_vision(model, adapter, plan, image_inputs_of(adapter, model, sample))
    details = describe(model, adapter, plan, vision, context)
    details["decoder"]["ops"] = dict(sorted(Counter(node.op_type for node in decoder.graph.node).items()))
    details["annotations"] = {name: node_stage_counts(proto) for name, proto in
                              (("vision", vision.model), ("embedding", embedding), ("decoder", decoder))}
    return {"vision": vision.model, "embedding": embedding, "decoder": decoder, "details": details}


def export_folder(context: ExportContext, options: OrtOptions, staging: Path) -> ExportInfo:
    """Everything the backend writes into ``staging``."""
    import onnxruntime
    import torch
    import transformers

    from mmsdk.plugins.backends.onnxruntime import genai, readme

    plan = make_plan(context, options)
    sample = sample_batch(context)
    graphs = build_graphs(context, plan, sample)
    details = graphs["details"]
    # Files go into the staging folder, which the caller deletes if anything below raises.
    _save(graphs["vision"], staging / FILES["vision"])
    _save(graphs["embedding"], staging / FILES["embedding"])
    _save(graphs["decoder"], staging / FILES["decoder"], external=DECODER_DATA)
    context.processor.save_pretrained(staging / PROCESSOR_DIR)
    if options.verify:
        from mmsdk.plugins.backends.onnxruntime.verify import verify_against_torch

        details["verification"] = verify_against_torch(context, staging, details, sample)
    details["genai"] = genai.write_if_supported(context, details, staging, enabled=options.genai == "auto")
    details["exported_with"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                "onnxruntime": onnxruntime.__version__}
    readme.write(staging, context, details)
    return ExportInfo(details=details, requirements={"onnxruntime": ">=1.30", "onnx": ">=1.17"})


def _save(proto: onnx.ModelProto, path: Path, external: str | None = None) -> None:
    import onnx

    if external is None:
        onnx.save_model(proto, str(path))
        return
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=external, size_threshold=1024)


def describe(model: nn.Module, adapter: ModelAdapter, plan: ExportPlan, vision: VisionGraph,
             context: ExportContext) -> dict[str, Any]:
    """What the runtime needs to drive the graphs (stored as the manifest's ``details``)."""
    layout = adapter.kv_layout(model)
    image_layout = adapter.image_tokens(model)
    sections = adapter.rope_sections(model)
    kv = plan.kv
    cache = {"bits": kv.bits if kv else None, "dtype": plan.dtype if kv is None else ("int8" if kv.bits == 8 else "uint8"),
             "last_dim": cache_last_dim(kv, layout.head_dim), "scales_from": kv.source if kv else None}
    decoder: dict[str, Any] = {
        "accuracy_level": plan.accuracy_level, "dtype": plan.dtype,
        "self_attention_layers": list(layout.self_attention_layers), "num_heads": layout.num_heads,
        "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim, "hidden_size": layout.hidden_size,
        "max_sequence_length": plan.max_positions, "cache": cache,
        "position_ids": "mrope" if sections else "1d", "mrope_sections": list(sections) if sections else None,
        "cross_attention": _cross_details(plan, layout),
    }
    if sections:
        decoder["spatial_merge_size"] = int(model.config.vision_config.spatial_merge_size)
    if plan.sparse is not None and plan.sparse.kind == "self":  # extra decoder inputs the runtime feeds
        decoder["sparse_xattn"] = {"image_token_mask": N.IMAGE_TOKEN_MASK, "block_size": plan.sparse.block,
                                   "image_key_sums": N.PAST_IMAGE_KEY_SUMS if plan.sparse_key_state else None}
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    head = adapter.lm_head(model)
    return {
        "files": dict(FILES), "decoder_data": DECODER_DATA, "processor": PROCESSOR_DIR,
        "vocab_size": int(getattr(head, "out_features", 0) + getattr(head, "out_additional_features", 0)),
        "family": adapter.family, "adapter": adapter.name,
        "image_tokens": image_layout.mode, "image_token_id": image_layout.image_token_id,
        "vision": vision.details(), "decoder": decoder,
        "generation": {"eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
                       "pad_token_id": getattr(gen, "pad_token_id", None)},
        "passes": {r.name: PASS_SUPPORT.get(r.name, "weights and modules read as they are") for r in context.results},
        "io": {"inputs_embeds": N.INPUTS_EMBEDS, "logits": N.LOGITS, "past_key": N.PAST_KEY,
               "past_value": N.PAST_VALUE, "present_key": N.PRESENT_KEY, "present_value": N.PRESENT_VALUE},
    }


def _cross_details(plan: ExportPlan, layout: Any) -> dict[str, Any] | None:
    if not plan.cross:
        return None
    assert plan.recipe is not None
    return {"layers": [c.decoder_index for c in plan.cross_with_kv()], "heads": layout.num_heads,
            "mask_input": plan.recipe.mask_input,
            "blocks": [{"layer": c.decoder_index, "attention": c.attention_open, "mlp": c.mlp_open} for c in plan.cross]}
