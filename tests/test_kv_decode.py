"""Packed int4 KV decode attention kernels (all variants) against the fp64 reference, on fresh random codes.

On CPU the kernels run under Triton's interpreter (fp32 / fp16 queries: the interpreter mishandles
bf16) in a process of their own; on CUDA the compiled kernels run, which is where a flush of
subnormals (the "subnormal" variant depends on them) would show up as wrong outputs.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
from pathlib import Path

import pytest
import torch

from mmsdk.plugins.quantizers.quantized_cache import Packed, StaticCodec

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # must be set before Triton first compiles anything
WORD_VARIANTS = ("subnormal", "magic")


@pytest.fixture
def device():
    """The device the kernels run on, skipping where they cannot run."""
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    if CUDA:
        return "cuda"
    if not INTERPRETING:
        pytest.skip("interpreter checks run in their own process (test_kv_decode_under_the_interpreter)")
    from tests import _interpreter

    _interpreter.patch()
    return "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _problem(device, hq, hkv, dim, t_max, length, dtype=torch.float32, key_codes=None, query=None):
    """(query, codes, scales, length tensor, dequantized K, dequantized V) with random codes and scales."""
    codes = [torch.randint(0, 256, (1, hkv, t_max, dim // 2), dtype=torch.uint8, device=device) for _ in range(2)]
    if key_codes is not None:
        codes[0] = key_codes
    scales = [torch.rand(hkv, dim, device=device) * 0.3 + 0.05 for _ in range(2)]
    deq = [StaticCodec("int4", s).decode(Packed(c[:, :, :length]), torch.float32, dim)
           for c, s in zip(codes, scales, strict=True)]
    if query is None:
        query = torch.randn(1, hq, 1, dim, device=device)
    count = torch.tensor([length], dtype=torch.int64, device=device)
    return query.to(dtype), codes, scales, count, deq[0], deq[1]


def _check(device, variant, config, hq, hkv, dim, t_max, length, dtype, masks, tol):
    """Run one variant on a fresh problem with each mask and compare with the reference."""
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention

    query, codes, scales, count, k_deq, v_deq = _problem(device, hq, hkv, dim, t_max, length, dtype)
    for mask in masks:
        out = decode_attention(query, *codes, *scales, count, "int4", dim**-0.5, mask, config=config, variant=variant)
        assert out.dtype == dtype
        assert _rel(out, reference_decode_attention(query, k_deq, v_deq, dim**-0.5, mask)) < tol


@pytest.mark.parametrize("variant", WORD_VARIANTS)
def test_mha_word_kernels_match_reference(device, variant):
    torch.manual_seed(1)
    # (dim, t_max, length, BLOCK_T, target programs): a length that is no multiple of BLOCK_T over several
    # splits, a length far below t_max (most splits empty), head_dim 128 (16 words per token)
    for dim, t_max, length, block_t, target in ((32, 100, 77, 16, 8), (32, 200, 5, 16, 16), (128, 48, 41, 16, 4)):
        mask = torch.rand(1, length + 3, device=device) > 0.3
        _check(device, variant, (block_t, 1, target), 2, 2, dim, t_max, length, torch.float32, (None, mask),
               1e-4)  # interpreter fp32 ~5e-7 measured
    mask = torch.rand(1, 80, device=device) > 0.3
    _check(device, variant, None, 2, 2, 64, 80, 70, torch.float16, (None, mask), 3e-3)  # fp16 output ~2e-4


def test_gqa_kernels_take_block_configs(device):
    """Grouped-query heads (4 per KV head, tensor-core path) under the default and tuned block configurations."""
    torch.manual_seed(2)
    mask = torch.rand(1, 80, device=device) > 0.3
    # (variant, (BLOCK_T, warps, target programs[, stages])): defaults, a split per few tiles, one split over all
    # a fifth entry for "generic": each tile's V codes loaded with its K codes
    for variant, config in (("generic", None), ("generic", (32, 4, 4, 3)), ("generic", (64, 8, 1)),
                            ("generic", (32, 4, 4, 2, True)), ("generic", (64, 8, 1, None, False)),
                            ("magic", (32, 4, 4, 2)), ("magic", (64, 4, 1))):
        # "generic" rounds q and the softmax weights to fp16 for its dots (~3e-4); "magic" computes in fp32
        # (interpreter ~1e-6), which CUDA runs on TF32 tensor cores (~1e-3)
        tol = 5e-3 if device != "cpu" else 2e-3 if variant == "generic" else 1e-4
        _check(device, variant, config, 8, 2, 32, 100, 77, torch.float32, (None, mask), tol)
    from mmsdk.kernels.kv_decode import decode_attention

    query, codes, scales, count, _, _ = _problem(device, 8, 2, 32, 20, 10)
    with pytest.raises(ValueError, match="BLOCK_T, num_warps, target programs"):
        decode_attention(query, *codes, *scales, count, "int4", 0.1, config=(32, 4), variant="generic")
    with pytest.raises(ValueError, match="BLOCK_T, num_warps, target programs"):
        decode_attention(query, *codes, *scales, count, "int4", 0.1, config=(32, 4, 8, 2, 1), variant="magic")


def test_lazy_rescaling_follows_growing_scores(device):
    """Later keys line up with q more and more, so the running max climbs many times past the slack."""
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention

    torch.manual_seed(3)
    dim, t_max, length = 32, 160, 150
    query = torch.randn(1, 2, 1, dim, device=device) * 6
    noise = torch.randint(-3, 4, (1, 2, t_max, dim), device=device)
    trend = (torch.arange(t_max, device=device) * 8 // t_max)[None, None, :, None]
    values = (noise + trend * query.sign().long()).clamp(-8, 7) + 8
    key_codes = (values[..., 0::2] | (values[..., 1::2] << 4)).to(torch.uint8)
    query, codes, scales, count, k_deq, v_deq = _problem(device, 2, 2, dim, t_max, length, key_codes=key_codes,
                                                         query=query)
    scores = (query.double() @ k_deq.double().transpose(-1, -2)) * dim**-0.5 * 1.4426950408889634
    climb = scores[..., :length].cummax(-1).values
    assert float((climb[..., -1] - climb[..., 15]).min()) > 32  # > 4 rescales of 8 (log2 units) after tile 1
    expected = reference_decode_attention(query, k_deq, v_deq, dim**-0.5)
    for variant in WORD_VARIANTS:
        out = decode_attention(query, *codes, *scales, count, "int4", dim**-0.5, config=(16, 1, 2), variant=variant)
        assert _rel(out, expected) < 1e-4  # interpreter fp32: subnormal ~1.4e-6, magic ~6e-7
    # the next tile's K/V loaded ahead; V's sums over a quarter of each tile's tokens (rescaled as the tiles go); the
    # tile loop pipelined by Triton (3 stages: through shared memory on CUDA)
    for config in ((16, 1, 2, None, True, False), (16, 1, 2, None, True, True), (32, 1, 2, None, False, True),
                   (16, 1, 2, 3, False, True, True)):
        out = decode_attention(query, *codes, *scales, count, "int4", dim**-0.5, config=config, variant="subnormal")
        assert _rel(out, expected) < 1e-4, config


def test_integer_key_dots_only_round_the_query(device):
    """The "subnormal" kernel's integer K dots (config entry 7) equal attention with the query rounded as
    _kv_intdot_triton.py documents (one scale per head, 16-bit integers) and stay near the exact reference with a few
    K channels 15x larger than the rest; the float dots stay at fp32 error."""
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention

    torch.manual_seed(5)
    dim, t_max, length, heads = 128, 96, 90, 2
    query, codes, scales, count, k_deq, v_deq = _problem(device, heads, heads, dim, t_max, length)
    scales[0][:, :4] *= 15  # outlier channels: the head's largest query product sets the integer scale
    k_deq[..., :4] *= 15
    log2_scale = dim**-0.5 * 1.4426950408889634
    a = query[:, :, 0].float() * scales[0][None] * log2_scale  # the kernel's pre-scaled query [1, H, D]
    top = a.abs().amax(-1, keepdim=True)
    rounded = torch.floor(a.double() * (32767.0 / top.double()) + 0.5)  # == fma(a, 32767 / top, 0.5) in fp64
    codes_k = torch.stack([codes[0][:, :, :length] & 15, codes[0][:, :, :length] >> 4], -1).flatten(-2).double() - 8
    scores = torch.einsum("bhd,bhtd->bht", rounded, codes_k) * (top.double() / 32767)
    modelled = (torch.softmax(scores * math.log(2), -1)[:, :, None] @ v_deq.double()).transpose(1, 2)
    exact = reference_decode_attention(query, k_deq, v_deq, dim**-0.5)
    for config in ((32, 1, 2, None, True, True, True), (16, 1, 4, None, False, False, True)):
        out = decode_attention(query, *codes, *scales, count, "int4", dim**-0.5, config=config, variant="subnormal")
        assert _rel(out, modelled) < 1e-5, config  # interpreter fp32 ~2e-7
        assert _rel(out, exact) < 2e-3, config  # the query's rounding: ~1e-4 here
    out = decode_attention(query, *codes, *scales, count, "int4", dim**-0.5, config=(32, 1, 2, None, True, True, False),
                           variant="subnormal")
    assert _rel(out, exact) < 1e-4


def test_leading_masked_tiles_and_empty_rows(device):
    """Whole tiles masked before the first kept token, and a batch row whose mask keeps nothing, give no NaN."""
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention

    torch.manual_seed(4)
    query, codes, scales, count, k_deq, v_deq = _problem(device, 2, 2, 32, 96, 90)
    mask = torch.rand(1, 96, device=device) > 0.3
    mask[:, :50] = False
    for prefetch, fold in ((False, False), (True, False), (True, True)):
        out = decode_attention(query, *codes, *scales, count, "int4", 32**-0.5, mask,
                               config=(16, 1, 2, None, prefetch, fold), variant="subnormal")
        assert _rel(out, reference_decode_attention(query, k_deq, v_deq, 32**-0.5, mask)) < 1e-4, prefetch  # ~5e-7
    out = decode_attention(query, *codes, *scales, count, "int4", 32**-0.5, torch.zeros_like(mask),
                           config=(16, 1, 2), variant="subnormal")
    assert not out.isnan().any() and float(out.abs().max()) == 0.0


def test_variant_choice_is_validated(device):
    from mmsdk.kernels.kv_decode import VARIANTS, decode_attention

    assert VARIANTS[0] == "subnormal"
    query, codes, scales, count, _, _ = _problem(device, 2, 2, 32, 20, 10)
    with pytest.raises(ValueError, match="one of"):
        decode_attention(query, *codes, *scales, count, "int4", 0.1, variant="fast")
    int8_codes = [torch.zeros(1, 2, 20, 32, dtype=torch.int8, device=device) for _ in range(2)]
    with pytest.raises(ValueError, match="int32 words"):
        decode_attention(query, *int8_codes, *scales, count, "int8", 0.1, variant="subnormal")
    gqa_query = torch.randn(1, 4, 1, 32, device=device)  # 4 query heads over 2 KV heads
    with pytest.raises(ValueError, match="one KV head per query head"):
        decode_attention(gqa_query, *codes, *scales, count, "int4", 0.1, variant="subnormal")
    with pytest.raises(ValueError, match="a seventh"):  # fold and kdot are the subnormal kernel's; nothing past them
        decode_attention(query, *codes, *scales, count, "int4", 0.1, config=(16, 1, 2, None, True, True, True, 1),
                         variant="subnormal")
    with pytest.raises(ValueError, match="a seventh"):
        decode_attention(query, *codes, *scales, count, "int4", 0.1, config=(16, 1, 2, None, True, True, True),
                         variant="magic")


def test_generic_tiles_follow_batch_rows_times_kv_heads(monkeypatch):
    """decode_attention sizes the generic kernel's tiles by its (batch row, KV head) pairs (generic_config's ``rows``),
    whose count sets how many programs a call has, and by the codes' format."""
    pytest.importorskip("triton")
    from mmsdk.kernels import kv_decode

    class Picked(Exception):
        pass

    seen = []

    def spy(*args, **kwargs):
        seen.append((kwargs.get("rows"), kwargs.get("fmt")))
        raise Picked

    monkeypatch.setattr(kv_decode, "generic_config", spy)
    for batch, hkv, fmt in ((1, 4, "int4"), (2, 4, "int4"), (3, 8, "int4"), (2, 4, "int8")):
        query = torch.randn(batch, 7 * hkv, 1, 32)
        width, dtype = (16, torch.uint8) if fmt == "int4" else (32, torch.int8)
        codes = [torch.zeros(batch, hkv, 64, width, dtype=dtype) for _ in range(2)]
        scale = torch.ones(hkv, 32)
        with pytest.raises(Picked):
            kv_decode.decode_attention(query, *codes, scale, scale, torch.tensor([10]), fmt, 0.1)
    assert seen == [(4, "int4"), (8, "int4"), (24, "int4"), (8, "int8")]


