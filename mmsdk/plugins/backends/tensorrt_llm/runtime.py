"""Run a target-A export on the CPU: vision ONNX (ONNX Runtime) + host-side glue + the reference decoder.

The host side does what TensorRT-LLM's multimodal runner does: it feeds the vision graph, arranges
the features (LLaVA-NeXT tiles and newlines, Qwen window order), replaces the image placeholder
tokens by fake ids ``vocab_size + i`` pointing into the feature table, and builds M-RoPE positions.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from mmsdk.plugins.backends.tensorrt_llm.reference import ReferenceLM, load_checkpoint, mrope_positions
from mmsdk.plugins.backends.tensorrt_llm.vision_inputs import (
    QwenVisionGeometry,
    block_mask,
    rotary_pos_emb,
    window_index,
    window_order,
)

__all__ = ["LLM_DIR", "ReferenceModel", "host_details"]

LLM_DIR = "llm"


def host_details(model: Any, adapter: Any, model_type: str) -> dict[str, Any]:
    """What the host side needs to drive the vision graph (stored in the manifest's details)."""
    cfg = model.config
    out: dict[str, Any] = {"model_type": model_type, "image_token_id": adapter.image_tokens(model).image_token_id}
    if model_type == "llava_next":
        out.update(grid_pinpoints=[list(p) for p in cfg.image_grid_pinpoints], tile_size=cfg.vision_config.image_size,
                   feature_side=cfg.vision_config.image_size // cfg.vision_config.patch_size)
    if model_type.startswith("qwen"):
        from mmsdk.plugins.backends.tensorrt_llm.vision_onnx import qwen_geometry

        geo = qwen_geometry(model, adapter)
        out["geometry"] = {"head_dim": geo.head_dim, "merge_size": geo.merge_size, "theta": geo.theta,
                           "patch_size": geo.patch_size, "window_size": geo.window_size}
    return out


class ReferenceModel:
    """A target-A export folder, runnable on the CPU: ``logits(inputs)`` from the processor's inputs."""

    def __init__(self, folder: str | Path, host: dict[str, Any]) -> None:
        import onnxruntime

        self.folder = Path(folder)
        self.host = host
        self.lm: ReferenceLM = load_checkpoint(self.folder / LLM_DIR)
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        self.vision = onnxruntime.InferenceSession(str(self.folder / "vision" / "model.onnx"), options,
                                                   providers=["CPUExecutionProvider"])

    def logits(self, inputs: dict[str, torch.Tensor], kv_cache: bool = True) -> torch.Tensor:
        """Logits [1, L, vocab] for one prompt with one image (the processor's input dict); ``kv_cache``
        reads K/V through the quantized cache's scales, as TensorRT-LLM's generation steps do."""
        ids = inputs["input_ids"]
        if ids.shape[0] != 1:
            raise ValueError("the reference runs one sequence at a time; pass a batch of one prompt")
        table, positions = self._features(inputs)
        marker = ids[0] == self.host["image_token_id"]
        fake = ids[0].clone()
        fake[marker] = self.lm.vocab_size + torch.arange(int(marker.sum()))
        if table is not None and table.shape[0] != int(marker.sum()):
            raise ValueError(f"{table.shape[0]} visual features for {int(marker.sum())} image tokens")
        return self.lm.logits(fake, table, positions, kv_cache)[None]

    def _features(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        kind = self.host["model_type"]
        if "pixel_values" not in inputs:
            return None, None
        if kind == "llava":
            return self._run(input=inputs["pixel_values"])[0], None
        if kind == "llava_next":
            tiles = self._run(input=inputs["pixel_values"][0])
            newline = self._newline()
            return _pack_llava_next(tiles, inputs["image_sizes"][0].tolist(), newline, self.host), None
        return self._qwen(inputs)

    def _qwen(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        geo = QwenVisionGeometry(**self.host["geometry"])
        grid, pixels = inputs["image_grid_thw"], inputs["pixel_values"].float()
        rotary = rotary_pos_emb(grid, geo)
        lengths = [int(t * h * w) for t, h, w in grid.tolist()]
        feeds = {"input": pixels, "rotary_pos_emb": rotary, "attention_mask": block_mask(lengths)}
        if self.host["model_type"] == "qwen2_5_vl":
            index, windows = window_index(grid, geo)
            feeds = {"input": window_order(pixels, index, geo.merge_unit),
                     "rotary_pos_emb": window_order(rotary, index, geo.merge_unit),
                     "attention_mask": block_mask(lengths), "window_attention_mask": block_mask(windows)}
            features = self._run(**feeds)[torch.argsort(index)]
        else:
            features = self._run(**feeds)
        grids = [tuple(int(v) for v in row) for row in grid.tolist()]
        positions = mrope_positions(inputs["input_ids"][0], self.host["image_token_id"], grids, geo.merge_size)
        return features, positions

    def _run(self, **feeds: torch.Tensor) -> torch.Tensor:
        out = self.vision.run(None, {k: v.float().numpy() for k, v in feeds.items()})[0]
        return torch.from_numpy(out)

    def _newline(self) -> torch.Tensor:
        import safetensors.torch

        return safetensors.torch.load_file(str(self.folder / "vision" / "image_newlines.safetensors"))["image_newline"]


def _best_resolution(size: tuple[int, int], candidates: list[list[int]]) -> tuple[int, int]:
    height, width = size
    best, best_used, best_waste = (height, width), -1, math.inf
    for cand_h, cand_w in candidates:
        scale = min(cand_w / width, cand_h / height)
        used = min(int(width * scale) * int(height * scale), width * height)
        waste = cand_w * cand_h - used
        if used > best_used or (used == best_used and waste < best_waste):
            best, best_used, best_waste = (cand_h, cand_w), used, waste
    return best


def _pack_llava_next(tiles: torch.Tensor, image_size: list[int], newline: torch.Tensor,
                     host: dict[str, Any]) -> torch.Tensor:
    """Base view, then the any-res tile grid unpadded to the image's aspect with a newline per row."""
    side, tile = host["feature_side"], host["tile_size"]
    best_h, best_w = _best_resolution((image_size[0], image_size[1]), host["grid_pinpoints"])
    rows, cols = best_h // tile, best_w // tile
    grid = tiles[1:1 + rows * cols].reshape(rows, cols, side, side, -1)
    grid = grid.permute(4, 0, 2, 1, 3).reshape(-1, rows * side, cols * side)
    grid = _unpad(grid, image_size)
    grid = torch.cat([grid, newline[:, None, None].expand(-1, grid.shape[1], 1).to(grid.dtype)], dim=-1)
    return torch.cat([tiles[0], grid.flatten(1).T])


def _unpad(grid: torch.Tensor, size: list[int]) -> torch.Tensor:
    height, width = size
    cur_h, cur_w = grid.shape[1:]
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        pad = (cur_h - new_h) // 2
        return grid[:, pad:cur_h - pad, :]
    new_w = int(round(width * (cur_h / height), 7))
    pad = (cur_w - new_w) // 2
    return grid[:, :, pad:cur_w - pad]
