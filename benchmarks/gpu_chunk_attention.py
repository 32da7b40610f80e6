"""How a prefill chunk should attend over the prefix in the cache (CUDA only).

A chunk of ``q`` positions per row, after ``p`` positions already in the cache, attends causally with the diagonal
at the lower right of its ``[q, p + q]`` score block. PyTorch's ``is_causal`` means upper-left alignment, so
transformers hands SDPA a materialised boolean mask. This script times, per chunk and summed over a whole prompt cut
into chunks, the ways to compute that attention on LLaVA-1.5-7B's heads (32 x 128, bf16), and checks each against the
masked SDPA's output:

* ``masked``: SDPA with the boolean mask (what transformers does);
* ``lower_right``: ``torch.nn.attention.bias.causal_lower_right`` (flash attention with its own lower-right causal);
* ``split``: the prefix without a mask and the chunk's own square causally (cuDNN attention, log-sum-exps kept), the
  two merged by their log-sum-exps;
* ``split_flash``: the same split on flash attention;
and, timed once, one causal SDPA over the whole prompt (transformers' unchunked prefill), for scale;
* ``prefix_cudnn_lse`` / ``prefix_sdpa``: the split's prefix part alone with and without the log-sum-exp (where the
  split's time goes; errors not meaningful).

    python benchmarks/gpu_chunk_attention.py --out chunk_attention.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    length, total = q.shape[2], k.shape[2]
    keep = torch.ones(length, total, dtype=torch.bool, device=q.device).tril(total - length)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[None, None].expand(q.shape[0], 1, -1, -1))


def lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    return out[0], out[1]


def split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    prefix = k.shape[2] - q.shape[2]
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _merged(q, k, v, _cudnn)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
    return out[0], out[1]


def _merged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Any) -> torch.Tensor:
    """The prefix without a mask and the chunk's own square causally, by ``attend`` (output and log-sum-exp each),
    merged by their log-sum-exps."""
    prefix = k.shape[2] - q.shape[2]
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o1, lse1 = attend(q, k[:, :, :prefix], v[:, :, :prefix], False)
    o2, lse2 = attend(q, k[:, :, prefix:], v[:, :, prefix:], True)
    lse1, lse2 = lse1.reshape(*q.shape[:3], 1).float(), lse2.reshape(*q.shape[:3], 1).float()
    w1 = torch.sigmoid(lse1 - lse2)  # exp(lse1) / (exp(lse1) + exp(lse2))
    return torch.lerp(o2.float(), o1.float(), w1).to(q.dtype)


def split_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _merged(q, k, v, _flash)


def prefix_cudnn_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Diagnostic, not an answer: the split's prefix part alone (cuDNN, log-sum-exp kept)."""
    prefix = max(k.shape[2] - q.shape[2], q.shape[2])
    return _cudnn(q, k[:, :, :prefix], v[:, :, :prefix], False)[0]


def prefix_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Diagnostic, not an answer: the prefix part through SDPA without a mask (no log-sum-exp)."""
    prefix = max(k.shape[2] - q.shape[2], q.shape[2])
    return F.scaled_dot_product_attention(q, k[:, :, :prefix], v[:, :, :prefix])


def timed_us(fn: Callable[[], Any], reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="chunk_attention.json")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--chunks", default="512,1024", help="positions per row per chunk")
    args = parser.parse_args()
    heads, dim = 32, 128
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(n: int) -> torch.Tensor:
        return torch.randn(args.batch, heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    q_all, k_all, v_all = rand(args.length), rand(args.length), rand(args.length)
    results: dict[str, Any] = {"command": f"python benchmarks/gpu_chunk_attention.py --batch {args.batch} --length "
                               f"{args.length} --chunks {args.chunks}", "torch": torch.__version__,
                               "one_pass_us": timed_us(lambda: F.scaled_dot_product_attention(
                                   q_all, k_all, v_all, is_causal=True)), "chunks": []}
    print("one pass", results["one_pass_us"], flush=True)
    ways = {"masked": masked, "lower_right": lower_right, "split": split, "split_flash": split_flash,
            "prefix_cudnn_lse": prefix_cudnn_lse, "prefix_sdpa": prefix_sdpa}
    for chunk in (int(c) for c in args.chunks.split(",")):
        row: dict[str, Any] = {"chunk": chunk, "total_us": {w: 0.0 for w in ways}, "max_error": {w: 0.0 for w in ways},
                               "errors": {}, "per_chunk_us": []}
        for start in range(0, args.length, chunk):
            q = q_all[:, :, start:start + chunk]
            k, v = k_all[:, :, :start + chunk], v_all[:, :, :start + chunk]
            reference = masked(q, k, v).float()
            times = {}
            for name, way in ways.items():
                try:
                    answer = way(q, k, v).float()
                    error = (answer - reference).abs().max().item() if answer.shape == reference.shape else 0.0
                    times[name] = timed_us(lambda way=way, q=q, k=k, v=v: way(q, k, v))
                except Exception as exc:  # a way this torch build cannot run: recorded, not fatal
                    times[name] = float("nan")  # and so the way's total: a sum over fewer chunks would flatter it
                    row["errors"][name] = repr(exc)[:200]
                row["total_us"][name] += times[name]
                if name not in row["errors"]:
                    row["max_error"][name] = max(row["max_error"][name], error)
            row["per_chunk_us"].append({"prefix": start, **times})
        results["chunks"].append(row)
        print(json.dumps({k: row[k] for k in ("chunk", "total_us", "max_error")}), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
