"""Target A's vision part: tower + projector as ONNX with the I/O names TensorRT-LLM's multimodal
engine builder uses (specs/tensorrt-llm.md 3.2), and the ``vision/config.json`` its runner reads.

``llava``: ``input`` [B, 3, S, S] -> ``encoder_output`` [B, Nv, H].
``llava_next``: ``input`` [P, 3, S, S] (the tiles of one image) -> ``encoder_output`` [P, Nv, H], plus
``image_newlines.safetensors``; the host unpads and inserts newlines.
``qwen2_vl``: ``input`` [hw, C*T*p*p], ``rotary_pos_emb`` [hw, d/2], ``attention_mask`` [1, hw, hw] ->
``encoder_output`` [hw/4, H].
``qwen2_5_vl`` (mmsdk's contract; TensorRT-LLM's builder has none): as ``qwen2_vl`` with every row in
window order, plus ``window_attention_mask`` [1, hw, hw]; the output is in window order too.

The graphs are float32: the engine is built with ``--fp16``/``--bf16`` and the runner casts the
features to the language model's dtype.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.tensorrt_llm.vision_inputs import QwenVisionGeometry, block_mask, rotary_pos_emb

__all__ = ["VISION_DIR", "export_vision", "qwen_geometry"]

VISION_DIR = "vision"
OPSET = 17  # what TensorRT-LLM's builder exports with


class _LlavaVision(nn.Module):
    def __init__(self, tower: nn.Module, projector: nn.Module, layer: int | list[int], keep_cls: bool) -> None:
        super().__init__()
        self.tower, self.projector, self.layer, self.keep_cls = tower, projector, layer, keep_cls

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        states = self.tower(image, output_hidden_states=True).hidden_states
        layers = self.layer if isinstance(self.layer, list) else [self.layer]
        features = torch.cat([states[i] for i in layers], dim=-1)
        return self.projector(features if self.keep_cls else features[:, 1:])


class _QwenVision(nn.Module):
    """Qwen2(.5)-VL vision tower with explicit rotary angles and additive masks (eager attention)."""

    def __init__(self, tower: nn.Module, blocks: list[nn.Module], specs: list[tuple[str, str, int, int]],
                 projector: nn.Module, full: frozenset[int] | None) -> None:
        super().__init__()
        self.patch_embed, self.merger = tower.patch_embed, projector
        self.blocks = nn.ModuleList(blocks)
        self.specs = specs
        self.full = full  # indexes of full-attention blocks (Qwen2.5-VL); None: every block is full

    def forward(self, x: torch.Tensor, rotary: torch.Tensor, mask: torch.Tensor,
                window_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.patch_embed(x)
        emb = torch.cat([rotary, rotary], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        for index, (block, spec) in enumerate(zip(self.blocks, self.specs, strict=True)):
            use = mask if self.full is None or index in self.full or window_mask is None else window_mask
            h = h + self._attention(block, spec, block.norm1(h), cos, sin, use)
            h = h + block.mlp(block.norm2(h))
        return self.merger(h)

    @staticmethod
    def _attention(block: nn.Module, spec: tuple[str, str, int, int], h: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        qkv_name, o_name, heads, dim = spec
        n = h.shape[0]
        q, k, v = getattr(block.attn, qkv_name)(h).reshape(n, 3, heads, dim).permute(1, 2, 0, 3).unbind(0)
        c, s = cos[None], sin[None]
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(dim) + mask, dim=-1, dtype=torch.float32)
        out = (weights @ v).transpose(0, 1).reshape(n, heads * dim)
        return getattr(block.attn, o_name)(out)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def qwen_geometry(model: nn.Module, adapter: Any) -> QwenVisionGeometry:
    """Head size, merge size, rotary base and window size of a Qwen vision tower."""
    vc = model.config.vision_config
    block = adapter.vision_blocks(model)[0]
    rope = getattr(vc, "rope_parameters", None) or {}
    return QwenVisionGeometry(head_dim=block.head_dim, merge_size=vc.spatial_merge_size,
                              theta=float(rope.get("rope_theta", 10000.0)), patch_size=vc.patch_size,
                              window_size=getattr(vc, "window_size", None))


def export_vision(model: nn.Module, adapter: Any, model_type: str, folder: Path, precision: str,
                  max_batch_size: int) -> dict[str, Any]:
    """Write ``model.onnx``, ``config.json`` (and LLaVA-NeXT's newline) into ``folder``; return a summary."""
    folder.mkdir(parents=True, exist_ok=True)
    if model_type in ("llava", "llava_next"):
        spec = _export_llava(model, adapter, folder / "model.onnx", model_type)
    else:
        spec = _export_qwen(model, adapter, folder / "model.onnx", model_type)
    if model_type == "llava_next":
        import safetensors.torch

        newline = model.model.image_newline.detach().float().contiguous()
        safetensors.torch.save_file({"image_newline": newline}, str(folder / "image_newlines.safetensors"))
    batch = 5 if model_type == "llava_next" else max_batch_size  # one image's tiles (base + up to 4)
    shape = [batch, *spec["output_shape"][1:]] if model_type.startswith("llava") else spec["output_shape"]
    config = {"builder_config": {"model_type": model_type, "precision": precision, "max_batch_size": batch,
                                 "strongly_typed": False, "model_name": "multiModal", "output_shape": shape},
              "plugin_config": {}}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {**spec, "max_batch_size": batch}


def _export_llava(model: nn.Module, adapter: Any, path: Path, model_type: str) -> dict[str, Any]:
    cfg = model.config
    tower = copy.deepcopy(adapter.vision_tower(model)).float().eval()
    projector = copy.deepcopy(adapter.projector(model)).float().eval()
    keep_cls = getattr(cfg, "vision_feature_select_strategy", "default") == "full"
    wrapper = _LlavaVision(tower, projector, cfg.vision_feature_layer, keep_cls).eval()
    size = cfg.vision_config.image_size
    dummy = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens, hidden = wrapper(dummy).shape[1:]
    error = _onnx_export(wrapper, (dummy,), path, ["input"], ["encoder_output"],
                         {"input": {0: "batch"}, "encoder_output": {0: "batch"}})
    return {"inputs": {"input": [-1, 3, size, size]}, "outputs": {"encoder_output": [-1, tokens, hidden]},
            "output_shape": [-1, tokens, hidden], "tokens_per_tile": tokens, "max_abs_error_vs_torch": error}


def _export_qwen(model: nn.Module, adapter: Any, path: Path, model_type: str) -> dict[str, Any]:
    geo = qwen_geometry(model, adapter)
    vc = model.config.vision_config
    windowed = model_type == "qwen2_5_vl"
    full = frozenset(getattr(vc, "fullatt_block_indexes", ())) if windowed else None
    original = adapter.vision_tower(model)
    tower = copy.deepcopy(original).float().eval()
    names = {id(m): n for n, m in original.named_modules()}
    copies = dict(tower.named_modules())
    blocks = adapter.vision_blocks(model)
    projector = copies[names[id(adapter.projector(model))]]
    wrapper = _QwenVision(tower, [copies[names[id(b.module)]] for b in blocks],
                          [(b.projections.qkv, b.projections.o, b.num_heads, b.head_dim) for b in blocks],
                          projector, full).eval()
    side = 2 * geo.merge_size
    grid = torch.tensor([[1, side, side]])
    hw = side * side
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    pixels = torch.randn(hw, width, generator=torch.Generator().manual_seed(0))
    args: tuple[torch.Tensor, ...] = (pixels, rotary_pos_emb(grid, geo), block_mask([hw]))
    names = ["input", "rotary_pos_emb", "attention_mask"]
    axes: dict[str, dict[int, str]] = {"input": {0: "hw"}, "rotary_pos_emb": {0: "hw"},
                                       "attention_mask": {1: "hw", 2: "hw"}, "encoder_output": {0: "tokens"}}
    if windowed:
        args = (*args, block_mask([hw]))
        names.append("window_attention_mask")
        axes["window_attention_mask"] = {1: "hw", 2: "hw"}
    with torch.no_grad():
        hidden = wrapper(*args).shape[-1]
    error = _onnx_export(wrapper, args, path, names, ["encoder_output"], axes)
    inputs = {"input": [-1, width], "rotary_pos_emb": [-1, geo.head_dim // 2], "attention_mask": [1, -1, -1]}
    if windowed:
        inputs["window_attention_mask"] = [1, -1, -1]
    return {"inputs": inputs, "outputs": {"encoder_output": [-1, hidden]}, "output_shape": [-1, hidden],
            "input_width": width, "rotary_dim": geo.head_dim // 2, "max_abs_error_vs_torch": error}


def _onnx_export(module: nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str],
                 outputs: list[str], axes: dict[str, dict[int, str]]) -> float:
    """Export, then run the graph once with ONNX Runtime; return its max error against torch."""
    # The TorchScript exporter is what TensorRT-LLM's builder uses (opset 17, dynamic_axes), and it is
    # ~10x faster than the dynamo exporter on these graphs; dynamo is the fallback.
    errors = []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for dynamo in (False, True):
            try:
                torch.onnx.export(module, args, str(path), opset_version=OPSET, input_names=inputs,
                                  output_names=outputs, dynamic_axes=axes, dynamo=dynamo)
                break
            except Exception as err:
                errors.append(f"{'dynamo' if dynamo else 'torchscript'}: {type(err).__name__}: {str(err)[:300]}")
        else:
            raise ExportError(
                "the vision tower + projector could not be exported to ONNX: " + " | ".join(errors),
                fix="check that the passes applied to the vision tower are traceable, or export to 'torch'.",
            )
        expected = module(*args)
    return _self_check(path, inputs, args, expected)


def _self_check(path: Path, inputs: list[str], args: tuple[torch.Tensor, ...], expected: torch.Tensor) -> float:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    got = session.run(None, {name: arg.numpy() for name, arg in zip(inputs, args, strict=True)})[0]
    error = float((torch.from_numpy(got) - expected).abs().max())
    if error > 1e-3 * max(1.0, float(expected.abs().max())):
        raise ExportError(
            f"the exported vision graph does not reproduce the torch vision path (max difference {error:.3g}).",
            fix="a pass changed the vision tower in a way the exporter did not trace faithfully; export to 'torch', "
            "or report the pass and model.",
        )
    return error
