"""embedding.onnx: token embeddings, with image features scattered into the image-token positions.

Inline families (LLaVA, Qwen-VL): ``input_ids`` [B, S] + ``image_features`` [N, hidden] (every image
token of the batch, in reading order; N may be 0) -> ``inputs_embeds``. Cross-attention families:
``input_ids`` -> ``inputs_embeds`` (images reach the decoder through cross-attention instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.onnxruntime import names as N
from mmsdk.plugins.backends.onnxruntime.graph import FLOAT, INT64, GraphBuilder

if TYPE_CHECKING:
    import onnx
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter

__all__ = ["embedding_table", "build_embedding"]


def embedding_table(module: nn.Module, where: str) -> np.ndarray:
    """The [vocab, hidden] table of an nn.Embedding (plus IDEFICS's additional rows, if any)."""
    from torch import nn

    if not isinstance(module, nn.Embedding):
        raise ExportError(
            f"{where} is a {type(module).__name__}, not an embedding table the onnxruntime backend can read.",
            fix="leave the token embeddings unquantized for this export, or export to the 'torch' backend.",
        )
    tables = [module.weight.detach().float().cpu().numpy()]
    extra = getattr(module, "additional_embedding", None)
    if isinstance(extra, nn.Embedding):
        tables.append(extra.weight.detach().float().cpu().numpy())
    return np.concatenate(tables)


def build_embedding(model: nn.Module, adapter: ModelAdapter, float_type: int = FLOAT) -> onnx.ModelProto:
    """The embedding graph of ``model`` (``inputs_embeds`` of ``float_type``; image features stay float32)."""
    module = adapter.embed_tokens(model)
    table = embedding_table(module, "the token embeddings")
    layout = adapter.image_tokens(model)
    g = GraphBuilder("embedding", modality="multimodal", stage="embedding", float_type=float_type)
    ids = g.input(N.INPUT_IDS, INT64, [N.BATCH, N.SEQUENCE])
    hidden = table.shape[1]
    with g.scope("embed_tokens", module="embed_tokens", modality="text"):
        weights = g.const("embed_tokens.weight", table)
    if layout.mode != "inline" or layout.image_token_id is None:
        with g.scope("embed_tokens", modality="text"):
            out = g.op("Gather", [weights, ids], axis=0)
        g.output(out, N.INPUTS_EMBEDS, g.float_type, [N.BATCH, N.SEQUENCE, hidden])
        return g.model()
    features = g.input(N.IMAGE_FEATURES, FLOAT, ["num_image_tokens", hidden])
    with g.scope("merge_image_features"):
        if float_type != FLOAT:
            features = g.op("Cast", [features], to=float_type)
        is_image = g.op("Equal", [ids, g.const("image_token_id", np.int64(layout.image_token_id))])
        safe_ids = g.op("Where", [is_image, g.const("zero_id", np.int64(0)), ids])
        text = g.op("Gather", [weights, safe_ids], axis=0)
        flat = g.op("Reshape", [g.op("Cast", [is_image], to=INT64), g.ints("minus1", [-1])])
        order = g.op("Sub", [g.op("CumSum", [flat, g.const("axis0", np.int64(0))]), g.const("one", np.int64(1))])
        count = g.op("Gather", [g.op("Shape", [features]), g.const("zero", np.int64(0))], axis=0)
        # Text positions read one zero row appended after the features, so N = 0 works too.
        index = g.op("Where", [g.op("Cast", [flat], to=9), order, count])
        padded = g.op("Concat", [features, g.const("zero_row", np.zeros((1, hidden), np.float32))], axis=0)
        picked = g.op("Gather", [padded, index], axis=0)
        picked = g.op("Reshape", [picked, g.op("Shape", [text])])
        mask = g.op("Unsqueeze", [is_image, g.ints("last", [-1])])
        out = g.op("Where", [mask, picked, text])
    g.output(out, N.INPUTS_EMBEDS, g.float_type, [N.BATCH, N.SEQUENCE, hidden])
    return g.model()
