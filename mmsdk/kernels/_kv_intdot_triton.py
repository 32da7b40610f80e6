"""Attention scores of int4 K codes against a 16-bit integer query, for the MHA decode kernel
(:func:`mmsdk.kernels._kv_subnormal_triton.decode_partial_int4_subnormal_mha` with ``KDOT``). Imported with it.

Why integers: the float way decodes each nibble with an AND and multiplies it with an FMA (about 18 instructions per
word of 8 codes, half of them on the integer pipe, which has half the fp32 pipe's lanes). ``dp2a`` multiplies two
16-bit integers with two bytes and adds both products to a 32-bit sum in one instruction, so with the query rounded
to 16-bit integers a word costs one shift, two ANDs and four ``dp2a``: 7 instructions, of them 3 on the integer pipe.

Rounding: the query (already multiplied by K's per-channel scales and the softmax scale) is rounded to integers in
[-32767, 32767] with one scale per head (its largest magnitude maps to 32767): a relative error of at most 1.5e-5 of
that largest channel per channel. For the attention output that is 2.7e-5 with even channel scales and 1.1e-4 with a
few channels 15x larger than the rest, against 0.23-0.33 for the int4 cache itself; an 8-bit query gave 8e-3
(benchmarks/kv_query_rounding.py, random inputs, 4096 tokens). The sums are exact integers: at most
16 * 32767 * 15 * 128 < 2**31 for head_dim 128.
"""

from __future__ import annotations

import triton
import triton.language as tl

QUERY_LEVELS = tl.constexpr(32767.0)  # the query's largest magnitude, as an integer

# One int32 word of 8 codes (nibble j = channel 8w + j) against the query's channels of that word, packed as pairs of
# int16 (``$2`` = channels 0 and 2, ``$3`` = 4 and 6, ``$4`` = 1 and 3, ``$5`` = 5 and 7; low half first). The even
# nibbles are shifted up into the high half of their bytes, so both halves read as 16 x code: the result is
# 16 * sum_j q_j c_j. dp2a.lo multiplies the pair with bytes 0 and 1 of its second operand, dp2a.hi with bytes 2 and 3.
def word_dot_ptx(accumulate: bool) -> str:
    """The PTX of one word's dot; with ``accumulate`` its sum starts from ``$1`` and the operands shift up by one
    (the batch-1 W4A16 GEMV's use, mmsdk/kernels/_gemv_idot_triton.py), otherwise from 0."""
    word, p0, p1, p2, p3 = ("$2", "$3", "$4", "$5", "$6") if accumulate else ("$1", "$2", "$3", "$4", "$5")
    start = "$1" if accumulate else "0"
    return (f"{{\n.reg .b32 e, o;\nshl.b32 e, {word}, 4;\nand.b32 e, e, 0xF0F0F0F0;\nand.b32 o, {word}, 0xF0F0F0F0;\n"
            f"dp2a.lo.s32.u32 $0, {p0}, e, {start};\ndp2a.hi.s32.u32 $0, {p1}, e, $0;\n"
            f"dp2a.lo.s32.u32 $0, {p2}, o, $0;\ndp2a.hi.s32.u32 $0, {p3}, o, $0;\n}}")


_WORD_DOT = word_dot_ptx(False)
WORD_DOT = tl.constexpr(_WORD_DOT)


@triton.jit
def int16_pair(low, high):
    """Two int32 values in [-32768, 32767] as one int32 holding their 16-bit halves (``low`` in bits 0-15)."""
    return (low & 0xFFFF) | (high << 16)


@triton.jit
def round_to_levels(x, inv_unit):
    """``x / unit`` rounded to the nearest integer (halves up) as int32; one fused multiply-add, so the result does
    not depend on where the compiler would have fused it."""
    return tl.floor(tl.math.fma(x, inv_unit, 0.5)).to(tl.int32)


