"""Image-token scorers for the built-in adapters: which vision tokens the vision tower attends to most.

VisionZip ranks a CLIP token by the attention the CLS token pays it in the feature layer; towers
without a CLS token (Qwen-VL) rank it by the attention it receives from all tokens of its image.
Only the needed rows are computed (one CLS row per image, or a column sum per head), from the
projections the attention module already has, in a forward pre-hook: the tower's own attention
keeps its fused kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from mmsdk.core.adapter import VisionBlock

__all__ = ["ClsAttentionScorer", "ReceivedAttentionScorer", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The standard RoPE helper: [-x2, x1] for the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _hidden_states(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor:
    if args:
        return args[0]
    return kwargs["hidden_states"] if "hidden_states" in kwargs else kwargs["hidden_state"]


class _HookedScorer:
    """Scores computed in a forward pre-hook on one vision block's attention; subclasses say how."""

    block: VisionBlock

    @contextmanager
    def capture(self, call_kwargs: Mapping[str, Any]) -> Iterator[list[torch.Tensor]]:
        """Record one score tensor per tower run while the context is open."""
        out: list[torch.Tensor] = []

        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            out.append(self._score_run(args, kwargs, call_kwargs))

        handle = self.block.attention.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield out
        finally:
            handle.remove()

    def _score_run(self, args: tuple[Any, ...], kwargs: dict[str, Any], call_kwargs: Mapping[str, Any]) -> torch.Tensor:
        """One tower run's scores, flattened in the language model's token order."""
        raise NotImplementedError


class ClsAttentionScorer(_HookedScorer):
    """Scores tokens by one layer's attention in a CLS-led tower, per group of tokens.

    ``rule`` "cls": the CLS row (summed over heads), VisionZip's rule; "received": the attention a
    token receives from the group's patch tokens (mean over heads and queries), for towers whose
    CLS output was never trained to summarize (e.g. trained from scratch with the CLS dropped).
    A group is a run of ``group`` consecutive tokens starting with its CLS token (one image for
    CLIP, one tile for Mllama); only its first ``valid`` tokens are real (Mllama pads tiles). The
    CLS token's own score is +inf when the model keeps it as an image token, else it is dropped.
    ``finish`` maps the per-group scores [groups, tokens] to the language model's token order.
    """

    def __init__(
        self,
        block: VisionBlock,
        *,
        keep_cls: bool,
        rule: str = "cls",
        group: Callable[[torch.Tensor], tuple[int, int]] | None = None,
        finish: Callable[[torch.Tensor, Mapping[str, Any]], torch.Tensor] | None = None,
    ) -> None:
        self.block = block
        self.keep_cls = keep_cls
        self.rule = rule
        self.group = group
        self.finish = finish

    def _score_run(self, args: tuple[Any, ...], kwargs: dict[str, Any], call_kwargs: Mapping[str, Any]) -> torch.Tensor:
        scores = self._scores(_hidden_states(args, kwargs))
        return self.finish(scores, call_kwargs) if self.finish else scores.reshape(-1)

    @torch.no_grad()
    def _scores(self, hidden: torch.Tensor) -> torch.Tensor:
        block, proj = self.block, self.block.projections
        rows, length, _ = hidden.shape
        group, valid = self.group(hidden) if self.group else (length, length)
        groups = hidden.reshape(rows * (length // group), group, -1)[:, :valid]
        queries = groups[:, :1] if self.rule == "cls" else groups  # only the CLS row when that is the rule
        q = getattr(block.attention, proj.q)(queries)
        k = getattr(block.attention, proj.k)(groups)
        heads, dim = block.num_heads, block.head_dim
        q = q.view(q.shape[0], q.shape[1], heads, dim).transpose(1, 2)
        k = k.view(k.shape[0], valid, heads, dim).transpose(1, 2)
        probs = torch.softmax((q @ k.transpose(-1, -2)).float() * dim**-0.5, dim=-1)
        if self.rule == "cls":
            scores = probs.sum(dim=1)[:, 0]  # [groups, valid]
        else:
            scores = probs.mean(dim=1)[:, 1:].mean(dim=1)  # received from the patch tokens
        if self.keep_cls:
            scores[:, 0] = float("inf")
            return scores
        return scores[:, 1:]


class ReceivedAttentionScorer(_HookedScorer):
    """Scores tokens by the attention they receive from every token of their image (no CLS token).

    For Qwen-VL: hooks one vision block's attention (packed sequence, ``cu_seqlens`` per image,
    2-D rotary ``position_embeddings``), averages the attention probabilities over heads and
    queries, then sums each ``merge`` consecutive patches into the merged token the LLM sees.
    ``order`` maps the block's token order to the tower's output order (window attention).
    """

    def __init__(
        self, block: VisionBlock, *, merge: int, order: Callable[[Mapping[str, Any]], torch.Tensor | None]
    ) -> None:
        self.block = block
        self.merge = merge
        self.order = order

    def _score_run(self, args: tuple[Any, ...], kwargs: dict[str, Any], call_kwargs: Mapping[str, Any]) -> torch.Tensor:
        cu_seqlens = kwargs["cu_seqlens"] if "cu_seqlens" in kwargs else args[1]
        scores = self._scores(_hidden_states(args, kwargs), cu_seqlens, kwargs.get("position_embeddings"))
        merged = scores.view(-1, self.merge).sum(dim=-1)
        order = self.order(call_kwargs)
        return merged if order is None else merged[torch.argsort(order.to(merged.device))]

    @torch.no_grad()
    def _scores(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, rope: Any) -> torch.Tensor:
        block = self.block
        seq = hidden.shape[0]
        qkv = getattr(block.attention, block.projections.qkv)(hidden)
        q, k = qkv.reshape(seq, 3, block.num_heads, -1).unbind(1)[:2]
        if rope is not None:
            cos, sin = (t.unsqueeze(-2).float() for t in rope)
            q = q.float() * cos + rotate_half(q.float()) * sin
            k = k.float() * cos + rotate_half(k.float()) * sin
        scores = torch.empty(seq, device=hidden.device, dtype=torch.float32)
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            qs, ks = q[start:end].transpose(0, 1), k[start:end].transpose(0, 1)  # [heads, n, dim]
            total = torch.zeros(end - start, device=hidden.device, dtype=torch.float32)
            for head in range(qs.shape[0]):  # one head at a time keeps the n x n matrix small
                probs = torch.softmax((qs[head] @ ks[head].T).float() * qs.shape[-1] ** -0.5, dim=-1)
                total += probs.mean(dim=0)
            scores[start:end] = total / qs.shape[0]
        return scores
