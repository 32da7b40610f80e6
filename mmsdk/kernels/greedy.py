"""Greedy token choice on the device: the argmax over each row of logits, and a whole greedy step in one kernel.

torch's argmax of one LM-head row (32k bf16 logits) took 10.5 µs per decode step on an H200 (a decode profile of
LLaVA-1.5-7B shapes), about as long as the int4 qkv GEMV (12288 x 4096, 10.1 µs), and the rest of a greedy step (pad
for finished rows, the end-token check, writing the token twice) took about six more small launches. Here a row of
at most one tile (``block`` values) is one Triton program that does all of it; a longer row is first split into
tiles, one program each, whose maxima the step's program then reduces (two launches: one program reading Qwen2-VL's
152k logits in 16k tiles took 26 µs of an H200 decode step, waiting on one tile after the other).
"""

from __future__ import annotations

import torch

from mmsdk.kernels import triton_ready

__all__ = ["argmax_rows", "greedy_step", "record_choice"]

_BLOCK = 4096  # 32 values per thread with 4 warps: 8 tile programs for a 32k vocabulary, 38 for 152k


def _kernel_takes(logits: torch.Tensor) -> bool:
    return (triton_ready(logits) and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] > 0
            and logits.dtype in (torch.bfloat16, torch.float16, torch.float32))


def _tile(vocab: int, block: int) -> tuple[int, int]:
    """(tile width, warps) for a row of ``vocab`` values."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"block {block}: pass a power of two")
    block = min(block, 1 << max(0, (vocab - 1).bit_length()))
    return block, 16 if block >= 8192 else 4


def _chunk_maxima(logits: torch.Tensor, width: int, warps: int) -> dict[str, object]:
    """The tile programs' launch for rows longer than one tile (their maxima, for the reducing kernel's
    ``CHUNKED`` arguments), or the placeholders of a one-tile row."""
    rows, vocab = logits.shape
    chunks = -(-vocab // width)
    if chunks == 1:
        return dict(values_ptr=logits, indices_ptr=logits, chunks=1)
    from mmsdk.kernels import _greedy_triton

    values = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _greedy_triton.chunk_argmax[(chunks, rows)](logits, values, indices, vocab, logits.stride(0), chunks, BLOCK=width,
                                                num_warps=warps, enable_fp_fusion=True)
    return dict(values_ptr=values, indices_ptr=indices, chunks=chunks, CHUNKS=1 << (chunks - 1).bit_length(),
                CHUNKED=True)


def argmax_rows(logits: torch.Tensor, block: int = _BLOCK) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[B, V]`` logits: the same indices (first maximum, NaN counting as the maximum).

    ``block`` (a power of two) is the tile width: the default suits LM heads; tests pass small ones to cover rows of
    many tiles cheaply. Rows longer than one tile take two launches (module docstring).
    """
    if not _kernel_takes(logits):
        return logits.argmax(-1)
    from mmsdk.kernels import _greedy_triton

    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    width, warps = _tile(vocab, block)
    _greedy_triton.argmax_rows[(rows,)](logits, out, vocab, logits.stride(0), BLOCK=width, num_warps=warps,
                                        **_chunk_maxima(logits, width, warps), enable_fp_fusion=True)
    return out


def record_choice(new: torch.Tensor, finished: torch.Tensor, eos: torch.Tensor, pad: int, token: torch.Tensor,
                  tokens: torch.Tensor | None = None, column: torch.Tensor | None = None) -> None:
    """The rest of a decode step once each row's token ``new`` [B] is chosen, in place: ``token`` gets it, or
    ``pad`` where ``finished`` was set; ``finished`` is then set where it is in ``eos``; with ``tokens`` and a device
    ``column`` it is also stored at ``tokens[:, column]`` (torch ops; :func:`greedy_step` does this in its kernel)."""
    new = torch.where(finished, torch.full_like(new, pad), new)
    if eos.numel():  # not torch.isin: with many end tokens it sorts, and syncs with the host
        finished |= (new[:, None] == eos.reshape(1, -1)).any(-1)
    if tokens is not None:
        tokens.index_copy_(1, column, new[:, None])
    token.copy_(new)


def greedy_step(logits: torch.Tensor, finished: torch.Tensor, eos: torch.Tensor, pad: int, token: torch.Tensor,
                tokens: torch.Tensor | None = None, column: torch.Tensor | None = None, block: int = _BLOCK) -> None:
    """One greedy step for ``[B, V]`` logits, in place: ``token`` [B] int64 gets each row's argmax, or ``pad`` where
    ``finished`` [B] bool was set; ``finished`` is then set where the token is in ``eos`` (int64 end tokens); with
    ``tokens`` [B, T] and a device ``column`` [1] index, the token is also stored at ``tokens[:, column]``.

    What ``argmax``, ``where``, ``isin``, ``index_copy_`` and ``copy_`` compute, in one launch on CUDA (two for
    rows longer than ``block``).
    """
    if not (_kernel_takes(logits) and finished.is_contiguous() and token.is_contiguous()
            and (tokens is None or tokens.stride(-1) == 1)):
        record_choice(logits.argmax(-1), finished, eos, pad, token, tokens, column)
        return
    from mmsdk.kernels import _greedy_triton

    rows, vocab = logits.shape
    width, warps = _tile(vocab, block)
    ends = eos.reshape(-1).contiguous() if eos.numel() else token
    _greedy_triton.greedy_step[(rows,)](
        logits, finished, ends, token, tokens if tokens is not None else token,
        column if column is not None else token, vocab, logits.stride(0), eos.numel(), int(pad),
        tokens.stride(0) if tokens is not None else 0, **_chunk_maxima(logits, width, warps), BLOCK=width,
        BLOCK_EOS=max(1, 1 << max(0, (eos.numel() - 1).bit_length())), HAS_COLUMN=tokens is not None,
        num_warps=warps, enable_fp_fusion=True,
    )
