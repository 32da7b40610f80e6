"""A CPU reference for target A: load ``config.json`` + ``rank{N}.safetensors`` back and run them.

This is the proof that the export is right, so it shares no code with the writer: it unpacks the
INT4 bytes with its own arithmetic, undoes the tensor-parallel splits (including replicated KV
heads) and the pipeline renumbering from the config alone, and runs a LLaMA/Qwen2 decoder written
from the definitions (RMSNorm, GPT-NeoX or multimodal RoPE, GQA attention, ``proj(act(fc) * gate)``).
Token ids at or above ``vocab_size`` read rows of a prompt table, as TensorRT-LLM's prompt-tuning
embedding does with visual features.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mmsdk.core.errors import ArtifactIntegrityError

__all__ = ["ReferenceLM", "load_checkpoint", "mrope_positions", "unpack_int4"]

_ACTS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [n/2, k] -> int8 [n, k]: low nibble is row 2j, high nibble row 2j+1, both signed."""
    b = packed.view(torch.uint8).to(torch.int32)
    low = ((b % 16) ^ 8) - 8
    high = ((b // 16) ^ 8) - 8
    out = torch.empty(b.shape[0] * 2, b.shape[1], dtype=torch.int32)
    out[0::2], out[1::2] = low, high
    return out.to(torch.int8)


@dataclass
class _Layer:
    weights: dict[str, torch.Tensor]  # float32 effective weights: q,k,v,o,fc,gate,proj (+ q_b,k_b,v_b)
    norms: tuple[torch.Tensor, torch.Tensor]
    kv_scale: float | None


class ReferenceLM:
    """The decoder of a target-A checkpoint, recombined into one float32 model."""

    def __init__(self, config: dict[str, Any], layers: list[_Layer], embed: torch.Tensor, final_norm: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        self.config, self.layers, self.embed, self.final_norm, self.lm_head = config, layers, embed, final_norm, lm_head

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def logits(self, input_ids: torch.Tensor, prompt_table: torch.Tensor | None = None,
               positions: torch.Tensor | None = None, kv_cache: bool = True) -> torch.Tensor:
        """Logits [L, vocab] of one sequence; ids >= vocab_size index ``prompt_table``; ``positions``
        is [L] (RoPE) or [3, L] (M-RoPE), default 0..L-1. ``kv_cache``: read K/V back through the
        checkpoint's INT8/FP8 cache scales (as generation steps do) instead of at full precision."""
        ids = input_ids.reshape(-1)
        fake = ids >= self.vocab_size
        h = self.embed[torch.where(fake, 0, ids)]
        if bool(fake.any()):
            if prompt_table is None:
                raise ValueError("input ids reference visual features but no prompt table was given")
            h[fake] = prompt_table.float()[ids[fake] - self.vocab_size]
        pos = positions if positions is not None else torch.arange(ids.numel())
        cos, sin = self._rope(pos)
        for layer in self.layers:
            h = self._layer(layer, h, cos, sin, kv_cache)
        return _rms_norm(h, self.final_norm, self.config["norm_epsilon"]) @ self.lm_head.T

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        dim = int(cfg.get("rotary_embedding_dim") or cfg["head_size"])
        inv = 1.0 / (float(cfg["rotary_base"]) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if cfg["position_embedding_type"] == "rope_gpt_neox":
            if cfg.get("rotary_scaling"):
                raise NotImplementedError(f"rotary_scaling {cfg['rotary_scaling']} is not implemented here")
            angles = pos.double()[:, None] * inv
            emb = torch.cat([angles, angles], dim=-1)
        elif cfg["position_embedding_type"] == "mrope":
            angles = pos.double()[:, :, None] * inv  # [3, L, dim/2]
            section = list(cfg["rotary_scaling"]["mrope_section"]) * 2
            emb = torch.cat([angles, angles], dim=-1)
            emb = torch.cat([part[i % 3] for i, part in enumerate(emb.split(section, dim=-1))], dim=-1)
        else:
            raise NotImplementedError(f"position_embedding_type {cfg['position_embedding_type']!r}")
        return emb.cos().float(), emb.sin().float()

    def _layer(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv_cache: bool) -> torch.Tensor:
        cfg, w = self.config, layer.weights
        nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]
        x = _rms_norm(h, layer.norms[0], cfg["norm_epsilon"])
        n = x.shape[0]
        q = (x @ w["q"].T + w.get("q_b", 0)).reshape(n, nh, hd).transpose(0, 1)
        k = (x @ w["k"].T + w.get("k_b", 0)).reshape(n, nkv, hd).transpose(0, 1)
        v = (x @ w["v"].T + w.get("v_b", 0)).reshape(n, nkv, hd).transpose(0, 1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if kv_cache and layer.kv_scale is not None:
            k, v = (self._kv_roundtrip(t, layer.kv_scale) for t in (k, v))
        k, v = k.repeat_interleave(nh // nkv, dim=0), v.repeat_interleave(nh // nkv, dim=0)
        scores = q @ k.transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(n, nh * hd)
        h = h + attn @ w["o"].T
        x = _rms_norm(h, layer.norms[1], cfg["norm_epsilon"])
        act = _ACTS[cfg["hidden_act"]]
        return h + (act(x @ w["fc"].T) * (x @ w["gate"].T)) @ w["proj"].T

    def _kv_roundtrip(self, t: torch.Tensor, scale: float) -> torch.Tensor:
        # What attention reads back from a quantized cache: x_q * s with x_q = quant(x / s).
        algo = self.config["quantization"].get("kv_cache_quant_algo")
        if algo == "INT8":
            return torch.clamp(torch.round(t / scale), -128, 127) * scale
        if algo == "FP8":
            return torch.clamp(t / scale, -448, 448).to(torch.float8_e4m3fn).float() * scale
        raise NotImplementedError(f"kv_cache_quant_algo {algo!r}")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def mrope_positions(input_ids: torch.Tensor, image_token_id: int, grids: list[tuple[int, int, int]],
                    merge_size: int) -> torch.Tensor:
    """Qwen2-VL's 3-D positions [3, L]: text counts up on all axes; an image's merged tokens take
    (t, row, column) offsets from the position where the image starts."""
    ids = input_ids.reshape(-1).tolist()
    out: list[list[int]] = [[], [], []]
    nxt, i, image = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            for axis in out:
                axis.append(nxt)
            nxt, i = nxt + 1, i + 1
            continue
        t, h, w = grids[image][0], grids[image][1] // merge_size, grids[image][2] // merge_size
        for ti in range(t):
            for hi in range(h):
                for wi in range(w):
                    out[0].append(nxt + ti)
                    out[1].append(nxt + hi)
                    out[2].append(nxt + wi)
        nxt, i, image = nxt + max(t, h, w), i + t * h * w, image + 1
    return torch.tensor(out)


# --- loading -------------------------------------------------------------------------------------

def load_checkpoint(folder: str | Path) -> ReferenceLM:
    """Read a target-A checkpoint folder and recombine every rank into one float32 model."""
    import safetensors.torch

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    mapping = config.get("mapping", {})
    tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    ranks = []
    for rank in range(tp * pp):
        path = folder / f"rank{rank}.safetensors"
        if not path.is_file():
            raise ArtifactIntegrityError(f"{path} is missing.", fix="re-export; every rank needs its file.")
        ranks.append(safetensors.torch.load_file(str(path)))
    per_stage = config["num_hidden_layers"] // pp
    layers = []
    for stage in range(pp):
        stage_ranks = ranks[stage * tp:(stage + 1) * tp]
        for local in range(per_stage):
            layers.append(_load_layer(config, stage_ranks, f"transformer.layers.{local}.", tp))
    last = ranks[(pp - 1) * tp:]
    lm_head = torch.cat([r["lm_head.weight"] for r in last]).float()[: config["vocab_size"]]
    return ReferenceLM(config, layers, ranks[0]["transformer.vocab_embedding.weight"].float(),
                       last[0]["transformer.ln_f.weight"].float(), lm_head)


def _load_layer(config: dict[str, Any], ranks: list[dict[str, torch.Tensor]], prefix: str, tp: int) -> _Layer:
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_size"]
    nkv_rank = -(-nkv // tp)
    sizes = [nh // tp * hd, nkv_rank * hd, nkv_rank * hd]
    qkv_parts = [_effective(r, prefix + "attention.qkv") for r in ranks]
    weights: dict[str, torch.Tensor] = {}
    for index, role in enumerate("qkv"):
        per_rank = [w.split(sizes)[index] for w, _ in qkv_parts]
        weights[role] = _gather_heads(per_rank, role, nkv, tp)
        if qkv_parts[0][1] is not None:
            biases = [b.split(sizes)[index][:, None] for _, b in qkv_parts]
            weights[f"{role}_b"] = _gather_heads(biases, role, nkv, tp)[:, 0]
    weights["o"] = torch.cat([_effective(r, prefix + "attention.dense")[0] for r in ranks], dim=1)
    weights["fc"] = torch.cat([_effective(r, prefix + "mlp.fc")[0] for r in ranks], dim=0)
    weights["gate"] = torch.cat([_effective(r, prefix + "mlp.gate")[0] for r in ranks], dim=0)
    weights["proj"] = torch.cat([_effective(r, prefix + "mlp.proj")[0] for r in ranks], dim=1)
    scale = ranks[0].get(prefix + "attention.kv_cache_scaling_factor")
    norms = (ranks[0][prefix + "input_layernorm.weight"].float(), ranks[0][prefix + "post_layernorm.weight"].float())
    return _Layer(weights, norms, None if scale is None else float(scale.reshape(-1)[0]))


def _gather_heads(per_rank: list[torch.Tensor], role: str, nkv: int, tp: int) -> torch.Tensor:
    if role == "q" or nkv >= tp:
        return torch.cat(per_rank)
    copies = tp // nkv  # ranks r*copies .. r*copies+copies-1 hold a copy of KV head r
    for head in range(nkv):
        group = per_rank[head * copies:(head + 1) * copies]
        if any(not torch.equal(group[0], other) for other in group[1:]):
            raise ArtifactIntegrityError(
                f"the replicated copies of KV head {head} differ between ranks.",
                fix="re-export; replicated KV heads must be identical on every rank that holds them.",
            )
    return torch.cat(per_rank[::copies])


def _effective(tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float32 weight [n, k] as the kernel applies it, bias) of one linear in one rank."""
    weight = tensors[name + ".weight"]
    bias = tensors.get(name + ".bias")
    bias = None if bias is None else bias.float()
    scales = tensors.get(name + ".weights_scaling_factor")
    if scales is None:
        return weight.float(), bias
    values = unpack_int4(weight).float()
    group = values.shape[1] // scales.shape[1]
    dequant = values * scales.float().repeat_interleave(group, dim=1)
    pre = tensors.get(name + ".prequant_scaling_factor")
    if pre is not None:
        dequant = dequant * pre.float().reshape(1, -1)
    return dequant, bias
