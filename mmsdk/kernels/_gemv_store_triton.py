"""How the batch-1 W4A16 GEMVs store their output: bias, residual and the next RMSNorm's statistics
(:func:`store_output`) and the statistics' reading by the gated GEMVs (:func:`load_norm_parts`,
:func:`rms_from_parts`).

Imported only when a kernel is launched (through mmsdk.kernels._w4a16_triton).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_residual(product, r_ptrs, ok, dtype: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """``product`` rounded to ``dtype``; with ``HAS_RESIDUAL`` then ``residual + that``, rounded again.

    Bitwise what ``residual + linear(x)`` gives in torch: the linear's output is rounded to the model
    dtype, and torch adds two bf16/fp16 tensors in fp32 and rounds the sum.
    """
    out = product.to(dtype)
    if HAS_RESIDUAL:
        out = (out.to(tl.float32) + tl.load(r_ptrs, mask=ok, other=0.0).to(tl.float32)).to(dtype)
    return out


@triton.jit
def leave_norm_statistics(value, columns, ok, row, part, N, g_ptr, scaled_ptr, sq_ptr, n_parts):
    """What the RMSNorm that reads this store needs, left by the store (mmsdk.kernels.norm_fold.NormStatistics):
    ``weight * value`` rounded to the model dtype at ``scaled[row, columns]`` and the sum of ``value**2`` over these
    columns at ``sq[row, part]`` (fp32), so that its reader scales its finished sums by ``1 / rms`` instead of a norm
    launch normalizing its input. ``value`` is what the store wrote (the model dtype), ``ok`` the columns that
    exist."""
    v = tl.where(ok, value.to(tl.float32), 0.0)
    w = tl.load(g_ptr + columns, mask=ok, other=0.0).to(tl.float32)
    tl.store(scaled_ptr + row.to(tl.int64) * N + columns, (v * w).to(scaled_ptr.dtype.element_ty), mask=ok)
    tl.store(sq_ptr + row * n_parts + part, tl.sum(v * v, 0))


@triton.jit
def store_output(acc, columns, ok, row, part, N, b_ptr, r_ptr, out_ptr, g_ptr, scaled_ptr, sq_ptr, n_parts,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, LEAVE_NORM: tl.constexpr):
    """A GEMV's finished fp32 sums ``acc`` for ``columns`` of activation row ``row`` into ``out [M, N]``: plus the
    bias, rounded to out's dtype, plus the residual ``r`` (:func:`add_residual`), and with ``LEAVE_NORM`` the
    statistics of the RMSNorm that reads the output (:func:`leave_norm_statistics`, part ``part`` of ``n_parts``).
    What a one-slice GEMV's store and the K slices' epilogue both do."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + columns, mask=ok, other=0.0).to(tl.float32)
    at = row.to(tl.int64) * N + columns
    value = add_residual(acc, r_ptr + at, ok, out_ptr.dtype.element_ty, HAS_RESIDUAL)
    tl.store(out_ptr + at, value, mask=ok)
    if LEAVE_NORM:
        leave_norm_statistics(value, columns, ok, row, part, N, g_ptr, scaled_ptr, sq_ptr, n_parts)


@triton.jit
def load_norm_parts(sq_ptr, row, n_parts, PARTS: tl.constexpr):
    """Row ``row``'s partial sums of squares (:func:`leave_norm_statistics`), ``[PARTS]`` fp32, zeros past
    ``n_parts`` (:func:`rms_from_parts` reduces them)."""
    at = tl.arange(0, PARTS)
    return tl.load(sq_ptr + row * n_parts + at, mask=at < n_parts, other=0.0)


@triton.jit
def rms_from_parts(parts, K_in, eps):
    """``1 / sqrt(sum(parts) / K_in + eps)``: an RMSNorm's scale from :func:`load_norm_parts`."""
    return tl.math.rsqrt(tl.sum(parts, 0) / K_in + eps)

