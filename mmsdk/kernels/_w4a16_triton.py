"""Triton kernels behind mmsdk.kernels.w4a16 (imported only when a kernel is launched)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequant_tile(w, s_ptr, z_ptr, rn, n_ok, k0, kp, stride_zn,
                 GROUP: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Even- and odd-k weights of a [BLOCK_K/2, BLOCK_N] byte tile, fp32, scaled (k along dim 0)."""
    NG: tl.constexpr = BLOCK_K // GROUP
    GH: tl.constexpr = GROUP // 2
    k_blocks = kp // GROUP
    g = k0 // GROUP + tl.arange(0, NG)
    g_ok = n_ok[None, :] & (g[:, None] < k_blocks)
    s = tl.load(s_ptr + rn[None, :] * k_blocks + g[:, None], mask=g_ok, other=0.0).to(tl.float32)
    if HAS_ZP:
        zb = tl.load(z_ptr + rn[None, :] * stride_zn + g[:, None] // 2, mask=g_ok, other=0)
        z = ((zb >> ((g[:, None] % 2) * 4).to(tl.uint8)) & 15).to(tl.float32)
    else:
        z = tl.full((NG, BLOCK_N), 8.0, tl.float32)
    lo = tl.reshape((w & 15).to(tl.float32), (NG, GH, BLOCK_N))
    hi = tl.reshape((w >> 4).to(tl.float32), (NG, GH, BLOCK_N))
    lo = (lo - z[:, None, :]) * s[:, None, :]
    hi = (hi - z[:, None, :]) * s[:, None, :]
    return tl.reshape(lo, (BLOCK_K // 2, BLOCK_N)), tl.reshape(hi, (BLOCK_K // 2, BLOCK_N))


@triton.jit
def fused(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K_in, KP, stride_xm, stride_om, stride_zn,
          GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rh = tl.arange(0, HALF)
    n_ok, m_ok = rn < N, rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KP, BLOCK_K):
        ke = k0 + 2 * rh
        x_row = x_ptr + rm[:, None] * stride_xm + ke[None, :]
        xe = tl.load(x_row, mask=m_ok[:, None] & (ke[None, :] < K_in), other=0.0)
        xo = tl.load(x_row + 1, mask=m_ok[:, None] & (ke[None, :] + 1 < K_in), other=0.0)
        kb = k0 // 2 + rh
        w = tl.load(w_ptr + rn[None, :] * (KP // 2) + kb[:, None], mask=n_ok[None, :] & (kb[:, None] < KP // 2),
                    other=0)
        lo, hi = dequant_tile(w, s_ptr, z_ptr, rn, n_ok, k0, KP, stride_zn, GROUP, HAS_ZP, BLOCK_N, BLOCK_K)
        acc += tl.dot(xe, lo.to(xe.dtype))
        acc += tl.dot(xo, hi.to(xo.dtype))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def dequant(w_ptr, s_ptr, z_ptr, out_ptr, N, K_out, KP, stride_zn,
            GROUP: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rh = tl.arange(0, HALF)
    n_ok = rn < N
    kb = k0 // 2 + rh
    w = tl.load(w_ptr + rn[None, :] * (KP // 2) + kb[:, None], mask=n_ok[None, :] & (kb[:, None] < KP // 2),
                other=0)
    lo, hi = dequant_tile(w, s_ptr, z_ptr, rn, n_ok, k0, KP, stride_zn, GROUP, HAS_ZP, BLOCK_N, BLOCK_K)
    tile = tl.reshape(tl.join(tl.trans(lo), tl.trans(hi)), (BLOCK_N, BLOCK_K))  # interleave even/odd k
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rn[:, None] * K_out + rk[None, :], tile.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (rk[None, :] < K_out))
