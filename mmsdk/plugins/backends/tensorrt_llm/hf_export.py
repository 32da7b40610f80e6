"""Target B: a Hugging Face folder plus ``hf_quant_config.json`` for TensorRT-LLM's PyTorch backend.

Tensor names stay Hugging Face's (transformers writes them in the original checkpoint layout).
An INT4 linear becomes ModelOpt's W4A16_AWQ form: ``weight`` uint8 [out/2, in] (the same nibble
layout as the checkpoint target), ``weight_scale`` [out, in/g]. The PyTorch backend's fused q/k/v
and gate/up loaders read no ``pre_quant_scale``, so an AWQ activation scale is folded into the norm
in front of them; ``o_proj``/``down_proj`` keep theirs. FP8 KV scales go to ``k_proj.k_scale`` and
``v_proj.v_scale``. Vision tower and projector stay in full precision and are listed in
``exclude_modules``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.tensorrt_llm.lowering import Int4Linear, LinearWeights
from mmsdk.plugins.backends.tensorrt_llm.packing import pack_int4_rows
from mmsdk.plugins.backends.tensorrt_llm.weights import LanguageModelWeights, LayerWeights

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext

__all__ = ["HF_QUANT_CONFIG", "hf_quant_config", "write_hf"]

HF_QUANT_CONFIG = "hf_quant_config.json"
_ROLE_ATTR = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
              "down": "down_proj"}


def write_hf(context: ExportContext, lm: LanguageModelWeights, folder: Path, dtype: str, kv_algo: str | None,
             kv_scales: dict[int, float]) -> dict[str, Any]:
    """Write config, weights, processor and (when quantized) ``hf_quant_config.json``; return the quant config."""
    model, adapter = context.model, context.adapter
    dt = getattr(torch, dtype)
    _check_vision_is_plain(context)
    names = {id(m): n for n, m in model.named_modules()}
    state = {k: v for k, v in model.state_dict().items()}
    for index, (layer_module, layer) in enumerate(zip(adapter.decoder_layers(model), lm.layers, strict=True)):
        attention, mlp = adapter.self_attention(layer_module), adapter.mlp(layer_module)
        attn_name, mlp_name, layer_name = names[id(attention)], names[id(mlp)], names[id(layer_module)]
        _drop_prefixes(state, (f"{attn_name}.", f"{mlp_name}."))
        state.update(_layer_tensors(layer, layer_name, attn_name, mlp_name))
        if kv_algo is not None:
            state[f"{attn_name}.k_proj.k_scale"] = torch.tensor(kv_scales[index], dtype=torch.float32)
            state[f"{attn_name}.v_proj.v_scale"] = torch.tensor(kv_scales[index], dtype=torch.float32)
    head = adapter.lm_head(model)
    if isinstance(lm.lm_head, Int4Linear):  # TensorRT-LLM keeps lm_head in full precision: write q * s exactly
        _drop_prefixes(state, (f"{names[id(head)]}.",))
        state[f"{names[id(head)]}.weight"] = lm.lm_head.float_weight()
    state = {k: _cast(k, v, dt) for k, v in state.items()}
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    quant = hf_quant_config(context, lm, kv_algo)
    _finish_config(folder / "config.json", dtype, quant)
    if quant is not None:
        (folder / HF_QUANT_CONFIG).write_text(json.dumps(quant, indent=2) + "\n")
    if context.processor is not None and hasattr(context.processor, "save_pretrained"):
        context.processor.save_pretrained(folder)
    return quant or {}


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Packed INT4 bytes stay uint8 and KV scales float32; everything else floating is the model dtype.
    if not tensor.is_floating_point() or name.endswith(("k_proj.k_scale", "v_proj.v_scale")):
        return tensor
    return tensor.to(dtype)


def _check_vision_is_plain(context: ExportContext) -> None:
    """TensorRT-LLM runs the vision tower from the Hugging Face weights with its own code: refuse
    modules it could not load (a quantized or otherwise replaced layer)."""
    model, adapter = context.model, context.adapter
    for part in (adapter.vision_tower(model), adapter.projector(model)):
        for name, module in part.named_modules():
            origin = type(module).__module__
            if not origin.startswith(("torch.", "transformers.")):
                raise ExportError(
                    f"the vision part holds {name or type(part).__name__} ({type(module).__name__} from {origin}); "
                    "TensorRT-LLM's PyTorch backend runs the vision tower from plain Hugging Face weights.",
                    fix="keep the vision tower and projector unmodified for target='hf' (limit the pass to the "
                    "language model), or export target='checkpoint', whose vision part is an ONNX graph.",
                )


def _drop_prefixes(state: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> None:
    for key in [k for k in state if k.startswith(prefixes)]:
        del state[key]


def _layer_tensors(layer: LayerWeights, layer_name: str, attn_name: str, mlp_name: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    norms = {"input_layernorm": layer.input_norm.float(), "post_attention_layernorm": layer.post_norm.float()}
    for norm, roles in (("input_layernorm", ("q", "k", "v")), ("post_attention_layernorm", ("gate", "up"))):
        pre = _shared_prequant([layer.linears()[r] for r in roles], f"{layer_name}: {'/'.join(roles)}")
        if pre is not None:  # the loader reads no pre_quant_scale here, so the norm carries it
            norms[norm] = norms[norm] * pre
    for norm, weight in norms.items():
        out[f"{layer_name}.{norm}.weight"] = weight
    for role, linear in layer.linears().items():
        owner = attn_name if role in ("q", "k", "v", "o") else mlp_name
        out.update(_linear(f"{owner}.{_ROLE_ATTR[role]}", linear, keep_prequant=role in ("o", "down")))
    return out


def _shared_prequant(parts: list[LinearWeights], where: str) -> torch.Tensor | None:
    scales = [p.prequant() for p in parts if isinstance(p, Int4Linear)]
    if not scales or all(bool((s == 1).all()) for s in scales):
        return None
    if any(not torch.equal(scales[0], s) for s in scales[1:]) or len(scales) != len(parts):
        raise ExportError(
            f"{where} read the same input but carry different AWQ pre-quant scales; TensorRT-LLM's PyTorch "
            "backend needs one scale folded into the norm in front of them.",
            fix="calibrate these projections with one shared activation scale, or export target='checkpoint'.",
        )
    return scales[0]


def _linear(name: str, linear: LinearWeights, *, keep_prequant: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(linear, Int4Linear):
        out[f"{name}.weight"] = pack_int4_rows(linear.q).view(torch.uint8)
        out[f"{name}.weight_scale"] = linear.scales.float()
        if keep_prequant:
            out[f"{name}.pre_quant_scale"] = linear.prequant()
    else:
        out[f"{name}.weight"] = linear.weight.detach().float()
    if linear.bias is not None:
        out[f"{name}.bias"] = linear.bias.detach().float()
    return out


def hf_quant_config(context: ExportContext, lm: LanguageModelWeights, kv_algo: str | None) -> dict[str, Any] | None:
    """ModelOpt's ``hf_quant_config.json`` for this model (None when nothing is quantized)."""
    from mmsdk import __version__

    group = lm.group_size()
    if group is None and kv_algo is None:
        return None
    quant: dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": kv_algo}
    if group is not None:
        quant.update(quant_algo="W4A16_AWQ", group_size=group, has_zero_point=False, pre_quant_scale=True,
                     exclude_modules=_excluded(context, lm))
    return {"producer": {"name": "mmsdk", "version": __version__}, "quantization": quant}


