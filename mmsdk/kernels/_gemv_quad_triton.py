"""Batch-1 "quad" GEMV kernels behind mmsdk.kernels.w4a16, and the step helpers the gated MLP's paired kernel
(_gemv_gated_triton.py) shares.

Imported only when a kernel is launched (through mmsdk.kernels._w4a16_triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmsdk.kernels._gemv_store_triton import store_output
from mmsdk.kernels._pdl_triton import wait_for_inputs


@triton.jit
def nibble_factor(P: tl.constexpr):
    """2**(85 - P): turns a nibble left at bit position ``P`` of a float's bit pattern into ``code * 2**-64``.

    Any bit pattern below 2**24 read as fp32 is that integer times 2**-149 (the subnormals and the floats of the
    lowest exponent continue one another), so a nibble at bits 20..23 needs no shift either.
    """
    if P == 0:
        return 3.8685626227668134e+25  # 2**85
    elif P == 4:
        return 2.4178516392292583e+24  # 2**81
    elif P == 8:
        return 1.5111572745182865e+23  # 2**77
    elif P == 12:
        return 9.44473296573929e+21  # 2**73
    elif P == 16:
        return 5.902958103587057e+20  # 2**69
    else:
        return 3.6893488147419103e+19  # 2**65


@triton.jit
def step_vectors(row, cw, c_ok, K_in, MASK_K: tl.constexpr = True):
    """The 8 values of every word of a step from one row (activations, or a folded norm's factors), ``[C, 4, 8]``:
    ``row[8w .. 8w+7]`` for each word ``w`` of each quad, contiguous per word (one or two 16-byte loads). Without
    ``MASK_K`` the caller knows the step's words lie inside K: the load takes no mask."""
    rq, rj = tl.arange(0, 4), tl.arange(0, 8)
    k = (cw[:, None, None] + rq[None, :, None]) * 8 + rj[None, None, :]
    if MASK_K:
        return tl.load(row + k, mask=c_ok[:, None, None] & (k < K_in), other=0.0)
    return tl.load(row + k)


@triton.jit
def by_nibble(v):
    """``[C, 4, 8]`` values split by nibble position into eight ``[C, 4]`` tiles (three in-register splits,
    ``j = 4 i0 + 2 i1 + i2``)."""
    even, odd = tl.split(tl.reshape(v, (v.shape[0], 4, 2, 2, 2)))
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def step_activations(x_row, cw, c_ok, K_in, MASK_K: tl.constexpr = True, f_row=None, NORM: tl.constexpr = False):
    """A step's activations for :func:`quad_step`, loaded and split by nibble once (shared by every weight).

    Returns ``2**-64 * sum x`` per quad (``[C]``) and the activations of nibble positions 0..7 (``[C, 4]``
    each), fp32, each times the factor that turns its masked nibble's subnormal into ``code * 2**-64``.

    With ``NORM`` (an RMSNorm folded into the GEMV) ``f_row`` holds, per channel, the norm's weight times that
    factor (mmsdk.kernels.norm_fold; bf16 or fp32): the activations become ``x * weight`` (exact in fp32: the
    product of a 16-bit float and a product of two) and the sum ``2**-64 * sum x * weight``; the row's ``1 / rms``
    scales the finished output (:func:`norm_scale`).
    """
    if NORM:
        f = step_vectors(f_row, cw, c_ok, K_in, MASK_K).to(tl.float32)
        v = step_vectors(x_row, cw, c_ok, K_in, MASK_K).to(tl.float32) * f
        y0, y1, y2, y3, y4, y5, y6, y7 = by_nibble(v)
        # each y_j over its factor is x_j * weight_j exactly (powers of two); then 2**-64 as in the plain sum
        plain = (y0 * 2.5849394142282115e-26 + y1 * 4.1359030627651384e-25 + y2 * 6.617444900424222e-24
                 + y3 * 1.0587911840678754e-22 + y4 * 1.6940658945086007e-21 + y5 * 2.710505431213761e-20
                 + y6 * 4.1359030627651384e-25 + y7 * 2.5849394142282115e-26)
        return tl.sum(plain, 1) * 5.421010862427522e-20, y0, y1, y2, y3, y4, y5, y6, y7
    a0, a1, a2, a3, a4, a5, a6, a7 = by_nibble(step_vectors(x_row, cw, c_ok, K_in, MASK_K))
    x0, x1, x2, x3 = a0.to(tl.float32), a1.to(tl.float32), a2.to(tl.float32), a3.to(tl.float32)
    x4, x5, x6, x7 = a4.to(tl.float32), a5.to(tl.float32), a6.to(tl.float32), a7.to(tl.float32)
    xs = tl.sum((x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7) * 5.421010862427522e-20, 1)  # 2**-64 * sum x
    # nibble 5 is masked in place (bits 20..23); 6 and 7 are read from the word shifted right by 20 and 28 (bits 4, 0)
    return (xs, x0 * nibble_factor(0), x1 * nibble_factor(4), x2 * nibble_factor(8), x3 * nibble_factor(12),
            x4 * nibble_factor(16), x5 * nibble_factor(20), x6 * nibble_factor(4), x7 * nibble_factor(0))


@triton.jit
def squares_at(x_row, w0, w_end, rc, K_in, MASK_K: tl.constexpr, NORM: tl.constexpr, WHOLE_ROW: tl.constexpr):
    """``sum x**2`` per quad of the step at word ``w0`` (``[C]``, fp32; zeros unless ``NORM`` and ``WHOLE_ROW``).

    The load is the one :func:`step_activations` makes, and the compiler merges the two (offline sm_90 builds of the
    8 x 128 x 4 tile: 16 16-byte loads per step with a folded norm, 12 without: the 4 more are the factors). A
    program whose slice is the whole row sums its row's squares this way instead of reading the row again after its
    K loop (:func:`inverse_rms`)."""
    squares = tl.zeros(rc.shape, tl.float32)
    if NORM:
        if WHOLE_ROW:
            cw = w0 + 4 * rc
            x = step_vectors(x_row, cw, cw < w_end, K_in, MASK_K).to(tl.float32)
            squares = tl.sum(tl.sum(x * x, 2), 1)
    return squares


@triton.jit
def norm_scale(ssq, x_row, K_in, eps, WHOLE_ROW: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """The folded norm's ``1 / rms`` of the row: from the squares summed in the K loop (``WHOLE_ROW``) or read
    again (:func:`inverse_rms`)."""
    if WHOLE_ROW:
        return tl.math.rsqrt(tl.sum(ssq, 0) / K_in + eps)
    return inverse_rms(x_row, K_in, eps, NORM_BLOCK)


@triton.jit
def inverse_rms(x_row, K_in, eps, BLOCK: tl.constexpr):
    """``1 / sqrt(mean(x**2) + eps)`` over the row's ``K_in`` activations, fp32 (a folded RMSNorm's scale), for
    programs that see only a slice of the row: the quad GEMVs read the row again after their K loop, the "idot"
    rounding kernel before it rounds its quads. ``BLOCK`` covers K in one or a few passes: the loads of one pass are in
    flight together.
    """
    acc = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K_in, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_row + k, mask=k < K_in, other=0.0).to(tl.float32)
        acc += v * v
    return tl.math.rsqrt(tl.sum(acc, 0) / K_in + eps)


@triton.jit
def quad_scales(s_ptr, rn, g, ok, k_blocks, MASK: tl.constexpr = True):
    """The fp32 scale of every row and quad of a step, ``[BLOCK_N, BLOCK_C]`` (loaded before the activations);
    without ``MASK`` every row and quad is known to exist."""
    if MASK:
        return tl.load(s_ptr + rn[:, None] * k_blocks + g[None, :], mask=ok, other=0.0).to(tl.float32)
    return tl.load(s_ptr + rn[:, None] * k_blocks + g[None, :]).to(tl.float32)


@triton.jit
def quad_step(words, s, z_ptr, rn, g, ok, stride_zn, xs, y0, y1, y2, y3, y4, y5, y6, y7,
              HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """One weight's ``2**-64 * s * (sum code x - z sum x)`` for a step, ``[BLOCK_N, BLOCK_C]`` (rows x quads).

    ``words`` is the step's ``[BLOCK_N, BLOCK_C, 4]`` word tile, ``s`` its scales (:func:`quad_scales`), ``g``
    each quad's group, ``xs`` and ``y*`` come from :func:`step_activations`. A nibble masked in place is a
    subnormal: one AND and one FMA per nibble. The 32 nibbles of a quad run as one chain of FMAs (word by word,
    :func:`word_terms`): no sum over the quad's words afterwards, and one accumulator per quad instead of four
    (offline sm_90 builds of the 8 x 128 x 4 tile: 24.0 instructions per weight word and 96 registers, against
    24.8 and 126 with a sum of four word products).
    """
    a, b = tl.split(tl.reshape(words, (BLOCK_N, BLOCK_C, 2, 2)))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    t = word_terms(w0, y0, y1, y2, y3, y4, y5, y6, y7, 0, tl.zeros((BLOCK_N, BLOCK_C), tl.float32))
    t = word_terms(w1, y0, y1, y2, y3, y4, y5, y6, y7, 1, t)
    t = word_terms(w2, y0, y1, y2, y3, y4, y5, y6, y7, 2, t)
    t = word_terms(w3, y0, y1, y2, y3, y4, y5, y6, y7, 3, t)
    if HAS_ZP:
        zb = tl.load(z_ptr + rn[:, None] * stride_zn + g[None, :] // 2, mask=ok, other=0)
        z = ((zb >> ((g[None, :] % 2) * 4).to(tl.uint8)) & 15).to(tl.float32)
    else:
        z = tl.full((BLOCK_N, BLOCK_C), 8.0, tl.float32)
    return s * (t - z * xs[None, :])


@triton.jit
def pick(y, Q: tl.constexpr):
    """Column ``Q`` of a ``[C, 4]`` tile (register splits: each thread holds a quad's four columns)."""
    a, b = tl.split(tl.reshape(y, (y.shape[0], 2, 2)))
    if Q == 0:
        return tl.split(a)[0]
    elif Q == 1:
        return tl.split(b)[0]
    elif Q == 2:
        return tl.split(a)[1]
    return tl.split(b)[1]


@triton.jit
def word_terms(w, y0, y1, y2, y3, y4, y5, y6, y7, Q: tl.constexpr, t):
    """``t`` plus the 8 nibble products of word ``Q`` of every quad (``w``: ``[BLOCK_N, BLOCK_C]``), in nibble order.

    Nibble 5 is masked in place (a bit pattern below 2**24 read as fp32 is that integer times 2**-149); nibbles 6
    and 7 come from logical shifts by 20 (then an AND) and 28 (no AND).
    """
    unsigned = w.to(tl.uint32, bitcast=True)
    t += (w & 15).to(tl.float32, bitcast=True) * pick(y0, Q)[None, :]
    t += (w & 0xF0).to(tl.float32, bitcast=True) * pick(y1, Q)[None, :]
    t += (w & 0xF00).to(tl.float32, bitcast=True) * pick(y2, Q)[None, :]
    t += (w & 0xF000).to(tl.float32, bitcast=True) * pick(y3, Q)[None, :]
    t += (w & 0xF0000).to(tl.float32, bitcast=True) * pick(y4, Q)[None, :]
    t += (w & 0xF00000).to(tl.float32, bitcast=True) * pick(y5, Q)[None, :]
    t += ((unsigned >> 20) & 0xF0).to(tl.float32, bitcast=True) * pick(y6, Q)[None, :]
    t += (unsigned >> 28).to(tl.float32, bitcast=True) * pick(y7, Q)[None, :]
    return t


@triton.jit
def quad_accumulate(words, s, x_row, cw, c_ok, K_in, z_ptr, rn, g, ok, stride_zn, HAS_ZP: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, MASK_K: tl.constexpr = True, f_row=None,
                    NORM: tl.constexpr = False):
    """One weight's step, :func:`quad_step`, with the step's activations loaded here (``NORM``: as
    :func:`step_activations` takes it)."""
    xs, y0, y1, y2, y3, y4, y5, y6, y7 = step_activations(x_row, cw, c_ok, K_in, MASK_K, f_row, NORM)
    return quad_step(words, s, z_ptr, rn, g, ok, stride_zn, xs, y0, y1, y2, y3, y4, y5, y6, y7, HAS_ZP, BLOCK_N,
                     BLOCK_C)


@triton.jit
def whole_steps_end(w_loop, w_end, K_in, STEP: tl.constexpr):
    """Where the steps from ``w_loop`` stop lying wholly inside both the slice (``w_end``) and K (``K_in``
    activations: padded layers have packed words past it)."""
    return w_loop + tl.maximum(tl.minimum(w_end, K_in // 8) - w_loop, 0) // STEP * STEP


@triton.jit
def step_words(w_ptr, at, w0, rw, n_ok, w_end, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, MASK_K: tl.constexpr,
               MASK_N: tl.constexpr):
    """One weight's words of the step at word ``w0``, ``[BLOCK_N, BLOCK_C, 4]`` (``at``: ``row * KW + i`` for each row
    and each word ``i`` of a step, 0 .. 4 BLOCK_C - 1).

    ``MASK_K`` masks words past the slice, ``MASK_N`` rows past N. A step known to lie inside both needs neither:
    about 1.5 fewer instructions per weight word in the K loop with the scales and activations unmasked too
    (offline sm_90 builds).
    """
    if MASK_K:
        flat = tl.load(w_ptr + at + w0, mask=n_ok[:, None] & (w0 + rw < w_end)[None, :], other=0)
    elif MASK_N:
        flat = tl.load(w_ptr + at + w0, mask=n_ok[:, None], other=0)
    else:
        flat = tl.load(w_ptr + at + w0)
    return tl.reshape(flat, (BLOCK_N, BLOCK_C, 4))


@triton.jit
def step_scales(s_ptr, rn, g, ok, n_ok, k_blocks, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                MASK_K: tl.constexpr, MASK_N: tl.constexpr):
    """:func:`quad_scales` masked as :func:`step_words` masks the words (``ok``: rows and quads that exist)."""
    if MASK_K:
        return quad_scales(s_ptr, rn, g, ok, k_blocks)
    return quad_scales(s_ptr, rn, g, tl.broadcast_to(n_ok[:, None], (BLOCK_N, BLOCK_C)), k_blocks, MASK_N)


@triton.jit
def quad_step_at(w_ptr, at, w0, w_end, rw, rc, n_ok, s_ptr, rn, k_blocks, x_row, K_in, z_ptr, stride_zn,
                 WPG: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                 MASK_K: tl.constexpr, MASK_N: tl.constexpr, f_row=None, NORM: tl.constexpr = False):
    """One weight's step at word ``w0``: its words, scales and activations loaded (masked as in
    :func:`step_words`), :func:`quad_step` run."""
    cw = w0 + 4 * rc  # first word of each quad
    c_ok = cw < w_end
    ok = n_ok[:, None] & c_ok[None, :]
    words = step_words(w_ptr, at, w0, rw, n_ok, w_end, BLOCK_N, BLOCK_C, MASK_K, MASK_N)
    g = cw // WPG
    s = step_scales(s_ptr, rn, g, ok, n_ok, k_blocks, BLOCK_N, BLOCK_C, MASK_K, MASK_N)
    return quad_accumulate(words, s, x_row, cw, c_ok, K_in, z_ptr, rn, g, ok, stride_zn, HAS_ZP, BLOCK_N, BLOCK_C,
                           MASK_K, f_row, NORM)


@triton.jit
def gemv_quad(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K_in, KW, groups_per_split, stride_xm,
              stride_zn, w2_ptr, s2_ptr, z2_ptr, n_blocks, r_ptr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
              HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, PAIRED: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_C: tl.constexpr, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
              HAS_RESIDUAL: tl.constexpr = False, ROW_MASK: tl.constexpr = True, f_ptr=None, eps=0.0,
              NORM: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1024, WHOLE_ROW: tl.constexpr = False,
              g_ptr=None, scaled_ptr=None, sq_ptr=None, LEAVE_NORM: tl.constexpr = False):
    """Batch-1 GEMV over ``[BLOCK_N, BLOCK_C, 4]`` word tiles (one activation row per program).

    With ``PAIRED`` two weights of the same shape share the launch (a gated MLP's gate and up
    projections): programs past ``n_blocks`` along axis 0 read the second weight (``w2/s2/z2``) and
    write its fp32 partials at columns ``N .. 2N`` of ``out`` (rows ``2N`` wide), for
    ``split_gated`` to finish as ``silu(gate) * up`` (the paired GEMV's "quad" kinds; its "gated"
    kind is :func:`gemv_quad_gated`, which needs no epilogue at one K slice).

    Three things make it fast where :func:`gemv` is not (H200 measurements in docs/benchmarks.md):

    * Activations as 16-byte vectors. :func:`gemv` gathers each nibble position's activation
      (``x[8w + j]``) with a 2-byte load whose 32 lanes hit addresses 64 bytes apart, about 16 L1
      wavefronts per load and 8 loads per weight word: the activations, not the weights, saturated
      the load path (1.0-1.2 TB/s whatever else changed). Here a word's 8 activations are one
      16-byte load, split by nibble position in registers.
    * Subnormal nibbles. A nibble masked in place, ``w & (15 << 4j)``, read as an fp32 bit pattern
      is exactly ``code * 2**(4j - 149)`` (a subnormal, or for nibble 5 at bits 20..23 possibly a float
      of the lowest exponent, which continues the subnormals linearly); times ``x * 2**(85 - 4j)`` it
      gives ``code * x * 2**-64`` in one FMA, so a nibble costs one AND instead of a shift, an AND, an
      OR and a subtraction. Nibbles 6 and 7 come from logical shifts by 20 (then an AND) and by 28 (no
      AND). The zero point folds out (``s * (sum c x - z sum x)``), the 2**-64 is undone at the end
      (exact; activations up to 2**42 stay finite). Needs subnormals kept (PTX ``fma.rn.f32`` without
      ``.ftz``, Triton's default); the GPU tests compare against the reference and catch a flush.
    * Whole steps without masks. The steps that lie wholly inside the K slice and K load their words,
      scales and activations without K masks (rows are masked only where N is not a multiple of
      BLOCK_N: ``ROW_MASK``); the slice's last, partial step runs with them. Offline sm_90 builds
      (benchmarks/sm90_gemv_builds.py) of the 8 x 128 x 4 tile: 24.0 SASS instructions per weight
      word in the whole steps and 25.6 in the last one, against 27.3 when every step was masked,
      nibbles 5..7 came from one arithmetic shift by 20 and each word's products were summed apart.
    * Quads. The last tile axis is one 16-byte weight load of 4 words of one group, so a thread
      loads one scale per row and quad and runs its 4 words as one FMA chain before scaling; the weights are loaded
      as one contiguous run per row (lanes along K) and viewed as quads; rows run over warps, so an
      activation a thread loads serves ``BLOCK_N / num_warps`` rows. The fastest tiles measured carry
      128-256 weight bytes per thread and step, and at 8 rows or fewer the activations' split by
      nibble position needs 2-11 shared-memory barriers per program over both K loops (43-45 for the
      16- and 32-row tiles of 4 warps; benchmarks/sm90_gemv_builds.py).

    With ``PREFETCH`` (kind "quadp") each step issues the next step's weight loads before its own
    arithmetic (registers for two word tiles), so a program keeps loads in flight while it computes.

    With ``PDL`` (launched with programmatic dependent launch, mmsdk/kernels/_pdl_triton.py) a program
    loads its first step's words and scales, which no earlier kernel writes, while the kernel before it
    still runs, then waits for that kernel before it reads the activations.

    With ``HAS_RESIDUAL`` and ``DIRECT`` the store is ``residual + x @ W.T`` (``r_ptr``: ``[M, N]``, out's
    dtype), rounded as torch rounds the two steps (:func:`add_residual`): a decoder layer's last residual add.

    With ``NORM`` the GEMV reads an RMSNorm's input, not its output: the product is ``rms_norm(x) @ W.T``
    (mmsdk.kernels.norm_fold). The K loop multiplies by ``x * weight`` (``f_ptr``: the norm's weight times each
    channel's nibble factor), and the row's ``1 / rms`` scales the sum before the bias: the norm's own launch is
    gone from a decode step. With ``WHOLE_ROW`` (one K slice) the K loop sums the squares of the activations it
    loads, otherwise the row is read again after it (:func:`norm_scale`, ``eps``, ``NORM_BLOCK``).

    With ``LEAVE_NORM`` and ``DIRECT`` the output is an RMSNorm's input (its weight at ``g_ptr``), and the store
    also leaves that norm's statistics for the norm's reader (:func:`leave_norm_statistics`: ``n_blocks`` parts per
    row at ``sq_ptr``, ``weight * out`` at ``scaled_ptr``): a decoder layer's attention output plus residual, which
    its gated MLP reads.
    """
    WPG: tl.constexpr = GROUP // 8
    pid_n, split, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    out_cols = N
    column0 = 0
    if PAIRED:
        out_cols = 2 * N
        if pid_n >= n_blocks:  # the second weight: same shape, its own buffers
            pid_n -= n_blocks
            column0 = N
            w_ptr, s_ptr, z_ptr = w2_ptr, s2_ptr, z2_ptr
    k_blocks = KW // WPG
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, BLOCK_C)
    n_ok = rn < N
    x_row = x_ptr + row * stride_xm
    f_row = f_ptr if NORM else x_row
    ssq = tl.zeros((BLOCK_C,), tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    w_begin = split * groups_per_split * WPG
    w_end = tl.minimum(w_begin + groups_per_split * WPG, KW)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * KW
    rw = tl.arange(0, 4 * BLOCK_C)
    w_loop = w_begin
    if PREFETCH or PDL:  # the first step's words; with PREFETCH each step then loads the next step's
        flat = tl.load(w_rows + w_begin + rw[None, :], mask=n_ok[:, None] & (w_begin + rw < w_end)[None, :], other=0)
    if PDL:
        if PREFETCH:
            wait_for_inputs(PDL)
        else:  # the first step, its words and scales loaded before the wait
            cw = w_begin + 4 * rc
            c_ok = cw < w_end
            ok = n_ok[:, None] & c_ok[None, :]
            g = cw // WPG
            s = quad_scales(s_ptr, rn, g, ok, k_blocks)
            wait_for_inputs(PDL)
            acc += quad_accumulate(tl.reshape(flat, (BLOCK_N, BLOCK_C, 4)), s, x_row, cw, c_ok, K_in, z_ptr, rn, g,
                                   ok, stride_zn, HAS_ZP, BLOCK_N, BLOCK_C, True, f_row, NORM)
            ssq += squares_at(x_row, w_begin, w_end, rc, K_in, True, NORM, WHOLE_ROW)
            w_loop = w_begin + 4 * BLOCK_C
    if PREFETCH:
        for w0 in range(w_loop, w_end, 4 * BLOCK_C):
            cw = w0 + 4 * rc  # first word of each quad
            c_ok = cw < w_end
            ok = n_ok[:, None] & c_ok[None, :]
            words = tl.reshape(flat, (BLOCK_N, BLOCK_C, 4))
            at = w0 + 4 * BLOCK_C + rw
            flat = tl.load(w_rows + at[None, :], mask=n_ok[:, None] & (at < w_end)[None, :], other=0)
            g = cw // WPG
            s = quad_scales(s_ptr, rn, g, ok, k_blocks)
            acc += quad_accumulate(words, s, x_row, cw, c_ok, K_in, z_ptr, rn, g, ok, stride_zn, HAS_ZP, BLOCK_N,
                                   BLOCK_C, True, f_row, NORM)
            ssq += squares_at(x_row, w0, w_end, rc, K_in, True, NORM, WHOLE_ROW)
    else:
        full_end = whole_steps_end(w_loop, w_end, K_in, 4 * BLOCK_C)
        row_words = rn[:, None].to(tl.int64) * KW + rw[None, :]
        for w0 in range(w_loop, full_end, 4 * BLOCK_C):  # no K masks: every word and activation exists
            acc += quad_step_at(w_ptr, row_words, w0, w_end, rw, rc, n_ok, s_ptr, rn, k_blocks, x_row, K_in, z_ptr,
                                stride_zn, WPG, HAS_ZP, BLOCK_N, BLOCK_C, False, ROW_MASK, f_row, NORM)
            ssq += squares_at(x_row, w0, w_end, rc, K_in, False, NORM, WHOLE_ROW)
        for w0 in range(full_end, w_end, 4 * BLOCK_C):  # the slice's last, partial step
            acc += quad_step_at(w_ptr, row_words, w0, w_end, rw, rc, n_ok, s_ptr, rn, k_blocks, x_row, K_in, z_ptr,
                                stride_zn, WPG, HAS_ZP, BLOCK_N, BLOCK_C, True, True, f_row, NORM)
            ssq += squares_at(x_row, w0, w_end, rc, K_in, True, NORM, WHOLE_ROW)
    out = tl.sum(acc, 1) * 1.8446744073709552e+19  # undo 2**-64
    if NORM:  # every K slice's partial: the sum of them is linear in the row's scale
        out *= norm_scale(ssq, x_row, K_in, eps, WHOLE_ROW, NORM_BLOCK)
    dst = out_ptr + (split * M + row).to(tl.int64) * out_cols + column0 + rn
    if DIRECT:
        store_output(out, rn, n_ok, row, pid_n, N, b_ptr, r_ptr, out_ptr, g_ptr, scaled_ptr, sq_ptr, n_blocks,
                     HAS_BIAS, HAS_RESIDUAL, LEAVE_NORM)
    else:
        tl.store(dst, out, mask=n_ok)
