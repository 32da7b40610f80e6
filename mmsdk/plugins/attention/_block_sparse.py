"""Block-sparse text-to-image attention masks: which image-key blocks each text-query block keeps.

Each row is cut into a grid of ``block`` tokens (for queries and keys alike) that starts at the
row's first real token, so left padding shifts nothing: a prompt gets the same blocks, and the
same layout, alone or inside a padded batch. (Cross-attention keys are image states, never
padded: their grid starts at the first state; the query grid starts at the call's first real
query.) For every query block holding text rows, image-key blocks are ranked by pooled
similarity (mean query of the block's text rows against mean key of the block's image columns,
per head, averaged over heads) and the top ``ceil(density * visible)`` survive; visible means not
entirely in the query block's future. Only text-row x image-column entries are ever dropped:
image rows, text columns and padding keep the model's own mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockLayout", "allowed_entries", "block_layout", "combine_mask", "drop_mask", "kept_pairs", "layout_csr",
           "sparse_mask"]


@dataclass(frozen=True)
class BlockLayout:
    """Kept image-key blocks per text-query block: ``keep`` [B, query blocks, key blocks] (bool).

    Block ``i`` of row ``b`` covers the row's tokens ``i * block`` .. ``(i + 1) * block - 1``
    counted from its first real token; ``q_ids`` [B, Lq] / ``k_ids`` [B, Lk] give every query /
    key its block (-1 before the row's first real token: padding, in no block).
    """

    keep: torch.Tensor
    block: int
    q_ids: torch.Tensor
    k_ids: torch.Tensor
    valid: torch.Tensor  # [B, query blocks, key blocks]: the (query block, image-key block) pairs that could be kept

    # The counts are read on demand: each read waits for the GPU, so the attention call itself never does.
    @property
    def candidates(self) -> int:
        """(query block, image-key block) pairs that could be kept."""
        return int(self.valid.sum())

    @property
    def kept(self) -> int:
        """Pairs kept."""
        return int(self.keep.sum())

    @property
    def density(self) -> float:
        """Kept share of the candidate text-to-image block pairs."""
        return self.kept / self.candidates if self.candidates else 1.0


def _block_means(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, count: int,
                 block: int) -> tuple[torch.Tensor, ...]:
    """Weighted mean of x [B, H, L, d] over each row's blocks -> [B, H, count, d], [B, count] (summed weights).

    ``positions`` [B, L] counts each entry from its row's first real token (consecutive, negative for padding), so
    block i of a row is its entries at positions i * block .. (i + 1) * block - 1: each row is gathered into that grid
    and summed over whole blocks (gathers and sums only, no scatter, so torch.compile builds it on CPU and GPU)."""
    batch, heads, length, dim = x.shape
    grid = torch.arange(count * block, device=x.device)[None, :] - positions[:, :1]  # [B, count * block]: source
    inside = (grid >= 0) & (grid < length)
    grid = grid.clamp(0, length - 1)
    w = weight.to(x.dtype).gather(1, grid) * inside
    gathered = x.gather(2, grid[:, None, :, None].expand(-1, heads, -1, dim))
    sums = (gathered * w[:, None, :, None]).reshape(batch, heads, count, block, dim).sum(dim=3)
    totals = w.reshape(batch, count, block).sum(dim=2)
    return sums / totals.clamp(min=1)[:, None, :, None], totals


def _positions(length: int, offset: int, starts: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    """[B, length]: each entry's position counted from its row's first real token (negative for padding)."""
    positions = torch.arange(length, device=device) + offset
    shift = starts.to(device)[:, None] if starts is not None else torch.zeros(batch, 1, dtype=torch.long, device=device)
    return positions[None, :] - shift


@torch.no_grad()
def block_layout(q: torch.Tensor, k: torch.Tensor, text_rows: torch.Tensor, image_cols: torch.Tensor, *,
                 block: int, density: float, causal: bool, starts: torch.Tensor | None = None) -> BlockLayout:
    """Choose the kept image-key blocks for q [B, H, Lq, d] and k [B, Hkv, Lk, d].

    ``starts`` [B]: index of each row's first real token, on the key axis for self-attention
    (``causal``: the queries are the last Lq keys) and on the query axis for cross-attention
    (whose keys are never padded); None means no row is padded.
    """
    batch, heads, q_len, _ = q.shape
    k_len = k.shape[2]
    q_offset = k_len - q_len if causal else 0
    q_pos = _positions(q_len, q_offset, starts, batch, q.device)
    k_pos = _positions(k_len, 0, starts if causal else None, batch, q.device)
    q_ids, k_ids = torch.div(q_pos, block, rounding_mode="floor"), torch.div(k_pos, block, rounding_mode="floor")
    nq, nk = (q_offset + q_len - 1) // block + 1, (k_len - 1) // block + 1
    q_mean, q_rows = _block_means(q.float(), text_rows, q_pos, nq, block)
    k_mean, k_cols = _block_means(k.float(), image_cols, k_pos, nk, block)
    k_mean = k_mean.repeat_interleave(heads // k.shape[1], dim=1)
    scores = (q_mean @ k_mean.transpose(-1, -2)).mean(dim=1)  # [B, nq, nk]
    valid = (q_rows[:, :, None] > 0) & (k_cols[:, None, :] > 0)
    if causal:  # a key block is visible if it starts at or before the query block's last row
        ends = ((torch.arange(nq, device=q.device) + 1) * block - 1)[None, :]
        last_row = torch.minimum(ends, q_pos[:, -1:])  # [B, nq]
        valid &= (torch.arange(nk, device=q.device) * block)[None, None, :] <= last_row[:, :, None]
    counts = valid.sum(dim=-1)
    want = torch.ceil(counts.float() * density).long().clamp(min=1)
    want = torch.where(counts > 0, want, torch.zeros_like(want))
    ranked = scores.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True)
    rank = ranked.argsort(dim=-1)  # each key block's place in the ranking (the inverse permutation)
    keep = valid & (rank < want[..., None])
    return BlockLayout(keep, block, q_ids, k_ids, valid)


def drop_mask(layout: BlockLayout, text_rows: torch.Tensor, image_cols: torch.Tensor) -> torch.Tensor:
    """[B, 1, Lq, Lk] True where a text row must not see an image column."""
    q_ids, k_ids = layout.q_ids, layout.k_ids
    nk = layout.keep.shape[2]
    per_row = layout.keep.gather(1, q_ids.clamp(min=0)[:, :, None].expand(-1, -1, nk))  # [B, Lq, nk]
    kept = per_row.gather(2, k_ids.clamp(min=0)[:, None, :].expand(-1, q_ids.shape[1], -1))  # [B, Lq, Lk]
    rows, cols = text_rows & (q_ids >= 0), image_cols & (k_ids >= 0)
    return (rows[:, :, None] & cols[:, None, :] & ~kept)[:, None]


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


def sparse_mask(q: torch.Tensor, k: torch.Tensor, text_rows: torch.Tensor, image_cols: torch.Tensor,
                starts: torch.Tensor | None, given: torch.Tensor | None, *, block: int, density: float,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One attention call's rule whole: (the layout's ``keep`` [B, query blocks, key blocks], the model's mask
    ``given`` (or the causal / full one) with the dropped text-to-image entries removed, in its own convention, and
    the text-to-image entries it still allows, 0-dim). Tensor operations only, so torch.compile can fuse them."""
    layout = block_layout(q, k, text_rows, image_cols, block=block, density=density, causal=causal, starts=starts)
    allowed = combine_mask(given, drop_mask(layout, text_rows, image_cols), causal=causal, dtype=q.dtype)
    return layout.keep, allowed, kept_pairs(allowed, text_rows, image_cols)


def layout_csr(keep: torch.Tensor) -> dict[str, list[int]]:
    """ONNX Runtime SparseAttention's CSR form of one [query blocks, key blocks] layout."""
    rows, cols = [0], []
    for row in keep.tolist():
        cols.extend(j for j, kept in enumerate(row) if kept)
        rows.append(len(cols))
    return {"block_row_indices": rows, "block_col_indices": cols}


def kept_pairs(mask: torch.Tensor, text_rows: torch.Tensor, image_cols: torch.Tensor) -> torch.Tensor:
    """Text-to-image score entries ``mask`` (bool or additive, [B, 1, Lq, Lk]) allows: a 0-dim int64 tensor on the
    mask's device (read it with int(): that waits for the device)."""
    cross = (text_rows[:, :, None] & image_cols[:, None, :])[:, None]
    return (cross & allowed_entries(mask)).sum()


def allowed_entries(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as a boolean (True = attend), whichever convention it has (bool or additive)."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
