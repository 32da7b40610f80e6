"""Tensor-core W4A16 GEMV for a few activation rows (blocks of up to 16), behind mmsdk.kernels.w4a16 (kind "mma").

Imported only when a kernel is launched (through mmsdk.kernels._w4a16_triton).

A nibble ``c`` OR-ed into the bit pattern of 128.0 in bf16 (``0x4300``, 7 mantissa bits; 1024.0 in fp16) is exactly
``128 + c``, and one ``lop3`` does it for two nibbles of a 32-bit register (``w & 0x000F000F | 0x43004300``); one
packed fma then subtracts 136, leaving the centred code ``c - 8``. With the byte shuffle and shifts that is 12
instructions per 8 nibbles, and the tensor cores do the multiply-adds. The compiler loads the packed bytes
straight into the tensor-core operand layout (``ldmatrix`` from a shared-memory stage filled by ``cp.async``) and
converts them there, so the 16-bit weights never go through shared memory.

The weights are the dot's left operand (``[BLOCK_N, half group]``) and the activations the right one, so the
accumulator holds ``BLOCK_N x BLOCK_M`` outputs (the tensor cores pad ``BLOCK_M`` to 8) and the per-group scaling
costs a few FMAs per output: each group is one ``tl.dot`` pair (even and odd channels), scaled in fp32 (a zero point
``z`` adds ``(8 - z) * sum x`` first). With the activations on the other side the accumulator would hold 16 rows of
every output (mma tiles are 16 tall) and its per-group scaling took a third of the loop at groups of 32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmsdk.kernels._gemv_gated_triton import silu_times
from mmsdk.kernels._gemv_store_triton import add_residual
from mmsdk.kernels._pdl_triton import wait_for_inputs

# 4 bytes [e0, e1, e2, e3] in one register -> low nibbles (e0, e1), (e2, e3) and high nibbles (e0, e1), (e2, e3) as
# pairs of 16-bit floats of nibble - 8. prmt reorders the bytes to [e0, e2, e1, e3] so that one mask (0x000F000F)
# picks the nibbles of two elements at bits 0 and 16; lop3 with LUT 0xEA is (a & b) | c and makes each half
# MAGIC + nibble (bf16 0x4300 = 128.0 has 7 mantissa bits, fp16 0x6400 = 1024.0 has 10: a nibble in the low bits is
# exact); one packed fma by 1.0 plus OFFSET (-136 or -1032) leaves nibble - 8, exactly (small integers).
_NIBBLES_TO_PAIRS = """{
.reg .b32 t, u, one, off;
mov.b32 one, ONE;
mov.b32 off, OFFSET;
prmt.b32 t, $4, 0, 0x3120;
lop3.b32 u, t, 0x000F000F, MAGIC, 0xEA;
fma.rn.KIND $0, u, one, off;
shr.u32 u, t, 8;
lop3.b32 u, u, 0x000F000F, MAGIC, 0xEA;
fma.rn.KIND $1, u, one, off;
shr.u32 u, t, 4;
lop3.b32 u, u, 0x000F000F, MAGIC, 0xEA;
fma.rn.KIND $2, u, one, off;
shr.u32 u, t, 12;
lop3.b32 u, u, 0x000F000F, MAGIC, 0xEA;
fma.rn.KIND $3, u, one, off;
}"""
NIBBLES_TO_BF16 = tl.constexpr(_NIBBLES_TO_PAIRS.replace("ONE", "0x3F803F80").replace("OFFSET", "0xC308C308")
                               .replace("MAGIC", "0x43004300").replace("KIND", "bf16x2"))
NIBBLES_TO_FP16 = tl.constexpr(_NIBBLES_TO_PAIRS.replace("ONE", "0x3C003C00").replace("OFFSET", "0xE408E408")
                               .replace("MAGIC", "0x64006400").replace("KIND", "f16x2"))


@triton.jit
def centred_nibbles(b, dtype: tl.constexpr, ASM: tl.constexpr):
    """``(low nibble - 8, high nibble - 8)`` of uint8 bytes ``b`` in ``dtype`` (bf16 or fp16; exact), elementwise.

    With ``ASM`` four bytes at a time through the PTX above (CUDA only); otherwise by arithmetic (the interpreter),
    with the same values.
    """
    if ASM:
        if dtype == tl.float16:
            return tl.inline_asm_elementwise(NIBBLES_TO_FP16, "=r,=r,=r,=r,r", [b],
                                             dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(NIBBLES_TO_BF16, "=r,=r,=r,=r,r", [b],
                                             dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        return ((b & 15).to(tl.float32) - 8.0).to(dtype), ((b >> 4).to(tl.float32) - 8.0).to(dtype)


@triton.jit
def group_product(x_ptr, w_ptr, rm, m_ok, rn, n_ok, g, g_end, stride_xm, K_in, KB, GROUP: tl.constexpr,
                  ASM: tl.constexpr):
    """One group's ``(sum_k (c_k - 8) x_k, x)``: ``[BLOCK_N, BLOCK_M]`` fp32 and the group's activations.

    ``w_ptr`` holds ``KB`` bytes per output row (the MatMulNBits layout: byte ``i`` of a group carries channels
    ``2i`` (low nibble) and ``2i + 1``). The activations load as contiguous pairs, split in registers. A group from
    ``g_end`` on (past the slice) reads as zeros; the masks are built per element (Triton's interpreter takes no
    scalar term in a load mask). The weights are the dot's left operand, so the
    accumulator has one column per activation row (``BLOCK_M``, padded by the compiler to the tensor cores' 8).
    """
    HALF: tl.constexpr = GROUP // 2
    rh = tl.arange(0, HALF)
    byte = tl.load(w_ptr + rn[:, None].to(tl.int64) * KB + g * HALF + rh[None, :],
                   mask=n_ok[:, None] & (g * HALF + rh < g_end * HALF)[None, :], other=0)
    low, high = centred_nibbles(byte, x_ptr.dtype.element_ty, ASM)
    k = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :],
                mask=m_ok[:, None] & ((k < K_in) & (k < g_end * GROUP))[None, :], other=0.0)
    xe, xo = tl.split(tl.reshape(x, (x.shape[0], HALF, 2)))
    product = tl.dot(low, tl.trans(xe))
    product = tl.dot(high, tl.trans(xo), product)
    return product, x


@triton.jit
def scaled_group(x_ptr, w_ptr, s_ptr, z_ptr, rm, m_ok, rn, n_ok, g, g_end, stride_xm, stride_zn, K_in, KB, k_blocks,
                 GROUP: tl.constexpr, HAS_ZP: tl.constexpr, ASM: tl.constexpr):
    """One group's contribution ``scale * sum_k (c_k - zero) x_k``, ``[BLOCK_N, BLOCK_M]`` fp32 (a group from ``g_end``
    on contributes zeros)."""
    product, x = group_product(x_ptr, w_ptr, rm, m_ok, rn, n_ok, g, g_end, stride_xm, K_in, KB, GROUP, ASM)
    ok = n_ok & (rn * 0 + g < g_end)
    s = tl.load(s_ptr + rn * k_blocks + g, mask=ok, other=0.0).to(tl.float32)
    if HAS_ZP:  # the codes were centred on 8: add (8 - z) * sum x
        zb = tl.load(z_ptr + rn * stride_zn + g // 2, mask=ok, other=0)
        shift = 8.0 - ((zb >> ((g % 2) * 4).to(tl.uint8)) & 15).to(tl.float32)
        product += shift[:, None] * tl.sum(x.to(tl.float32), 1)[None, :]
    return product * s[:, None]


@triton.jit
def gemv_mma(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K_in, KW, groups_per_split, stride_xm, stride_zn,
             r_ptr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, STEP_G: tl.constexpr, ASM: tl.constexpr,
             PDL: tl.constexpr = False, HAS_RESIDUAL: tl.constexpr = False, w2_ptr=None, s2_ptr=None, z2_ptr=None,
             PAIRED: tl.constexpr = False):
    """``x @ W.T`` for ``BLOCK_M`` activation rows over one K slice of ``groups_per_split`` groups, on the tensor cores.

    Grid: (output row blocks of ``BLOCK_N``, K slices, blocks of ``BLOCK_M`` activation rows). A step covers ``STEP_G``
    groups (small groups: more weight bytes per thread and step). Stores fp32 partials at
    ``out[split]`` or, with ``DIRECT`` (one slice), the finished ``[M, N]`` output in out's dtype with the bias
    and, with ``HAS_RESIDUAL``, plus ``r`` (:func:`~mmsdk.kernels._gemv_store_triton.add_residual`). The codes become
    the activations' dtype (bf16 or fp16) and the tensor cores accumulate in fp32.
    ``PDL``: the program waits for the kernel before it (``wait_for_inputs``) before it reads the activations.

    ``PAIRED`` (a gated MLP's gate ``W`` and up ``W2``, same shape and layout; no bias or residual): each program the
    same rows of both weights, storing ``silu(x W.T) * (x W2.T)`` with ``DIRECT``, else both fp32 partials at
    ``out[split]`` (rows ``2N`` wide, up at columns ``N ..``) for the split epilogue.
    """
    pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_blocks = KW * 8 // GROUP
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    g_begin = split * groups_per_split
    g_end = tl.minimum(g_begin + groups_per_split, k_blocks)
    wait_for_inputs(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g0 in range(g_begin, g_end, STEP_G):
        for i in tl.static_range(STEP_G):  # whole groups, each with its own loads, dot pair and scaling
            g = g0 + i
            acc += scaled_group(x_ptr, w_ptr, s_ptr, z_ptr, rm, m_ok, rn, n_ok, g, g_end, stride_xm, stride_zn, K_in,
                                KW * 4, k_blocks, GROUP, HAS_ZP, ASM)
            if PAIRED:
                acc2 += scaled_group(x_ptr, w2_ptr, s2_ptr, z2_ptr, rm, m_ok, rn, n_ok, g, g_end, stride_xm,
                                     stride_zn, K_in, KW * 4, k_blocks, GROUP, HAS_ZP, ASM)
    ok = n_ok[:, None] & m_ok[None, :]
    if PAIRED and DIRECT:
        dst = out_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]
        tl.store(dst, silu_times(acc, acc2).to(out_ptr.dtype.element_ty), mask=ok)
    elif PAIRED:
        dst = out_ptr + (split * M + rm[None, :]).to(tl.int64) * (2 * N) + rn[:, None]
        tl.store(dst, acc, mask=ok)
        tl.store(dst + N, acc2, mask=ok)
    elif DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        residual = r_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]
        out = add_residual(acc, residual, ok, out_ptr.dtype.element_ty, HAS_RESIDUAL)
        tl.store(out_ptr + rm[None, :].to(tl.int64) * N + rn[:, None], out, mask=ok)
    else:
        tl.store(out_ptr + (split * M + rm[None, :]).to(tl.int64) * N + rn[:, None], acc, mask=ok)
