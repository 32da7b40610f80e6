"""Batch-1 W4A16 GEMV on integer dot products (kind "idot" of mmsdk.kernels.w4a16), and the kernel that rounds its
activations. Imported only when a kernel is launched (through mmsdk.kernels._w4a16_triton).

Why integers: the "quad" GEMV decodes each nibble with an AND and multiplies it in with an FMA, about 24 SASS
instructions per weight word with the loads (offline sm_90 builds, benchmarks/sm90_gemv_builds.py), so a batch-1
GEMV keeps the schedulers half busy while it streams its weights. ``dp2a`` multiplies two 16-bit integers with two
bytes of a word and adds both products to a 32-bit sum in one instruction: with the activations rounded to 16-bit
integers a word of 8 codes costs one shift, two ANDs and four ``dp2a``, and a quad of 4 words one conversion and two
float operations more.

Rounding: each quad's 32 activations (channels ``32q .. 32q+31``, the 4 words a thread reads as one 16-byte load) are
rounded to integers in [-32767, 32767] with a scale of their own (their largest magnitude maps to 32767): an error
of at most 1.5e-5 of that largest activation per channel, a quarter of a bf16 rounding of it and below the error of
the fp32 sum over K the float kernels make. The integer sums are exact: 32 codes of at most 240 (16 x 15) times 32767
stay below 2**31.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmsdk.kernels._gemv_quad_triton import by_nibble, inverse_rms, pick
from mmsdk.kernels._gemv_store_triton import load_norm_parts, rms_from_parts, store_output
from mmsdk.kernels._kv_intdot_triton import int16_pair, round_to_levels, word_dot_ptx, word_dots
from mmsdk.kernels._pdl_triton import wait_for_inputs

ACTIVATION_LEVELS = tl.constexpr(32767.0)  # a quad's largest activation magnitude, as an integer
# channels per pass of a folded norm's sum of squares (mmsdk.kernels._gemv_quad_triton.inverse_rms), for the rounding
# kernel and the GEMVs that round their own quads alike (within a pass each sums in its own thread layout, so their
# 1 / rms may still differ in the last bit)
ROW_SCALE_BLOCK = tl.constexpr(2048)

# ``$1`` plus the dot of one int32 word of 8 codes (nibble j = channel 8w + j) with the word's 8 activations, packed as
# pairs of int16 (``$3`` = channels 0 and 2, ``$4`` = 4 and 6, ``$5`` = 1 and 3, ``$6`` = 5 and 7; low half first). The
# even nibbles are shifted up into the high half of their bytes, so every byte reads as 16 x code: the sum grows by
# 16 * sum_j x_j c_j. dp2a.lo multiplies the pair with bytes 0 and 1 of its second operand, dp2a.hi with bytes 2 and 3.
# (The KV kernel's WORD_DOT, from the same template in mmsdk/kernels/_kv_intdot_triton.py, starts from 0.)
_WORD_DOT_ADD = word_dot_ptx(True)
WORD_DOT_ADD = tl.constexpr(_WORD_DOT_ADD)


@triton.jit
def quad_activations(x_row, quads, q_ok, K_in, row_scale, g_ptr, pq_ptr, NORM: tl.constexpr,
                     PREQUANT: tl.constexpr):
    """The activations of ``quads`` (``[BLOCK_Q]``) as fp32 ``[BLOCK_Q, 4, 8]`` (word, nibble), zeros past ``K_in``
    or where ``q_ok`` is false; with ``NORM`` times ``row_scale`` (the row's ``1 / rms``) and the norm's weight
    (with ``PREQUANT`` times an AWQ pre-scale), in that order."""
    words = quads[:, None] * 4 + tl.arange(0, 4)[None, :]  # [BLOCK_Q, 4]
    k = words[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    k_ok = q_ok[:, None, None] & (k < K_in)
    x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
    if NORM:
        weight = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        if PREQUANT:
            weight *= tl.load(pq_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        x = x * row_scale * weight
    return x


@triton.jit
def round_quads(x):
    """Quads of activations ``[BLOCK_Q, 4, 8]`` (fp32) rounded: per word the four int32 of int16 pairs (channels 0/2,
    4/6, 1/3, 5/7; ``[BLOCK_Q, 4]`` each), per quad the scale that turns a dot's integer into the product (the
    quad's unit over 16) and the sum of its integers. The same values wherever a quad is rounded."""
    top = tl.max(tl.max(tl.abs(x), 2), 1)
    inv_unit = tl.where(top > 0, ACTIVATION_LEVELS / top, 0.0)  # an all-zero quad gives zero products
    levels = round_to_levels(x, inv_unit[:, None, None])
    x0, x1, x2, x3, x4, x5, x6, x7 = by_nibble(levels)
    return (int16_pair(x0, x2), int16_pair(x4, x6), int16_pair(x1, x3), int16_pair(x5, x7),
            top / (16.0 * ACTIVATION_LEVELS), tl.sum(tl.sum(levels, 2), 1))


@triton.jit
def quantize_activations(x_ptr, xq_ptr, xs_ptr, xsum_ptr, K_in, n_quads, stride_xm, BLOCK_Q: tl.constexpr,
                         PDL: tl.constexpr = False, g_ptr=None, pq_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                         PREQUANT: tl.constexpr = False):
    """One activation row's quads ``[BLOCK_Q]`` as :func:`gemv_idot` reads them: per word ``w`` four int32 of int16
    pairs at ``xq[row, 4w .. 4w+3]`` (channels 0/2, 4/6, 1/3, 5/7 of the word), per quad the scale that turns a
    dot's integer into the product (``xs``: fp32, the quad's unit over 16) and the sum of its integers (``xsum``:
    the zero point's share). Channels past ``K_in`` (a padded layer's last group) are zeros. With ``PDL`` it waits
    for the kernel before it first, then lets the GEMV launch (which loads its first weights meanwhile).

    With ``NORM`` the row is an RMSNorm's input: each program reads the whole row for its ``1 / rms`` (``eps``) and
    rounds ``x / rms * g`` (``g_ptr``: the norm's weight; with ``PREQUANT`` times an AWQ pre-scale at ``pq_ptr``), in
    fp32 with no rounding to the model dtype in between (as the "quad" kinds fold a norm), so the GEMV reads the
    normalized row with no norm launch before it.
    """
    wait_for_inputs(PDL)
    pid, row = tl.program_id(0), tl.program_id(1)
    quads = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = quads < n_quads
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    row_scale = inverse_rms(x_row, K_in, eps, ROW_SCALE_BLOCK) if NORM else 1.0
    p0, p1, p2, p3, xs, xsum = round_quads(quad_activations(x_row, quads, q_ok, K_in, row_scale, g_ptr, pq_ptr, NORM,
                                                            PREQUANT))
    pairs = xq_ptr + row.to(tl.int64) * (4 * n_quads * 4) + (quads[:, None] * 4 + tl.arange(0, 4)[None, :]) * 4
    tl.store(pairs, p0, mask=q_ok[:, None])
    tl.store(pairs + 1, p1, mask=q_ok[:, None])
    tl.store(pairs + 2, p2, mask=q_ok[:, None])
    tl.store(pairs + 3, p3, mask=q_ok[:, None])
    tl.store(xs_ptr + row * n_quads + quads, xs, mask=q_ok)
    tl.store(xsum_ptr + row * n_quads + quads, xsum, mask=q_ok)


@triton.jit
def word_dot_add(w, p0, p1, p2, p3, acc, ASM: tl.constexpr):
    """``acc + 16 * sum_j x_j c_j`` for every word of ``w`` (int32 ``[BLOCK_N, BLOCK_C]``) against the word's packed
    activations (``[BLOCK_C]`` each). With ``ASM`` through the PTX above (CUDA only); otherwise by integer
    arithmetic (the interpreter), with the same, exact, values."""
    if ASM:
        return tl.inline_asm_elementwise(WORD_DOT_ADD, "=r,r,r,r,r,r,r",
                                         [acc, w, p0[None, :], p1[None, :], p2[None, :], p3[None, :]],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return acc + word_dots(w, p0, p1, p2, p3, False)  # the same pair order as the KV kernel's query


@triton.jit
def by_pair(v):
    """``[C, 4, 4]`` packed activations split by pair into four ``[C, 4]`` tiles (``p = 2 i0 + i1``)."""
    a, b = tl.split(tl.reshape(v, (v.shape[0], 4, 2, 2)))
    p0, p2 = tl.split(a)
    p1, p3 = tl.split(b)
    return p0, p1, p2, p3


@triton.jit
def rounded_step(xq_row, xs_row, xsum_row, q0, quads, c_ok, pair_at, MASK_K: tl.constexpr = True):
    """A step's rounded activations: the packed pairs split by pair position (four ``[BLOCK_C, 4]``), each quad's
    scale and integer sum (``[BLOCK_C]``); loaded once per step and shared by every weight of the program (without
    ``MASK_K`` every quad of the step exists)."""
    if MASK_K:
        p0, p1, p2, p3 = by_pair(tl.load(xq_row + 16 * q0 + pair_at, mask=c_ok[:, None, None], other=0))
        xs = tl.load(xs_row + quads, mask=c_ok, other=0.0)
        xsum = tl.load(xsum_row + quads, mask=c_ok, other=0)
    else:
        p0, p1, p2, p3 = by_pair(tl.load(xq_row + 16 * q0 + pair_at))
        xs = tl.load(xs_row + quads)
        xsum = tl.load(xsum_row + quads)
    return p0, p1, p2, p3, xs, xsum


@triton.jit
def idot_products(words, s, p0, p1, p2, p3, xs, xsum, quads, z_ptr, rn, ok, stride_zn, WPG: tl.constexpr,
                  HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ASM: tl.constexpr):
    """One weight's fp32 products ``[BLOCK_N, BLOCK_C]`` (rows x quads) for a step, from its words
    ``[BLOCK_N, BLOCK_C, 4]``, its group scales ``s`` and the step's activations (:func:`rounded_step`)."""
    a, b = tl.split(tl.reshape(words, (BLOCK_N, BLOCK_C, 2, 2)))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    d = word_dot_add(w0, pick(p0, 0), pick(p1, 0), pick(p2, 0), pick(p3, 0), tl.zeros((BLOCK_N, BLOCK_C), tl.int32),
                     ASM)
    d = word_dot_add(w1, pick(p0, 1), pick(p1, 1), pick(p2, 1), pick(p3, 1), d, ASM)
    d = word_dot_add(w2, pick(p0, 2), pick(p1, 2), pick(p2, 2), pick(p3, 2), d, ASM)
    d = word_dot_add(w3, pick(p0, 3), pick(p1, 3), pick(p2, 3), pick(p3, 3), d, ASM)
    if HAS_ZP:
        g = quads * 4 // WPG
        zb = tl.load(z_ptr + rn[:, None] * stride_zn + g[None, :] // 2, mask=ok, other=0)
        z = ((zb >> ((g[None, :] % 2) * 4).to(tl.uint8)) & 15).to(tl.int32)
        d -= 16 * z * xsum[None, :]
    else:
        d -= (128 * xsum)[None, :]
    return s * (d.to(tl.float32) * xs[None, :])


@triton.jit
def step_inputs(xq_row, xs_row, xsum_row, q0, quads, c_ok, pair_at, x_row, K_in, row_scale, g_ptr, pq_ptr,
                MASK_K: tl.constexpr, SELF_ROUND: tl.constexpr, NORM: tl.constexpr, PREQUANT: tl.constexpr):
    """A step's rounded activations (:func:`rounded_step`'s values): read from the rounding kernel's output, or with
    ``SELF_ROUND`` rounded here from the activation row ``x_row`` (``K_in`` channels; ``NORM`` / ``PREQUANT`` and
    ``row_scale`` as :func:`quad_activations` takes them): the same bits but for a folded norm's ``1 / rms``."""
    if SELF_ROUND:
        p0, p1, p2, p3, xs, xsum = round_quads(quad_activations(x_row, quads, c_ok, K_in, row_scale, g_ptr, pq_ptr,
                                                                NORM, PREQUANT))
    else:
        p0, p1, p2, p3, xs, xsum = rounded_step(xq_row, xs_row, xsum_row, q0, quads, c_ok, pair_at, MASK_K)
    return p0, p1, p2, p3, xs, xsum


@triton.jit
def step_tile(w_rows, s_ptr, q0, q_end, rn, n_ok, rc, rw, k_blocks, WPG: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_C: tl.constexpr, ROW_MASK: tl.constexpr, MASK_K: tl.constexpr = True):
    """The step at quad ``q0``: its words ``[BLOCK_N, BLOCK_C, 4]``, group scales (fp32), quads, which quads and
    (row, quad) pairs exist. Without ``MASK_K`` the caller knows every quad of the step exists: its loads take no K
    mask (no registers zeroed and no predicates set for them: 10.7 instead of 12.5 instructions per word in an offline
    sm_90 build of 16 x 64 x 4), and without ``ROW_MASK`` no row mask either."""
    quads = q0 + rc
    c_ok = quads < q_end
    ok = n_ok[:, None] & c_ok[None, :]
    at = w_rows + 4 * q0 + rw[None, :]
    scale_at = s_ptr + rn[:, None] * k_blocks + (quads * 4 // WPG)[None, :]
    if MASK_K:
        w_ok = (4 * q0 + rw < 4 * q_end)[None, :]
        if ROW_MASK:
            w_ok = n_ok[:, None] & w_ok
        flat = tl.load(at, mask=w_ok, other=0)
        s = tl.load(scale_at, mask=ok, other=0.0)
    elif ROW_MASK:
        flat = tl.load(at, mask=n_ok[:, None], other=0)
        s = tl.load(scale_at, mask=n_ok[:, None], other=0.0)
    else:
        flat = tl.load(at)
        s = tl.load(scale_at)
    return tl.reshape(flat, (BLOCK_N, BLOCK_C, 4)), s.to(tl.float32), quads, c_ok, ok


@triton.jit
def idot_program(N, KW, quads_per_split, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """An integer-dot GEMV program's (split, activation row, output rows ``rn``, which of them exist, a step's quad and
    word offsets, first and end quad of its K slice, quads and groups per weight row); grid (row blocks, K slices,
    activation rows)."""
    pid_n, split, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_quads = KW // 4
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    q_begin = split * quads_per_split
    return (split, row, rn, rn < N, tl.arange(0, BLOCK_C), tl.arange(0, 4 * BLOCK_C), q_begin,
            tl.minimum(q_begin + quads_per_split, n_quads), n_quads, KW // (GROUP // 8))


@triton.jit
def rounded_row(xq_ptr, xs_ptr, xsum_ptr, row, KW, n_quads, rc):
    """Activation row ``row`` as :func:`quantize_activations` left it (its pairs, quad scales and integer sums) and a
    step's offsets into its pairs, ``[BLOCK_C, 4, 4]``."""
    pair_at = (rc[:, None, None] * 4 + tl.arange(0, 4)[None, :, None]) * 4 + tl.arange(0, 4)[None, None, :]
    return xq_ptr + row.to(tl.int64) * (4 * KW), xs_ptr + row * n_quads, xsum_ptr + row * n_quads, pair_at


@triton.jit
def idot_step(acc, w_rows, s_ptr, q0, q_end, rn, n_ok, rc, rw, k_blocks, xq_row, xs_row, xsum_row, pair_at, z_ptr,
              stride_zn, x_row, K_in, row_scale, g_ptr, pq_ptr, WPG: tl.constexpr, HAS_ZP: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ROW_MASK: tl.constexpr, ASM: tl.constexpr,
              MASK_K: tl.constexpr, SELF_ROUND: tl.constexpr, NORM: tl.constexpr, PREQUANT: tl.constexpr):
    """``acc`` plus the step at quad ``q0`` (without ``MASK_K`` every quad of it exists)."""
    words, s, quads, c_ok, ok = step_tile(w_rows, s_ptr, q0, q_end, rn, n_ok, rc, rw, k_blocks, WPG, BLOCK_N, BLOCK_C,
                                          ROW_MASK, MASK_K)
    p0, p1, p2, p3, xs, xsum = step_inputs(xq_row, xs_row, xsum_row, q0, quads, c_ok, pair_at, x_row, K_in,
                                           row_scale, g_ptr, pq_ptr, MASK_K, SELF_ROUND, NORM, PREQUANT)
    return acc + idot_products(words, s, p0, p1, p2, p3, xs, xsum, quads, z_ptr, rn, ok, stride_zn, WPG, HAS_ZP,
                               BLOCK_N, BLOCK_C, ASM)


@triton.jit
def gemv_idot(xq_ptr, xs_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, KW, quads_per_split, stride_zn,
              r_ptr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ROW_MASK: tl.constexpr,
              ASM: tl.constexpr, PDL: tl.constexpr = False, x_ptr=None, stride_xm=0, K_in=0, g_ptr=None, pq_ptr=None,
              eps=0.0, SELF_ROUND: tl.constexpr = False, NORM: tl.constexpr = False, PREQUANT: tl.constexpr = False,
              sq_ptr=None, n_parts=0, PARTS: tl.constexpr = 1, ROW_SCALE: tl.constexpr = False, scaled_ptr=None,
              LEAVE_NORM: tl.constexpr = False):
    """Batch-1 GEMV over ``[BLOCK_N, BLOCK_C, 4]`` word tiles (rows x quads x words) against activations rounded by
    :func:`quantize_activations` (one activation row per program, grid axis 2).

    Per quad and row the 4 words' dots run as one chain of ``dp2a`` into an int32 sum; the zero point's share
    (``16 z`` times the quad's integer sum) comes off in integers, and the quad's activation scale and the row's
    group scale turn it into fp32 (two float operations per 4 words). ``DIRECT`` stores the output row (one K
    slice; with ``HAS_BIAS`` and ``HAS_RESIDUAL`` rounded as torch rounds ``residual + linear``; with ``LEAVE_NORM``
    leaving the statistics of the RMSNorm that reads it, one part per row block: ``store_output``), otherwise fp32
    partials for mmsdk.kernels.split_k.finish_splits. With ``PDL`` a program loads its first step's words and
    scales before it waits for the kernel before it.

    With ``SELF_ROUND`` (kind "idotr") there is no rounding kernel: each program rounds the quads of its steps itself
    from the activation row (``x_ptr``, ``stride_xm``, ``K_in`` channels; with ``NORM`` an RMSNorm's input, its
    weight at ``g_ptr``, ``PREQUANT`` and ``eps`` as :func:`quantize_activations` takes them), as the rounding kernel
    rounds them: the same output bit for bit without a norm; with one, the row's ``1 / rms`` is summed in this
    program's thread layout and may differ in its last bit. Every program whose K slice holds a quad rounds it again:
    work traded for the rounding launch the GEMV would wait for.

    ``ROW_SCALE`` as in the gated kernels: the row is an RMSNorm's input times its weight (what the store before left,
    mmsdk.kernels.norm_fold.NormStatistics), and the sums are scaled by the row's ``1 / rms`` from the ``n_parts``
    partial sums of squares at ``sq_ptr`` (``K_in`` channels, ``eps``) before the bias: the norm applied with neither
    a launch of its own nor a read of the whole row.
    """
    WPG: tl.constexpr = GROUP // 8
    split, row, rn, n_ok, rc, rw, q_begin, q_end, n_quads, k_blocks = idot_program(N, KW, quads_per_split, GROUP,
                                                                                   BLOCK_N, BLOCK_C)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * KW
    xq_row, xs_row, xsum_row, pair_at = rounded_row(xq_ptr, xs_ptr, xsum_ptr, row, KW, n_quads, rc)
    x_row = x_ptr + row.to(tl.int64) * stride_xm if SELF_ROUND else x_ptr
    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    q_loop = q_begin
    if PDL:  # the first step's weights load while the kernel before it runs
        words, s, quads, c_ok, ok = step_tile(w_rows, s_ptr, q_begin, q_end, rn, n_ok, rc, rw, k_blocks, WPG, BLOCK_N,
                                              BLOCK_C, ROW_MASK)
        wait_for_inputs(PDL)
        row_scale = inverse_rms(x_row, K_in, eps, ROW_SCALE_BLOCK) if SELF_ROUND and NORM else 1.0
        p0, p1, p2, p3, xs, xsum = step_inputs(xq_row, xs_row, xsum_row, q_begin, quads, c_ok, pair_at, x_row, K_in,
                                               row_scale, g_ptr, pq_ptr, True, SELF_ROUND, NORM, PREQUANT)
        acc += idot_products(words, s, p0, p1, p2, p3, xs, xsum, quads, z_ptr, rn, ok, stride_zn, WPG, HAS_ZP,
                             BLOCK_N, BLOCK_C, ASM)
        q_loop = q_begin + BLOCK_C
    else:
        row_scale = inverse_rms(x_row, K_in, eps, ROW_SCALE_BLOCK) if SELF_ROUND and NORM else 1.0
    whole_end = q_loop + tl.maximum(q_end - q_loop, 0) // BLOCK_C * BLOCK_C
    for q0 in range(q_loop, whole_end, BLOCK_C):  # whole steps: no K masks
        acc = idot_step(acc, w_rows, s_ptr, q0, q_end, rn, n_ok, rc, rw, k_blocks, xq_row, xs_row, xsum_row, pair_at,
                        z_ptr, stride_zn, x_row, K_in, row_scale, g_ptr, pq_ptr, WPG, HAS_ZP, BLOCK_N, BLOCK_C,
                        ROW_MASK, ASM, False, SELF_ROUND, NORM, PREQUANT)
    for q0 in range(whole_end, q_end, BLOCK_C):  # the slice's last, partial step
        acc = idot_step(acc, w_rows, s_ptr, q0, q_end, rn, n_ok, rc, rw, k_blocks, xq_row, xs_row, xsum_row, pair_at,
                        z_ptr, stride_zn, x_row, K_in, row_scale, g_ptr, pq_ptr, WPG, HAS_ZP, BLOCK_N, BLOCK_C,
                        ROW_MASK, ASM, True, SELF_ROUND, NORM, PREQUANT)
    out = tl.sum(acc, 1)
    if ROW_SCALE:  # after the wait above (or, without PDL, after the kernel that left the sums)
        out *= rms_from_parts(load_norm_parts(sq_ptr, row, n_parts, PARTS), K_in, eps)
    if DIRECT:  # a norm read (NORM, ROW_SCALE) and one left (LEAVE_NORM) share g_ptr / sq_ptr: never both
        store_output(out, rn, n_ok, row, tl.program_id(0), N, b_ptr, r_ptr, out_ptr, g_ptr, scaled_ptr, sq_ptr,
                     n_parts, HAS_BIAS, HAS_RESIDUAL, LEAVE_NORM)
    else:
        tl.store(out_ptr + (split * M + row).to(tl.int64) * N + rn, out, mask=n_ok)
