"""H200 suite: kernel micro-benchmarks, decode speed, memory waterfall and prefill on LLaVA-1.5-7B shapes.

Random bf16 weights built on the GPU from the published configuration (no downloads). Every
timing is a median after warm-up (triton.testing.do_bench for kernels, CUDA-synchronised wall
clock over whole generate() calls for models). Results go to ``--out`` as JSON after every
section, so a failing section leaves the others' numbers.

    python benchmarks/gpu_suite.py --out results.json [--quick] [--sections micro,decode,memory,ttft]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from benchmarks.gpu_models import (  # noqa: F401 (re-exported: the other GPU scripts reach them through this module)
    KV_BF16,
    KV_INT4,
    attach_int4_kv,
    build_llava,
    build_qwen2_vl,
    llava_config,
    llava_inputs,
    lm_bytes,
    memory_floor,
    optimized,
    qwen2_vl_config,
)
from benchmarks.gpu_tune import cold

H200_COPY_BW = 4.27e12  # measured device-to-device copy on the H200 (techniques.md 7): the speed limit
RESULTS: dict[str, Any] = {}


def save(path: str) -> None:
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def save_now() -> None:
    """Write the results so far (sections that run long save partial rows)."""
    if "out" in RESULTS:
        save(RESULTS["out"])


def bench(fn: Callable[[], Any], rep: int = 200) -> float:
    """Median milliseconds of fn (CUDA events, L2 flushed between reps by do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def gbench(fn: Callable[[], Any] | list[Callable[[], Any]], calls: int = 20) -> float:
    """Median milliseconds of one fn call, from a CUDA graph of ``calls`` calls (no Python launch overhead).

    ``fn`` may be a list: the same work on copies of its inputs (gpu_tune.cold), called in turn.
    """
    from mmsdk.kernels import captured_calls

    graph, calls = captured_calls(fn, calls)
    return bench(graph.replay, rep=100) / calls


def release_memory() -> None:
    """Free what dropped models held: optimized models hold reference cycles, which only the collector frees."""
    gc.collect()
    torch.cuda.empty_cache()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ----------------------------------------------------------------------------------------------- env
def section_env() -> dict[str, Any]:
    import transformers
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "copy_GBps": copy_bandwidth() / 1e9, "speed_limit_GBps": speed_limit() / 1e9}


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read and write counted), median of do_bench reps; measured
    once per run (kept in the results)."""
    if "copy_Bps" not in RESULTS:
        x = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        RESULTS["copy_Bps"] = 2 * x.numel() * 2 / bench(lambda: y.copy_(x), rep=100) * 1e3
    return RESULTS["copy_Bps"]


def speed_limit() -> float:
    """Bytes per second the floors divide by: on an H200 the issue's 4.27 TB/s (so figures compare across passes);
    on another card its own copy bandwidth (an H100's floors at 4.27 would flatter it)."""
    return H200_COPY_BW if "H200" in torch.cuda.get_device_name() else copy_bandwidth()


# --------------------------------------------------------------------------------------------- micro
W4_SHAPES = {"qkv 12288x4096": (12288, 4096), "gate+up 22016x4096": (22016, 4096), "down 4096x11008": (4096, 11008),
             "o_proj 4096x4096": (4096, 4096), "qwen gate+up 37888x3584": (37888, 3584)}


def section_w4a16(quick: bool) -> list[dict[str, Any]]:
    from mmsdk.kernels.w4a16 import int4_linear
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4, to_tinygemm

    rows = []
    for name, (n, k) in W4_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        packed = quantize_int4(w, 128, scale_dtype=torch.bfloat16)
        dense = dequantize_int4(packed, torch.bfloat16)
        tiny_w, tiny_sz = to_tinygemm(packed)
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = int4_linear(x, packed.qweight, packed.scales, None, k, 128)
            err = rel(out, x.float() @ dense.float().T)

            def ours(qweight: torch.Tensor, scales: torch.Tensor) -> Any:
                return int4_linear(x, qweight, scales, None, k, 128)

            # every variant reads its weight from HBM (copies in turn); mmsdk_l2_us repeats one copy, as the
            # runs before the ninth pass did (int4 weights up to ~40 MB were then partly read from L2)
            t_bf16 = gbench(cold(lambda w: torch.nn.functional.linear(x, w), dense))
            t_tiny = gbench(cold(lambda w, sz: torch.ops.aten._weight_int4pack_mm(x, w, 128, sz), tiny_w, tiny_sz))
            t_ours = gbench(cold(ours, packed.qweight, packed.scales))
            t_l2 = gbench(lambda: ours(packed.qweight, packed.scales))
            packed_bytes = packed.qweight.numel() + packed.scales.numel() * 2 + x.numel() * 2 + m * n * 2
            rows.append({"shape": name, "M": m, "rel_err": err, "bf16_us": t_bf16 * 1e3, "tinygemm_us": t_tiny * 1e3,
                         "mmsdk_us": t_ours * 1e3, "speedup_vs_bf16": t_bf16 / t_ours,
                         "speedup_vs_tinygemm": t_tiny / t_ours, "mmsdk_TBps": packed_bytes / t_ours / 1e9,
                         "mmsdk_l2_us": t_l2 * 1e3, "cfg": _tuned_gemv(n, k, m)})
            print(rows[-1], flush=True)
        if quick and len(rows) >= 6:
            break
    return rows


def _tuned_gemv(n: int, k: int, m: int) -> Any:
    """The configuration the tuner chose for int4_linear's GEMV of ``m`` rows on this shape (g128, bf16; None for
    the fused kernel's rows, which this key does not cover)."""
    from mmsdk.kernels.w4a16_tuning import tuning

    bucket = 1 if m == 1 else (4 if m <= 4 else 16)
    return tuning().chosen.get(("gemv", bucket, n, k // 128, 128, torch.bfloat16, False, False, False))


def kv_problem(hq: int, hkv: int, ctx: int, d: int, device: str = "cuda", fmt: str = "int4",
               batch: int = 1) -> tuple[Any, ...]:
    """Random decode inputs: (scale, codec, q, bf16 K, bf16 V, K codes, V codes, length) in ``fmt``, ``batch`` rows
    of ``ctx`` cached tokens each."""
    from mmsdk.plugins.quantizers.quantized_cache import StaticCodec

    scale = torch.rand(hkv, d, device=device) * 0.05 + 0.02
    codec = StaticCodec(fmt, scale)
    kbf = torch.randn(batch, hkv, ctx, d, device=device, dtype=torch.bfloat16)
    vbf = torch.randn(batch, hkv, ctx, d, device=device, dtype=torch.bfloat16)
    kc, vc = codec.encode(kbf).data.contiguous(), codec.encode(vbf).data.contiguous()
    length = torch.tensor([ctx], device=device)
    q = torch.randn(batch, hq, 1, d, device=device, dtype=torch.bfloat16)
    return scale, codec, q, kbf, vbf, kc, vc, length


def kv_row(label: str, hq: int, hkv: int, ctx: int, batch: int = 1) -> dict[str, Any]:
    """One INT4-KV decode attention call against SDPA on the bf16 cache, both read from HBM, with its error."""
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention
    from mmsdk.plugins.quantizers.quantized_cache import Packed

    d = 128
    scale, codec, q, kbf, vbf, kc, vc, length = kv_problem(hq, hkv, ctx, d, batch=batch)
    # as the packed cache calls it: MHA's kernel merges its own splits with the cache's counters
    counters = torch.zeros(batch * hkv + 1, dtype=torch.int32, device="cuda") if hq == hkv else None

    def ours(k_codes: torch.Tensor, v_codes: torch.Tensor) -> Any:
        return decode_attention(q, k_codes, v_codes, scale, scale, length, "int4", d**-0.5, merge_counters=counters)

    kd, vd = codec.decode(Packed(kc), torch.float32, d), codec.decode(Packed(vc), torch.float32, d)
    err = rel(ours(kc, vc), reference_decode_attention(q, kd, vd, d**-0.5))
    del kd, vd

    def sdpa(k: torch.Tensor, v: torch.Tensor) -> Any:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv)

    # both caches read from HBM (copies in turn, as each layer reads its own cache); mmsdk_l2_us repeats one copy,
    # as the runs before the ninth pass did (a 4k-token int4 cache fits in L2)
    t_ours, t_sdpa = gbench(cold(ours, kc, vc)), gbench(cold(sdpa, kbf, vbf))
    t_l2 = gbench(lambda: ours(kc, vc))
    bytes_int4 = kc.numel() * 2
    row = {"heads": label, "ctx": ctx, "batch": batch, "merged": counters is not None, "rel_err": err,
           "mmsdk_int4_us": t_ours * 1e3, "sdpa_bf16_us": t_sdpa * 1e3, "time_ratio": t_ours / t_sdpa,
           "mmsdk_TBps": bytes_int4 / t_ours / 1e9, "sdpa_TBps": 2 * kbf.numel() * 2 / t_sdpa / 1e9,
           "mmsdk_l2_us": t_l2 * 1e3}
    print(row, flush=True)
    return row


KV_HEADS = (("llava MHA 32/32", 32, 32), ("qwen2-vl GQA 28/4", 28, 4))


def section_kv(quick: bool) -> list[dict[str, Any]]:
    return [kv_row(label, hq, hkv, ctx) for label, hq, hkv in KV_HEADS for ctx in (4096, 16384)]


def section_kv_batch(quick: bool) -> list[dict[str, Any]]:
    """The ``kv`` section's calls at batch 1, 4 and 8 (the memory waterfall's batch is 4): at batch 1 a grouped-query
    call reads 2 MB at 4k tokens and is bound by its launches and round trips; with more rows it streams."""
    rows = []
    for batch in (1, 4) if quick else (1, 4, 8):
        for label, hq, hkv in KV_HEADS:
            for ctx in (4096, 16384):
                rows.append(kv_row(label, hq, hkv, ctx, batch))
                release_memory()
    return rows


def section_kv_merge(quick: bool) -> list[dict[str, Any]]:
    """The int4 MHA decode kernel ("subnormal") with its splits merged by a combine kernel and by the partial
    kernel's last program per head (``merge_counters``: one launch fewer; the packed cache's default), against SDPA
    on bf16 K/V, at LLaVA-1.5-7B's heads, each cache read from HBM. Whether the merge still pays."""
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention
    from mmsdk.plugins.quantizers.quantized_cache import Packed

    rows = []
    hq = hkv = 32
    d = 128
    for ctx in (1280, 4096, 16384):
        scale, codec, q, kbf, vbf, kc, vc, length = kv_problem(hq, hkv, ctx, d)
        counters = torch.zeros(hkv + 1, dtype=torch.int32, device="cuda")
        kd, vd = codec.decode(Packed(kc), torch.float32, d), codec.decode(Packed(vc), torch.float32, d)
        reference = reference_decode_attention(q, kd, vd, d**-0.5)

        def ours(k_codes: torch.Tensor, v_codes: torch.Tensor, merged: bool = False) -> Any:
            return decode_attention(q, k_codes, v_codes, scale, scale, length, "int4", d**-0.5,
                                    merge_counters=counters if merged else None)

        def merged(k_codes: torch.Tensor, v_codes: torch.Tensor) -> Any:
            return ours(k_codes, v_codes, True)

        def sdpa(k: torch.Tensor, v: torch.Tensor) -> Any:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

        row = {"heads": "llava MHA 32/32", "ctx": ctx, "rel_err_combine": rel(ours(kc, vc), reference),
               "rel_err_merged": rel(merged(kc, vc), reference), "counters_left": int(counters.abs().sum())}
        t_plain, t_merged = gbench(cold(ours, kc, vc)), gbench(cold(merged, kc, vc))
        t_sdpa = gbench(cold(sdpa, kbf, vbf))
        row.update({"combine_us": t_plain * 1e3, "merged_us": t_merged * 1e3, "sdpa_bf16_us": t_sdpa * 1e3,
                    "combine_ratio": t_plain / t_sdpa, "merged_ratio": t_merged / t_sdpa,
                    "counters_left_after_timing": int(counters.abs().sum())})
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


def section_kv_formats(quick: bool) -> list[dict[str, Any]]:
    """The packed decode kernel on int4, int8 and fp8 codes against SDPA on bf16 K/V, each cache read from HBM:
    Llama-3.2-11B-Vision heads (32 / 8) over a short self-attention cache (256 slots) and one image's 6404
    cross-attention tokens, and Qwen2-VL-7B's (28 / 4) at 4k. In Mllama's decode step int8 and fp8 K/V measured
    4.1 ms against int4's 2.6 (gpu_cross_attention_decode.py); this says how much of that is the kernel."""
    from mmsdk.kernels.kv_decode import decode_attention, reference_decode_attention
    from mmsdk.plugins.quantizers.quantized_cache import Packed

    rows = []
    d = 128
    for label, hq, hkv, ctx in (("mllama self 32/8", 32, 8, 256), ("mllama image 32/8", 32, 8, 6404),
                                ("qwen2-vl GQA 28/4", 28, 4, 4096)):
        t_sdpa = None
        for fmt in ("int4", "int8", "fp8"):
            scale, codec, q, kbf, vbf, kc, vc, length = kv_problem(hq, hkv, ctx, d, fmt=fmt)

            def ours(k_codes: torch.Tensor, v_codes: torch.Tensor) -> Any:
                return decode_attention(q, k_codes, v_codes, scale, scale, length, fmt, d**-0.5)

            def sdpa(k: torch.Tensor, v: torch.Tensor) -> Any:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            kd, vd = codec.decode(Packed(kc), torch.float32, d), codec.decode(Packed(vc), torch.float32, d)
            err = rel(ours(kc, vc), reference_decode_attention(q, kd, vd, d**-0.5))
            t_sdpa = t_sdpa or gbench(cold(sdpa, kbf, vbf))
            t_ours = gbench(cold(ours, kc, vc))
            code_bytes = (kc.numel() + vc.numel()) * kc.element_size()
            row = {"heads": label, "ctx": ctx, "fmt": fmt, "rel_err": err, "mmsdk_us": t_ours * 1e3,
                   "sdpa_bf16_us": t_sdpa * 1e3, "time_ratio": t_ours / t_sdpa, "mmsdk_TBps": code_bytes / t_ours / 1e9}
            if fmt != "int4":  # one byte per channel holds twice int4's codes in registers: other tiles
                row["configs_us"] = {}
                for config in KV_BYTE_CONFIGS:
                    def tried(k_codes: torch.Tensor, v_codes: torch.Tensor, config: tuple[int, ...] = config) -> Any:
                        return decode_attention(q, k_codes, v_codes, scale, scale, length, fmt, d**-0.5, config=config)

                    row["configs_us"][str(config)] = gbench(cold(tried, kc, vc)) * 1e3
            rows.append(row)
            print(rows[-1], flush=True)
    rows.append({"compiled_decode_kernels": compiled_kernels()})
    print(rows[-1], flush=True)
    return rows


def compiled_kernels() -> list[dict[str, Any]]:
    """Registers and spills of every compiled variant of the generic packed-KV decode kernel (Triton's cache; its
    layout is Triton's own, so a failure to read it is recorded, not raised)."""
    from mmsdk.kernels import _kv_grouped_triton

    found = []
    try:
        for caches in _kv_grouped_triton.decode_partial.device_caches.values():
            for key, kernel in caches[0].items():
                kernel._init_handles()
                found.append({"n_regs": kernel.n_regs, "n_spills": kernel.n_spills, "key": str(key)[-400:]})
    except Exception as error:  # noqa: BLE001 - a diagnostic: keep what was read and why the rest was not
        found.append({"error": repr(error)[:300]})
    return found


# (BLOCK_T, num_warps, target programs, num_stages, V loaded with K) of the generic decode kernel, tried on int8 and
# fp8 codes next to their defaults: the first three are int4's defaults (long, short, middle caches), which int8 and
# fp8 took before their tiles were halved for the registers' sake (kv_decode_choice.generic_config)
KV_BYTE_CONFIGS = ((128, 4, 264, 2, 1), (128, 8, 264, 2, 1), (256, 8, 264, 2, 1), (128, 4, 264, 2, 0),
                   (64, 4, 264, 2, 0), (64, 4, 528, 2, 0), (32, 4, 528, 2, 0), (64, 8, 264, 2, 0))


def section_norm(quick: bool) -> list[dict[str, Any]]:
    from mmsdk.kernels import norm_rope as ref
    from mmsdk.kernels import norm_rope_gpu as gpu

    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception as error:  # liger missing: its columns stay empty
        print("liger unavailable:", error)
        LigerRMSNormFunction = liger_rotary_pos_emb = None
    rows = []
    eager_add = torch.compile(ref.add_rms_norm) if False else ref.add_rms_norm
    for tokens in (1, 4096, 16384):
        h = 4096
        x, r = (torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5
        got, exp = gpu.add_rms_norm(x, r, w, 1e-6), ref.add_rms_norm(x, r, w, 1e-6)
        row = {"op": "add+rmsnorm", "tokens": tokens, "rel_err": max(rel(got[0], exp[0]), rel(got[1], exp[1])),
               "mmsdk_us": gbench(lambda: gpu.add_rms_norm(x, r, w, 1e-6)) * 1e3,
               "eager_us": gbench(lambda: eager_add(x, r, w, 1e-6)) * 1e3}
        if LigerRMSNormFunction is not None:  # liger: add in torch, then its norm (it has no fused add here)
            row["liger_us"] = gbench(lambda: LigerRMSNormFunction.apply(x + r, w, 1e-6, 0.0, "llama")) * 1e3
        row["mmsdk_TBps"] = 4 * x.numel() * 2 / row["mmsdk_us"] / 1e6
        rows.append(row)
        print(row, flush=True)
        hq, hk, d = 32, 32, 128
        q = torch.randn(1, hq, tokens, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, hk, tokens, d, device="cuda", dtype=torch.bfloat16)
        ang = torch.randn(1, tokens, d // 2, device="cuda") * 100
        cos, sin = (torch.cat([f(ang)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
        got, exp = gpu.rope_qk(q, k, cos, sin), ref.rope_qk(q, k, cos, sin)
        row = {"op": "rope q+k", "tokens": tokens, "rel_err": max(rel(got[0], exp[0]), rel(got[1], exp[1])),
               "mmsdk_us": gbench(lambda: gpu.rope_qk(q, k, cos, sin)) * 1e3,
               "eager_us": gbench(lambda: ref.rope_qk(q, k, cos, sin)) * 1e3}
        if liger_rotary_pos_emb is not None:
            row["liger_us"] = gbench(lambda: liger_rotary_pos_emb(q, k, cos, sin)) * 1e3
        row["mmsdk_TBps"] = 2 * (q.numel() + k.numel()) * 2 / row["mmsdk_us"] / 1e6
        rows.append(row)
        print(row, flush=True)
    return rows


def timed_calls(run: Callable[..., Any], inputs: dict[str, Any], new: int, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``run`` after one untimed call (compiles, captures, allocates)."""
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run(**inputs, max_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times[1:]


def decode_rate(model: Any, inputs: dict[str, Any], new: int, reps: int, generate: Any = None) -> dict[str, Any]:
    """Decode ms per token from the medians of ``reps`` calls of ``new`` and of one new token (prefill cancels), each
    call's milliseconds kept (``calls_ms``): on a host whose calls of one length spread (docs/benchmarks.md,
    forty-ninth pass) the lists show how far the difference can be trusted."""
    run = generate or model.generate
    calls = {n: timed_calls(run, inputs, n, reps) for n in (1, new)}
    t1, tn = statistics.median(calls[1]) / 1e3, statistics.median(calls[new]) / 1e3
    step = (tn - t1) / (new - 1)
    return {"step_ms": step * 1e3, "tokens_per_s": 1.0 / step, "ttft_ms": t1 * 1e3,
            "calls_ms": {str(n): times for n, times in calls.items()}}


def against_floor(row: dict[str, Any], model: Any, kv: float, tokens: int) -> dict[str, Any]:
    """``row`` (with ``step_ms``) and its bandwidth floor: ``floor_ms`` for the model's weights plus ``kv`` bytes per
    cached token at ``tokens`` tokens, and ``x_floor``, the step over it."""
    row["floor_ms"] = lm_bytes(model, kv, tokens) / speed_limit() * 1e3
    row["x_floor"] = row["step_ms"] / row["floor_ms"]
    return row


def decode_recorder(quick: bool, rows: list[dict[str, Any]], new: int = 128, reps: int = 3) -> Callable[..., None]:
    """``record(name, model, kv_bytes_per_token, generate=None)``: one decode row at 1k context into ``rows``."""
    ctx, new, reps = (1024, 32, 1) if quick else (1024, new, reps)
    inputs = llava_inputs(1, ctx, images=False)

    def record(name: str, model: Any, kv: float, generate: Any = None) -> None:
        row = {"variant": name, **decode_rate(model, inputs, new, reps, generate)}
        row["bytes_per_step"] = lm_bytes(model, kv, ctx + new // 2)
        row["floor_ms"] = row["bytes_per_step"] / speed_limit() * 1e3
        row["fraction_of_limit"] = row["floor_ms"] / row["step_ms"]
        rows.append(row)
        print(row, flush=True)

    return record


def section_decode(quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    record = decode_recorder(quick, rows)
    kv_bf16, kv_int4 = KV_BF16, KV_INT4

    model = build_llava()
    record("HF bf16 eager generate", model, kv_bf16, type(model).generate.__get__(model))
    del model
    release_memory()
    model = optimized(build_llava(), (), kv=False)
    record("mmsdk bf16 (fast generate: static cache + CUDA graph)", model, kv_bf16)
    del model
    release_memory()
    try:
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        model = build_llava()
        quantize_(model.model.language_model,
                  Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))
        record("torchao int4 weight-only (HF eager generate)", model, kv_bf16, type(model).generate.__get__(model))
        del model
    except Exception as error:
        rows.append({"variant": "torchao int4 weight-only", "error": repr(error)[:500]})
        traceback.print_exc()
    release_memory()
    model = optimized(build_llava(), ("int4-weight",), kv=True)
    record("mmsdk int4-weight + int4-kv (fast generate)", model, kv_int4)
    record("mmsdk int4-weight + int4-kv (HF generate, no graphs)", model, kv_int4, model._mmsdk_fast_generate)
    del model
    release_memory()
    model = optimized(build_llava(), ("qkv-fuse", "int4-weight", "rmsnorm-rope-fusion"), kv=True)
    record("mmsdk qkv-fuse + int4-weight + rmsnorm-rope-fusion + int4-kv (fast generate)", model, kv_int4)
    del model
    release_memory()
    from mmsdk.plugins.attention.rmsnorm_rope import RMSNormRoPEFusionConfig
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    model = optimized(build_llava(), int4_g128_stack(), kv=True)
    record("mmsdk qkv-fuse + int4-weight g128 + rmsnorm-rope-fusion + int4-kv (fast generate)", model,
           kv_int4)
    del model
    release_memory()
    # the same stack without the one-kernel input/final norms and the paired gate/up kernel (their share)
    earlier = ("qkv-fuse", Int4WeightConfig(gated_mlp_kernel=False), RMSNormRoPEFusionConfig(plain_norms=False))
    model = optimized(build_llava(), earlier, kv=True)
    record("same stack without plain-norm and gated-MLP kernels (fast generate)", model, kv_int4)
    del model
    release_memory()
    return rows


def section_steady(quick: bool) -> list[dict[str, Any]]:
    """mmsdk's decode step in steady state: (t(2n) - t(n)) / n, which leaves out each generate call's fixed
    cost (prefill, two eager steps and the CUDA-graph capture) that ``decode_rate`` spreads over n - 1 steps."""
    return steady_rows(quick, steady_stacks())


def section_steady_g32(quick: bool) -> list[dict[str, Any]]:
    """The steady section's first stack alone (LLaVA-1.5-7B, full stack g32), with more calls: where whole generate
    calls disagree with the replayed step, its rows show which call lengths' times spread."""
    return steady_rows(quick, steady_stacks()[:1], reps=7)


def steady_stacks() -> tuple[tuple[str, Any], ...]:
    """(name, passes before int4-kv) of the steady section's stacks: full stack g32, g128, g32 without the plain-norm
    and gated-MLP kernels."""
    from mmsdk.plugins.attention.rmsnorm_rope import RMSNormRoPEFusionConfig
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    return (("qkv-fuse + int4-weight + rmsnorm-rope-fusion + int4-kv",
             ("qkv-fuse", "int4-weight", "rmsnorm-rope-fusion")),
            ("same with int4-weight g128", int4_g128_stack()),
            ("same (g32) without plain-norm and gated-MLP kernels",
             ("qkv-fuse", Int4WeightConfig(gated_mlp_kernel=False), RMSNormRoPEFusionConfig(plain_norms=False))))


def steady_rows(quick: bool, stacks: tuple[tuple[str, Any], ...], reps: int = 3) -> list[dict[str, Any]]:
    """One steady-state row per (name, passes) stack: medians of ``reps`` calls of 1, n and 2n new tokens, each
    call's milliseconds kept (``calls_ms``), the kept step replayed after them (``replayed_step_ms``,
    :func:`mmsdk.kernels.step_search.kept_step_ms`), the measure that has no per-call cost at all, a one-token call's
    GPU time per kernel (``first_token_kernels``) and the tuner's configurations (``tuned_configs``)."""
    from benchmarks.gpu_tune import generate_kernels
    from mmsdk.kernels.step_search import kept_step_ms
    from mmsdk.kernels.w4a16_tuning import tuning

    inputs = llava_inputs(1, 1024, images=False)
    new, reps = (32, 1) if quick else (128, reps)
    rows: list[dict[str, Any]] = []
    for name, passes in stacks:
        model = optimized(build_llava(), passes, kv=True)
        calls = {n: timed_calls(model.generate, inputs, n, reps) for n in (1, new, 2 * new)}
        t1, tn, t2n = (statistics.median(calls[n]) for n in (1, new, 2 * new))
        row = {"variant": name, "new": new, "t1_ms": t1, "tn_ms": tn, "t2n_ms": t2n,
               "step_ms_per_call": (tn - t1) / (new - 1), "steady_step_ms": (t2n - tn) / new,
               "fixed_cost_per_call_ms": tn - t1 - (new - 1) * (t2n - tn) / new,
               "calls_ms": {str(n): times for n, times in calls.items()}}
        # a one-token call's GPU time per kernel, in the state the timed calls ran in (before kept_step_ms drops the
        # kept graph): against t1_ms it says whether a slow first token is GPU work
        row["first_token_kernels"] = generate_kernels(model, inputs, 1, limit=12)
        row["replayed_step_ms"] = kept_step_ms(model, inputs, rounds=5)
        # every configuration the process's tuner holds by now (prefill over 64 rows dequantizes untuned: not there)
        row["tuned_configs"] = {str(key): config for key, config in tuning().chosen.items()}
        row["floor_ms"] = lm_bytes(model, KV_INT4, 1024 + new) / speed_limit() * 1e3
        row["steady_over_floor"] = row["steady_step_ms"] / row["floor_ms"]
        rows.append(row)
        print(row, flush=True)
        del model
        release_memory()
    return rows


@contextmanager
def without_mma_gemv() -> Iterator[None]:
    """GEMV candidates as they were before the tensor-core kind ("mma") existed, for an A/B in one run."""
    from mmsdk.kernels import w4a16
    from mmsdk.kernels.w4a16_tuning import tuning

    before = dict(w4a16._GEMV_CANDIDATES)
    for bucket, candidates in before.items():
        w4a16._GEMV_CANDIDATES[bucket] = tuple(c for c in candidates if len(c) < 5 or c[4] != "mma")
    w4a16._GEMV_CANDIDATES[4] += ((32, 256, 4, 4), (16, 512, 4, 3), (32, 1, 4, 16, "dot"))
    w4a16._GEMV_CANDIDATES[16] += ((32, 256, 4, 4), (64, 2, 4, 16, "dot"))
    w4a16.gemv_candidates.cache_clear()
    tuning().chosen.clear()
    try:
        yield
    finally:
        w4a16._GEMV_CANDIDATES.update(before)
        w4a16.gemv_candidates.cache_clear()
        tuning().chosen.clear()


def section_batch_decode(quick: bool) -> list[dict[str, Any]]:
    """Batch-4 decode on LLaVA-1.5-7B shapes, 1k text tokens per row: the GEMVs see 4 activation rows.

    HF bf16 eager against mmsdk's stack (int4-weight g32 and g128), the latter also with the GEMV kinds that existed
    before the tensor-core "mma" kind (``without_mma_gemv``), in the same run. The floor counts the weights once
    and the KV of all four rows.
    """
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    batch, ctx, new, reps = (4, 1024, 16, 1) if quick else (4, 1024, 64, 3)
    inputs = llava_inputs(batch, ctx, images=False)
    rows: list[dict[str, Any]] = []

    def record(name: str, model: Any, kv: float, generate: Any = None) -> None:
        row = {"variant": name, "batch": batch, **decode_rate(model, inputs, new, reps, generate)}
        row["tokens_per_s"] *= batch
        against_floor(row, model, kv * batch, ctx + new // 2)
        rows.append(row)
        print(row, flush=True)

    model = build_llava()
    record("HF bf16 eager generate", model, KV_BF16, type(model).generate.__get__(model))
    del model
    release_memory()
    for group in (32, 128):
        passes = ("qkv-fuse", Int4WeightConfig(group_size=group), "rmsnorm-rope-fusion")
        # a fresh model per variant: generate keeps its static cache and CUDA graph between calls, so a variant timed
        # on a model that already ran would time the other variant's graph, or a re-capture inside its timed calls
        model = optimized(build_llava(), passes, kv=True)
        record(f"mmsdk qkv-fuse + int4-weight g{group} + rmsnorm-rope-fusion + int4-kv (fast generate)", model,
               KV_INT4)
        del model
        release_memory()
        with without_mma_gemv():
            model = optimized(build_llava(), passes, kv=True)
            record(f"same g{group}, GEMV kinds before 'mma'", model, KV_INT4)
            del model
        release_memory()
    return rows


def section_qwen_decode(quick: bool) -> list[dict[str, Any]]:
    """Batch-1 decode on Qwen2-VL-7B shapes (GQA 28/4, M-RoPE), 1k text context: HF eager vs mmsdk's stack."""

    ctx, new, reps = (1024, 32, 1) if quick else (1024, 128, 3)
    inputs = qwen_text_inputs(1, ctx)
    kv_bytes = 28 * 2 * 4 * 128  # per token and byte of element: layers x (K, V) x KV heads x head_dim
    rows: list[dict[str, Any]] = []

    def record(name: str, model: Any, kv: float, generate: Any = None) -> None:
        row = {"variant": name, **decode_rate(model, inputs, new, reps, generate)}
        against_floor(row, model, kv, ctx + new // 2)
        rows.append(row)
        print(row, flush=True)

    model = build_qwen2_vl()
    record("HF bf16 eager generate", model, kv_bytes * 2, type(model).generate.__get__(model))
    del model
    release_memory()
    model = optimized(build_qwen2_vl(), int4_g128_stack(), kv=True)
    record("mmsdk qkv-fuse + int4-weight g128 + rmsnorm-rope-fusion + int4-kv (fast generate)", model, kv_bytes * 0.5)
    return rows


@contextmanager
def batch_one_kv_tiles() -> Iterator[None]:
    """The grouped-query INT4-KV kernel with its batch-1 tiles whatever the batch (kv_decode_choice's many-row
    thresholds out of reach), for an A/B in one run."""
    from mmsdk.kernels import kv_decode_choice

    names = ("MANY_ROWS_MIDDLE", "MANY_ROWS_WIDE", "MANY_ROWS_LONG")
    before = {name: getattr(kv_decode_choice, name) for name in names}
    for name in names:
        setattr(kv_decode_choice, name, 1 << 30)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(kv_decode_choice, name, value)


def int4_g128_stack() -> tuple[Any, ...]:
    """mmsdk's decode stack before int4-kv, as the sections run it: qkv-fuse, int4-weight g128, rmsnorm-rope-fusion."""
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    return ("qkv-fuse", Int4WeightConfig(group_size=128), "rmsnorm-rope-fusion")


def qwen_text_inputs(batch: int, ctx: int) -> dict[str, torch.Tensor]:
    """``batch`` rows of ``ctx`` random text tokens for Qwen2-VL shapes, the same in every run (seed 1)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(1, 150000, (batch, ctx), device="cuda", generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def section_qwen_batch_decode(quick: bool) -> list[dict[str, Any]]:
    """Batch-4 decode on Qwen2-VL-7B shapes with a 3k-token prompt per row (a cache of 2k-4k slots, 16 batch rows x
    KV heads): :func:`qwen_batch_decode_rows`, six rounds."""
    return qwen_batch_decode_rows(quick, 3072, (True, False, False, True, True, False))


def section_qwen_batch_decode_long(quick: bool) -> list[dict[str, Any]]:
    """The same with 12k-token prompts (a cache beyond 4k slots, where the many-row tiles go 3 deep), four rounds."""
    return qwen_batch_decode_rows(quick, 12288, (True, False, False, True))


# (BLOCK_T, warps, target programs, stages, V with K) of the grouped-query KV kernel forced in the batch-4 step: the
# many-row tiles (2 and 3 deep), and the batch-1 middle- and long-cache tiles
BATCH_STEP_ATTENTION = ((64, 2, 528, 2, True), (64, 2, 528, 3, True), (256, 8, 264, 2, True), (128, 4, 264, 2, True))


def section_qwen_batch_step_attention(quick: bool) -> list[dict[str, Any]]:
    """The batch-4 decode step of Qwen2-VL-7B shapes (3k- and 12k-token prompts per row) with each of
    ``BATCH_STEP_ATTENTION`` forced as the KV kernel's config, in one model per prompt length (kept graph captured
    again per trial, median of three replays after a call), with programmatic dependent launch and without: whether
    the tiles that run the attention call alone 1.2-1.6x faster at batch 4 (gpu_kernel_sweeps.py gqa_batch4) change
    the step, where qwen_batch_decode measured no difference."""
    return qwen_batch_step_rows(((4, 3072),) if quick else ((4, 3072), (4, 12288)), BATCH_STEP_ATTENTION,
                                (True,) if quick else (True, False))


def section_qwen_batch_step_attention_check(quick: bool) -> list[dict[str, Any]]:
    """The same with the default chosen from it against the many-row tiles it replaced, at batch 4 (3k / 12k-token
    prompts) and batch 8 (3k), with programmatic dependent launch."""
    return qwen_batch_step_rows(((4, 3072),) if quick else ((4, 3072), (8, 3072), (4, 12288)),
                                ((64, 2, 528, 2, True), (64, 2, 528, 3, True), (128, 4, 264, 2, True)), (True,))


def section_qwen_batch8_long_step(quick: bool) -> list[dict[str, Any]]:
    """The same at batch 8 with 12k-token prompts (32 rows over a long cache)."""
    return qwen_batch_step_rows(((8, 3072),) if quick else ((8, 12288),),
                                ((64, 2, 528, 2, True), (64, 2, 528, 3, True), (128, 4, 264, 2, True)), (True,))


def section_qwen_batch_paired_mlp(quick: bool) -> list[dict[str, Any]]:
    """Batched decode steps of Qwen2-VL-7B shapes (int4 stack, 3k-token prompts, batch 4 and 8) with the gated MLP's
    gate and up as one paired tensor-core GEMV (``MMSDK_PAIRED_ROWS=1``) and as two GEMVs, their K-slice sums, a
    SiLU and a multiply (``MMSDK_PAIRED_ROWS=0``): :func:`paired_mlp_rows`."""
    return paired_mlp_rows(quick, build_qwen2_vl, int4_g128_stack(), qwen_text_inputs, "qwen2-vl g128")


def section_llava_batch_paired_mlp(quick: bool) -> list[dict[str, Any]]:
    """The same on LLaVA-1.5-7B shapes with groups of 32 (multi-head attention, 11008-wide MLP), 3k text tokens per
    row: whether the paired GEMV's gain at groups of 128 holds where each weight carries four times the scales."""
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    passes = ("qkv-fuse", Int4WeightConfig(group_size=32), "rmsnorm-rope-fusion")
    return paired_mlp_rows(quick, build_llava, passes, lambda batch, ctx: llava_inputs(batch, ctx, images=False),
                           "llava g32")


def paired_mlp_rows(quick: bool, build: Callable[[], Any], passes: tuple[Any, ...],
                    inputs_for: Callable[[int, int], dict[str, torch.Tensor]], label: str) -> list[dict[str, Any]]:
    """Per batch (4 and 8, 3k-token prompts) one model of ``build`` with ``passes`` and int4-kv, its step timed with
    the paired gate / up GEMV on and off, alternating (kept graph captured again per trial, median of three replays
    after a call); whether the two settings' first 32 greedy tokens agree (fast generate), and through transformers'
    loop (which the scores request takes) each step's logits' relative difference while the two answers agree (random
    weights leave near-ties, so answers part after a few tokens)."""
    from benchmarks.gpu_decode_reuse import step_ms_recaptured
    from benchmarks.gpu_tune import env_setting
    from mmsdk.kernels import PAIRED_ROWS_ENV

    rows: list[dict[str, Any]] = []
    for batch in (4,) if quick else (4, 8):
        inputs = inputs_for(batch, 3072)
        model = optimized(build(), passes, kv=True)
        tokens = {}
        for setting in ("0", "1", "1", "0") if not quick else ("0", "1"):
            with env_setting(PAIRED_ROWS_ENV, setting):
                row = {"model": label, "batch": batch, "ctx": 3072, "paired_rows": setting == "1",
                       "step_ms": step_ms_recaptured(model, inputs)}
                tokens[setting] = model.generate(**inputs, max_new_tokens=32, do_sample=False)[:, 3072:]
            rows.append(row)
            print(row, flush=True)
        rows[-1]["new_tokens_agree"] = float((tokens["0"] == tokens["1"]).float().mean())
        rows[-1].update(logits_while_agreeing(model, inputs, PAIRED_ROWS_ENV, 16))
        del model
        release_memory()
    return rows


def section_qwen_batch6_step(quick: bool) -> list[dict[str, Any]]:
    """The batch-6 step (24 rows x KV heads, between the measured 16 and 32) over 3k- and 12k-token prompts: the default
    (the long-cache tile below kv_decode_choice.MANY_ROWS_WIDE rows) against the wide 64-token tile, 3 deep."""
    return qwen_batch_step_rows(((6, 3072),) if quick else ((6, 3072), (6, 12288)),
                                ((64, 2, 528, 3, True), (128, 4, 264, 2, True)), (True,))


def section_qwen_batch7_step(quick: bool) -> list[dict[str, Any]]:
    """The batch-7 step (28 rows x KV heads, below kv_decode_choice.MANY_ROWS_WIDE) over 3k-token prompts: the default
    (the long-cache tile) against the wide 64-token tile, 3 deep, which wins from 32 rows."""
    return qwen_batch_step_rows(((7, 3072),), ((64, 2, 528, 3, True), (128, 4, 264, 2, True)), (True,))


def section_qwen_batch8_int8_step(quick: bool) -> list[dict[str, Any]]:
    """int8 K/V at batch 8 over 3k- and 12k-token prompts: the wide tile halved (the default over middle caches from
    this pass) against the wide tile (the default beyond them)."""
    return qwen_batch_step_rows(((8, 3072),) if quick else ((8, 3072), (8, 12288)),
                                ((64, 2, 528, 3, True), (32, 2, 528, 3, True)), (True,), "int8-kv")


def section_qwen_batch_pdl(quick: bool) -> list[dict[str, Any]]:
    """The batched decode step with its defaults (paired gate / up GEMV on) with programmatic dependent launch and
    without (``MMSDK_PDL=0``), each twice, at batch 4 x 3k / 12k-token prompts and batch 8 x 3k."""
    return qwen_batch_step_rows(((4, 3072),) if quick else ((4, 3072), (8, 3072), (4, 12288)), (),
                                (True, False, True, False))


def section_qwen_batch_attention_pdl(quick: bool) -> list[dict[str, Any]]:
    """Where the batch-8 step's PDL cost sits (qwen_batch_pdl: 1.8% at 8 x 3k, while 4 x 12k gained 2.0%): the
    defaults against the KV decode kernels alone launched without PDL (gpu_decode_reuse's "no_pdl" trial), twice."""
    return qwen_batch_step_rows(((8, 3072),) if quick else ((8, 3072), (4, 12288)), ("no_pdl", "no_pdl"), (True,))


def section_qwen_batch_attention_pdl_check(quick: bool) -> list[dict[str, Any]]:
    """The batch-8 step after the KV kernels lost PDL at 32 rows over middle caches (kv_decode_choice.
    launched_without_pdl): at 8 x 3k the default against the same tile forced (a forced config keeps PDL); at 8 x 12k
    (a long cache, PDL kept) the default against the KV kernels without it."""
    return [*qwen_batch_step_rows(((8, 3072),), ((64, 2, 528, 3, True),), (True,)),
            *([] if quick else qwen_batch_step_rows(((8, 12288),), ("no_pdl",), (True,)))]


def section_qwen_batch_step_gemvs(quick: bool) -> list[dict[str, Any]]:
    """The batch-4 and batch-8 decode steps of Qwen2-VL-7B shapes (int4 stack, int4-kv, 3k-token prompts) with each
    GEMV's config chosen by timing the replayed step (gpu_decode_reuse.search_step_rows: every "mma" candidate of the
    rows bucket pinned in turn for q/k/v, o_proj, down and the paired gate / up), where the tuner times them alone."""
    from benchmarks.gpu_decode_reuse import search_step_rows
    from mmsdk.kernels.w4a16 import gemv_row_bucket

    rows: list[dict[str, Any]] = []
    for batch in (4,) if quick else (4, 8):
        inputs = qwen_text_inputs(batch, 3072)
        model = optimized(build_qwen2_vl(), int4_g128_stack(), kv=True)
        model.generate(**inputs, max_new_tokens=128, do_sample=False)  # tune, compile, capture; sizes the cache
        row = {"batch": batch, "ctx": 3072, **search_step_rows(model, inputs, gemv_row_bucket(batch))}
        rows.append(row)
        print({k: row[k] for k in ("batch", "start_ms", "final_ms", "kept")}, flush=True)
        del model
        release_memory()
    return rows


def logits_while_agreeing(model: Any, inputs: dict[str, torch.Tensor], env: str, new: int) -> dict[str, Any]:
    """Greedy answers of ``new`` tokens with ``env`` at "0" and at "1": :func:`answers_compared`."""
    from benchmarks.gpu_tune import env_setting

    runs = []
    for setting in ("0", "1"):
        with env_setting(env, setting):
            runs.append(scored_answer(model, inputs, new))
    return answers_compared(*runs, inputs["input_ids"].shape[1])


def scored_answer(model: Any, inputs: dict[str, torch.Tensor], new: int) -> Any:
    """A greedy answer of ``new`` tokens with each step's logits (the scores request takes transformers' loop)."""
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=new, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)


def answers_compared(first: Any, second: Any, prompt: int) -> dict[str, Any]:
    """Each step's logits' relative difference (norm over the batch) while two scored answers agree, and the first
    step where they part (None: they never do)."""
    differences, parted = [], None
    for step, (a, b) in enumerate(zip(first.scores, second.scores)):
        if not torch.equal(first.sequences[:, : prompt + step], second.sequences[:, : prompt + step]):
            parted = step
            break
        differences.append(float((a.double() - b.double()).norm() / a.double().norm()))
    return {"logits_rel_diff_while_agreeing": differences, "answers_part_at_step": parted}


def section_qwen_batch_rounding(quick: bool) -> list[dict[str, Any]]:
    """How far a batched decode's logits move under a change that only rounds differently, next to the paired gate /
    up GEMV's change (Qwen2-VL-7B shapes, int4 stack, int4-kv, batch 4 x 3k-token prompts, transformers' loop):
    ``MMSDK_PAIRED_ROWS=0`` with the tuner's picks against the same with each 4-row plain GEMV pinned to another
    tensor-core tile (other K slices: the fp32 partials summed in another order, so some bf16 outputs round the
    other way), and against ``MMSDK_PAIRED_ROWS=1`` (silu(gate) * up from fp32, one rounding where the two GEMVs round
    gate, up, the SiLU and the product)."""
    from benchmarks.gpu_decode_reuse import row_bucket_trials
    from benchmarks.gpu_tune import env_setting
    from mmsdk.kernels import PAIRED_ROWS_ENV
    from mmsdk.kernels.w4a16_tuning import tuning

    inputs = qwen_text_inputs(4, 3072)
    model = optimized(build_qwen2_vl(), int4_g128_stack(), kv=True)
    new = 4 if quick else 12
    table = tuning().chosen
    with env_setting(PAIRED_ROWS_ENV, "0"):
        reference = scored_answer(model, inputs, new)  # tunes the 4-row keys
        pins = {}  # key -> (the tuner's pick, a tile over another program target: other K slices)
        for key, candidates in row_bucket_trials(4, gated=False).values():
            target = table[key][5] if len(table[key]) > 5 else None
            other = [c for c in candidates if c[5] != target]
            if other:
                pins[key] = (table[key], other[0])
                table[key] = other[0]
        retiled = scored_answer(model, inputs, new)
        for key, (cfg, _) in pins.items():
            table[key] = cfg
    with env_setting(PAIRED_ROWS_ENV, "1"):
        paired = scored_answer(model, inputs, new)
    prompt = inputs["input_ids"].shape[1]
    rows = [{"change": "4-row GEMVs on other tiles", "pins": {str(k): v for k, v in pins.items()},
             **answers_compared(reference, retiled, prompt)},
            {"change": "paired gate / up GEMV", **answers_compared(reference, paired, prompt)}]
    for row in rows:
        print(row, flush=True)
    del model
    release_memory()
    return rows


def section_qwen_batch_step_attention_bytes(quick: bool) -> list[dict[str, Any]]:
    """The same for int8 and fp8 K/V (their many-row tiles were chosen from the call alone): batch 4 with 12k-token
    prompts and batch 8 with 3k, the default against int4's many-row tile, the halved long-cache tile and the halved
    many-row tile."""
    configs = ((64, 2, 528, 3, True), (64, 4, 264, 2, True), (32, 2, 528, 3, True))
    shapes = ((4, 3072),) if quick else ((4, 12288), (8, 3072))
    return [row for kv in ("int8-kv", "fp8-kv") for row in qwen_batch_step_rows(shapes, configs, (True,), kv)]


def qwen_batch_step_rows(shapes: tuple[tuple[int, int], ...], configs: tuple[tuple[Any, ...], ...],
                         pdl_settings: tuple[bool, ...], kv: str = "int4-kv") -> list[dict[str, Any]]:
    """Per (batch, prompt tokens) of ``shapes`` one model (K/V packed by pass ``kv``); its step timed with the default
    KV config, each of ``configs`` forced, and the default again, under each of ``pdl_settings``."""
    from benchmarks.gpu_decode_reuse import attention_config, step_ms_recaptured
    from benchmarks.gpu_models import attach_kv
    from benchmarks.gpu_tune import pdl_setting
    from mmsdk import Optimizer

    passes = int4_g128_stack()
    rows: list[dict[str, Any]] = []
    for batch, ctx in shapes:
        inputs = qwen_text_inputs(batch, ctx)
        opt = Optimizer(build_qwen2_vl(), None)
        opt.apply(*passes)
        model = opt.model
        attach_kv(model, opt.adapter, kv)
        del opt
        model.generate(**inputs, max_new_tokens=128, do_sample=False)  # tune, compile, capture; sizes the cache
        for pdl in pdl_settings:
            with pdl_setting(pdl):
                for config in (None, *configs, None):
                    with attention_config(config):
                        row = {"kv": kv, "batch": batch, "ctx": ctx, "pdl": pdl, "cfg": config,
                               "step_ms": step_ms_recaptured(model, inputs)}
                    rows.append(row)
                    print(row, flush=True)
        del model
        release_memory()
    return rows


def qwen_batch_decode_rows(quick: bool, ctx: int, order: tuple[bool, ...]) -> list[dict[str, Any]]:
    """Batch-4 decode on Qwen2-VL-7B shapes with a ``ctx``-token prompt per row: mmsdk's stack with the grouped-query
    KV kernel's many-row tiles (the default; ``order``'s True rounds) and with its batch-1 tiles, each on a fresh
    model.

    ``step_ms`` (generate calls of 1 and ``new`` tokens, the difference per token) moved between 2.2 and 4.0 ms for
    one stack in one process (h200_suite_qwen_batch_decode_35*.json): at batch 4 the prefill of 4 x 3k tokens
    (~340 ms, its run-to-run spread tens of ms) leaves the difference mostly noise. ``step_replay_ms`` is the kept
    decode step's CUDA graph replayed (gpu_decode_reuse.replay_step_ms, median of 3 x 64 replays): the step alone,
    what the tiles change."""
    from benchmarks.gpu_decode_reuse import call_ms, replay_step_ms
    from benchmarks.gpu_tune import generate_kernels

    batch, new, reps = (4, 16, 1) if quick else (4, 64, 3)
    inputs = qwen_text_inputs(batch, ctx)
    kv_bytes = 28 * 2 * 4 * 128 * 0.5 * batch  # per token: layers x (K, V) x KV heads x head_dim, half a byte each
    passes = int4_g128_stack()
    rows: list[dict[str, Any]] = []
    for round_, many_rows in enumerate(order[:2] if quick else order):
        with nullcontext() if many_rows else batch_one_kv_tiles():
            model = optimized(build_qwen2_vl(), passes, kv=True)
            row = {"round": round_, "kv_tiles": "many-row" if many_rows else "batch-1", "batch": batch,
                   **decode_rate(model, inputs, new, reps)}
            replays = []
            for _ in range(3):  # each call refills the kept cache to ctx + new + 1 slots; 64 replays still fit
                call_ms(model, inputs, new, 1)
                replays.append(replay_step_ms(model))
            row["step_replay_ms"] = statistics.median(replays)
            if round_ < 2:  # where a call's GPU time goes, once per tile choice (prefill kernels included)
                row["kernels"] = generate_kernels(model, inputs, 16, limit=25)
        against_floor(row, model, kv_bytes, ctx + new // 2)
        row["replay_x_floor"] = row["step_replay_ms"] / row["floor_ms"]
        rows.append(row)
        print(row, flush=True)
        del model
        release_memory()
    return rows


def section_compiled(quick: bool) -> list[dict[str, Any]]:
    """The compiled peers next to mmsdk's full stack (64 new tokens, 2 reps: compilation takes minutes).

    The peers use transformers' own compiled decoding: a static cache makes ``generate`` compile the
    decode step itself (``generation_config.compile_config``, CUDA graphs via reduce-overhead).
    Wrapping ``model.forward`` in ``torch.compile`` as well fails under generate on transformers 5.17
    (a CUDA-graph output read after the next replay overwrote it).
    """
    rows: list[dict[str, Any]] = []
    RESULTS["compiled"] = rows  # saved after each row: a row that runs out of time keeps the others
    record = decode_recorder(quick, rows, new=64, reps=2)

    model = optimized(build_llava(), int4_g128_stack(), kv=True)
    record("mmsdk qkv-fuse + int4-weight g128 + rmsnorm-rope-fusion + int4-kv (fast generate)", model, KV_INT4)
    del model
    release_memory()
    save_now()

    def compiled(name: str, prepare: Callable[[Any], None]) -> None:
        try:
            model = build_llava()
            prepare(model)
            model.generation_config.cache_implementation = "static"
            start = time.perf_counter()
            record(name, model, KV_BF16, type(model).generate.__get__(model))
            rows[-1]["seconds_incl_compile"] = time.perf_counter() - start
        except Exception as error:
            traceback.print_exc()
            rows.append({"variant": name, "error": repr(error)[:500]})
        release_memory()
        torch._dynamo.reset()
        save_now()

    def torchao_int4(model: Any) -> None:
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        quantize_(model.model.language_model, Int4WeightOnlyConfig(group_size=128,
                                                                   int4_packing_format="tile_packed_to_4d"))

    compiled("HF bf16 static cache + generate's torch.compile", lambda model: None)
    compiled("torchao int4 weight-only g128 + static cache + generate's torch.compile", torchao_int4)
    return rows


def section_memory(quick: bool) -> list[dict[str, Any]]:
    batch, length, new = (4, 1024, 8) if quick else (4, 4096, 128)
    inputs = llava_inputs(batch, length, images=True)
    steps: list[tuple[str, tuple[Any, ...], bool, float]] = [
        ("HF bf16", (), False, 1.0), ("int4-weight", ("int4-weight",), False, 1.0), ("int4-kv", (), True, 1.0),
        ("token-prune 0.25", ({"name": "token-prune", "keep_ratio": 0.25},), False, 0.25),
        ("all: int4-weight + int4-kv + token-prune 0.25", ("int4-weight", {"name": "token-prune", "keep_ratio": 0.25}),
         True, 0.25)]
    rows = []
    for name, passes, kv, keep in steps:
        try:
            # the previous row's model must be gone: an optimized model holds reference cycles (its generate
            # override refers back to it), which only the garbage collector frees
            release_memory()
            leftover = torch.cuda.memory_allocated()
            base = build_llava()
            passes = tuple(_pass(p) for p in passes)
            model = optimized(base, passes, kv) if (passes or kv) else base
            weights, kv_bytes = memory_floor(model, batch, length - int(576 * (1 - keep)) + new, kv)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=new, do_sample=False)
            torch.cuda.synchronize()
            # what earlier rows left allocated (cuBLAS keeps a 32 MiB workspace per stream it ran on) is not this
            # row's: the peak counts from it, as in a process that runs only this row
            peak = torch.cuda.max_memory_allocated() - leftover
            rows.append({"row": name, "allocated_before_build_GB": leftover / 1e9, "peak_GB": peak / 1e9,
                         "reserved_GB": torch.cuda.max_memory_reserved() / 1e9, "weights_GB": weights / 1e9,
                         "kv_GB": kv_bytes / 1e9, "floor_GB": (weights + kv_bytes) / 1e9,
                         "seconds": time.perf_counter() - start})
            rows[-1]["peak_over_floor"] = rows[-1]["peak_GB"] / rows[-1]["floor_GB"]
        except Exception as error:
            traceback.print_exc()
            rows.append({"row": name, "error": repr(error)[:500]})
        print(rows[-1], flush=True)
        model = base = None
    return rows


def _pass(entry: Any) -> Any:
    if isinstance(entry, dict):
        from mmsdk.plugins.encoders.token_prune import TokenPruneConfig

        return TokenPruneConfig(keep_ratio=entry["keep_ratio"])
    return entry


def section_ttft(quick: bool) -> list[dict[str, Any]]:
    """Time to the first token of LLaVA-1.5-7B (bf16) with token-prune at keep 1.0 / 0.5 / 0.25, through transformers'
    generate and through mmsdk's (``opt.model.generate``: chunked prefill into the static cache), for an interactive
    prompt (batch 1, one image + 64 text tokens) and a batch whose prefill is bound by the GPU (4 x 4096 tokens).

    Each case runs in two rounds with the keeps (and the two generates) in opposite orders, a fresh model per row:
    the batch-1 prefill is bound by the host's kernel launches (a profiled call: ~46 ms of CPU against ~12 ms of
    GPU), so its times move with what ran before it in the process; the spread across rounds is part of the result.
    """
    cases = {"batch 1 x 640": (1, 640, 10), "batch 4 x 4096": (4, 4096, 5)}
    if quick:
        cases = {"batch 1 x 640": (1, 640, 3), "batch 2 x 1024": (2, 1024, 2)}
    rows = []
    for case, (batch, length, reps) in cases.items():
        inputs = llava_inputs(batch, length, images=True)
        for round_index, keeps in enumerate(((None, 0.5, 0.25), (0.25, 0.5, None))):
            for keep in keeps:
                try:
                    release_memory()
                    base = build_llava()
                    model = optimized(base, (_pass({"keep_ratio": keep}),) if keep else (), False)
                    runs = {"hf": type(model).generate.__get__(model), "mmsdk": model.generate}
                    order = list(runs) if round_index == 0 else list(runs)[::-1]  # each generate first once
                    times = {name: timed_calls(runs[name], inputs, 1, reps) for name in order}
                    hf, ours = times["hf"], times["mmsdk"]
                    rows.append({"case": case, "round": round_index, "batch": batch, "prompt_tokens": length,
                                 "keep_ratio": keep or 1.0, "hf_ttft_ms": statistics.median(hf),
                                 "hf_min_ms": min(hf), "mmsdk_ttft_ms": statistics.median(ours),
                                 "mmsdk_min_ms": min(ours)})
                except Exception as error:
                    traceback.print_exc()
                    rows.append({"case": case, "round": round_index, "batch": batch, "keep_ratio": keep,
                                 "error": repr(error)[:500]})
                print(rows[-1], flush=True)
                model = base = None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_suite.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sections", default="env,w4a16,kv,norm,decode,memory,ttft")
    args = parser.parse_args()
    RESULTS["out"] = args.out
    RESULTS["command"] = ("python benchmarks/gpu_suite.py " + ("--quick " if args.quick else "")
                          + f"--sections {args.sections}")
    sections = {"env": lambda q: section_env(), "w4a16": section_w4a16, "kv": section_kv,
                "kv_batch": section_kv_batch, "kv_formats": section_kv_formats, "kv_merge": section_kv_merge,
                "norm": section_norm,
                "decode": section_decode,
                "steady": section_steady, "steady_g32": section_steady_g32, "qwen_decode": section_qwen_decode,
                "qwen_batch_decode": section_qwen_batch_decode,
                "qwen_batch_decode_long": section_qwen_batch_decode_long,
                "qwen_batch_step_attention": section_qwen_batch_step_attention,
                "qwen_batch_step_attention_check": section_qwen_batch_step_attention_check,
                "qwen_batch8_long_step": section_qwen_batch8_long_step,
                "qwen_batch_paired_mlp": section_qwen_batch_paired_mlp,
                "qwen_batch_step_attention_bytes": section_qwen_batch_step_attention_bytes,
                "qwen_batch6_step": section_qwen_batch6_step,
                "qwen_batch7_step": section_qwen_batch7_step,
                "llava_batch_paired_mlp": section_llava_batch_paired_mlp,
                "qwen_batch_step_gemvs": section_qwen_batch_step_gemvs,
                "qwen_batch_rounding": section_qwen_batch_rounding,
                "qwen_batch_pdl": section_qwen_batch_pdl,
                "qwen_batch_attention_pdl": section_qwen_batch_attention_pdl,
                "qwen_batch_attention_pdl_check": section_qwen_batch_attention_pdl_check,
                "qwen_batch8_int8_step": section_qwen_batch8_int8_step,
                "batch_decode": section_batch_decode,
                "compiled": section_compiled, "memory": section_memory, "ttft": section_ttft}
    for name in args.sections.split(","):
        start = time.perf_counter()
        try:
            RESULTS[name] = sections[name](args.quick)
        except Exception as error:
            traceback.print_exc()
            RESULTS[name] = {"error": repr(error)[:1000]}
        RESULTS.setdefault("seconds", {})[name] = time.perf_counter() - start
        save(args.out)
        print(f"== {name} done in {time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
