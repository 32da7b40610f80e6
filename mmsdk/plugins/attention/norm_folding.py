"""A decoder layer's decode step with its RMSNorms inside its INT4 GEMVs (``rmsnorm-rope-fusion``, ``norm_in_gemv``).

On an H200 (docs/benchmarks.md) the input norm inside the q/k/v GEMV made the Llama-7B g32 step 1.895-1.897 ms against
1.978 unfolded (benchmarks/results/h200_decode_reuse_norm_in_qkv.json); o_proj's store leaving the post-attention
norm's statistics for the gated GEMV (``fold_mlp``, ``mlp_norm_in_gemv``) took another 27 µs (Llama-7B g32, 1.896 ->
1.869 ms) and 31 µs (Qwen2-VL-7B g128, 2.225 -> 2.195 ms) with the same GEMV configurations
(h200_decode_reuse_left_norm.json): rmsnorm-rope-fusion does both by default. (Folding the post-attention norm into
the gated GEMV's K loop instead cost that loop about 2.5 µs more than the launch it saved.)

A pre-norm layer runs ``norm -> attention -> add + norm -> MLP -> add``; in a batch-1 decode step each norm is a
launch of its own between two GEMVs (on an H200 about 2.9 µs each, 186 µs of a 1.97 ms Llama-7B step). Where the
layer's projections are :class:`~mmsdk.plugins.quantizers.int4_linear.Int4Linear`, a step (one position per row)
runs instead:

* the input norm inside the q/k/v GEMV: each projection is handed the norm for its next call on the layer's input
  (:meth:`Int4Linear.normalize_next`) and the attention gets the un-normalized input;
* with ``fold_mlp``: the attention's residual add in the o_proj GEMV's last store (:meth:`Int4Linear.add_next`),
  which also leaves the post-attention norm's statistics (``weight * sum`` and partial sums of squares,
  mmsdk.kernels.norm_fold.NormStatistics); the MLP's paired gate/up GEMV reads them and scales its sums by the
  row's ``1 / rms``, and the down projection's store adds the residual (the gated MLP's ``normed_residual_body``,
  mmsdk/plugins/quantizers/int4_mlp.py). Where o_proj's kernel left no statistics (and for fp16 models, whose
  ``weight * sum`` could overflow), the sum takes a norm launch.
  Without ``fold_mlp`` the attention's output and the residual take one add + RMSNorm launch, as in the unfolded
  layer.

With ``rmsnorm-rope-fusion``'s ``qkv_norm_statistics`` the folded layers are chained
(:func:`chain_input_norm_statistics`): a layer's down projection, adding the MLP's residual in its store, also leaves
the statistics of the next layer's input norm, handed to that layer's step (:class:`InputNormHandOff`) for exactly the
tensor they were left for. A q/k/v GEMV of an integer-dot kind ("idot" / "idotr", mmsdk.kernels.gemv_idot) then scales
its sums by the row's ``1 / rms`` from them instead of reading the whole row for it (kind "idotr" read it in each of
its programs); the other kinds fold the norm as before. The first layer, and a layer whose input came some other way,
fold the norm as before too. Where a layer's q/k/v GEMVs did not read the statistics (their tuned kind folds the norm),
the layer before stops leaving them (``leave_for_next``): its store does no work for nothing in the steps after, until
the next prompt, whose decode steps learn it again.

What cannot take its part runs as before (a torch add, a norm kernel). Nothing else may read the normalized input:
the fold is skipped while hooks or wrappers observe the attention or the MLP, and a step whose attention did not
pass its input to every q/k/v projection raises (the projections would have multiplied an un-normalized input).
On CPU the projections normalize with the reference op first: bitwise the unfolded layer (tests check this); on
CUDA the kernels differ from it by about one rounding of the activations (mmsdk.kernels.norm_fold).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmsdk.core.adapter import ModelAdapter
from mmsdk.kernels.norm_fold import NormStatistics
from mmsdk.plugins._forward import normed_residual_body, observed, plus_residual
from mmsdk.plugins.attention.fused_norm_rope import FusedAddRMSNorm
from mmsdk.plugins.attention.qkv_fuse import FusedSlice
from mmsdk.plugins.quantizers.int4_linear import Int4Linear

__all__ = ["InputNormHandOff", "NormFolding", "chain_input_norm_statistics", "folds_now"]


def _linear(module: Any) -> Any:
    """The layer a projection stands for: qkv-fuse's slices stand for the fused projection."""
    return module.fused if isinstance(module, FusedSlice) else module


