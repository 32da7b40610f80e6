"""What packed bf16 arithmetic would cost the batch-1 W4A16 GEMV in accuracy (CPU, no GPU needed).

The "quad" GEMV issues about 27 instructions per 4-byte weight word, 17 of them the nibble arithmetic (one AND and one
fp32 FMA per nibble: docs/benchmarks.md). Packed ``fma.rn.bf16x2`` would do two nibbles per instruction: a nibble masked
in place in each half of a 32-bit word is an exact bf16 subnormal (bits 0-7 of a half read linearly), so one AND and one
packed FMA would do two nibbles, about 9 instructions per word instead of 17. The products and their running sums are
then rounded to bf16 (8 significant bits) instead of fp32. This script emulates that rounding (every product and sum
rounded to bf16 as the packed FMA does, through fp32: a rare tie may round twice) on a random 4096-wide row block and
reports the error against the float64 product, next to the error of rounding the exact result to bf16 once (what any
bf16 output carries):

* ``uncentred_chain4``: each half-word lane sums its 4 products ``code * x`` (codes 0..15) in bf16, then fp32 takes
  over; the centring ``-8 * sum x`` is exact in fp32 (the subnormal trick cannot centre in place);
* ``uncentred_chain8``: the same over two words per chain (fewer conversions to fp32);
* ``centred_chain4``: the codes centred before the products (costs one more packed op per pair: ~13 per word).

    python benchmarks/packed_accumulation_error.py
"""

from __future__ import annotations

import json

import torch


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float64) rounded to bf16 (to nearest even, through fp32) and back."""
    return t.to(torch.float32).to(torch.bfloat16).double()


def _chain(codes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Sums over the last axis of ``codes * x`` with every product and partial sum rounded to bf16 (packed FMAs)."""
    acc = _bf16(codes[..., 0] * x[..., 0])
    for j in range(1, codes.shape[-1]):
        acc = _bf16(codes[..., j] * x[..., j] + acc)
    return acc


def errors(rows: int = 512, k: int = 4096, group: int = 128, seed: int = 0) -> dict[str, float]:
    """Relative errors (Frobenius, over ``rows`` outputs) of each scheme against the float64 product."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(k, generator=gen).to(torch.bfloat16).double()
    codes = torch.randint(0, 16, (rows, k), generator=gen).double()
    scales = (torch.rand(rows, k // group, generator=gen) * 0.02 + 0.01).to(torch.bfloat16).double()
    exact = ((codes - 8) * x * scales.repeat_interleave(group, 1)).sum(1)
    group_sums = x.view(k // group, group).sum(1)

    def finish(lanes: torch.Tensor, centred: bool) -> torch.Tensor:
        per_group = lanes.reshape(rows, k // group, -1).sum(2)  # fp32-exact from here on
        return ((per_group if centred else per_group - 8 * group_sums) * scales).sum(1)

    # a word's 8 nibbles as two lanes (low and high half) of 4 consecutive channels each
    words, xw = codes.view(rows, k // 8, 2, 4), x.view(k // 8, 2, 4)
    two_words = codes.view(rows, k // 16, 2, 2, 4).permute(0, 1, 3, 2, 4).reshape(rows, k // 16, 2, 8)
    x_two = x.view(k // 16, 2, 2, 4).permute(0, 2, 1, 3).reshape(k // 16, 2, 8)
    schemes = {"uncentred_chain4": finish(_chain(words, xw), False),
               "uncentred_chain8": finish(_chain(two_words, x_two), False),
               "centred_chain4": finish(_chain(words - 8, xw), True),
               "bf16_output_rounding": _bf16(exact)}
    return {name: float((out - exact).norm() / exact.norm()) for name, out in schemes.items()}


if __name__ == "__main__":
    print(json.dumps({"command": "python benchmarks/packed_accumulation_error.py", "rows": 512, "k": 4096,
                      "group": 128, "relative_error": errors()}, indent=1))
