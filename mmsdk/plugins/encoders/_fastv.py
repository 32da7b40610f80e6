"""FastV inside the language model: after layer K, drop the image tokens the last prompt token ignores.

At prefill, a pre-hook on layer K-1's attention computes one score row, the attention of the last
prompt token over every key (head-averaged, RoPE applied, padding masked): O(L * d) extra work,
so the layer itself keeps SDPA. Layers K..N-1 get wrappers that gather the kept rows of the hidden
states, position embeddings, positions and 4-D mask (the kept tokens keep their original RoPE
positions, as FastV renumbers ``position_ids = keep_indexs``), so their KV cache holds only the
kept tokens. On decode, the same wrappers drop the pruned columns from the mask. Every row of a
batch drops the same number of tokens (the smallest row's budget), so no new padding appears.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mmsdk.kernels.norm_rope import rope_qk
from mmsdk.plugins._forward import add_forward_wrapper
from mmsdk.plugins._runtime import ModelRuntime, cache_of

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter

__all__ = ["install_fastv", "last_token_scores"]


def _norm(attention: nn.Module, name: str | None, x: torch.Tensor) -> torch.Tensor:
    if name is None:
        return x
    module = getattr(attention, name)
    return getattr(module, "normalize", module)(x)  # a deferred norm (rmsnorm-rope-fusion) still normalizes


@torch.no_grad()
def last_token_scores(adapter: ModelAdapter, attention: nn.Module, hidden: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor] | None, mask: Any) -> torch.Tensor:
    """[B, L]: head-averaged attention probabilities of the last position over every position."""
    proj = adapter.attention_projections(attention)
    norms = adapter.qk_norm_names(attention) or (None, None)
    batch, length, _ = hidden.shape
    head_dim = attention.head_dim
    q = _norm(attention, norms[0], getattr(attention, proj.q)(hidden[:, -1:]).view(batch, 1, -1, head_dim))
    k = _norm(attention, norms[1], getattr(attention, proj.k)(hidden).view(batch, length, -1, head_dim))
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if rope is not None:
        cos, sin = rope
        q, _ = rope_qk(q, q, cos[:, -1:], sin[:, -1:])
        k, _ = rope_qk(k, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q @ k.transpose(-1, -2)).float().squeeze(2) * head_dim**-0.5  # [B, H, L]
    valid = _last_row_valid(mask, batch, length, hidden.device)
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=1)


def _last_row_valid(mask: Any, batch: int, length: int, device: torch.device) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    row = mask[:, 0, -1, -length:].expand(batch, length)
    return row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2


class _FastV:
    """The per-model FastV state: the kept indices of the call in flight and of the cache."""

    def __init__(self, adapter: ModelAdapter, runtime: ModelRuntime, kept: Callable[[int], int]) -> None:
        self.adapter = adapter
        self.runtime = runtime
        self.kept = kept
        self.keep: torch.Tensor | None = None  # [B, L'] for the prefill in flight
        self.bound: tuple[Any, torch.Tensor, int] | None = None  # (cache ref, keep, prefill length)

    def score(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        call = self.runtime.call
        images = call.query_image_mask if call is not None else None
        self.keep = None
        if images is None or not bool(images.any()):
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        scores = last_token_scores(self.adapter, module, hidden, kwargs.get("position_embeddings"),
                                   kwargs.get("attention_mask"))
        self.keep = self._keep(scores, images.to(hidden.device))

    def _keep(self, scores: torch.Tensor, images: torch.Tensor) -> torch.Tensor | None:
        from mmsdk.runtime.compaction import true_runs

        drops = []
        for row in images:
            runs = true_runs(row.tolist())
            drops.append(sum((end - start) - self.kept(end - start) for start, end in runs))
        drop = min(drops)
        if drop <= 0:
            return None
        ranked = scores.masked_fill(~images, float("inf"))  # text tokens are never dropped
        dropped = ranked.topk(drop, dim=-1, largest=False).indices
        keep = torch.ones_like(images)
        keep.scatter_(1, dropped, False)
        return keep.nonzero()[:, 1].view(images.shape[0], -1)

    def layer_forward(self, original: Callable[..., Any], hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cache = cache_of(kwargs)
        if self.keep is not None:
            keep = self.keep.to(hidden.device)
            if hidden.shape[1] != keep.shape[1]:  # the first pruned layer: its input is still full length
                if cache is not None:
                    self.bound = (weakref.ref(cache), keep, hidden.shape[1])
                hidden = hidden.gather(1, keep[..., None].expand(-1, -1, hidden.shape[-1]))
            _gather_prefill(kwargs, keep)
        elif self.bound is not None and cache is not None and self.bound[0]() is cache:
            _gather_decode_mask(kwargs, self.bound[1], self.bound[2])
        return original(hidden, *args, **kwargs)


def _gather_seq(x: torch.Tensor, keep: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """x [..., B or 1, L, *tail] (seq at ``seq_dim``) -> [..., B, L', *tail]: each row's kept positions."""
    dim = seq_dim % x.dim() - 1  # the batch dimension sits right before the sequence
    shape = list(x.shape)
    shape[dim] = keep.shape[0]
    x = x.expand(*shape)
    view = [1] * x.dim()
    view[dim], view[dim + 1] = keep.shape
    index = keep.view(view).expand(*shape[: dim + 1], keep.shape[1], *shape[dim + 2:])
    return x.gather(dim + 1, index)


def _gather_mask(mask: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None) -> torch.Tensor:
    """A [B or 1, 1, Lq, Lk] mask with only the kept query rows and key columns."""
    batch = (rows if rows is not None else cols).shape[0]
    mask = mask.expand(batch, *mask.shape[1:])
    if rows is not None and mask.shape[2] > 1:
        mask = mask.gather(2, rows[:, None, :, None].expand(batch, mask.shape[1], rows.shape[1], mask.shape[3]))
    if cols is not None:
        mask = mask.gather(3, cols[:, None, None, :].expand(batch, mask.shape[1], mask.shape[2], cols.shape[1]))
    return mask


def _gather_prefill(kwargs: dict[str, Any], keep: torch.Tensor) -> None:
    rope = kwargs.get("position_embeddings")
    if rope is not None:
        kwargs["position_embeddings"] = tuple(_gather_seq(t, keep, -2) for t in rope)
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor):
        kwargs["position_ids"] = _gather_seq(positions, keep, -1)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        kwargs["attention_mask"] = _gather_mask(mask, keep, keep)


def _gather_decode_mask(kwargs: dict[str, Any], keep: torch.Tensor, prefill_length: int) -> None:
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return
    extra = torch.arange(prefill_length, mask.shape[-1], device=keep.device).expand(keep.shape[0], -1)
    kwargs["attention_mask"] = _gather_mask(mask, None, torch.cat([keep, extra], dim=1))


def install_fastv(model: nn.Module, adapter: ModelAdapter, runtime: ModelRuntime, layer: int,
                  kept: Callable[[int], int]) -> None:
    """Score at layer ``layer - 1``, prune from layer ``layer`` on."""
    state = _FastV(adapter, runtime, kept)
    layers = adapter.decoder_layers(model)
    attention = adapter.self_attention(layers[layer - 1])
    attention.register_forward_pre_hook(state.score, with_kwargs=True)
    for decoder_layer in layers[layer:]:
        add_forward_wrapper(decoder_layer, state.layer_forward)
