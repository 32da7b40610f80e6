"""``rmsnorm-rope-fusion``: fused normalization and rotary modules, exact against the originals.

* Residual add + RMSNorm as one op: each pre-norm decoder layer's post-attention norm becomes a
  :class:`FusedAddRMSNorm` (same weight), and the layer computes ``norm(residual + attn)`` with
  the sum as the next residual (ONNX Runtime ``SkipSimplifiedLayerNormalization``).
* The remaining RMSNorms of the decoder (each layer's input norm, the final norm) become a
  :class:`FusedAddRMSNorm` without residual: one kernel on CUDA instead of the eight elementwise
  and reduction kernels transformers' RMSNorm launches (a batch-1 decode step is made of such
  short kernels: each costs more in launch gaps than in work).
* RoPE on q and k together: the module-level rotary function each self-attention calls is bound,
  for that module only, to a :class:`FusedRoPE` (ORT ``RotaryEmbedding``; ``MRotaryEmbedding``
  for M-RoPE). M-RoPE models also get :class:`FusedMRoPEEmbedding`, which picks each frequency
  slot's T/H/W position before the trigonometry instead of computing all three streams; plain-RoPE
  models get :class:`FusedRoPEEmbedding`, the same kernel with one stream (one launch per call for
  cos/sin where transformers' rotary module makes about seven).
* RMSNorm + RoPE where they are adjacent (per-head q/k norms, Qwen3-VL): the norms become
  :class:`DeferredRMSNorm` (same weights, identity in place) and :class:`FusedRMSNormRoPE`
  normalizes and rotates q and k in one op.
* Norms inside the GEMVs (``norm_in_gemv``, on by default): in decode steps of layers whose
  projections are INT4 (``int4-weight``), each layer's input norm runs inside its q/k/v GEMV
  (mmsdk/plugins/attention/norm_folding.py), and with ``mlp_norm_in_gemv`` (also on by default) the
  attention's residual add runs in o_proj's GEMV, whose store leaves the post-attention norm's
  statistics for the gated MLP's gate/up GEMV: no norm launch left between a layer's GEMVs. With
  ``qkv_norm_statistics`` (on by default) the down projection's store leaves the next layer's
  input-norm statistics the same way, for an integer-dot q/k/v GEMV. On CUDA this is not bitwise
  the unfolded layer: the folded kernels skip the rounding of the normalized activations
  (mmsdk/kernels/norm_fold.py).

Every replacement is checked on a probe against the module it replaces (bitwise in the model's
dtype) and skipped, with the reason in the records, if it would not be exact (the folded norms
are bitwise on CPU, where the projections run the reference norm first). The torch ops
(mmsdk/kernels/norm_rope.py) are the reference and run on CPU; on CUDA each fused module runs one
Triton kernel (mmsdk/kernels/norm_rope_gpu.py), equal to the reference up to rounding order.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from typing import Any, Callable

import torch
from pydantic import Field
from torch import nn

import mmsdk
from mmsdk.core.adapter import ModelAdapter
from mmsdk.core.backend import LowerTarget
from mmsdk.core.config import PassConfig
from mmsdk.core.passes import PassContext, PassSpec
from mmsdk.core.registry import Registrar
from mmsdk.kernels.norm_rope import mrope_streams
from mmsdk.plugins._forward import body_function, module_body, plus_residual, rebind_global, set_forward_body
from mmsdk.plugins.attention.fused_norm_rope import (
    DeferredRMSNorm,
    FusedAddRMSNorm,
    FusedMRoPEEmbedding,
    FusedRMSNormRoPE,
    FusedRoPE,
    FusedRoPEEmbedding,
    RoPEInAttention,
)
from mmsdk.plugins.attention.fused_norm_rope_lowering import onnx_lowering, trtllm_lowering
from mmsdk.plugins.attention.norm_folding import NormFolding, chain_input_norm_statistics, folds_now

__all__ = [
    "RMSNormRoPEFusionConfig",
    "FusedAddRMSNorm",
    "FusedRoPE",
    "DeferredRMSNorm",
    "FusedRMSNormRoPE",
    "FusedMRoPEEmbedding",
    "FusedRoPEEmbedding",
    "apply_rmsnorm_rope_fusion",
]

# Arguments a decoder layer receives for its self-attention (the rest are the layer's own, e.g. Mllama's).
_ATTENTION_ARGS = frozenset({"attention_mask", "position_ids", "position_embeddings", "cache", "past_key_values",
                             "use_cache", "cache_position", "output_attentions"})


class RMSNormRoPEFusionConfig(PassConfig):
    """Which fusions to make."""

    residual_norm: bool = Field(True, description="Fuse residual add + post-attention RMSNorm in decoder layers.")
    plain_norms: bool = Field(True, description="Run the decoder layers' input RMSNorms and the final RMSNorm as "
                              "one fused op each.")
    rope: bool = Field(True, description="Rotate q and k in one op in every self-attention.")
    qk_norm: bool = Field(True, description="Fold per-head q/k RMSNorms into the RoPE op where adjacent (Qwen3).")
    mrope_tables: bool = Field(True, description="M-RoPE models: build sectioned cos/sin in one pass.")
    rope_tables: bool = Field(True, description="Plain-RoPE models: build each call's cos/sin in one kernel "
                              "(transformers launches about seven small ones, each a launch in every decode step).")
    rope_in_attention: bool = Field(True, description="On decode steps over a packed KV cache (int4-kv / int8-kv / "
                                    "fp8-kv on CUDA), let the attention kernel rotate q and k as it loads them instead "
                                    "of a separate RoPE launch (bitwise the same numbers on an H200).")
    norm_in_gemv: bool = Field(True, description="In decode steps of layers with INT4 projections (int4-weight), run "
                               "the input RMSNorm inside the q/k/v GEMV: one norm launch less per layer (on an H200 "
                               "about 2-3 µs each, docs/benchmarks.md). On CUDA the activations the GEMV multiplies "
                               "are not rounded to the model dtype after the norm (outputs differ from the unfolded "
                               "layer by about that rounding); needs residual_norm.")
    mlp_norm_in_gemv: bool = Field(True, description="With norm_in_gemv, in bf16 models: the attention's residual add "
                                   "in o_proj's GEMV, whose store leaves the post-attention RMSNorm's statistics for "
                                   "the gated MLP's GEMV: no norm launch left between GEMVs (H200: 27-31 µs less per "
                                   "7B step, docs/benchmarks.md). fp16 keeps the launch (weight * input may overflow).")
    qkv_norm_statistics: bool = Field(True, description="With mlp_norm_in_gemv: each layer's down-projection store "
                                      "also leaves the next layer's input-norm statistics, and a q/k/v GEMV of an "
                                      "integer-dot kind ('idot' / 'idotr') scales its sums by them instead of reading "
                                      "the whole row for the norm (H100: 34-41 µs less per LLaVA-1.5-7B g32 step, "
                                      "8-19 on Qwen2-VL-7B g128, docs/benchmarks.md). Where the q/k/v GEMV's kind "
                                      "folds the norm instead, the store stops leaving them after the first step.")


def _eps(norm: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)


def _probe(weight: torch.Tensor, *shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(weight.device, weight.dtype)


def _fused_norm(norm: nn.Module) -> FusedAddRMSNorm | None:
    """A FusedAddRMSNorm that computes exactly what ``norm`` does (checked on a probe), or None."""
    eps = _eps(norm)
    weight = getattr(norm, "weight", None)
    if eps is None or not isinstance(weight, nn.Parameter):
        return None
    fused = FusedAddRMSNorm(weight, eps)
    x = _probe(weight, 2, 3, weight.shape[-1])
    return fused if _same(norm(x), fused.reference(x)) else None


def _fuse_residual_norms(model: nn.Module, adapter: ModelAdapter, skipped: list[str],
                         config: RMSNormRoPEFusionConfig) -> list[str]:
    fused_names = []
    foldings: list[NormFolding | None] = []  # one per decoder layer, in order (None: not folded)
    names = {id(m): n for n, m in model.named_modules()}
    for layer in adapter.decoder_layers(model):
        norms = adapter.decoder_norm_names(layer)
        if norms is None:
            foldings.append(None)
            continue
        norm = getattr(layer, norms[1])
        fused = _fused_norm(norm)
        if fused is None:
            skipped.append(f"{names[id(norm)]}: its normalization is not RMSNorm with a plain weight")
            foldings.append(None)
            continue
        setattr(layer, norms[1], fused)
        folding = (NormFolding(layer, adapter, norms[0], fused, fold_mlp=config.mlp_norm_in_gemv)
                   if config.norm_in_gemv else None)
        set_forward_body(layer, _fused_layer_body(layer, adapter, norms[0], fused, folding))
        fused_names.append(names[id(layer)])
        foldings.append(folding)
    if config.qkv_norm_statistics and config.mlp_norm_in_gemv:
        chain_input_norm_statistics(foldings)
    return fused_names


def _fuse_plain_norms(model: nn.Module, adapter: ModelAdapter, skipped: list[str]) -> list[str]:
    """Replace each decoder layer's input norm and the final norm by a residual-free FusedAddRMSNorm."""
    names = {id(m): n for n, m in model.named_modules()}
    owners = []
    for layer in adapter.decoder_layers(model):
        norms = adapter.decoder_norm_names(layer)
        if norms is not None:
            owners.append((layer, norms[0]))
    final = adapter.final_norm(model)
    done = []
    for owner, attr in owners:
        norm = getattr(owner, attr)
        if isinstance(norm, FusedAddRMSNorm):
            continue
        fused = _fused_norm(norm)
        if fused is None:
            skipped.append(f"{names[id(norm)]}: its normalization is not RMSNorm with a plain weight")
            continue
        setattr(owner, attr, fused)
        done.append(names[id(norm)])
    if isinstance(final, nn.Module) and not isinstance(final, FusedAddRMSNorm):
        fused = _fused_norm(final)
        if fused is None:
            skipped.append(f"{names[id(final)]}: its normalization is not RMSNorm with a plain weight")
        else:
            done.append(_replace_module(model, final, fused))
    return done


