"""Triton kernels behind mmsdk.kernels.norm_rope_gpu (imported only when a kernel is launched).

Rounding follows the torch reference ops (mmsdk/kernels/norm_rope.py): sums and normalized values
are rounded to the activation dtype where the reference rounds them, products of two values of
that dtype are exact in fp32, so the kernels differ from the reference by at most the rounding of
the reductions' order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmsdk.kernels._pdl_triton import let_next_launch


@triton.jit
def add_rms_norm(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, H, sx, sr, so, ss, eps,
                 HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """One row: ``total = x + residual`` (stored), ``out = weight * rms_norm(total)``.

    With ``PDL`` the next kernel may launch at once (a GEMV loads its first weights meanwhile).
    """
    let_next_launch(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0)
    if HAS_RES:
        total = (x.to(tl.float32) + tl.load(r_ptr + row * sr + cols, mask=ok, other=0.0).to(tl.float32))
        total = total.to(x.dtype)
        tl.store(sum_ptr + row * ss + cols, total, mask=ok)
    else:
        total = x
    h = total.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, 0) / H + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_heads(x_ptr, o_ptr, w_ptr, c1, c2, s1, s2, base_x, base_o, sxh, soh, h0, heads, HALF, eps, D,
                  NORM: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_D2: tl.constexpr):
    """RoPE (after an optional per-head RMSNorm) of heads ``h0 .. h0 + BLOCK_HEADS - 1`` of one token, in two
    half-rows."""
    hh = h0 + tl.arange(0, BLOCK_HEADS)
    rd = tl.arange(0, BLOCK_D2)
    ok = (hh < heads)[:, None] & (rd < HALF)[None, :]
    src = x_ptr + base_x + hh[:, None].to(tl.int64) * sxh + rd[None, :]
    x1 = tl.load(src, mask=ok, other=0.0)
    x2 = tl.load(src + HALF, mask=ok, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / D + eps)
        w1 = tl.load(w_ptr + rd, mask=rd < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + rd, mask=rd < HALF, other=0.0).to(tl.float32)
        a = (w1[None, :] * (a * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        b = (w2[None, :] * (b * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = a * c1[None, :] - b * s1[None, :]
    o2 = b * c2[None, :] + a * s2[None, :]
    dst = o_ptr + base_o + hh[:, None].to(tl.int64) * soh + rd[None, :]
    tl.store(dst, o1.to(dtype), mask=ok)
    tl.store(dst + HALF, o2.to(dtype), mask=ok)


@triton.jit
def rope_qk(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, L, HQ, HK, HALF, D,
            sqb, sqh, sql, skb, skh, skl, sob_q, soh_q, sol_q, sob_k, soh_k, sol_k, scb, scl, eps_q, eps_k,
            NORM: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_D2: tl.constexpr):
    """One token (batch b, position l; program axis 0) and one block of ``BLOCK_HEADS`` of its q or k heads
    (axis 1: q's blocks, then k's), rotated by that token's cos/sin row.

    Blocks of heads rather than a program per token: a single token (the decode step) is then spread over several
    programs whose loads are in flight together, instead of one program rotating q and then k.
    """
    pid = tl.program_id(0)
    block = tl.program_id(1)
    b = (pid // L).to(tl.int64)
    l_ = (pid % L).to(tl.int64)
    rd = tl.arange(0, BLOCK_D2)
    dm = rd < HALF
    trig = b * scb + l_ * scl
    c1 = tl.load(cos_ptr + trig + rd, mask=dm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + trig + HALF + rd, mask=dm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + trig + rd, mask=dm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + trig + HALF + rd, mask=dm, other=0.0).to(tl.float32)
    q_blocks = tl.cdiv(HQ, BLOCK_HEADS)
    if block < q_blocks:
        _rotate_heads(q_ptr, qo_ptr, qw_ptr, c1, c2, s1, s2, b * sqb + l_ * sql, b * sob_q + l_ * sol_q, sqh, soh_q,
                      block * BLOCK_HEADS, HQ, HALF, eps_q, D, NORM, BLOCK_HEADS, BLOCK_D2)
    else:
        _rotate_heads(k_ptr, ko_ptr, kw_ptr, c1, c2, s1, s2, b * skb + l_ * skl, b * sob_k + l_ * sol_k, skh, soh_k,
                      (block - q_blocks) * BLOCK_HEADS, HK, HALF, eps_k, D, NORM, BLOCK_HEADS, BLOCK_D2)


@triton.jit
def mrope_cos_sin(pos_ptr, inv_ptr, stream_ptr, cos_ptr, sin_ptr, BL, HALF, sps, scaling,
                  BLOCK_D2: tl.constexpr):
    """One token: slot j reads position stream ``streams[j]`` and writes cos/sin at j and j + HALF."""
    t = tl.program_id(0).to(tl.int64)
    rd = tl.arange(0, BLOCK_D2)
    dm = rd < HALF
    stream = tl.load(stream_ptr + rd, mask=dm, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + stream * sps + t, mask=dm, other=0).to(tl.float32)
    freq = pos * tl.load(inv_ptr + rd, mask=dm, other=0.0)
    # Reduce to [-pi, pi] in two exact-ish steps (Cody-Waite) so that a fast cos/sin stays accurate at
    # positions in the thousands: 6.28125 has 8 significant bits, so turns * 6.28125 is exact in fp32.
    turns = tl.floor(freq * 0.15915494309189535 + 0.5)
    freq = (freq - turns * 6.28125) - turns * 0.0019353071795864769
    c = (tl.cos(freq) * scaling).to(cos_ptr.dtype.element_ty)
    s = (tl.sin(freq) * scaling).to(sin_ptr.dtype.element_ty)
    row = t * 2 * HALF
    tl.store(cos_ptr + row + rd, c, mask=dm)
    tl.store(cos_ptr + row + HALF + rd, c, mask=dm)
    tl.store(sin_ptr + row + rd, s, mask=dm)
    tl.store(sin_ptr + row + HALF + rd, s, mask=dm)