def test_attention_appends_the_new_token_itself(device):
    """decode_attention(..., append=(k, v)) equals append_kv, a length increment and decode_attention: the same
    codes, length and output bitwise ("subnormal" and "generic" append in their own launches, "magic" first)."""
    from mmsdk.kernels.kv_decode import append_kv, decode_attention

    torch.manual_seed(4)
    # (query heads, KV heads, dim, t_max, length, variant, config): the new token inside a split, at a split's
    # first position, the last cache slot, with a mask, through the tile loop pipelined by Triton (its loads, through
    # shared memory on CUDA, come after the program's barrier that follows the new token's stores), and grouped heads
    # (appended before the kernel)
    cases = ((2, 2, 32, 100, 77, "subnormal", (16, 1, 8)), (2, 2, 32, 96, 48, "subnormal", (16, 1, 4)),
             (2, 2, 128, 48, 47, "subnormal", None), (3, 3, 32, 64, 20, "subnormal", (16, 1, 64, None, False)),
             (2, 2, 32, 100, 77, "subnormal", (32, 1, 8, None, True, True)),
             (2, 2, 32, 100, 77, "subnormal", (16, 1, 8, 4, False, True, True)),
             (2, 2, 128, 96, 48, "subnormal", (16, 1, 4, 3, False, True, True)),
             (4, 2, 32, 64, 30, "magic", None), (4, 2, 32, 64, 30, "generic", None))
    for hq, hkv, dim, t_max, length, variant, config in cases:
        query, codes, scales, count, _, _ = _problem(device, hq, hkv, dim, t_max, length)
        new = [torch.randn(1, hkv, 1, dim, device=device) for _ in range(2)]
        mask = torch.rand(1, length + 1, device=device) > 0.3 if hq == 3 else None
        appended, count_a = [c.clone() for c in codes], count.clone()
        append_kv(*new, *appended, *scales, count_a, "int4")
        count_a += 1
        expected = decode_attention(query, *appended, *scales, count_a, "int4", dim**-0.5, mask, config, variant)
        got = decode_attention(query, *codes, *scales, count, "int4", dim**-0.5, mask, config, variant,
                               append=(new[0], new[1]))
        assert torch.equal(codes[0], appended[0]) and torch.equal(codes[1], appended[1]), (variant, length)
        assert int(count) == length + 1
        assert torch.equal(got, expected), (variant, length)
    # int8 codes (the "generic" byte kernel, grouped heads), V's codes loaded after the softmax and with K's
    for v_ahead in (False, True):
        codes = [torch.randint(-128, 128, (1, 2, 40, 32), dtype=torch.int8, device=device) for _ in range(2)]
        scales = [torch.rand(2, 32, device=device) * 0.05 + 0.01 for _ in range(2)]
        query = torch.randn(1, 4, 1, 32, device=device)
        new = [torch.randn(1, 2, 1, 32, device=device) for _ in range(2)]
        appended = [c.clone() for c in codes]
        count, count_a = (torch.tensor([17], device=device) for _ in range(2))
        append_kv(*new, *appended, *scales, count_a, "int8")
        count_a += 1
        config = (32, 4, 4, 2, v_ahead)
        expected = decode_attention(query, *appended, *scales, count_a, "int8", 0.2, config=config)
        got = decode_attention(query, *codes, *scales, count, "int8", 0.2, config=config, append=(new[0], new[1]))
        assert torch.equal(codes[0], appended[0]) and torch.equal(codes[1], appended[1]) and int(count) == 18
        assert torch.equal(got, expected)
        plain = decode_attention(query, *appended, *scales, count_a, "int8", 0.2, config=(32, 4, 4, 2, not v_ahead))
        assert torch.equal(plain, expected), v_ahead  # where V is loaded changes no arithmetic


