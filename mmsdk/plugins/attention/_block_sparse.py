"""Block-sparse text-to-image attention masks: which image-key blocks each text-query block keeps.

The sequence is cut into a fixed grid of ``block`` tokens (for queries and keys alike, as
FlexAttention and ONNX Runtime's SparseAttention index blocks). For every query block holding
text rows, image-key blocks are ranked by pooled similarity (mean query of the block's text rows
against mean key of the block's image columns, per head, averaged over heads) and the top
``ceil(density * visible)`` survive; visible means not entirely in the query block's future.
Only text-row x image-column entries are ever dropped: image rows and text columns keep the
model's own mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockLayout", "block_layout", "drop_mask", "combine_mask", "layout_csr", "kept_pairs"]


@dataclass(frozen=True)
class BlockLayout:
    """Kept image-key blocks per text-query block: ``keep`` [B, query blocks, key blocks] (bool)."""

    keep: torch.Tensor
    block: int
    q_offset: int
    candidates: int  # (query block, image-key block) pairs that could be kept
    kept: int

    @property
    def density(self) -> float:
        """Kept share of the candidate text-to-image block pairs."""
        return self.kept / self.candidates if self.candidates else 1.0


def _block_means(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """Weighted mean of x [B, H, L, d] over each block of the L axis -> [B, H, count, d], weights [B, count]."""
    w = weight.to(x.dtype)
    sums = x.new_zeros(x.shape[0], x.shape[1], count, x.shape[-1])
    sums.index_add_(2, ids, x * w[:, None, :, None])
    totals = w.new_zeros(w.shape[0], count).index_add_(1, ids, w)
    return sums / totals.clamp(min=1)[:, None, :, None], totals


@torch.no_grad()
def block_layout(q: torch.Tensor, k: torch.Tensor, text_rows: torch.Tensor, image_cols: torch.Tensor, *,
                 block: int, density: float, causal: bool) -> BlockLayout:
    """Choose the kept image-key blocks for q [B, H, Lq, d] and k [B, Hkv, Lk, d]."""
    batch, heads, q_len, _ = q.shape
    k_len = k.shape[2]
    q_offset = k_len - q_len if causal else 0
    q_ids = (torch.arange(q_len, device=q.device) + q_offset) // block
    k_ids = torch.arange(k_len, device=q.device) // block
    nq, nk = int(q_ids[-1]) + 1, int(k_ids[-1]) + 1
    q_mean, q_rows = _block_means(q.float(), text_rows, q_ids, nq)
    k_mean, k_cols = _block_means(k.float(), image_cols, k_ids, nk)
    k_mean = k_mean.repeat_interleave(heads // k.shape[1], dim=1)
    scores = (q_mean @ k_mean.transpose(-1, -2)).mean(dim=1)  # [B, nq, nk]
    valid = (q_rows[:, :, None] > 0) & (k_cols[:, None, :] > 0)
    if causal:
        last_row = torch.clamp((torch.arange(nq, device=q.device) + 1) * block - 1, max=q_offset + q_len - 1)
        valid &= (torch.arange(nk, device=q.device) * block)[None, None, :] <= last_row[None, :, None]
    counts = valid.sum(dim=-1)
    want = torch.ceil(counts.float() * density).long().clamp(min=1)
    want = torch.where(counts > 0, want, torch.zeros_like(want))
    ranked = scores.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True)
    rank = torch.empty_like(ranked)
    rank.scatter_(-1, ranked, torch.arange(nk, device=q.device).expand_as(ranked))
    keep = valid & (rank < want[..., None])
    return BlockLayout(keep, block, q_offset, int(valid.sum()), int(keep.sum()))


def drop_mask(layout: BlockLayout, text_rows: torch.Tensor, image_cols: torch.Tensor) -> torch.Tensor:
    """[B, 1, Lq, Lk] True where a text row must not see an image column."""
    q_len, k_len = text_rows.shape[1], image_cols.shape[1]
    q_ids = (torch.arange(q_len, device=text_rows.device) + layout.q_offset) // layout.block
    k_ids = torch.arange(k_len, device=text_rows.device) // layout.block
    kept = layout.keep[:, q_ids][:, :, k_ids]  # [B, Lq, Lk]
    return (text_rows[:, :, None] & image_cols[:, None, :] & ~kept)[:, None]


def combine_mask(mask: torch.Tensor | None, dropped: torch.Tensor, *, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """The model's mask with ``dropped`` entries removed, in the mask's own convention (bool or additive)."""
    if mask is None:
        q_len, k_len = dropped.shape[-2:]
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=dropped.device)
        if causal:
            allowed = torch.ones_like(allowed).tril(diagonal=k_len - q_len)
        return allowed[None, None] & ~dropped
    if mask.dtype == torch.bool:
        return mask & ~dropped
    return mask.masked_fill(dropped, torch.finfo(mask.dtype).min)


def layout_csr(keep: torch.Tensor) -> dict[str, list[int]]:
    """ONNX Runtime SparseAttention's CSR form of one [query blocks, key blocks] layout."""
    rows, cols = [0], []
    for row in keep.tolist():
        cols.extend(j for j, kept in enumerate(row) if kept)
        rows.append(len(cols))
    return {"block_row_indices": rows, "block_col_indices": cols}


def kept_pairs(before: torch.Tensor, after: torch.Tensor, text_rows: torch.Tensor,
               image_cols: torch.Tensor) -> tuple[int, int]:
    """(text-to-image score entries the model's mask allows, entries still allowed after the block mask)."""
    cross = (text_rows[:, :, None] & image_cols[:, None, :])[:, None]
    return int((cross & _allowed(before)).sum()), int((cross & _allowed(after)).sum())


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
