"""Block-sparse attention on ONNX Runtime CPU: com.microsoft SparseAttention vs GroupQueryAttention with an
additive block mask (the two lowerings open to sparse-xattn), same layout, same numbers.

    python benchmarks/ort_sparse_attention.py [--seq 1024] [--markdown docs/benchmarks.md]

One prefill attention call (batch 1), causal block layouts keeping a share of the lower-triangular
blocks (the diagonal always kept). Times: process CPU time with one intra-op thread (robust on a
shared machine) and the fastest wall time, each the best of --repeats runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import environment, write_results  # noqa: E402


def _session(node: Any, inputs: list, outputs: list) -> Any:
    import onnxruntime as ort
    from onnx import helper

    graph = helper.make_graph([node], "attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _best(run: Any, repeats: int) -> tuple[float, float]:
    run()
    cpu, wall = float("inf"), float("inf")
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        run()
        cpu, wall = min(cpu, time.process_time() - c), min(wall, time.perf_counter() - w)
    return round(cpu * 1e3, 2), round(wall * 1e3, 2)


def main() -> None:
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    s, h, kv, d, bs = args.seq, args.heads, args.kv_heads, args.head_dim, args.block
    nb = s // bs
    vi = helper.make_tensor_value_info
    common = [vi("q", T.FLOAT, [1, s, h * d]), vi("k", T.FLOAT, [1, s, kv * d]), vi("v", T.FLOAT, [1, s, kv * d])]
    outs = [vi(n, T.FLOAT, None) for n in ("o", "ok", "ov")]
    gqa = _session(helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tl", "", "", "", "bias"],
                                    ["o", "ok", "ov"], domain="com.microsoft", num_heads=h, kv_num_heads=kv),
                   [*common, vi("pk", T.FLOAT, [1, kv, 0, d]), vi("pv", T.FLOAT, [1, kv, 0, d]), vi("sl", T.INT32, [1]),
                    vi("tl", T.INT32, []), vi("bias", T.FLOAT, [1, 1, s, s])], outs)
    sparse = _session(helper.make_node("SparseAttention", ["q", "k", "v", "pk", "pv", "rows", "cols", "tl", "ksl"],
                                       ["o", "ok", "ov"], domain="com.microsoft", num_heads=h, kv_num_heads=kv,
                                       sparse_block_size=bs),
                      [*common, vi("pk", T.FLOAT, [1, kv, s, d]), vi("pv", T.FLOAT, [1, kv, s, d]),
                       vi("rows", T.INT32, [1, nb + 1]), vi("cols", T.INT32, [1, "nnz"]), vi("tl", T.INT32, []),
                       vi("ksl", T.INT32, [1])], outs)
    rng = np.random.RandomState(0)
    q, k, v = (rng.randn(1, s, n * d).astype(np.float32) for n in (h, kv, kv))
    rows_out: dict[str, Any] = {}
    for density in (1.0, 0.5, 0.25):
        keep = np.tril(np.ones((nb, nb), bool)) & ((rng.rand(nb, nb) < density) | np.eye(nb, dtype=bool))
        row_ptr = np.concatenate([[0], np.cumsum(keep.sum(1))]).astype(np.int32)[None]
        cols = np.concatenate([np.nonzero(r)[0] for r in keep]).astype(np.int32)[None]
        allowed = np.kron(keep, np.ones((bs, bs), bool)) & np.tril(np.ones((s, s), bool))
        bias = np.where(allowed, 0, np.float32(-3.4e38)).astype(np.float32)[None, None]
        empty = np.zeros((1, kv, 0, d), np.float32)
        gqa_feeds = dict(q=q, k=k, v=v, pk=empty, pv=empty, sl=np.array([s - 1], np.int32), tl=np.array(s, np.int32),
                         bias=bias)
        binding = sparse.io_binding()  # SparseAttention updates its cache in place: past and present share memory
        cache = [ort.OrtValue.ortvalue_from_numpy(np.zeros((1, kv, s, d), np.float32)) for _ in range(2)]
        for name, value in dict(q=q, k=k, v=v, rows=row_ptr, cols=cols, tl=np.array(s, np.int32),
                                ksl=np.array([s], np.int32)).items():
            binding.bind_cpu_input(name, value)
        for name, value in zip(("pk", "pv"), cache):
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output("ok", cache[0])
        binding.bind_ortvalue_output("ov", cache[1])
        binding.bind_output("o", "cpu")
        sparse.run_with_iobinding(binding)
        difference = float(np.abs(binding.get_outputs()[2].numpy() - gqa.run(["o"], gqa_feeds)[0]).max())
        g_cpu, g_wall = _best(lambda f=gqa_feeds: gqa.run(["o"], f), args.repeats)
        s_cpu, s_wall = _best(lambda b=binding: sparse.run_with_iobinding(b), args.repeats)
        rows_out[f"{density:.2f}"] = {"kept_blocks": int(keep.sum()), "causal_blocks": int(nb * (nb + 1) // 2),
                                      "gqa_masked_cpu_ms": g_cpu, "gqa_masked_wall_ms": g_wall,
                                      "sparse_attention_cpu_ms": s_cpu, "sparse_attention_wall_ms": s_wall,
                                      "max_abs_difference": difference}
    results = {"environment": environment(), "shape": {"seq": s, "heads": h, "kv_heads": kv, "head_dim": d,
                                                       "block": bs}, "rows": rows_out}
    table = ("| density | kept / causal blocks | GQA + block mask, CPU ms (wall) | SparseAttention, CPU ms (wall) | "
             "max difference |\n| --- | --- | --- | --- | --- |\n") + "\n".join(
        f"| {k} | {r['kept_blocks']} / {r['causal_blocks']} | {r['gqa_masked_cpu_ms']} ({r['gqa_masked_wall_ms']}) | "
        f"{r['sparse_attention_cpu_ms']} ({r['sparse_attention_wall_ms']}) | {r['max_abs_difference']:.1e} |"
        for k, r in rows_out.items())
    table += f"\n\nPrefill of {s} tokens, {h} heads / {kv} KV heads of {d}, {bs}-token blocks, one intra-op thread."
    print(table)
    write_results("ort_sparse_attention", results, table, args.markdown)


if __name__ == "__main__":
    main()