def _merged_matches_combine(device, batch, heads, dim, t_max, length, config):
    """The int4 "subnormal" kernel with ``merge_counters`` on a fresh problem, without and with a mask, the new token
    appended and rotated: the combine kernel's output within rounding, the same codes and length, the counters back
    at zero; a second call with them (a graph's replay) again. Returns (query, codes, scales, count) of the last
    call."""
    from mmsdk.kernels.kv_decode import decode_attention

    codes = [torch.randint(0, 256, (batch, heads, t_max, dim // 2), dtype=torch.uint8, device=device)
             for _ in range(2)]
    scales = [torch.rand(heads, dim, device=device) * 0.3 + 0.05 for _ in range(2)]
    query = torch.randn(batch, heads, 1, dim, device=device)
    new = [torch.randn(batch, heads, 1, dim, device=device) for _ in range(2)]
    angles = torch.rand(batch, 1, dim // 2, device=device) * 6
    rope = (angles.cos().repeat(1, 1, 2), angles.sin().repeat(1, 1, 2))
    mask = torch.rand(batch, t_max, device=device) > 0.3
    counters = torch.zeros(batch * heads + 1, dtype=torch.int32, device=device)
    for m in (None, mask):
        ours, theirs = [c.clone() for c in codes], [c.clone() for c in codes]
        count_ours, count_theirs = (torch.tensor([length], device=device) for _ in range(2))
        expected = decode_attention(query, *theirs, *scales, count_theirs, "int4", dim**-0.5, m, config, "subnormal",
                                    append=(new[0], new[1]), rope=rope)
        got = decode_attention(query, *ours, *scales, count_ours, "int4", dim**-0.5, m, config, "subnormal",
                               append=(new[0], new[1]), rope=rope, merge_counters=counters)
        assert int(count_ours) == length + 1 and torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
        assert _rel(got, expected) < 1e-6, (batch, heads, dim, length)
        assert not counters.any()
        again = decode_attention(query, *ours, *scales, count_ours, "int4", dim**-0.5, m, config, "subnormal",
                                 merge_counters=counters)
        plain = decode_attention(query, *ours, *scales, count_ours, "int4", dim**-0.5, m, config, "subnormal")
        assert _rel(again, plain) < 1e-6 and not counters.any() and int(count_ours) == length + 1
    return query, codes, scales, count_ours


def test_subnormal_kernel_merges_its_own_splits(device):
    """With ``merge_counters`` the "subnormal" kernel's last program per head merges the splits (no combine kernel),
    over one split and several (:func:`_merged_matches_combine`); "magic" and "generic" leave the counters alone."""
    from mmsdk.kernels.kv_decode import decode_attention

    torch.manual_seed(6)
    # (batch, heads, dim, t_max, length, config): many splits of 16 tokens, one split, 128 channels
    for batch, heads, dim, t_max, length, config in ((2, 3, 32, 100, 77, (16, 1, 16)), (1, 2, 32, 40, 30, (64, 1, 1)),
                                                     (2, 2, 128, 64, 50, (16, 1, 8))):
        query, codes, scales, count = _merged_matches_combine(device, batch, heads, dim, t_max, length, config)
    with pytest.raises(ValueError, match="int32 zeros"):
        decode_attention(query, *codes, *scales, count, "int4", dim**-0.5, variant="subnormal",
                         merge_counters=torch.zeros(2, dtype=torch.int32, device=device))
    # the other kernels merge with the combine kernel and leave the counters alone
    for variant in ("magic", "generic"):
        counters = torch.zeros(batch * heads + 1, dtype=torch.int32, device=device)
        counters[0] = 5
        merged = decode_attention(query, *codes, *scales, count, "int4", dim**-0.5, variant=variant,
                                  merge_counters=counters)
        assert torch.equal(merged, decode_attention(query, *codes, *scales, count, "int4", dim**-0.5, variant=variant))
        assert int(counters[0]) == 5 and int(counters[1:].abs().sum()) == 0, variant


def _byte_codes(fmt, shape, device):
    """Random int8 codes, or random e4m3 bit patterns (subnormals and negatives included, NaN left out)."""
    if fmt == "int8":
        return torch.randint(-128, 128, shape, dtype=torch.int8, device=device)
    bits = torch.randint(0, 256, shape, dtype=torch.int32, device=device)
    bits = torch.where((bits & 0x7F) == 0x7F, bits ^ 1, bits)  # 0x7F / 0xFF are e4m3's NaNs
    return bits.to(torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_byte_codes_match_reference(device, fmt):
    """int8 / fp8 codes in the generic kernel, read as 16-bit channel pairs (even head_dim) or byte by byte (odd),
    on grouped-query heads (tensor cores) and on MHA heads, against the fp64 reference."""
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention
    from mmsdk.kernels.kv_decode_choice import byte_pairs

    torch.manual_seed(3)
    for hq, hkv, dim in ((8, 2, 64), (8, 2, 34), (8, 2, 33), (2, 2, 64), (3, 3, 33)):
        codes = [_byte_codes(fmt, (1, hkv, 48, dim), device) for _ in range(2)]
        assert byte_pairs(*codes, fmt, dim) == (dim % 2 == 0)
        scales = [torch.rand(hkv, dim, device=device) * 0.02 + 0.005 for _ in range(2)]
        query = torch.randn(1, hq, 1, dim, device=device)
        count = torch.tensor([45], device=device)
        deq = [StaticCodec(fmt, s).decode(Packed(c[:, :, :45]), torch.float32, dim)
               for c, s in zip(codes, scales, strict=True)]
        out = decode_attention(query, *codes, *scales, count, fmt, dim**-0.5, config=(16, 4, 4))
        assert _rel(out, reference_decode_attention(query, *deq, dim**-0.5)) < 5e-3, (hq, hkv, dim)


def test_attention_rotates_the_query_and_the_new_key_itself(device):
    """decode_attention(..., rope=(cos, sin)) on an unrotated query and new K equals the RoPE op followed by
    decode_attention: the same codes and bitwise the same output for every variant ("magic" rotates first), with and
    without a token to append, for one cos / sin row per batch row or one for all."""
    from mmsdk.kernels.kv_decode import decode_attention
    from mmsdk.kernels.norm_rope_gpu import rope_qk

    torch.manual_seed(6)
    # fp16 and bf16 on the GPU, fp16 under the interpreter (which mishandles bf16). Products of two fp16 / bf16 values
    # are exact in fp32, so the rotation rounds once either way; the softmax offset of the subnormal kernel is summed
    # in fp64 because its reduction order follows q's register layout, which the rotation changes (in fp32, 5 of 20
    # fp16 cases differed in an output element on an H200), and the rotated path scales each picked channel with the
    # loaded path's code (else the compiler fused the query's "* scale" into the offset's additions in one variant
    # only). On an H200: 176 of 176 cases bitwise equal (these and four 7B-sized ones, 8 seeds, fp16 and bf16).
    cases = ((1, 2, 2, 32, "subnormal", True, False), (2, 2, 2, 32, "subnormal", True, False),
             (2, 3, 3, 32, "subnormal", False, True), (2, 2, 2, 128, "subnormal", False, True),
             (1, 3, 3, 128, "subnormal", True, True), (2, 4, 2, 32, "magic", True, False),
             (2, 6, 2, 32, "generic", True, True), (1, 4, 2, 32, "generic", False, False))
    dtypes = (torch.float16, torch.bfloat16) if device == "cuda" else (torch.float16,)
    for (batch, hq, hkv, dim, variant, append, shared), half in itertools.product(cases, dtypes):
        t_max, length = 64, 37
        codes = [torch.randint(0, 256, (batch, hkv, t_max, dim // 2), dtype=torch.uint8, device=device)
                 for _ in range(2)]
        scales = [torch.rand(hkv, dim, device=device) * 0.3 + 0.05 for _ in range(2)]
        query = torch.randn(batch, hq, 1, dim, device=device).to(half)
        new = [torch.randn(batch, hkv, 1, dim, device=device).to(half) for _ in range(2)]
        angles = torch.rand(1 if shared else batch, 1, dim // 2, device=device) * 40
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(half), angles.sin().to(half)
        rotated_query, rotated_key = rope_qk(query, new[0], cos, sin)
        before = [c.clone() for c in codes]
        count_a, count = (torch.tensor([length], device=device) for _ in range(2))
        expected = decode_attention(rotated_query, *before, *scales, count_a, "int4", dim**-0.5, variant=variant,
                                    append=(rotated_key, new[1]) if append else None)
        got = decode_attention(query, *codes, *scales, count, "int4", dim**-0.5, variant=variant,
                               append=(new[0], new[1]) if append else None, rope=(cos, sin))
        assert torch.equal(codes[0], before[0]) and torch.equal(codes[1], before[1]), variant
        assert int(count) == int(count_a) == length + append
        assert torch.equal(got, expected), (variant, batch, dim, append, half)
    with pytest.raises(ValueError, match="rows as"):
        decode_attention(query, *codes, *scales, count, "int4", 0.2, rope=(cos[..., :8], sin[..., :8]))


def test_packed_layer_lets_attention_append_a_decode_token(device, monkeypatch):
    """A packed int4 layer keeps a decode step's token for attend() (whose kernel writes it); attend() or any other
    reader of the cache (here .keys) sees the same codes and length as when update() appends it at once."""
    from mmsdk.plugins.quantizers.static_kv import PackedStaticLayer

    torch.manual_seed(5)
    codec = StaticCodec("int4", torch.rand(1, 32, device=device) * 0.3 + 0.05)
    prompt, steps = [torch.randn(1, 2, 5, 32, device=device) for _ in range(2)], []
    for _ in range(3):
        steps.append([torch.randn(1, 2, 1, 32, device=device) for _ in range(2)])
    query = torch.randn(1, 2, 1, 32, device=device)

    def run(defer: bool) -> tuple[list[torch.Tensor], PackedStaticLayer]:
        layer = PackedStaticLayer(codec, codec, 16, fused=True)
        monkeypatch.setattr(layer, "_attention_appends", lambda *args: defer and PackedStaticLayer._attention_appends(
            layer, *args))
        layer.update(*prompt)
        outs = []
        for key, value in steps[:2]:
            layer.update(key, value)
            assert (layer._pending is not None) == defer
            outs.append(layer.attend(query, 32**-0.5, None))
        layer.update(*steps[2])
        outs.append(layer.keys)  # another reader: the kept token is written first
        return outs, layer

    # MMSDK_KV_MERGE=0: a combine kernel merges the kernel's splits
    monkeypatch.setenv("MMSDK_KV_MERGE", "0")
    (deferred, a), (direct, b) = run(True), run(False)
    assert all(torch.equal(x, y) for x, y in zip(deferred, direct, strict=True))
    assert torch.equal(a.key_codes, b.key_codes) and torch.equal(a.value_codes, b.value_codes)
    assert int(a.length) == int(b.length) == 8 and a._pending is None
    # by default the kernel merges its own splits with the layer's counters (one per head and one more)
    monkeypatch.delenv("MMSDK_KV_MERGE")
    merged, c = run(True)
    assert all(_rel(x, y) < 1e-6 for x, y in zip(merged, deferred, strict=True))
    assert torch.equal(c.key_codes, a.key_codes) and int(c.length) == 8
    assert c.merge_counters.shape == (3,) and not c.merge_counters.any()


def test_merge_switch_takes_0_or_1(monkeypatch):
    """``MMSDK_KV_MERGE``: 1 (or unset) has the int4 MHA kernel merge its own splits, 0 leaves them to the combine
    kernel; anything else is refused with the values allowed."""
    from mmsdk.kernels import kv_merge_enabled

    monkeypatch.delenv("MMSDK_KV_MERGE", raising=False)
    assert kv_merge_enabled()
    for mode, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("MMSDK_KV_MERGE", mode)
        assert kv_merge_enabled() is expected
    for bad in ("all", "yes", ""):
        monkeypatch.setenv("MMSDK_KV_MERGE", bad)
        with pytest.raises(ValueError, match="set it to 0 or 1"):
            kv_merge_enabled()


def test_packed_layer_lets_attention_rotate_a_decode_step(device):
    """take_rope(): the step's unrotated q and k go to update() / attend() and the kernel rotates them. The codes,
    length and output equal those of a step rotated by the RoPE op first, whether attend() runs, another reader
    takes the cache first (.keys), a fallback attention asks for the rotated query, or the step is settled without
    attention; tensors other than the ones offered are refused."""
    from mmsdk.kernels.norm_rope_gpu import rope_qk
    from mmsdk.plugins.quantizers.static_kv import PackedStaticLayer

    torch.manual_seed(7)
    half = torch.bfloat16 if device == "cuda" else torch.float16  # see test_attention_rotates_the_query_...
    codec = StaticCodec("int4", torch.rand(1, 32, device=device) * 0.3 + 0.05)
    prompt = [torch.randn(1, 2, 5, 32, device=device).to(half) for _ in range(2)]
    key, value, query = (torch.randn(1, 2, 1, 32, device=device).to(half) for _ in range(3))
    angles = torch.rand(1, 1, 16, device=device) * 30
    cos, sin = torch.cat([angles, angles], -1).cos().to(half), torch.cat([angles, angles], -1).sin().to(half)
    rotated_query, rotated_key = rope_qk(query, key, cos, sin)

    def layer() -> PackedStaticLayer:
        made = PackedStaticLayer(codec, codec, 16, fused=True)
        made.update(*prompt)
        return made

    reference = layer()
    reference.update(rotated_key, value)
    expected = reference.attend(rotated_query, 32**-0.5, None)

    def same_cache(other: PackedStaticLayer) -> bool:
        return (torch.equal(other.key_codes, reference.key_codes) and torch.equal(other.value_codes,
                                                                                 reference.value_codes)
                and int(other.length) == int(reference.length) and other._rope is None and other._pending is None)

    deferred = layer()
    assert deferred.take_rope(query, key, cos, sin)
    deferred.update(key, value)
    assert torch.equal(deferred.attend(query, 32**-0.5, None), expected) and same_cache(deferred)
    read_first = layer()
    assert read_first.take_rope(query, key, cos, sin)
    read_first.update(key, value)
    read_first.keys  # noqa: B018  (another reader: the kept token is rotated and written)
    assert torch.equal(read_first.attend(query, 32**-0.5, None), expected) and same_cache(read_first)
    fallback = layer()
    assert fallback.take_rope(query, key, cos, sin)
    fallback.update(key, value)
    assert torch.equal(fallback.rotated_query(query), rotated_query) and same_cache(fallback)
    settled = layer()
    assert settled.take_rope(query, key, cos, sin)
    settled.update(key, value)
    settled.settle_rope()
    assert same_cache(settled)
    refused = layer()
    assert not refused.take_rope(query[:, :, :0], key, cos, sin)  # not one decode token: rotated by the caller
    assert refused.take_rope(query, key, cos, sin)
    with pytest.raises(RuntimeError, match="rope_in_attention=False"):
        refused.update(key.clone(), value)


def test_word_launch_defaults_follow_the_cache_size():
    """The word kernels' and the generic kernel's defaults by cache size, a config's entries (None = the default) and
    the length checks."""
    from mmsdk.kernels.kv_word_config import WordLaunch, word_launch

    assert word_launch(None, "subnormal", 1, 1280) == WordLaunch(16, 1, 1056, 4, False, True, True)
    assert word_launch(None, "subnormal", 1, 4096) == WordLaunch(16, 1, 1056, 4, False, True, True)
    assert word_launch(None, "subnormal", 1, 16384) == WordLaunch(32, 1, 1056, 3, False, True, True)
    assert word_launch((16, 2, 64), "subnormal", 1, 16384) == WordLaunch(16, 2, 64, 3, False, True, True)
    assert word_launch((16, 1, 8, None, 1, 0, 0), "subnormal", 1, 100) == WordLaunch(16, 1, 8, 4, True, False, False)
    assert word_launch(None, "magic", 2, 100) == WordLaunch(32, 2, 1056, None, False, False, False)
    assert word_launch((64, 4, 8, 2), "magic", 4, 100) == WordLaunch(64, 4, 8, 2, False, False, False)
    from mmsdk.kernels.kv_decode_choice import generic_config

    # the generic kernel on grouped-query heads: 8 warps up to 4k slots, 256-token tiles from 2k, 4 warps beyond 4k
    assert generic_config(None, True, False, 1280) == ((128, 8, 264, 2), True)
    assert generic_config(None, True, False, 4096) == ((256, 8, 264, 2), True)
    assert generic_config(None, True, False, 16384) == ((128, 4, 264, 2), True)
    assert generic_config((64, 4, 8, None, False), True, False, 4096) == ((64, 4, 8, 2), False)
    # many (batch row, KV head) pairs: from 8 rows middle caches take the long-cache tile; from 32 rows middle and long
    # caches 64-token tiles on 2 warps, 3 deep, over twice the programs; short caches keep theirs; a config still wins
    assert generic_config(None, True, False, 4096, rows=4) == ((256, 8, 264, 2), True)
    assert generic_config(None, True, False, 4096, rows=8) == ((128, 4, 264, 2), True)
    assert generic_config(None, True, False, 4096, rows=16) == ((128, 4, 264, 2), True)
    assert generic_config(None, True, False, 16384, rows=16) == ((128, 4, 264, 2), True)
    assert generic_config(None, True, False, 4096, rows=32) == ((64, 2, 528, 3), True)
    assert generic_config(None, True, False, 16384, rows=32) == ((64, 2, 528, 3), True)
    assert generic_config(None, True, False, 1280, rows=32) == ((128, 8, 264, 2), True)
    assert generic_config((256, 8, 264), True, False, 4096, rows=32) == ((256, 8, 264, 3), True)  # stages: default's
    assert generic_config(None, False, True, 4096, rows=32) == generic_config(None, False, True, 4096)
    # int8 / fp8 codes: half the tokens per tile on the tensor cores (the same code bytes as int4's tile), unless set
    for fmt in ("int8", "fp8"):
        assert generic_config(None, True, False, 1280, fmt=fmt) == ((64, 8, 264, 2), True)
        assert generic_config(None, True, False, 16384, fmt=fmt) == ((64, 4, 264, 2), True)
        assert generic_config((128, 4, 264), True, False, 16384, fmt=fmt) == ((128, 4, 264, 2), True)
        assert generic_config(None, False, True, 1280, fmt=fmt) == generic_config(None, False, True, 1280)
        # ... but many rows take 64-token tiles on 2 warps, 3 deep, over long caches (from 16 rows there)
        assert generic_config(None, True, False, 16384, fmt=fmt, rows=16) == ((64, 2, 528, 3), True)
        assert generic_config(None, True, False, 16384, fmt=fmt, rows=8) == ((64, 4, 264, 2), True)
        assert generic_config(None, True, False, 1280, fmt=fmt, rows=32) == ((64, 8, 264, 2), True)
    # over middle caches int8 too (up to 32 rows, from where both halve int4's wide tile); fp8, slower to decode,
    # halves int4's tile
    assert generic_config(None, True, False, 4096, fmt="int8", rows=8) == ((64, 2, 528, 3), True)
    assert generic_config(None, True, False, 4096, fmt="int8", rows=16) == ((64, 2, 528, 3), True)
    assert generic_config(None, True, False, 4096, fmt="int8", rows=32) == ((32, 2, 528, 3), True)
    assert generic_config(None, True, False, 16384, fmt="int8", rows=32) == ((64, 2, 528, 3), True)
    assert generic_config(None, True, False, 4096, fmt="fp8", rows=8) == ((64, 4, 264, 2), True)
    assert generic_config(None, True, False, 4096, fmt="fp8", rows=32) == ((32, 2, 528, 3), True)
    assert generic_config(None, True, False, 4096, fmt="fp8", rows=4) == ((128, 8, 264, 2), True)
    # the generic kernel drops programmatic dependent launch only with its default wide tile over a middle cache (int4)
    from mmsdk.kernels.kv_decode_choice import launched_without_pdl

    assert launched_without_pdl(None, True, "int4", 3328, 32) and launched_without_pdl(None, True, "int4", 4096, 64)
    for config, use_dot, fmt, slots, rows in ((None, True, "int4", 3328, 16), (None, True, "int4", 12544, 32),
                                              (None, True, "int4", 1280, 32), (None, True, "int8", 3328, 32),
                                              ((64, 2, 528, 3), True, "int4", 3328, 32),
                                              (None, False, "int4", 3328, 32)):
        assert not launched_without_pdl(config, use_dot, fmt, slots, rows), (config, use_dot, fmt, slots, rows)
    too_short, too_long = (32, 1), (32, 1, 8, 2, 1, 1, 1, 1)
    for config, variant in ((too_short, "subnormal"), (too_long, "subnormal"), ((32, 1, 8, 2, 1), "magic")):
        with pytest.raises(ValueError, match="BLOCK_T, num_warps, target programs"):
            word_launch(config, variant, 1, 100)


@pytest.mark.skipif(not HAS_TRITON or CUDA or INTERPRETING, reason="needs Triton, on a machine without a GPU")
def test_kv_decode_under_the_interpreter():
    """Runs this file's kernel checks in a process where TRITON_INTERPRET=1 is set from the start (~60 s)."""
    from tests import _interpreter

    result = _interpreter.run_file(str(Path(__file__)), "not under_the_interpreter")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "17 passed" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)])
def test_packed_prefill_attends_a_group_of_heads_at_a_time(hq, hkv, monkeypatch):
    """A packed layer's prompt attention, dequantized a few heads at a time, equals SDPA over the whole prefix."""
    if INTERPRETING:
        pytest.skip("no kernel runs here: checked once, in the main process")
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from mmsdk.kernels import kv_decode
    from mmsdk.plugins.quantizers.static_kv import PackedStaticLayer

    dim, batch, prefix, chunk = 16, 2, 9, 5
    codecs = [StaticCodec("int4", torch.rand(hkv, dim) * 0.3 + 0.05) for _ in range(2)]
    layer = PackedStaticLayer(*codecs, 32, fused=True)
    layer.update(*(torch.randn(batch, hkv, prefix, dim) for _ in range(2)))  # an earlier chunk
    key, value = layer.update(*(torch.randn(batch, hkv, chunk, dim) for _ in range(2)))  # markers
    query = torch.randn(batch, hq, chunk, dim)
    causal = torch.ones(chunk, prefix + chunk, dtype=torch.bool).tril(prefix)[None, None].expand(batch, 1, -1, -1)
    module = SimpleNamespace(num_key_value_groups=hq // hkv, is_causal=True, training=False)
    expected, _ = sdpa_attention_forward(module, query, layer.keys, layer.values, causal, scaling=dim**-0.5)
    attention = kv_decode._make_attention("sdpa")
    groups, dequantized_heads = [], layer.dequantized_heads
    monkeypatch.setattr(layer, "dequantized_heads", lambda a, b: groups.append(b - a) or dequantized_heads(a, b))
    monkeypatch.setattr(kv_decode, "PREFILL_GROUP_BYTES", 2 * batch * (prefix + chunk) * dim * 4)  # one head each
    got, _ = attention(module, query, key, value, causal, scaling=dim**-0.5)
    assert groups == [1] * hkv and got.shape == (batch, chunk, hq, dim)
    assert torch.allclose(got, expected, atol=1e-6)  # the same SDPA per head: equal up to fp32 rounding (~1e-7)
    monkeypatch.setattr(kv_decode, "PREFILL_GROUP_BYTES", 1 << 30)
    groups.clear()
    assert torch.equal(attention(module, query, key, value, causal, scaling=dim**-0.5)[0], expected)
    assert groups == [hkv]  # a small prefix: all heads at once