def _excluded(context: ExportContext, lm: LanguageModelWeights) -> list[str]:
    """fnmatch patterns (checkpoint names) of every module left in full precision."""
    model, adapter = context.model, context.adapter
    names = {id(m): n for n, m in model.named_modules()}
    runtime = [names[id(adapter.vision_tower(model))], names[id(adapter.projector(model))],
               names[id(adapter.lm_head(model))], names[id(adapter.embed_tokens(model))]]
    for layer_module, layer in zip(adapter.decoder_layers(model), lm.layers, strict=True):
        attention, mlp = adapter.self_attention(layer_module), adapter.mlp(layer_module)
        for role, linear in layer.linears().items():
            owner = attention if role in ("q", "k", "v", "o") else mlp
            if not isinstance(linear, Int4Linear):
                runtime.append(f"{names[id(owner)]}.{_ROLE_ATTR[role]}")
    names = sorted({_checkpoint_name(model, name) for name in runtime})
    patterns = [n if n.endswith(("_proj", "lm_head")) else f"{n}*" for n in names]
    # A module inside another excluded part (Qwen's merger inside its vision tower) needs no pattern of its own.
    return [p for p in patterns if not any(o != p and o.endswith("*") and p.startswith(o[:-1] + ".")
                                           for o in patterns)]


def _checkpoint_name(model: Any, runtime_name: str) -> str:
    """The module name as the saved checkpoint spells it (transformers reverts its runtime renames)."""
    from transformers.core_model_loading import revert_weight_conversion

    reverted = revert_weight_conversion(model, {f"{runtime_name}.weight": torch.zeros(1)})
    return next(iter(reverted)).removesuffix(".weight")


def _finish_config(path: Path, dtype: str, quant: dict[str, Any] | None) -> None:
    config = json.loads(path.read_text())
    config["dtype"] = config["torch_dtype"] = dtype
    if quant is not None:  # the copy other runtimes read; TensorRT-LLM prefers hf_quant_config.json
        config["quantization_config"] = _config_copy(quant)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _config_copy(quant: dict[str, Any]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``, in the form ModelOpt writes next to hf_quant_config.json."""
    details = quant["quantization"]
    copy: dict[str, Any] = {"ignore": details.get("exclude_modules") or []}
    if details.get("quant_algo"):
        copy["quant_algo"] = details["quant_algo"]
    if details.get("kv_cache_quant_algo") == "FP8":
        copy["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    copy.update(producer=quant["producer"], quant_method="modelopt")
    return copy
