"""FlexAttention over sparse-xattn's dense boolean mask: the block mask built with tensor ops, the kernel compiled.

Measured on an H100 (benchmarks/gpu_sparse_xattn.py, LLaVA-1.5-7B's 4096-token prefill and Mllama's 512 text queries
over 6404 image tokens): ``flex_attention`` called eagerly runs torch's unfused reference, 11-28 ms a call against
0.18-0.83 ms for masked SDPA; ``create_block_mask`` over a mask_mod that reads a dense mask took 3.7-4.0 ms a call,
since it evaluates the mask_mod over the whole grid. Compiled, with the block mask built here from the dense mask
(allowed entries counted per tile), FlexAttention skips the 128 x 128 blocks no entry of which is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FLEX_BLOCK", "FlexRunner", "block_mask_from_dense", "block_mask_from_tiles", "build_compile_options",
           "compiled_flex_attention", "flex_attention_over", "tile_lists"]

FLEX_BLOCK = 128  # FlexAttention's default tile (query and key): a block of the mask is skipped only if all of it is


def block_mask_from_dense(allowed: torch.Tensor, block: int = FLEX_BLOCK, for_backward: bool = False) -> Any:
    """FlexAttention's BlockMask of ``allowed`` [B or 1, 1, Lq, Lk] (bool, True = attend), one mask for every head
    (and, with a batch of 1, for every row of the batch: FlexAttention broadcasts it).

    Tiles of ``block`` x ``block`` entries with no allowed entry are skipped, tiles allowed everywhere run without
    reading the mask ("full" blocks), the others apply it through the mask_mod, which reads the mask padded to whole
    tiles (so no index of a partial last tile falls outside it; prompts of whole tiles are read as they are).
    The query-major tile lists only a backward pass reads are built only ``for_backward`` (they cost two more sorts
    and scatters, on every layer's call)."""
    return block_mask_from_tiles(tile_lists(allowed, block), tuple(allowed.shape[2:]), block, for_backward)


def tile_lists(allowed: torch.Tensor, block: int = FLEX_BLOCK) -> tuple[torch.Tensor, ...]:
    """(``allowed`` padded to whole tiles, then count per query tile and key-tile indices of the partial tiles, then
    of the full ones): tensor operations only, which torch.compile can fuse with the mask's own build."""
    rows, _, q_len, k_len = allowed.shape
    pad_q, pad_k = -q_len % block, -k_len % block
    padded = allowed
    if pad_q or pad_k:  # constant padding takes no bool tensor
        padded = torch.nn.functional.pad(allowed.to(torch.uint8), (0, pad_k, 0, pad_q)).bool()
    n_q, n_k = padded.shape[2] // block, padded.shape[3] // block
    kept = padded.reshape(rows, 1, n_q, block, n_k, block).sum(dim=(3, 5), dtype=torch.int32)  # [rows, 1, n_q, n_k]
    full = kept == block * block
    partial = (kept > 0) & ~full
    return (padded, *_ordered(partial), *_ordered(full))


def block_mask_from_tiles(tiles: tuple[torch.Tensor, ...], seq_lengths: tuple[int, int], block: int = FLEX_BLOCK,
                          for_backward: bool = False) -> Any:
    """The BlockMask of :func:`tile_lists`' output, for a mask of ``seq_lengths`` (query, key) entries."""
    from torch.nn.attention.flex_attention import BlockMask

    padded, *lists = tiles
    rows = padded.shape[0]

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return padded[b if rows > 1 else 0, 0, q_idx, kv_idx]

    return BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=seq_lengths,
                                    compute_q_blocks=for_backward)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count per query tile [B, H, n_q], key-tile indices with the set ones first [B, H, n_q, n_k]), int32: the form
    BlockMask.from_kv_blocks takes (a stable sort keeps the set tiles in key order)."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts, order.to(torch.int32)


