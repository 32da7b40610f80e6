"""What rounding the query to integers costs the int4 KV decode attention in accuracy (CPU, no GPU needed).

The MHA decode kernel's integer K dots (mmsdk/kernels/_kv_intdot_triton.py) round the pre-scaled query (q times K's
per-channel scales times the softmax scale) to integers with one scale per head, its largest magnitude mapped to the
largest integer. This script measures, on random int4 caches of 4096 tokens and head_dim 128, the attention output's
relative error against the same attention with the exact query, for 8- and 16-bit integers, with even K channel scales
and with a few outlier channels (lognormal scales, four channels 15x larger, per-channel offsets: the pattern that
makes per-channel K scales necessary). The int4 cache's own error against the unquantized K and V is printed next to
it for scale.

    python benchmarks/kv_query_rounding.py   # -> benchmarks/results/kv_query_rounding.json
"""

from __future__ import annotations

import json

import torch

TOKENS, DIM = 4096, 128


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def errors(outliers: bool, seed: int = 0) -> dict[str, float]:
    """Relative output errors of one random head: per integer width, and the int4 cache's own."""
    torch.manual_seed(seed)
    k, v = torch.randn(TOKENS, DIM, dtype=torch.float64), torch.randn(TOKENS, DIM, dtype=torch.float64)
    channel = torch.ones(DIM, dtype=torch.float64)
    if outliers:
        channel = torch.exp(torch.randn(DIM, dtype=torch.float64) * 0.8)
        channel[:4] *= 15
    k = k * channel + torch.randn(DIM, dtype=torch.float64) * channel
    q = torch.randn(DIM, dtype=torch.float64) * 2
    k_scale, v_scale = k.abs().amax(0) / 7.5, v.abs().amax(0) / 7.5
    k_codes = torch.clamp(torch.round(k / k_scale), -8, 7)
    v_deq = torch.clamp(torch.round(v / v_scale), -8, 7) * v_scale
    softmax_scale = DIM**-0.5
    exact = torch.softmax((k_codes * k_scale) @ q * softmax_scale, 0) @ v_deq
    out = {"int4_cache_vs_unquantized": _rel(exact, torch.softmax(k @ q * softmax_scale, 0) @ v)}
    pre_scaled = q * k_scale * softmax_scale  # what the kernel rounds
    for bits in (8, 16):
        unit = pre_scaled.abs().max() / (2 ** (bits - 1) - 1)
        rounded = torch.floor(pre_scaled / unit + 0.5) * unit
        out[f"query_{bits}_bit"] = _rel(torch.softmax(k_codes @ rounded, 0) @ v_deq, exact)
    return out


def main() -> None:
    results = {"command": "python benchmarks/kv_query_rounding.py", "tokens": TOKENS, "head_dim": DIM,
               "even_channels": errors(False), "outlier_channels": errors(True)}
    print(json.dumps(results, indent=1))
    with open("benchmarks/results/kv_query_rounding.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
