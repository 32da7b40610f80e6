"""Triton kernel behind mmsdk.kernels.greedy (imported only when it is launched)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def first_max(v1, i1, v2, i2):
    """The greater of (value, index) pairs as torch.argmax decides: NaN above everything, ties to the lower index."""
    n1 = v1 != v1
    n2 = v2 != v2
    take2 = (n2 & ~n1) | ((n1 == n2) & ((v2 > v1) | (((v2 == v1) | n1) & (i2 < i1))))
    return tl.where(take2, v2, v1), tl.where(take2, i2, i1)


@triton.jit
def row_argmax(x_ptr, row, V, stride, BLOCK: tl.constexpr):
    """Index of row ``row``'s first maximum over ``V`` values (int32 scalar).

    Each lane keeps the best (value, index) of its columns, tile after tile (a later tile's indices are higher, so
    ties keep the earlier one), and one reduction over the lanes ends it. Padding lanes read -inf with indices past
    ``V``, so they never win, not even against a row of -inf.
    """
    offs = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        v = tl.load(x_ptr + row * stride + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        best_v, best_i = first_max(best_v, best_i, v, idx)
    _, index = tl.reduce((best_v, best_i), 0, first_max)
    return index


@triton.jit
def chunk_argmax(x_ptr, values_ptr, indices_ptr, V, stride, chunks, BLOCK: tl.constexpr):
    """First maximum of chunk ``program_id(0)`` (``BLOCK`` columns) of row ``program_id(1)``: its value (fp32) and
    index (int32) stored at ``[row, chunk]`` of ``values`` / ``indices``, for :func:`chunks_argmax` to finish.

    Many programs per row, each one load: one program reading a 152k vocabulary in 16k tiles spent 26 µs of an
    H200 decode step waiting on one tile after another (benchmarks/results/h200_decode_profile_qwen.json)."""
    chunk, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    best_v, best_i = tl.reduce((v, idx), 0, first_max)
    tl.store(values_ptr + row * chunks + chunk, best_v)
    tl.store(indices_ptr + row * chunks + chunk, best_i)


@triton.jit
def chunks_argmax(values_ptr, indices_ptr, row, chunks, CHUNKS: tl.constexpr):
    """Row ``row``'s first maximum from its chunks' (:func:`chunk_argmax`; int32 scalar). Padding lanes read -inf
    with indices past every column, so they never win."""
    at = tl.arange(0, CHUNKS)
    ok = at < chunks
    v = tl.load(values_ptr + row * chunks + at, mask=ok, other=float("-inf"))
    i = tl.load(indices_ptr + row * chunks + at, mask=ok, other=2147483647)
    _, index = tl.reduce((v, i), 0, first_max)
    return index


@triton.jit
def row_token(x_ptr, values_ptr, indices_ptr, row, V, stride, chunks, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
              CHUNKED: tl.constexpr):
    """Row ``row``'s argmax: from its chunks' maxima (``CHUNKED``) or read here (:func:`row_argmax`)."""
    if CHUNKED:
        return chunks_argmax(values_ptr, indices_ptr, row, chunks, CHUNKS)
    return row_argmax(x_ptr, row, V, stride, BLOCK)


@triton.jit
def argmax_rows(x_ptr, out_ptr, V, stride, values_ptr, indices_ptr, chunks, BLOCK: tl.constexpr,
                CHUNKS: tl.constexpr = 1, CHUNKED: tl.constexpr = False):
    """Index of row ``program_id(0)``'s first maximum (int64), one program per row (:func:`row_token`)."""
    row = tl.program_id(0).to(tl.int64)
    token = row_token(x_ptr, values_ptr, indices_ptr, row, V, stride, chunks, BLOCK, CHUNKS, CHUNKED)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def greedy_step(x_ptr, finished_ptr, eos_ptr, token_ptr, tokens_ptr, column_ptr, V, stride, n_eos, pad,
                stride_tokens, values_ptr, indices_ptr, chunks, BLOCK: tl.constexpr, BLOCK_EOS: tl.constexpr,
                HAS_COLUMN: tl.constexpr, CHUNKS: tl.constexpr = 1, CHUNKED: tl.constexpr = False):
    """One row of a greedy decode step: the argmax token (:func:`row_token`), ``pad`` if the row had finished, the
    row marked finished if the token is an end token (one of ``n_eos`` at ``eos``), the token stored at ``token``
    and, with ``HAS_COLUMN``, at column ``*column`` of ``tokens``."""
    row = tl.program_id(0).to(tl.int64)
    token = row_token(x_ptr, values_ptr, indices_ptr, row, V, stride, chunks, BLOCK, CHUNKS, CHUNKED).to(tl.int64)
    done = tl.load(finished_ptr + row) != 0
    token = tl.where(done, pad, token)
    re = tl.arange(0, BLOCK_EOS)
    ends = tl.load(eos_ptr + re, mask=re < n_eos, other=-1)
    hit = tl.sum(((ends == token) & (re < n_eos)).to(tl.int32), 0) > 0
    tl.store(finished_ptr + row, (done | hit).to(finished_ptr.dtype.element_ty))
    tl.store(token_ptr + row, token)
    if HAS_COLUMN:
        tl.store(tokens_ptr + row * stride_tokens + tl.load(column_ptr), token)