def _fused_layer_body(layer: nn.Module, adapter: ModelAdapter, input_norm: str, fused: FusedAddRMSNorm,
                      folding: NormFolding | None) -> Callable[..., Any]:
    """norm -> self-attention -> (add + norm fused) -> MLP -> add; training mode runs the original; decode steps
    with ``folding`` run the norms inside the GEMVs where the layer's projections can (:class:`NormFolding`)."""
    original = module_body(layer)
    signature = inspect.signature(original)
    own = {name for name, p in signature.parameters.items() if p.kind is not p.VAR_KEYWORD} - {"hidden_states"}
    layer_only = own - _ATTENTION_ARGS
    attention, mlp = adapter.self_attention(layer), adapter.mlp(layer)

    def body(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if layer.training:  # dropout and friends: only the original knows them
            return original(hidden_states, *args, **kwargs)
        if args:
            kwargs = {**signature.bind_partial(hidden_states, *args, **kwargs).arguments, **kwargs}
            kwargs.pop("hidden_states", None)
            kwargs.update(kwargs.pop("kwargs", {}))
        passed = {k: v for k, v in kwargs.items() if k not in layer_only}
        if folding is not None:
            out = folding.step(hidden_states, attention, mlp, passed)
            if out is not None:
                return out
        residual = hidden_states
        h = getattr(layer, input_norm)(hidden_states)
        h = attention(hidden_states=h, **passed)[0]
        h, residual = fused(h, residual)
        return plus_residual(mlp, h, residual)  # residual + mlp(h), in the MLP's last kernel where it can

    return body


def _mrope_layout(model: nn.Module, adapter: ModelAdapter) -> tuple[list[int] | None, list[int] | None]:
    """(mrope_section, per-slot position streams) read from the model's rotary module, or (None, None)."""
    rotary = adapter.rotary_embedding(model)
    if adapter.rotary_kind(model) != "mrope" or rotary is None:
        return None, None
    section = getattr(rotary, "mrope_section", None)
    if not hasattr(rotary, "recomposition_frequencies") or not hasattr(rotary, "inv_freq"):
        return (list(section) if section else None), None
    half = rotary.inv_freq.shape[0]
    marker = torch.arange(3, dtype=torch.float32)[:, None, None, None].expand(3, 1, 1, half).clone()
    streams = rotary.recomposition_frequencies(marker)[0, 0, :half].round().long().tolist()
    return (list(section) if section else None), streams


def _float_reference(module: nn.Module) -> torch.Tensor:
    """A floating-point tensor of ``module`` (its compute dtype and device); quantized modules keep
    their weights as packed integer buffers next to float scales, so buffers count too."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor
    return torch.empty(0)


def _rope_probe(attention: nn.Module, head_dim: int, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    heads = max(1, getattr(attention, "num_heads", 0) or getattr(attention.config, "num_attention_heads", 1))
    q = _probe(weight, 1, heads, 3, head_dim, seed=1)
    k = _probe(weight, 1, 1, 3, head_dim, seed=2)
    angles = _probe(weight, 1, 3, head_dim // 2, seed=3).float()
    angles = torch.cat([angles, angles], dim=-1)
    return q, k, angles.cos().to(weight.dtype), angles.sin().to(weight.dtype)


def _fuse_attention_rope(attention: nn.Module, adapter: ModelAdapter, config: RMSNormRoPEFusionConfig,
                         section: list[int] | None, interleaved: bool) -> tuple[str, str | None]:
    """Install the fused op on one attention module; return (kind, reason it was skipped or None)."""
    name = adapter.rope_function_name(attention)
    if name is None:
        return "none", "its forward applies no module-level RoPE function"
    function = body_function(attention)
    original = inspect.unwrap(function).__globals__.get(name)
    head_dim = int(attention.head_dim)
    q, k, cos, sin = _rope_probe(attention, head_dim, _float_reference(attention))
    norms = adapter.qk_norm_names(attention) if config.qk_norm else None
    if norms is not None:
        q_norm, k_norm = (getattr(attention, n) for n in norms)
        eps = (_eps(q_norm), _eps(k_norm))
        if None in eps:
            return "none", "its q/k norms keep no epsilon mmsdk recognises"
        deferred = (DeferredRMSNorm(q_norm.weight, eps[0]), DeferredRMSNorm(k_norm.weight, eps[1]))
        fused: nn.Module = FusedRMSNormRoPE(*deferred, head_dim=head_dim, mrope_section=section,
                                            mrope_interleaved=interleaved)
        expected, kind = original(q_norm(q), k_norm(k), cos, sin), "rmsnorm+rope"
    else:
        fused, kind = FusedRoPE(head_dim, section, interleaved), "rope"
        expected = original(q, k, cos, sin)
    if not _same(expected, fused.reference(q, k, cos, sin)):  # type: ignore[operator]
        return "none", f"its {name} differs from the reference rotate-half RoPE"
    attention.fused_rope = fused
    if kind == "rope" and config.rope_in_attention:
        set_forward_body(attention, types.MethodType(_rope_in_attention_body(function, name, fused), attention))
    else:
        set_forward_body(attention, types.MethodType(rebind_global(function, name, fused), attention))
    if norms is not None:
        for attr, module in zip(norms, deferred, strict=True):
            setattr(attention, attr, module)
    return kind, None


def _rope_in_attention_body(function: Callable[..., Any], name: str, fused: FusedRoPE) -> Callable[..., Any]:
    """``function`` (an attention forward) calling a :class:`RoPEInAttention` as ``name``, pointed at the call's
    packed KV cache layer, so a decode step's RoPE can run inside the attention kernel."""
    deferral = RoPEInAttention(fused)
    rebound = rebind_global(function, name, deferral)

    @functools.wraps(rebound)  # other passes may rebind globals of the inner function through __wrapped__
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        layer = deferral.cache_layer = _packed_cache_layer(self, kwargs)
        try:
            return rebound(self, *args, **kwargs)
        finally:
            deferral.cache_layer = None
            if layer is not None:
                layer.settle_rope()  # a RoPE left to a kernel that did not run (an error on the way) runs now

    return forward


def _packed_cache_layer(attention: nn.Module, kwargs: dict[str, Any]) -> Any:
    """The cache layer of this attention call that can rotate its decode step's q and k itself, or None."""
    cache = next((kwargs[k] for k in ("cache", "past_key_values", "past_key_value") if kwargs.get(k) is not None), None)
    layers, index = getattr(cache, "layers", None), getattr(attention, "layer_idx", None)
    if not isinstance(layers, list) or not isinstance(index, int) or not 0 <= index < len(layers):
        return None
    layer = layers[index]
    return layer if callable(getattr(layer, "take_rope", None)) else None


def _replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> str:
    for name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if child is old:
                setattr(parent, child_name, new)
                return f"{name}.{child_name}" if name else child_name
    raise LookupError("module not found in the model")


def _fuse_rope_tables(model: nn.Module, adapter: ModelAdapter,
                      streams: list[int] | None) -> tuple[str | None, str | None]:
    """Replace the rotary module by :class:`FusedMRoPEEmbedding` (M-RoPE: ``streams`` given) or
    :class:`FusedRoPEEmbedding` (plain RoPE); (replaced module's name or None, reason it was skipped or None)."""
    rotary = adapter.rotary_embedding(model)
    mrope = streams is not None
    label = "M-RoPE tables" if mrope else "RoPE tables"
    if rotary is None or (not mrope and adapter.rotary_kind(model) == "mrope"):
        return None, None
    if not mrope and not (isinstance(getattr(rotary, "inv_freq", None), torch.Tensor)
                          and isinstance(getattr(rotary, "attention_scaling", None), (int, float))):
        return None, f"{label}: the model's rotary module keeps no inv_freq / attention_scaling mmsdk recognises"
    if getattr(rotary, "rope_type", "default") != "default":
        return None, f"{label}: only the default rope type is fused (scaled variants update inv_freq)"
    fused = FusedMRoPEEmbedding(rotary, streams) if mrope else FusedRoPEEmbedding(rotary)
    generator = torch.Generator().manual_seed(4)
    positions = torch.randint(0, 64, (3, 2, 5) if mrope else (2, 5), generator=generator).to(rotary.inv_freq.device)
    x = torch.zeros(1, dtype=next(model.parameters()).dtype, device=rotary.inv_freq.device)
    if not _same(rotary(x, positions), fused.reference(x, positions)):
        return None, f"{label}: the model's rotary module computes something else"
    return _replace_module(model, rotary, fused), None


def apply_rmsnorm_rope_fusion(model: nn.Module, config: RMSNormRoPEFusionConfig,
                              context: PassContext) -> dict[str, Any]:
    """Replace norms and rotary application with fused modules; return what was fused and skipped."""
    adapter = context.adapter
    names = {id(m): n for n, m in model.named_modules()}
    skipped: list[str] = []
    records: dict[str, Any] = {"residual_norm": [], "norm_in_gemv": [], "plain_norms": [], "rope": [],
                               "rmsnorm_rope": [],
                               "mrope_tables": None, "rope_tables": None}
    if config.residual_norm:
        records["residual_norm"] = _fuse_residual_norms(model, adapter, skipped, config)
        # layers whose decode steps fold their norms into the GEMVs now (q/k/v already INT4); int4-weight applied
        # after this pass makes the others fold too: a layer looks its projections up on each call
        records["norm_in_gemv"] = [name for name, layer in model.named_modules()
                                   if name in records["residual_norm"] and config.norm_in_gemv
                                   and folds_now(layer, adapter)]
    if config.plain_norms:
        records["plain_norms"] = _fuse_plain_norms(model, adapter, skipped)
    section, streams = _mrope_layout(model, adapter)
    interleaved = streams is not None and section is not None and streams != mrope_streams(section)
    layout = None if section is None else ("interleaved" if interleaved else "sectioned")
    records.update(mrope_section=section, mrope_layout=layout)
    if config.rope:
        for layer in adapter.decoder_layers(model):
            attention = adapter.self_attention(layer)
            if attention is None:
                continue
            kind, reason = _fuse_attention_rope(attention, adapter, config, section, interleaved)
            if reason is not None:
                skipped.append(f"{names[id(attention)]}: {reason}")
            else:
                records["rope" if kind == "rope" else "rmsnorm_rope"].append(names[id(attention)])
    if streams is not None and config.mrope_tables:
        records["mrope_tables"], reason = _fuse_rope_tables(model, adapter, streams)
        if reason:
            skipped.append(reason)
    if streams is None and config.rope_tables:
        records["rope_tables"], reason = _fuse_rope_tables(model, adapter, None)
        if reason:
            skipped.append(reason)
    records["skipped"] = skipped
    if skipped:  # each skip leaves eager norms or RoPE where the user asked for fused ones: say so, not only record it
        logging.getLogger("mmsdk.plugins").warning(
            "rmsnorm-rope-fusion left %d module(s) as they were, e.g. %s (all reasons: the pass result's "
            "records['skipped'])", len(skipped), skipped[0])
    return records


@mmsdk.hookimpl
def mmsdk_lower(module: nn.Module, target: LowerTarget) -> Any:
    if target.backend == "onnxruntime":
        return onnx_lowering(module)
    if target.backend in ("tensorrt_llm", "tensorrt-llm", "trtllm"):
        return trtllm_lowering(module)
    return None


@mmsdk.hookimpl
def mmsdk_register_attention(register: Registrar[PassSpec]) -> None:
    register(
        PassSpec(
            name="rmsnorm-rope-fusion",
            config_cls=RMSNormRoPEFusionConfig,
            apply=apply_rmsnorm_rope_fusion,
            summary="fused residual-add+RMSNorm, q/k RoPE (1-D and M-RoPE) and q/k RMSNorm+RoPE modules, exact",
            fast_generate=True,  # tests/test_fast_generate.py: same tokens as transformers' loop
        )
    )