@triton.jit
def integer_query(a0, a1, a2, a3, a4, a5, a6, a7):
    """The pre-scaled query's channels ``8w + j`` (``a_j``, fp32 [W]) as 16-bit integers for :func:`word_dots`.

    Returns the four packed pair vectors, ``offset`` (the integer score of all-8 codes, 16 * 8 * sum q: the codes are
    stored as ``c + 8``) and ``unit`` (fp32: a score's integer times ``unit`` is the score)."""
    top = tl.maximum(tl.maximum(tl.maximum(tl.max(tl.abs(a0), 0), tl.max(tl.abs(a1), 0)),
                                tl.maximum(tl.max(tl.abs(a2), 0), tl.max(tl.abs(a3), 0))),
                     tl.maximum(tl.maximum(tl.max(tl.abs(a4), 0), tl.max(tl.abs(a5), 0)),
                                tl.maximum(tl.max(tl.abs(a6), 0), tl.max(tl.abs(a7), 0))))
    inv_unit = tl.where(top > 0, QUERY_LEVELS / top, 0.0)  # an all-zero query gives zero scores
    q0, q1 = round_to_levels(a0, inv_unit), round_to_levels(a1, inv_unit)
    q2, q3 = round_to_levels(a2, inv_unit), round_to_levels(a3, inv_unit)
    q4, q5 = round_to_levels(a4, inv_unit), round_to_levels(a5, inv_unit)
    q6, q7 = round_to_levels(a6, inv_unit), round_to_levels(a7, inv_unit)
    offset = 128 * tl.sum(q0 + q1 + q2 + q3 + q4 + q5 + q6 + q7, 0)
    return (int16_pair(q0, q2), int16_pair(q4, q6), int16_pair(q1, q3), int16_pair(q5, q7), offset,
            top / (16.0 * QUERY_LEVELS))


@triton.jit
def signed_half(pair, HIGH: tl.constexpr):
    """One 16-bit half of :func:`int16_pair`'s word, sign-extended."""
    if HIGH:
        return pair >> 16
    return (pair << 16) >> 16


@triton.jit
def word_dots(kw, qe01, qe23, qo01, qo23, ASM: tl.constexpr):
    """16 * sum_j q_j c_j for every word of ``kw`` (int32 ``[BLOCK_T, W]``) against the packed query ``[W]``.

    With ``ASM`` through the PTX above (CUDA only); otherwise by integer arithmetic (the interpreter), with the
    same, exact, values."""
    if ASM:
        return tl.inline_asm_elementwise(WORD_DOT, "=r,r,r,r,r,r", [kw, qe01[None, :], qe23[None, :],
                                                                   qo01[None, :], qo23[None, :]],
                                         dtype=tl.int32, is_pure=True, pack=1)
    u = kw.to(tl.uint32, bitcast=True)
    dot = (u & 0xF).to(tl.int32) * signed_half(qe01, False)[None, :]
    dot += ((u >> 4) & 0xF).to(tl.int32) * signed_half(qo01, False)[None, :]
    dot += ((u >> 8) & 0xF).to(tl.int32) * signed_half(qe01, True)[None, :]
    dot += ((u >> 12) & 0xF).to(tl.int32) * signed_half(qo01, True)[None, :]
    dot += ((u >> 16) & 0xF).to(tl.int32) * signed_half(qe23, False)[None, :]
    dot += ((u >> 20) & 0xF).to(tl.int32) * signed_half(qo23, False)[None, :]
    dot += ((u >> 24) & 0xF).to(tl.int32) * signed_half(qe23, True)[None, :]
    dot += (u >> 28).to(tl.int32) * signed_half(qo23, True)[None, :]
    return 16 * dot


@triton.jit
def integer_scores(kw, qe01, qe23, qo01, qo23, offset, unit, ASM: tl.constexpr):
    """Scores (log2 units, fp32 [BLOCK_T]) of the words ``kw`` against :func:`integer_query`'s query."""
    return (tl.sum(word_dots(kw, qe01, qe23, qo01, qo23, ASM), 1) - offset).to(tl.float32) * unit
