"""``sparse-xattn``: structured block-sparse cross-modal attention.

Text-query blocks attend only to the image-key blocks most similar to them (pooled q.k, top
``density`` share, see ``_block_sparse``). In the Flamingo family this applies to the
cross-attention layers; in LLaVA/Qwen to the text-to-image part of every self-attention (image
rows and text columns are untouched). The attention function each layer calls is wrapped for
that layer only: on CUDA with ``backend`` "auto"/"flex" the kept entries run through
FlexAttention's block mask; elsewhere the model's own attention (SDPA or eager) runs with the
block mask folded into its attention mask. Every layer carries a :class:`BlockSparseSpec`
(no weights) that records the rule, the last layout and how many score entries it skipped,
and that ``mmsdk_lower`` turns into ONNX Runtime / TensorRT-LLM instructions.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

import mmsdk
from mmsdk.core.adapter import ModelAdapter
from mmsdk.core.backend import LowerTarget
from mmsdk.core.config import PassConfig
from mmsdk.core.errors import IncompatiblePassError
from mmsdk.core.passes import CheckContext, PassContext, PassSpec
from mmsdk.core.registry import Registrar
from mmsdk.plugins._forward import body_function, rebind_global, set_forward_body
from mmsdk.plugins._runtime import ModelRuntime, runtime_of
from mmsdk.plugins.attention._block_sparse import allowed_entries, combine_mask, kept_pairs, layout_csr, sparse_mask
from mmsdk.plugins.attention._lowering import OnnxLowering, OnnxNode, TrtLlmLowering
from mmsdk.plugins.attention.flex_blocks import FlexRunner, tile_lists

__all__ = ["BlockSparseSpec", "SparseXAttnConfig", "apply_sparse_xattn", "flex_available"]

# (text rows [B, Lq], image columns [B, Lk], index of each row's first real token [B] or None)
_Rows = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


class SparseXAttnConfig(PassConfig):
    """Block size, how many image-key blocks survive, and which kernel runs them."""

    density: float = Field(0.5, gt=0, le=1, description="Share of the visible image-key blocks each text block keeps.")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per block, for queries and keys (ORT: 16-128).")
    backend: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="auto: FlexAttention on CUDA, masked SDPA elsewhere; flex: require FlexAttention."
    )


def flex_available(device: torch.device) -> bool:
    """True where FlexAttention can run fast: a CUDA device and torch.nn.attention.flex_attention."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


class BlockSparseSpec(nn.Module):
    """The sparse-xattn rule of one attention layer, its last layout and what it skipped (no weights)."""

    def __init__(self, config: SparseXAttnConfig, kind: Literal["self", "cross"],
                 flex: FlexRunner | None = None) -> None:
        super().__init__()
        self.density = config.density
        self.block = config.block_size
        self.backend = config.backend
        self.kind = kind
        self.last_keep: torch.Tensor | None = None  # [B, query blocks, key blocks] of the last call
        self.entry_counts: torch.Tensor | None = None  # text-to-image entries [dense total, kept], summed on device
        self.flex = flex or FlexRunner()  # the model's layers share one (apply_sparse_xattn)

    @property
    def score_entries(self) -> list[int]:
        """Text-to-image score entries since the last reset: [the model's mask allows, the block mask kept] (reads
        the device)."""
        return [0, 0] if self.entry_counts is None else [int(n) for n in self.entry_counts.tolist()]

    def count_entries(self, total: torch.Tensor, kept: torch.Tensor) -> None:
        """Add one call's counts (0-dim tensors) without waiting for the device."""
        counts = torch.stack((total, kept))
        self.entry_counts = counts if self.entry_counts is None else self.entry_counts + counts.to(
            self.entry_counts.device)

    def reset_score_entries(self) -> None:
        self.entry_counts = None

    def extra_repr(self) -> str:
        return f"kind={self.kind}, block={self.block}, density={self.density}, backend={self.backend}"


