"""Correctness checks and a block-size sweep for the W4A16 GEMV and the int4 KV decode kernels (CUDA).

Random inputs drawn fresh per check; outputs poisoned (NaN) before each run. Times are medians of
CUDA-graph replays (20 calls per graph, as benchmarks/gpu_suite.py's gbench). Writes JSON after
every section; stops sweeping when ``--budget`` seconds have passed.

    python benchmarks/gpu_tune.py --out tune.json --budget 120
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

RESULTS: dict[str, Any] = {}


def gtime(fn: Callable[[], Any] | list[Callable[[], Any]], calls: int = 20, reps: int = 15) -> float:
    """Median microseconds of one call of fn, from replays of a CUDA graph of ``calls`` calls (fn may be a list
    from :func:`cold`: called in turn)."""
    from mmsdk.kernels import graph_time_ms

    return graph_time_ms(fn, calls, reps) * 1e3


def cold(fn: Callable[..., Any], *tensors: Any) -> list[Callable[[], Any]]:
    """``fn(*tensors)`` on copies of ``tensors`` that together hold 3x the L2 cache, one callable per copy.

    Timed in turn (gpu_suite.gbench, :func:`gtime`), every call reads its tensors from HBM, as each layer of a
    model reads its weights: a call repeated on one copy reads whatever fits from L2 (50 MB on an H200: a 7B
    model's int4 qkv, o_proj and down weights, a 4k-token int4 KV cache), which flatters small inputs against
    big ones.
    """
    from mmsdk.kernels import l2_spill_copies

    return [lambda c=copy: fn(*c) for copy in l2_spill_copies(tensors)]


@contextmanager
def env_setting(name: str, value: str) -> Iterator[None]:
    """Environment variable ``name`` set to ``value`` inside the block, as it was after it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before


def pdl_setting(on: bool) -> AbstractContextManager[None]:
    """Programmatic dependent launch on or off (``MMSDK_PDL``) for kernels launched inside the block."""
    from mmsdk.kernels import PDL_ENV

    return env_setting(PDL_ENV, "1" if on else "0")


class NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing (a call timed without that launch)."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


def prefill_setting(chunk: int) -> AbstractContextManager[None]:
    """Fast generate's prefill chunk (``MMSDK_PREFILL_TOKENS``: tokens over all batch rows) inside the block."""
    from mmsdk.kernels.chunked_prefill import PREFILL_ENV

    return env_setting(PREFILL_ENV, str(chunk))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_w4a16() -> list[dict[str, Any]]:
    from mmsdk.kernels.w4a16 import int4_linear, w4a16_gemv
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    rows = []
    cases = [((1, 4096, 4096), True, (16, 2, 4, 1, "fma"), None), ((1, 1000, 4000), False, (8, 4, 4, 1, "fma"), 5),
             ((3, 4096, 11008), True, (16, 2, 4, 4, "fma"), None), ((16, 4096, 4096), False, (32, 1, 4, 16, "dot"), None),
             ((16, 512, 4096), True, (16, 1, 4, 8, "fma"), 3), ((7, 300, 1024), True, None, None),
             ((1, 4096, 4096), True, (32, 16, 4, 1, "quad"), None), ((1, 1000, 4000), False, (16, 32, 8, 1, "quad"), 5),
             ((1, 22016, 4096), True, (32, 16, 4, 1, "quad", 264), None), ((2, 4096, 11008), False, (16, 16, 4, 1, "quad"), 3)]
    for (m, n, k), sym, cfg, splits in cases:
        p = quantize_int4(torch.randn(n, k, device="cuda"), 128, symmetric=sym, scale_dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        exp = x.float() @ dequantize_int4(p, torch.float32).T + bias.float()
        out = w4a16_gemv(x, p.qweight, p.scales, p.zero_points, 128, bias, config=cfg, splits=splits)
        ok = bool(torch.isfinite(out).all())
        rows.append({"m": m, "n": n, "k": k, "sym": sym, "cfg": cfg, "splits": splits, "rel_err": rel(out, exp),
                     "finite": ok})
        out2 = int4_linear(x, p.qweight, p.scales, p.zero_points, k, 128, bias)
        rows[-1]["int4_linear_rel_err"] = rel(out2, exp)
        print(rows[-1], flush=True)
    return rows


def check_kv() -> list[dict[str, Any]]:
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention
    from mmsdk.plugins.quantizers.quantized_cache import Packed, StaticCodec

    rows = []
    for b, hq, hkv, d, tmax, length, masked in ((1, 32, 32, 128, 4096, 4000, False), (2, 28, 4, 128, 3000, 2999, True),
                                                (3, 8, 2, 64, 777, 700, True), (1, 32, 32, 128, 16384, 16384, False)):
        scale = torch.rand(hkv, d, device="cuda") * 0.05 + 0.02
        codec = StaticCodec("int4", scale)
        kc = codec.encode(torch.randn(b, hkv, tmax, d, device="cuda")).data.contiguous()
        vc = codec.encode(torch.randn(b, hkv, tmax, d, device="cuda")).data.contiguous()
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        mask = (torch.rand(b, tmax, device="cuda") > 0.3) if masked else None
        out = decode_attention(q, kc, vc, scale, scale, torch.tensor([length], device="cuda"), "int4", d**-0.5, mask)
        kd = codec.decode(Packed(kc), torch.float32, d)[:, :, :length]
        vd = codec.decode(Packed(vc), torch.float32, d)[:, :, :length]
        rows.append({"b": b, "hq": hq, "hkv": hkv, "d": d, "len": length, "mask": masked,
                     "rel_err": rel(out, reference_decode_attention(q, kd, vd, d**-0.5, mask)),
                     "finite": bool(torch.isfinite(out).all())})
        print(rows[-1], flush=True)
    return rows


def check_gated() -> list[dict[str, Any]]:
    """The paired gate/up GEMV with the SiLU*mul epilogue against two GEMVs + SiLU + mul (errors and times)."""
    from mmsdk.kernels.w4a16 import w4a16_gemv
    from mmsdk.kernels.w4a16_gated import w4a16_gated_silu
    from mmsdk.kernels.w4a16_tuning import tuning
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    rows = []
    for label, n, k, group in (("llava 11008x4096", 11008, 4096, 128), ("qwen2-vl 18944x3584", 18944, 3584, 128),
                               ("llava g32", 11008, 4096, 32)):
        gate, up = (quantize_int4(torch.randn(n, k, device="cuda") * 0.02, group, scale_dtype=torch.bfloat16)
                    for _ in range(2))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        parts = [(p.qweight, p.scales, p.zero_points) for p in (gate, up)]
        exp = torch.nn.functional.silu(x.float() @ dequantize_int4(gate, torch.float32).T) * (
            x.float() @ dequantize_int4(up, torch.float32).T)

        def fused() -> torch.Tensor:
            return w4a16_gated_silu(x, parts[0], parts[1], k, group)

        def separate() -> torch.Tensor:
            g = w4a16_gemv(x, *parts[0], group)
            return torch.nn.functional.silu(g) * w4a16_gemv(x, *parts[1], group)

        out, ref_out = fused(), separate()
        rows.append({"shape": label, "group": group, "rel_err": rel(out, exp), "separate_rel_err": rel(ref_out, exp),
                     "paired_us": gtime(fused), "separate_us": gtime(separate),
                     "cfg": tuning().chosen.get(("gated", n, k // group, group, torch.bfloat16, False, False))})
        rows[-1]["speedup"] = rows[-1]["separate_us"] / rows[-1]["paired_us"]
        print(rows[-1], flush=True)
    return rows


SHAPES = {"qkv": (12288, 4096), "gate+up": (22016, 4096), "down": (4096, 11008), "o_proj": (4096, 4096)}


def gemv_space(m: int) -> list[tuple[Any, ...]]:
    """GEMV configurations to sweep: the quad kernel widely, the shift-and-mask and tensor-core kernels as reference."""
    if m == 1:
        return ([(bn, c, w, 1, "quad") for bn, c, w in ((16, 16, 4), (32, 16, 4), (16, 32, 8), (8, 16, 4), (8, 32, 8),
                                                         (32, 32, 8), (64, 16, 8), (16, 8, 2))]
                + [(16, 2, 4, 1, "fma"), (32, 2, 4, 1, "fma")])
    if m == 4:
        return [(16, 2, 4, 4, "fma"), (32, 1, 4, 16, "dot")]
    return [(32, 1, 4, 16, "dot"), (64, 2, 4, 16, "dot")]


def sweep_w4a16(deadline: float) -> list[dict[str, Any]]:
    from mmsdk.kernels.w4a16 import gemv_splits, w4a16_gemv, w4a16_matmul
    from mmsdk.plugins.quantizers.packing import quantize_int4, to_tinygemm

    rows = []
    for m in (1, 4, 16):
        for name, (n, k) in SHAPES.items():
            p = quantize_int4(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), 128, scale_dtype=torch.bfloat16)
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16 = gtime(lambda: torch.nn.functional.linear(x, dense))
            tiny_w, tiny_sz = to_tinygemm(p)
            tiny = gtime(lambda: torch.ops.aten._weight_int4pack_mm(x, tiny_w, 128, tiny_sz))
            best: dict[str, tuple[float, Any, int]] = {}
            if m > 1:
                for cfg in ((32, 256, 4, 4), (16, 512, 4, 3), (64, 256, 4, 3), (32, 128, 4, 4)):
                    t = gtime(lambda: w4a16_matmul(x, p.qweight, p.scales, None, 128, None, config=cfg))
                    if "fused" not in best or t < best["fused"][0]:
                        best["fused"] = (t, cfg, 1)
            for cfg in gemv_space(m):
                base = gemv_splits(n, k // 128, cfg[0], cfg[1])
                for splits in sorted({1, max(1, base // 2), base, base * 2}):
                    if time.perf_counter() > deadline:
                        break
                    try:
                        t = gtime(lambda: w4a16_gemv(x, p.qweight, p.scales, None, 128, None, config=cfg, splits=splits))
                    except Exception as error:
                        print("skip", cfg, splits, type(error).__name__, str(error)[:100])
                        continue
                    if cfg[4] not in best or t < best[cfg[4]][0]:
                        best[cfg[4]] = (t, cfg, splits)
            if not best:
                continue
            top = min(best.values(), key=lambda b: b[0])
            rows.append({"M": m, "shape": name, "bf16_us": bf16, "tinygemm_us": tiny, "best_us": top[0],
                         "cfg": top[1], "splits": top[2], "speedup": bf16 / top[0], "vs_tinygemm": tiny / top[0],
                         "best_by_kind": {kind: {"us": b[0], "cfg": b[1], "splits": b[2]} for kind, b in best.items()},
                         "TBps": (p.qweight.numel() + p.scales.numel() * 2) / top[0] / 1e6})
            print(rows[-1], flush=True)
    return rows


# (BLOCK_T, num_warps, target programs) worth timing for the subnormal kernel (MHA). More tokens per thread
# (BLOCK_T / warps) means more loads in flight and more accumulator registers; one warp needs no barrier for the
# per-tile max. On an H200 (32 heads, head_dim 128) (32, 1, 1056) was fastest at 4k and 16k tokens.
WORD_CANDIDATES = ((16, 1, 1056), (16, 1, 2112), (32, 1, 1056), (32, 2, 1056), (32, 2, 2112), (64, 2, 1056),
                   (64, 4, 528), (64, 4, 1056), (128, 4, 528), (128, 8, 528))


def sweep_kv(deadline: float) -> list[dict[str, Any]]:
    """Each int4 decode variant over its configuration candidates, MHA and GQA, 4k and 16k, against SDPA on bf16."""
    from benchmarks.gpu_suite import kv_problem
    from mmsdk.kernels.kv_decode import decode_attention

    old_space = [(bt, w, t) for bt in (32, 64) for w in (2, 4) for t in (528, 1056)]
    rows = []
    for label, hq, hkv in (("MHA 32/32", 32, 32), ("GQA 28/4", 28, 4)):
        for ctx in (4096, 16384):
            d = 128
            scale, _, q, kbf, vbf, kc, vc, length = kv_problem(hq, hkv, ctx, d)
            sdpa = gtime(lambda: torch.nn.functional.scaled_dot_product_attention(q, kbf, vbf, enable_gqa=hq != hkv))
            results = []
            spaces = {"subnormal": WORD_CANDIDATES if hq == hkv else [], "magic": old_space, "generic": [None]}
            for variant, space in spaces.items():
                for cfg in space:
                    if time.perf_counter() > deadline:
                        break
                    try:
                        t = gtime(lambda: decode_attention(q, kc, vc, scale, scale, length, "int4", d**-0.5,
                                                           config=cfg, variant=variant))
                    except Exception as error:
                        print("skip", variant, cfg, type(error).__name__, str(error)[:100])
                        continue
                    results.append((t, variant, cfg))
            if not results:
                continue
            results.sort(key=lambda r: r[0])
            best_by_variant = {}
            for t, variant, cfg in results:
                best_by_variant.setdefault(variant, {"us": t, "cfg": cfg, "ratio": t / sdpa})
            rows.append({"heads": label, "ctx": ctx, "sdpa_us": sdpa, "best_us": results[0][0],
                         "variant": results[0][1], "cfg": results[0][2], "ratio": results[0][0] / sdpa,
                         "best_by_variant": best_by_variant,
                         "TBps": kc.numel() * 2 / results[0][0] / 1e6})
            print(rows[-1], flush=True)
    return rows


def memory_probe() -> dict[str, Any]:
    """Which module holds the prefill transient: 2-layer LLaVA-1.5-7B shapes, batch 4 x 4096, whole vs chunked."""
    import benchmarks.gpu_suite as suite
    from mmsdk.kernels.chunked_prefill import prefill_tokens

    config = suite.llava_config()
    config.text_config.num_hidden_layers = 2
    original = suite.llava_config
    suite.llava_config = lambda: config
    out: dict[str, Any] = {}
    try:
        inputs = suite.llava_inputs(4, 4096, images=True)
        for chunk in (1 << 20, prefill_tokens()):
            for label, passes, kv in (("int4-weight", ("int4-weight",), False), ("int4-weight+int4-kv", ("int4-weight",), True)):
                model = suite.optimized(suite.build_llava(), passes, kv)
                peaks: dict[str, float] = {}
                hooks = []
                lm = model.model.language_model
                for mod_name, mod in [("vision", model.model.vision_tower), ("projector", model.model.multi_modal_projector),
                                      ("attn", lm.layers[0].self_attn), ("mlp", lm.layers[0].mlp), ("lm_head", model.lm_head)]:
                    def pre(module, args, name=mod_name):
                        torch.cuda.synchronize()
                        module._base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()

                    def post(module, args, result, name=mod_name):
                        torch.cuda.synchronize()
                        peaks[name] = max(peaks.get(name, 0.0), (torch.cuda.max_memory_allocated() - module._base) / 1e9)

                    hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                with torch.inference_mode(), prefill_setting(chunk):
                    model.generate(**inputs, max_new_tokens=4, do_sample=False)
                for h in hooks:
                    h.remove()
                torch.cuda.reset_peak_memory_stats()
                with torch.inference_mode(), prefill_setting(chunk):
                    model.generate(**inputs, max_new_tokens=4, do_sample=False)
                out[f"{label} chunk={chunk}"] = {"module_transient_GB": peaks, "weights_GB": base / 1e9,
                                                  "peak_GB": torch.cuda.max_memory_allocated() / 1e9}
                print(label, chunk, out[f"{label} chunk={chunk}"], flush=True)
                del model
                torch.cuda.empty_cache()
    finally:
        suite.llava_config = original
    return out


def prune_memory() -> dict[str, Any]:
    """Why token-prune's waterfall row peaks high: does generate keep the fast path, and where is the peak?

    LLaVA-1.5-7B shapes, token-prune 0.25, batch 4 x 4096-token prompts with images, 8 new tokens; the
    ``mmsdk.kernels`` log lines (fallback reasons) are collected, and peaks are taken after the prefill
    forward alone and after the whole generate.
    """
    import benchmarks.gpu_suite as suite
    from mmsdk.plugins.encoders.token_prune import TokenPruneConfig

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect()
    logging.getLogger("mmsdk").addHandler(handler)
    try:
        model = suite.optimized(suite.build_llava(), (TokenPruneConfig(keep_ratio=0.25),), False)
        inputs = suite.llava_inputs(4, 4096, images=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        out: dict[str, Any] = {"weights_GB": base / 1e9}
        with torch.inference_mode():
            torch.cuda.reset_peak_memory_stats()
            model(**inputs, logits_to_keep=1)
            torch.cuda.synchronize()
            out["forward_only_peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
            torch.cuda.reset_peak_memory_stats()
            model.generate(**inputs, max_new_tokens=8, do_sample=False)
            torch.cuda.synchronize()
            out["generate_peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
        out["log"] = messages[:20]
        print(out, flush=True)
        return out
    finally:
        logging.getLogger("mmsdk").removeHandler(handler)


def generate_kernels(model: Any, inputs: dict[str, Any], new: int = 32, limit: int = 30) -> dict[str, Any]:
    """Where one greedy ``model.generate`` of ``new`` tokens spends GPU time: torch.profiler's device time per kernel
    name (CUDA-graph replays included), the ``limit`` largest, and their total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(**inputs, max_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: -e.device_time_total)
    return {"profiled_tokens": new, "gpu_time_ms_total": sum(e.device_time_total for e in kernels) / 1e3,
            "top_kernels": [{"name": e.key[:90], "calls": e.count, "ms_total": e.device_time_total / 1e3,
                             "us_per_call": e.device_time_total / max(1, e.count)} for e in kernels[:limit]]}


def decode_profile(model_name: str = "llava") -> dict[str, Any]:
    """Decode step (1k context) for two pass stacks, and where its GPU time goes: LLaVA-1.5-7B shapes g32
    (``decode_profile``) or Qwen2-VL-7B shapes g128 (``decode_profile_qwen``).

    The stacks: mmsdk's decode stack (rmsnorm-rope-fusion's defaults: each layer's input RMSNorm inside its q/k/v
    gemv_quad, o_proj's store leaving the post-attention norm's statistics for the gated GEMV), and the same with
    every norm an add_rms_norm launch of its own. The breakdown is torch.profiler's device time per kernel name over
    a 32-token fast generate (CUDA-graph replays included), divided by the number of graph-replayed steps.
    """
    import benchmarks.gpu_suite as suite
    from benchmarks.gpu_decode_reuse import _model_and_inputs
    from mmsdk.plugins.attention.rmsnorm_rope import RMSNormRoPEFusionConfig
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    int4 = "int4-weight" if model_name == "llava" else Int4WeightConfig(group_size=128)
    out: dict[str, Any] = {}
    stacks = (("qkv-fuse + int4-weight + rmsnorm-rope-fusion + int4-kv", ("qkv-fuse", int4, "rmsnorm-rope-fusion")),
              ("the same, every norm a launch of its own (norm_in_gemv=False)",
               ("qkv-fuse", int4, RMSNormRoPEFusionConfig(norm_in_gemv=False))))
    for label, passes in stacks:
        try:
            model, inputs, _ = _model_and_inputs(model_name, passes)
            row: dict[str, Any] = dict(suite.decode_rate(model, inputs, 128, 3))
            row.update(generate_kernels(model, inputs))
            out[label] = row
            print(label, {k: v for k, v in row.items() if k != "top_kernels"}, flush=True)
            for k in row["top_kernels"]:
                print(f"   {k['ms_total']:8.2f} ms {k['calls']:6d} x {k['us_per_call']:7.1f} us  {k['name']}", flush=True)
            del model
            torch.cuda.empty_cache()
        except Exception as error:
            traceback.print_exc()
            out[label] = {"error": repr(error)[:500]}
    return out


def decode_profile_qwen() -> dict[str, Any]:
    """:func:`decode_profile` on Qwen2-VL-7B shapes, g128."""
    return decode_profile("qwen2-vl")


def run_sections(results: dict[str, Any], names: list[str], run: Callable[[str, float], Any], out: str) -> None:
    """``results[name] = run(name, start time)`` per section; an error is recorded, JSON written after each."""
    for name in names:
        t0 = time.perf_counter()
        try:
            results[name] = run(name, t0)
        except Exception as error:
            traceback.print_exc()
            results[name] = {"error": repr(error)[:1000]}
        results.setdefault("seconds", {})[name] = time.perf_counter() - t0
        with open(out, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"== {name} {time.perf_counter() - t0:.1f}s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tune.json")
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--sections", default="check_w4a16,check_kv,sweep_w4a16,sweep_kv,memory_probe")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)  # the kernels log when a fallback runs instead
    start = time.perf_counter()

    def run(name: str, t0: float) -> Any:
        if name.startswith("sweep"):
            share = args.budget * (0.65 if name == "sweep_w4a16" else 1.0)
            return globals()[name](min(start + args.budget, t0 + share))
        return globals()[name]()

    run_sections(RESULTS, args.sections.split(","), run, args.out)
    for row in RESULTS.get("sweep_w4a16", []) if isinstance(RESULTS.get("sweep_w4a16"), list) else []:
        print(f"W4 M={row['M']:2d} {row['shape']:8s} bf16 {row['bf16_us']:6.1f} us  best {row['best_us']:6.1f} us "
              f"{row['speedup']:.2f}x  {row['cfg']} splits={row['splits']}")
    for row in RESULTS.get("sweep_kv", []) if isinstance(RESULTS.get("sweep_kv"), list) else []:
        print(f"KV {row['heads']} {row['ctx']} sdpa {row['sdpa_us']:.1f} us best {row['best_us']:.1f} us "
              f"ratio {row['ratio']:.2f} {row['cfg']}")


if __name__ == "__main__":
    main()
