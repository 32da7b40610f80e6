"""What the runtime reads from an export's manifest: graph files, I/O names, cache and image layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from mmsdk.core.errors import ArtifactIntegrityError
from mmsdk.runtime.positions import MRope

__all__ = ["ExportSpec"]

_CACHE_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "uint8": np.uint8}


@dataclass(frozen=True)
class ExportSpec:
    """The manifest details of an onnxruntime export, typed."""

    files: Mapping[str, str]
    processor_dir: str
    family: str
    inline_images: bool
    image_token_id: int | None
    vision_inputs: tuple[str, ...]
    vision_outputs: tuple[str, ...]
    image_slots: str | None  # vision output naming the kept image-token slots (token reduction)
    vision_output_shapes: Mapping[str, list[int]]  # per image
    fixed_inputs: Mapping[str, Any]
    self_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    cache_dtype: Any
    cache_last_dim: int
    max_sequence_length: int
    mrope: MRope | None
    cross_layers: tuple[int, ...]
    cross_mask_input: str | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    # sparse-xattn over a quantized cache: per-layer float32 state [B, kv_heads, blocks, head_dim] (name template)
    image_key_sums: str | None = None

    @classmethod
    def from_details(cls, details: Mapping[str, Any]) -> ExportSpec:
        """Parse; a folder written by another backend or version is an ArtifactIntegrityError."""
        try:
            return cls._parse(details)
        except (KeyError, TypeError) as err:
            raise ArtifactIntegrityError(
                f"manifest.json does not describe an onnxruntime export this mmsdk can run (missing {err}).",
                fix="re-export the model with this mmsdk version (Optimizer(...).export('onnxruntime', dir)).",
            ) from err

    @classmethod
    def _parse(cls, d: Mapping[str, Any]) -> ExportSpec:
        dec, vis, cross = d["decoder"], d["vision"], d["decoder"].get("cross_attention") or {}
        cache = dec["cache"]
        mrope = None
        if dec["position_ids"] == "mrope":
            mrope = MRope(int(d["image_token_id"]), int(dec["spatial_merge_size"]))
        gen = d["generation"]
        return cls(
            files=d["files"], processor_dir=d["processor"], family=d["family"],
            inline_images=d["image_tokens"] == "inline", image_token_id=d["image_token_id"],
            vision_inputs=tuple(vis["inputs"]),
            vision_outputs=tuple(o for o in vis["outputs"] if o != vis.get("slots_output")),
            image_slots=vis.get("slots_output"), vision_output_shapes=dict(vis.get("output_shapes") or {}),
            fixed_inputs=dict(vis.get("fixed_inputs") or {}), self_layers=tuple(dec["self_attention_layers"]),
            num_kv_heads=int(dec["num_kv_heads"]), head_dim=int(dec["head_dim"]),
            cache_dtype=_CACHE_DTYPES[cache["dtype"]], cache_last_dim=int(cache["last_dim"]),
            max_sequence_length=int(dec["max_sequence_length"]), mrope=mrope,
            cross_layers=tuple(cross.get("layers", ())), cross_mask_input=cross.get("mask_input"),
            eos_token_ids=tuple(int(e) for e in gen.get("eos_token_ids") or ()),
            pad_token_id=gen.get("pad_token_id"),
            image_key_sums=(dec.get("sparse_xattn") or {}).get("image_key_sums"),
        )