def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """``flex_attention`` under torch.compile, with torch's automatic dynamic shapes: the first shape compiles static
    (the quickest build), a size that changes is then made dynamic, so prompts of new lengths do not each compile
    anew (on the CPU machine six prompt shapes in a row compiled three times, then none; ``dynamic=True`` also
    compiled three times, since sizes of 1 are specialised, and its first build took four times as long). Every
    wrapper shares torch's compile cache: a second layer's kernel does not compile again."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def build_compile_options() -> dict[str, Any]:
    """Inductor settings for the functions :meth:`FlexRunner.run` compiles. Inductor's coalescing analysis does not
    support dynamic shapes yet (its own config says so) but runs on them anyway, and on CUDA (torch 2.11) it fails
    with an AssertionError in ``get_pw_red_splits`` once a second prompt length makes the mask build dynamic; the
    analysis only picks a tiling, so turning it off changes speed at most, never the result."""
    from torch._inductor import config

    return {"triton.coalesce_tiling_analysis": False} if hasattr(config.triton, "coalesce_tiling_analysis") else {}


def flex_attention_over(kernel: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        allowed: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """``kernel`` (FlexAttention, compiled or not) of q [B, H, Lq, d] over k / v [B, Hkv, Lk, d] where ``allowed``
    [B or 1, 1, Lq, Lk] (bool) is True; returns [B, Lq, H, d], as transformers' attention functions do."""
    return _attend(kernel, q, k, v, tile_lists(allowed), scaling)


def _attend(kernel: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            tiles: tuple[torch.Tensor, ...], scaling: float | None) -> torch.Tensor:
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    block_mask = block_mask_from_tiles(tiles, (q.shape[2], k.shape[2]), for_backward=backward)
    out = kernel(q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2).contiguous()


class FlexRunner:
    """What one model's sparse-xattn layers share on the FlexAttention path: the compiled functions (FlexAttention,
    compiled on the first call, and the pass's mask build, see :meth:`run`), which of them run eagerly because they
    could not compile, and why FlexAttention itself could not run (``failure``; None while it can), so a failure is
    found and stated once per model."""

    def __init__(self) -> None:
        self.functions: dict[str, Callable[..., Any]] = {}  # compiled, by name
        self.eager: dict[str, str] = {}  # name -> why it could not compile (then it runs eagerly)
        self.failure: str | None = None

    @property
    def kernel(self) -> Callable[..., torch.Tensor]:
        """The compiled FlexAttention."""
        found = self.functions.get("flex_attention")
        if found is None:
            found = self.functions["flex_attention"] = compiled_flex_attention()
        return found

    def run(self, name: str, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` under torch.compile (compiled once per runner, automatic dynamic shapes,
        :func:`build_compile_options`); if it cannot compile or run so, eagerly from then on, stated once in a log
        line. Only for functions whose eager form is fast enough: never FlexAttention itself (eager, it is torch's
        unfused reference)."""
        if name in self.eager:
            return function(*args)
        compiled = self.functions.get(name)
        if compiled is None:
            # the compile runs inside the first call, which can then take tens of seconds (36 s for the mask build
            # on an H100 host): say so, so a first prefill that stalls is explained
            logging.getLogger("mmsdk.plugins").info(
                "%s: compiling with torch.compile on its first call (tens of seconds; once more when a size first "
                "changes)", name)
            compiled = self.functions[name] = torch.compile(function, options=build_compile_options())
        try:
            return compiled(*args)
        except Exception as error:  # torch.compile raises its backend's errors at the first call
            self.eager[name] = f"{type(error).__name__}: {error}"
            logging.getLogger("mmsdk.plugins").warning("%s could not compile (%s); it runs eagerly", name,
                                                       self.eager[name])
            return function(*args)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: tuple[torch.Tensor, ...],
               scaling: float | None) -> torch.Tensor:
        """The compiled FlexAttention of q [B, H, Lq, d] over k / v over the mask of ``tiles`` (:func:`tile_lists`);
        returns [B, Lq, H, d], as transformers' attention functions do."""
        return _attend(self.kernel, q, k, v, tiles, scaling)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                 scaling: float | None) -> torch.Tensor:
        """:meth:`attend` over a dense mask ``allowed`` [B or 1, 1, Lq, Lk] (bool)."""
        return self.attend(q, k, v, tile_lists(allowed), scaling)

    def __getstate__(self) -> dict[str, Any]:
        # compiled functions do not pickle: compiled again where the copy runs; what failed stays failed
        return {"functions": {}, "eager": self.eager, "failure": self.failure}
