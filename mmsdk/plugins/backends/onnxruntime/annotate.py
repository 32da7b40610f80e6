"""Modality and stage annotations on ONNX graphs (the "MultiModalGraph IR" the profiler reads).

Every node carries ``mmsdk.modality`` (vision, text or multimodal), ``mmsdk.stage`` (vision_encoder,
projector, cross_kv, embedding, decoder, lm_head) and, where known, ``mmsdk.module`` (the torch
module it came from). Every model carries ``mmsdk.graph``, ``mmsdk.modality`` and ``mmsdk.stages``
(JSON: stage -> node count). :func:`read_annotations` turns a file back into that summary.
"""

from __future__ import annotations

import ast
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import onnx

__all__ = [
    "MODALITY_KEY",
    "STAGE_KEY",
    "MODULE_KEY",
    "MODALITIES",
    "STAGES",
    "annotate_traced",
    "model_metadata",
    "read_annotations",
]

MODALITY_KEY = "mmsdk.modality"
STAGE_KEY = "mmsdk.stage"
MODULE_KEY = "mmsdk.module"
MODALITIES = ("vision", "text", "multimodal")
STAGES = {  # stage -> its modality
    "vision_encoder": "vision",
    "projector": "multimodal",
    "cross_kv": "multimodal",
    "embedding": "multimodal",
    "decoder": "text",
    "cross_attention": "multimodal",
    "lm_head": "text",
}
_TORCH_SCOPES = "pkg.torch.onnx.name_scopes"


def node_stage_counts(model: onnx.ModelProto) -> dict[str, int]:
    """How many nodes each stage has."""
    counts: Counter[str] = Counter()
    for node in model.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        counts[props.get(STAGE_KEY, "unannotated")] += 1
    return dict(counts)


def model_metadata(model: onnx.ModelProto, graph: str, modality: str) -> None:
    """Write the model-level annotations from the node annotations already present."""
    values = {"mmsdk.graph": graph, MODALITY_KEY: modality, "mmsdk.stages": json.dumps(node_stage_counts(model))}
    kept = [p for p in model.metadata_props if p.key not in values]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in values.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value


def annotate_traced(model: onnx.ModelProto, scopes: Mapping[str, str], default_stage: str) -> None:
    """Annotate a traced graph: each node's stage from the longest module prefix in ``scopes``.

    ``scopes`` maps a qualified module name to a stage. Exporters name nodes after the module
    calls they went through, which may start below the root (a method such as
    ``get_image_features`` calls ``vision_tower`` directly), so every dotted suffix of a qualified
    name matches too. The torch exporter's bulky per-node debug properties are dropped.
    """
    expanded: dict[str, str] = {}
    for qualname, stage in scopes.items():
        parts = qualname.split(".")
        for start in range(len(parts)):
            expanded.setdefault(".".join(parts[start:]), stage)
    ordered = sorted(expanded.items(), key=lambda item: -len(item[0]))
    for node in model.graph.node:
        module = _module_path(node)
        stage = next((s for prefix, s in ordered if module == prefix or module.startswith(prefix + ".")), default_stage)
        del node.metadata_props[:]
        for key, value in ((MODALITY_KEY, STAGES[stage]), (STAGE_KEY, stage), (MODULE_KEY, module)):
            if value:
                entry = node.metadata_props.add()
                entry.key, entry.value = key, value


def _module_path(node: onnx.NodeProto) -> str:
    for prop in node.metadata_props:
        if prop.key == _TORCH_SCOPES:  # dynamo exporter: "['', 'm.vision', 'm.vision.layer', 'op']"
            try:
                scopes = [s for s in ast.literal_eval(prop.value) if s]
            except (ValueError, SyntaxError):
                return ""
            return scopes[-2] if len(scopes) > 1 else ""
    # TorchScript exporter: node names look like "/m/vision_tower/encoder/layers.0/self_attn/q_proj/MatMul"
    parts = [p for p in node.name.split("/") if p]
    return ".".join(parts[:-1])


def read_annotations(path: str | Path) -> dict[str, Any]:
    """``{"graph", "modality", "stages": {stage: nodes}, "nodes": [(name, op, modality, stage, module)]}``."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    nodes = []
    for node in model.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        nodes.append((node.name, node.op_type, props.get(MODALITY_KEY), props.get(STAGE_KEY), props.get(MODULE_KEY)))
    return {
        "graph": meta.get("mmsdk.graph"),
        "modality": meta.get(MODALITY_KEY),
        "stages": json.loads(meta.get("mmsdk.stages", "{}")),
        "nodes": nodes,
    }