class InputNormHandOff:
    """The statistics one layer's last store left for the next layer's input norm, held for exactly the tensor they
    were left for, until the next layer's step takes them (one per chained model:
    :func:`chain_input_norm_statistics`)."""

    def __init__(self) -> None:
        self._left_for: torch.Tensor | None = None
        self._statistics: NormStatistics | None = None

    def put(self, x: torch.Tensor, statistics: NormStatistics | None) -> None:
        """Hold ``statistics`` (None: nothing was left) for the step whose input is ``x``."""
        self._left_for, self._statistics = (None, None) if statistics is None else (x, statistics)

    def take(self, x: torch.Tensor) -> NormStatistics | None:
        """The statistics held for ``x`` (None for any other tensor); held ones are dropped either way."""
        if self._left_for is None:
            return None
        found = self._statistics if self._left_for is x else None
        self._left_for = self._statistics = None
        return found


class NormFolding:
    """One pre-norm decoder layer's decode step with its input norm folded into its INT4 q/k/v GEMVs and, with
    ``fold_mlp``, its attention's residual add into o_proj, whose store leaves the post-attention norm's statistics
    for the gated MLP (module docstring)."""

    def __init__(self, layer: nn.Module, adapter: ModelAdapter, input_norm: str, post_norm: FusedAddRMSNorm, *,
                 fold_mlp: bool = True) -> None:
        self.layer = layer
        self.adapter = adapter
        self.input_norm = input_norm
        self.post_norm = post_norm
        # False: only the input norm moves into the q/k/v GEMV; the attention's residual add and the post-attention
        # norm stay one add + RMSNorm launch, as in the unfolded layer (rmsnorm-rope-fusion's mlp_norm_in_gemv)
        self.fold_mlp = fold_mlp
        # set by chain_input_norm_statistics: the layers before and after, and where the statistics go between them
        self.previous: NormFolding | None = None
        self.next: NormFolding | None = None
        self.hand_off: InputNormHandOff | None = None
        # False once the next layer's q/k/v GEMVs were handed this layer's statistics and applied the norm instead
        # (True again at each prompt)
        self.leave_for_next = True

    def readers(self, attention: nn.Module) -> tuple[list[Int4Linear], Int4Linear | None] | None:
        """(the distinct INT4 layers behind q, k and v; o_proj if it is INT4), or None when the input norm cannot be
        folded: a projection is not INT4, or something observes the attention's calls."""
        names = self.adapter.attention_projections(attention)
        layers = [_linear(getattr(attention, name, None)) for name in (names.q, names.k, names.v)]
        unique = list({id(m): m for m in layers}.values())
        if observed(attention) or not all(isinstance(m, Int4Linear) and not observed(m) for m in unique):
            return None
        o_proj = getattr(attention, names.o, None)
        return unique, (o_proj if isinstance(o_proj, Int4Linear) and not observed(o_proj) else None)

    def step(self, hidden_states: torch.Tensor, attention: nn.Module, mlp: nn.Module,
             attention_kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The layer's output for one decode step with its norms folded, or None where this call cannot fold (not a
        decode step, or the input norm's readers cannot take it): the caller then runs the unfolded layer."""
        if hidden_states.dim() == 3 and hidden_states.shape[1] > 1:
            # a prompt: the decode steps after it learn again whether the next layer reads the statistics, so an
            # answer learned under other GEMV configs (a tuning table changed between calls) does not stay
            self.leave_for_next = True
            return None
        norm = getattr(self.layer, self.input_norm)
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1 or not isinstance(norm, FusedAddRMSNorm):
            return None
        readers = self.readers(attention)
        if readers is None:
            return None
        qkv, o_proj = readers
        handed = self.hand_off.take(hidden_states) if self.hand_off is not None else None
        if not self.fold_mlp:
            out, _ = self._attend(hidden_states, norm, qkv, None, attention, attention_kwargs, handed)
            h, residual = self.post_norm(out, hidden_states)
            return plus_residual(mlp, h, residual)
        out, added = self._attend(hidden_states, norm, qkv, o_proj, attention, attention_kwargs, handed)
        if handed is not None and self.previous is not None:
            self.previous.leave_for_next = handed.read
        total = out if added else hidden_states + out
        statistics = o_proj.left_statistics() if added and o_proj is not None else None
        fold_mlp = normed_residual_body(mlp)
        if fold_mlp is None or statistics is None:
            return plus_residual(mlp, self.post_norm(total), total)
        next_norm, down = self._next_input_norm(mlp, hidden_states.dtype)
        out = fold_mlp(total, self.post_norm, total, statistics, next_norm)
        if down is not None and self.hand_off is not None:
            self.hand_off.put(out, down.left_statistics())
        return out

    def _next_input_norm(self, mlp: nn.Module, dtype: torch.dtype) -> tuple[nn.Module | None, Int4Linear | None]:
        """(the next layer's input norm, this layer's down projection) when the down projection's store is to leave
        that norm's statistics (chained, bf16 as for o_proj's, an INT4 down projection nothing observes), else
        (None, None)."""
        if self.next is None or not self.leave_for_next or dtype != torch.bfloat16:
            return None, None
        next_norm = getattr(self.next.layer, self.next.input_norm, None)
        down = getattr(mlp, self.adapter.mlp_projections(mlp).down or "", None)
        if not isinstance(next_norm, FusedAddRMSNorm) or not isinstance(down, Int4Linear) or observed(down):
            return None, None
        return next_norm, down

    def _attend(self, hidden_states: torch.Tensor, norm: FusedAddRMSNorm, qkv: list[Int4Linear],
                o_proj: Int4Linear | None, attention: nn.Module, attention_kwargs: dict[str, Any],
                statistics: NormStatistics | None = None) -> tuple[torch.Tensor, bool]:
        """(``attention(norm(hidden_states))`` with the norm in the q/k/v GEMVs, True when o_proj's GEMV has added
        ``hidden_states`` to it as well): ``o_proj`` (an INT4 layer or None) is asked to add it; ``statistics``, what
        the previous layer's store left for ``norm``, go to the q/k/v projections with it."""
        for layer in qkv:
            layer.normalize_next(hidden_states, norm, statistics)
        if o_proj is not None:
            # the statistics hold weight * sum in the model dtype: fp16 could overflow where the normalized sum would
            # not (outlier channels of the residual stream), bf16 has fp32's range
            leave = self.post_norm if hidden_states.dtype == torch.bfloat16 else None
            o_proj.add_next(hidden_states, leave)
        try:
            out = attention(hidden_states=hidden_states, **attention_kwargs)[0]
        finally:
            norms_left = [layer.clear_next()[0] for layer in qkv]
            residual_left = o_proj is None or o_proj.clear_next()[1]
        if any(norms_left):
            raise RuntimeError(f"{type(attention).__name__} did not pass its input to each of its q/k/v projections "
                               "unchanged, so they could not normalize it themselves: apply rmsnorm-rope-fusion with "
                               "norm_in_gemv=False for this model.")
        return out, not residual_left


def chain_input_norm_statistics(foldings: list[NormFolding | None]) -> None:
    """Chain the foldings of consecutive decoder layers (``foldings``: one per layer in the model's order, None for a
    layer that folds nothing): each layer's down-projection store leaves the next layer's input-norm statistics,
    handed over through one :class:`InputNormHandOff` (module docstring)."""
    hand_off = InputNormHandOff()
    for before, folding, after in zip([None, *foldings[:-1]], foldings, [*foldings[1:], None]):
        if folding is not None:
            folding.previous, folding.next, folding.hand_off = before, after, hand_off


def folds_now(layer: nn.Module, adapter: ModelAdapter) -> bool:
    """True when a pre-norm layer's decode steps can fold its input norm now: its self-attention's q/k/v projections
    are INT4 and nothing observes the attention (what ``rmsnorm-rope-fusion`` records as ``norm_in_gemv``)."""
    attention = adapter.self_attention(layer)
    norms = adapter.decoder_norm_names(layer)
    post = None if norms is None else getattr(layer, norms[1], None)
    if attention is None or not isinstance(post, FusedAddRMSNorm):
        return False
    return NormFolding(layer, adapter, norms[0], post).readers(attention) is not None