@dataclass
class _CallMasks:
    """One forward call's text rows [B, Lq], image columns [B, Lk] and row starts, the same in every layer: built once
    per call, with one read of the device (``pairs``: some text row meets some image column) instead of a few per
    layer, since every read waits for the GPU's queue to drain."""

    text_rows: torch.Tensor
    image_cols: torch.Tensor
    starts: torch.Tensor | None
    pairs: bool
    allowed_by: list[tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=list)  # (model mask, entries)

    def entries_allowed(self, given: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                        causal: bool) -> torch.Tensor:
        """Text-to-image entries the model's own mask allows (``given``; None: the causal or full mask of q x k),
        counted once per mask the call's layers get (a model may give some layers a sliding-window mask)."""
        for mask, entries in self.allowed_by:
            if mask is given:
                return entries
        nothing = torch.zeros(q.shape[0], 1, q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        before = combine_mask(given, nothing, causal=causal, dtype=q.dtype)
        entries = kept_pairs(before, self.text_rows, self.image_cols)
        self.allowed_by.append((given, entries))
        return entries


def _per_call(runtime: ModelRuntime, masks: Callable[[torch.Tensor, torch.Tensor], _Rows]
              ) -> Callable[[torch.Tensor, torch.Tensor], _CallMasks]:
    """``masks`` built once per forward call (kept in the call's memo) and shared by its layers."""

    def call_masks(q: torch.Tensor, k: torch.Tensor) -> _CallMasks:
        call = runtime.call
        key = ("sparse-xattn", q.shape[0], q.shape[2], k.shape[2], q.device)
        found = call.memo.get(key) if call is not None else None
        if found is None:
            text_rows, image_cols, starts = masks(q, k)
            found = _CallMasks(text_rows, image_cols, starts, bool(text_rows.any() & image_cols.any()))
            if call is not None:
                call.memo[key] = found
        return found

    return call_masks


def _flex_masks(q: torch.Tensor, k: torch.Tensor, text_rows: torch.Tensor, image_cols: torch.Tensor,
                starts: torch.Tensor | None, given: torch.Tensor | None, block: int, density: float,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """(layout keep, text-to-image entries kept, FlexAttention's tile lists): the mask's whole build, which runs
    compiled on the FlexAttention path: eagerly it is about 150 small operations a layer call, bound by their
    launches (benchmarks/gpu_sparse_xattn.py --parts)."""
    keep, allowed, kept = sparse_mask(q, k, text_rows, image_cols, starts, given, block=block, density=density,
                                      causal=causal)
    return keep, kept, tile_lists(allowed_entries(allowed))


def _flex_attention(spec: BlockSparseSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: _CallMasks,
                    given: torch.Tensor | None, scaling: float | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(attention output [B, Lq, H, d], layout keep, entries kept) by the compiled mask build and the compiled
    FlexAttention; None where FlexAttention cannot run and ``backend`` "auto" lets masked SDPA take the call (stated
    once per model in a log line). Eager FlexAttention is never the fallback: it is torch's unfused reference,
    33-200x slower than masked SDPA on an H100 (mmsdk/plugins/attention/flex_blocks.py)."""
    flex = spec.flex
    if flex.failure is not None:
        return None
    keep, kept, tiles = flex.run("sparse-xattn mask build", _flex_masks, q, k, rows.text_rows, rows.image_cols,
                                 rows.starts, given, spec.block, spec.density, spec.kind == "self")
    try:
        return flex.attend(q, k, v, tiles, scaling), keep, kept
    except Exception as error:  # torch.compile raises its backend's errors at the first call
        if spec.backend == "flex":
            raise IncompatiblePassError(
                f"sparse-xattn backend='flex' could not compile FlexAttention: {type(error).__name__}: {error}",
                fix='install triton for this torch build, or use backend="auto" / "sdpa" (masked SDPA).',
            ) from error
        flex.failure = f"{type(error).__name__}: {error}"
        logging.getLogger("mmsdk.plugins").warning(
            "sparse-xattn: FlexAttention could not run (%s); its layers run masked SDPA", flex.failure)
        return None


class _SparseInterface:
    """Stands in for transformers' attention-function registry inside one attention module's forward."""

    def __init__(self, real: Any, spec: BlockSparseSpec, masks: Callable[[torch.Tensor, torch.Tensor], _CallMasks]):
        self.real = real
        self.spec = spec
        self.masks = masks

    def get_interface(self, name: str, default: Callable[..., Any]) -> Callable[..., Any]:
        return self.wrap(self.real.get_interface(name, default))

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self.wrap(self.real[name])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def wrap(self, attention: Callable[..., Any]) -> Callable[..., Any]:
        spec = self.spec

        def sparse(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                   *args: Any, **kwargs: Any) -> Any:
            from mmsdk.plugins.quantizers.static_kv import packed_layer

            layer = packed_layer(k)
            if layer is not None:  # a packed KV cache's marker (a KV-cache pass on CUDA): the layout needs the keys
                q = layer.rotated_query(q)  # a RoPE left to the packed kernel runs now
                k, v = layer.dequantized_heads(0, layer.key_codes.shape[1])
            rows = self.masks(q, k)
            if not rows.pairs:
                return attention(module, q, k, v, mask, *args, **kwargs)
            causal = spec.kind == "self"
            given = mask if isinstance(mask, torch.Tensor) else None
            use_flex = spec.backend == "flex" or (spec.backend == "auto" and flex_available(q.device))
            flexed = _flex_attention(spec, q, k, v, rows, given, kwargs.get("scaling")) if (
                use_flex and q.shape[2] > 1) else None
            if flexed is not None:
                out, keep, kept = flexed
            else:
                keep, allowed, kept = sparse_mask(q, k, rows.text_rows, rows.image_cols, rows.starts, given,
                                                  block=spec.block, density=spec.density, causal=causal)
                out = attention(module, q, k, v, allowed, *args, **kwargs)  # allowed keeps the given mask's form
            spec.last_keep = keep
            spec.count_entries(rows.entries_allowed(given, q, k, causal), kept)
            return out if flexed is None else (out, None)

        return sparse


def _first_real(mask: Any, length: int, batch: int, device: torch.device) -> torch.Tensor | None:
    """[B] index of each row's first real token in the last ``length`` columns of a 2-D mask (None: unknown)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < length:
        return None
    real = mask[:, mask.shape[1] - length:].to(device) != 0
    return real.int().argmax(dim=1)  # first real column (left padding); 0 for a row with none


def _real_rows(starts: torch.Tensor | None, length: int, batch: int, device: torch.device) -> torch.Tensor:
    """[B, length] True from each row's first real token on."""
    if starts is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    return torch.arange(length, device=device)[None, :] >= starts[:, None]


def _inline_masks(runtime: ModelRuntime) -> Callable[[torch.Tensor, torch.Tensor], _Rows]:
    """Text rows, image columns and row starts of self-attention, from the language model's call."""

    def masks(q: torch.Tensor, k: torch.Tensor) -> _Rows:
        batch, q_len, k_len = q.shape[0], q.shape[2], k.shape[2]
        call = runtime.call
        query_images = call.query_image_mask if call is not None else None
        if query_images is None or query_images.shape != (batch, q_len):
            empty = torch.zeros(batch, q_len, dtype=torch.bool, device=q.device)
            return empty, torch.zeros(batch, k_len, dtype=torch.bool, device=q.device), None
        starts = _first_real(call.language_mask if call is not None else None, k_len, batch, q.device)
        real = _real_rows(starts, k_len, batch, q.device)[:, k_len - q_len:]
        return ~query_images.to(q.device) & real, runtime.key_image_mask(k_len, batch, q.device), starts

    return masks


def _cross_masks(runtime: ModelRuntime) -> Callable[[torch.Tensor, torch.Tensor], _Rows]:
    """Cross-attention: every real query row is text, every key an image state (never padded)."""

    def masks(q: torch.Tensor, k: torch.Tensor) -> _Rows:
        batch, q_len = q.shape[0], q.shape[2]
        call = runtime.call
        starts = _first_real(call.attention_mask if call is not None else None, q_len, batch, q.device)
        return (_real_rows(starts, q_len, batch, q.device),
                torch.ones(batch, k.shape[2], dtype=torch.bool, device=q.device), starts)

    return masks


def _targets(model: nn.Module, adapter: ModelAdapter) -> list[tuple[nn.Module, Literal["self", "cross"]]]:
    blocks = adapter.cross_attention_blocks(model)
    if blocks:
        return [(block.attention, "cross") for block in blocks]
    layers = adapter.decoder_layers(model)
    return [(a, "self") for a in (adapter.self_attention(layer) for layer in layers) if a is not None]


def check_sparse_xattn(ctx: CheckContext) -> None:
    """Refuse combinations whose image positions differ per layer, and flex without CUDA."""
    config: SparseXAttnConfig = ctx.config  # type: ignore[assignment]
    impl = str(getattr(ctx.adapter.text_config(ctx.model), "_attn_implementation", "sdpa"))
    if impl.startswith("flash"):
        raise IncompatiblePassError(
            f"sparse-xattn needs a 4-D attention mask and this model runs {impl!r}, which takes none.",
            fix='load the model with attn_implementation="sdpa" (masked SDPA, or FlexAttention on CUDA).',
        )
    device = next(ctx.model.parameters()).device
    if config.backend == "flex" and not flex_available(device):
        raise IncompatiblePassError(
            f"sparse-xattn backend='flex' needs FlexAttention on a CUDA device; the model is on {device}.",
            fix='use backend="auto" (FlexAttention on CUDA, masked SDPA elsewhere) or move the model to a GPU.',
        )


def apply_sparse_xattn(model: nn.Module, config: SparseXAttnConfig, context: PassContext) -> dict[str, Any]:
    """Wrap the attention function of every cross-modal attention layer; return the layout rule."""
    adapter = context.adapter
    names = {id(m): n for n, m in model.named_modules()}
    targets = _targets(model, adapter)
    runtime = runtime_of(model, adapter)
    masks = _per_call(runtime, _cross_masks(runtime) if targets and targets[0][1] == "cross"
                      else _inline_masks(runtime))
    flex = FlexRunner()
    for attention, kind in targets:
        spec = BlockSparseSpec(config, kind, flex)
        attention.sparse_xattn = spec
        function = body_function(attention)
        proxy = _SparseInterface(_registry_of(function), spec, masks)
        set_forward_body(attention, types.MethodType(rebind_global(function, "ALL_ATTENTION_FUNCTIONS", proxy),
                                                     attention))
    kind = targets[0][1] if targets else "self"
    records = {
        "layers": [names[id(a)] for a, _ in targets],
        "part": "cross-attention layers" if kind == "cross" else "text-query x image-key part of self-attention",
        "block_size": config.block_size,
        "density": config.density,
        "rule": "per text-query block: top ceil(density * visible) image-key blocks by mean-pooled q.k (head mean)",
        "kernel": "FlexAttention on CUDA, masked SDPA elsewhere" if config.backend == "auto" else config.backend,
        "layout": "dynamic (computed per call); BlockSparseSpec.last_keep holds the last one",
    }
    if context.calibration is not None and context.processor is not None:
        records["example_layout"] = _example_layout(model, context)
    return records


def _example_layout(model: nn.Module, context: PassContext) -> dict[str, Any]:
    """The layouts the first calibration prompt produces (CSR per layer), for exporters of a fixed layout."""
    sample = context.calibration.samples[0]
    processor = context.processor
    inputs = processor(images=[sample.image], text=[context.adapter.format_prompt(sample.text, processor)])
    with torch.no_grad():
        model(**inputs)
    layouts = sparse_layouts(model)
    for spec in (m for m in model.modules() if isinstance(m, BlockSparseSpec)):
        spec.reset_score_entries()
    return {"prompt": sample.text, "layers": layouts}


def _registry_of(function: Callable[..., Any]) -> Any:
    import inspect

    namespace = inspect.unwrap(function).__globals__
    if "ALL_ATTENTION_FUNCTIONS" not in namespace:
        raise IncompatiblePassError(
            f"{function.__qualname__} does not pick its kernel from transformers' attention registry, so "
            "sparse-xattn cannot reach its attention call.",
            fix="use a transformers model class whose attention uses ALL_ATTENTION_FUNCTIONS (transformers >= 4.48).",
        )
    return namespace["ALL_ATTENTION_FUNCTIONS"]


def sparse_layouts(model: nn.Module) -> dict[str, dict[str, list[int]]]:
    """The last layout of every sparse-xattn layer (first batch row) in SparseAttention's CSR form."""
    return {name: layout_csr(m.last_keep[0]) for name, m in model.named_modules()
            if isinstance(m, BlockSparseSpec) and m.last_keep is not None}


@mmsdk.hookimpl
def mmsdk_lower(module: nn.Module, target: LowerTarget) -> Any:
    if not isinstance(module, BlockSparseSpec):
        return None
    rule = {"block_size": module.block, "density": module.density, "kind": module.kind}
    if target.backend == "onnxruntime":
        node = OnnxNode("Attention", "", {"is_causal": int(module.kind == "self")},
                        ("Q", "K", "V", "attn_mask"), ("Y",))
        return OnnxLowering((node,), note="masked attention; build attn_mask in-graph with the block rule "
                            f"{rule} (ReduceMean over blocks, MatMul, TopK, ScatterElements), or use "
                            "com.microsoft.SparseAttention with a fixed CSR layout from sparse_layouts()")
    if target.backend in ("tensorrt_llm", "tensorrt-llm", "trtllm"):
        return TrtLlmLowering(config={"attention_mask": "block_sparse_text_to_image", **rule},
                              note="TensorRT-LLM has no dynamic block-sparse cross-modal kernel: run dense or "
                              "pass the mask as a custom attention mask")
    return None


@mmsdk.hookimpl
def mmsdk_register_attention(register: Registrar[PassSpec]) -> None:
    register(
        PassSpec(
            name="sparse-xattn",
            config_cls=SparseXAttnConfig,
            apply=apply_sparse_xattn,
            check=check_sparse_xattn,
            summary="block-sparse text-to-image attention (top image blocks per text block; FlexAttention on CUDA)",
        )
    )
