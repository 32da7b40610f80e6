"""What one export will write, decided (and refused) before any file exists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mmsdk.plugins.backends.onnxruntime.kvcache import KVQuant
from mmsdk.plugins.backends.onnxruntime.sparse import SparseRule

if TYPE_CHECKING:
    from mmsdk.core.backend import LowerTarget

__all__ = ["CrossPlan", "CrossRecipe", "ExportPlan"]


@dataclass(frozen=True)
class CrossRecipe:
    """How a family's gated cross-attention block computes, beyond what its adapter names.

    ``row_mask``: where tokens that see no image are zeroed (IDEFICS: the attention output; Mllama:
    the MLP output, while such rows attend to every vision token unmasked). ``mask_input``: the
processor output [B, S, images(, tiles)] saying which vision groups each token sees. ``q_norm`` / ``k_norm``:
    per-head RMSNorm attribute names on the attention module (None if absent).
    """

    row_mask: str  # "attention" | "mlp"
    mask_input: str  # the processor output saying which tokens see which image (tiles)
    q_norm: str | None = None
    k_norm: str | None = None


@dataclass(frozen=True)
class CrossPlan:
    """One cross-attention block as exported: which of its two gated branches still contribute."""

    decoder_index: int
    block_index: int
    attention_open: bool = True
    mlp_open: bool = True


@dataclass(frozen=True)
class ExportPlan:
    """Decisions shared by the graphs of one export."""

    target: LowerTarget
    max_positions: int
    accuracy_level: int = 0
    dtype: str = "float32"  # activations and float weights of the embedding and decoder graphs
    kv: KVQuant | None = None
    recipe: CrossRecipe | None = None
    cross: tuple[CrossPlan, ...] = ()
    # decoder index -> (k scales, v scales, bits): cross-attention K/V a KV pass quantized in torch; the
    # vision graph quantizes and dequantizes them the same way (MultiHeadAttention reads float K/V).
    cross_kv_quant: dict[int, tuple[np.ndarray, np.ndarray, int]] = field(default_factory=dict)
    # token-prune / token-merge: the vision graph also outputs the kept image-token slots, and the
    # decoder takes explicit position ids (kept tokens keep their original, now gapped, positions)
    token_reduction: bool = False
    # sparse-xattn: the block-sparse text-to-image rule computed in the graph (sparse.py)
    sparse: SparseRule | None = None

    @property
    def explicit_positions(self) -> bool:
        """The decoder rotates q/k itself from ``position_ids`` (GQA's built-in RoPE cannot serve).

        GQA's RoPE numbers positions over the whole row, left padding included. Attention scores only
        see position differences, so that is exact in float; but a quantized cache stores K after
        RoPE, and K rotated by another angle rounds differently: with int4/int8 K the rows of a
        padded batch would not match the torch model's (which rotates by the real positions).
        """
        return (self.token_reduction or self.kv is not None
                or (self.sparse is not None and self.sparse.kind == "self"))

    @property
    def sparse_key_state(self) -> bool:
        """sparse-xattn on self-attention over a quantized cache: the decoder carries the image keys' block sums."""
        return self.kv is not None and self.sparse is not None and self.sparse.kind == "self"

    notes: dict[str, object] = field(default_factory=dict)

    def cross_with_kv(self) -> tuple[CrossPlan, ...]:
        """Blocks whose attention branch runs, so the vision graph computes their K/V."""
        return tuple(c for c in self.cross if c.attention_open)
