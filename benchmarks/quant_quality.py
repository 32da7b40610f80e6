"""Quantizer quality side by side, one run, same weights: mmsdk vs ONNX Runtime's and transformers' quantizers.

    python benchmarks/quant_quality.py --model builtin:llava-digits --out benchmarks/results/quant_quality.json

1. Weights: ORT's ``MatMulNBitsQuantizer`` (RTN, the quantizer ORT GenAI uses) vs mmsdk ``int4-weight``
   rtn and awq: relative output error of every decoder linear on calibration rows, and logits SQNR
   of the whole model with every decoder linear replaced.
2. KV cache: transformers ``QuantizedCache`` (quanto and HQQ backends, int4) vs mmsdk ``int4-kv``
   (static and dynamic): K/V bytes after prefill, K/V reconstruction SQNR after prefill, and logits
   SQNR over greedy decoding (each method's tokens, the full-precision model forced along them).
3. Accuracy (when the model has a shipped dataset): held-out accuracy with int4-weight (awq),
   int4-kv (static) and both, against the unquantized model.

Prints tables last and writes the numbers as JSON. CPU only; run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.session import Session
from mmsdk.plugins.quantizers.calibration_stats import cache_argument, collect_statistics
from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig, int4_targets
from mmsdk.plugins.quantizers.kv_cache import Int4KVConfig
from mmsdk.plugins.quantizers.kv_runtime import kv_bytes
from mmsdk.plugins.quantizers.packing import PackedInt4, dequantize_int4
from mmsdk.testing import sample_image, sqnr_db


def _ort_rtn(weight: torch.Tensor, block: int, symmetric: bool) -> torch.Tensor:
    """Quantize with onnxruntime.quantization's MatMulNBitsQuantizer and dequantize its MatMulNBits tensors."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    n, k = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(weight.T.float().contiguous().numpy(), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=block, is_symmetric=symmetric)
    quantizer.process()
    out = quantizer.model.model
    node = next(nd for nd in out.graph.node if nd.op_type == "MatMulNBits")
    inits = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in out.graph.initializer}
    zp = inits[node.input[3]] if len(node.input) > 3 and node.input[3] else None
    packed = PackedInt4(inits[node.input[1]], inits[node.input[2]], zp, k, block)
    return dequantize_int4(packed, torch.float32)


def _inputs(processor: Any, questions: list[tuple[Any, str]]) -> dict[str, torch.Tensor]:
    return processor(images=[q[0] for q in questions], text=[processor.format_prompt(q[1]) for q in questions])


def weight_section(
    model: torch.nn.Module, processor: Any, session: Session, calibration: list, evaluation: list, group: int
) -> dict[str, Any]:
    adapter = session.adapt(model)
    pad = dict(group_size=group, indivisible="pad")
    targets, _ = int4_targets(model, adapter, Int4WeightConfig(**pad))
    calib = mmsdk.CalibrationSet.from_any(calibration, session=session)
    stats = collect_statistics(model, adapter, calib, processor, linears=targets, max_rows=512)
    inputs = _inputs(processor, evaluation)
    with torch.no_grad():
        reference = model(**inputs).logits
    variants: dict[str, Any] = {}
    for label, symmetric in (("sym", True), ("asym", False)):
        ort_model = copy.deepcopy(model)
        layer_errors: dict[str, list[float]] = {"ort-rtn": [], "mmsdk-rtn": [], "mmsdk-awq": []}
        dequantized = {}
        for name, linear in targets.items():
            dequantized[name] = _ort_rtn(linear.weight.detach(), group, symmetric)
            with torch.no_grad():
                ort_model.get_submodule(name).weight.copy_(dequantized[name])
        mm = {}
        for method in ("rtn", "awq"):
            m = copy.deepcopy(model)
            opt = Optimizer(m, processor, session=session).calibrate(calib)
            mm[method] = opt.apply(Int4WeightConfig(method=method, symmetric=symmetric, **pad)).model
        for name, linear in targets.items():
            rows = stats.linears[name].rows.rows
            ref = rows @ linear.weight.detach().float().T
            outs = {"ort-rtn": rows @ dequantized[name].T}
            for method in ("rtn", "awq"):
                layer = mm[method].get_submodule(name)
                x = rows * layer.prequant.float() if layer.prequant is not None else rows
                outs[f"mmsdk-{method}"] = x @ layer.dequantize(torch.float32).T
            for key, out in outs.items():
                layer_errors[key].append(float((ref - out).pow(2).sum() / ref.pow(2).sum()))
        with torch.no_grad():
            sqnr = {"ort-rtn": sqnr_db(reference, ort_model(**inputs).logits)}
            sqnr.update({f"mmsdk-{k}": sqnr_db(reference, v(**inputs).logits) for k, v in mm.items()})
        variants[label] = {
            "mean_relative_output_error": {k: sum(v) / len(v) for k, v in layer_errors.items()},
            "logits_sqnr_db": sqnr,
        }
    return {"group_size": group, "linears": len(targets), "variants": variants}


def _forced_logits(model: torch.nn.Module, inputs: dict, sequence: torch.Tensor) -> torch.Tensor:
    start = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=sequence.shape[1] - start,
            do_sample=False,
            prefix_allowed_tokens_fn=lambda b, ids: [int(sequence[b, ids.shape[-1]])],
            return_dict_in_generate=True,
            output_logits=True,
        )
    return torch.stack(out.logits, 1).float()


def _tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of every tensor reachable from ``obj`` (quanto tensor subclasses and HQQ tuples included)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor) and hasattr(obj, "__tensor_flatten__"):
        names, _ = obj.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(obj, n), seen) for n in names)
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


def _hf_layer_bytes(layer: Any) -> int:
    residual = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None and t.dim() == 4)
    return _tensor_bytes([layer._quantized_keys, layer._quantized_values]) + residual


def _hf_layer_kv(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)
    if layer.keys is not None and layer.keys.dim() == 4 and layer.keys.numel():
        k, v = torch.cat([k, layer.keys], -2), torch.cat([v, layer.values], -2)
    return k, v


def kv_section(
    model: torch.nn.Module,
    processor: Any,
    session: Session,
    calibration: list,
    prompt: tuple,
    steps: int,
    group: int,
    residual: int,
) -> dict[str, Any]:
    from transformers import DynamicCache, QuantizedCache

    model = copy.deepcopy(model).to(torch.bfloat16)
    inputs = _inputs(processor, [prompt])
    inputs = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in inputs.items()}
    arg = cache_argument(model)
    fp = DynamicCache()
    with torch.no_grad():
        model(**inputs, **{arg: fp}, use_cache=True)
    fp_k = [layer.keys.float() for layer in fp.layers]
    fp_v = [layer.values.float() for layer in fp.layers]
    fp16_bytes = sum(k.numel() + v.numel() for k, v in zip(fp_k, fp_v, strict=True)) * 2
    rows: dict[str, Any] = {}

    def record(
        label: str,
        prefill_cache: Any,
        layer_kv: Any,
        nbytes: int,
        make_cache: Any,
        generator: torch.nn.Module,
        count: Any,
    ) -> None:
        ks, vs = zip(*(layer_kv(layer) for layer in prefill_cache.layers), strict=True)
        kv_sqnr = sqnr_db(
            torch.cat([k.flatten() for k in fp_k + fp_v]), torch.cat([t.float().flatten() for t in ks + vs])
        )
        with torch.no_grad():
            out = generator.generate(
                **inputs,
                max_new_tokens=steps,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
                **{arg: make_cache()},
            )
        logits = torch.stack(out.logits, 1).float()
        final = out.get("cache", out.get("past_key_values"))
        rows[label] = {
            "kv_bytes_after_prefill": nbytes,
            "fraction_of_fp16": nbytes / fp16_bytes,
            "kv_bytes_after_decode": count(final),
            "kv_sqnr_db": kv_sqnr,
            "logits_sqnr_db": sqnr_db(_forced_logits(model, inputs, out.sequences), logits),
        }

    for backend in ("quanto", "hqq"):
        for axis in (0, -1 if backend == "quanto" else 1):

            def make(backend: str = backend, axis: int = axis) -> Any:
                return QuantizedCache(
                    backend=backend,
                    config=model.config,
                    nbits=4,
                    axis_key=axis,
                    axis_value=axis,
                    q_group_size=group,
                    residual_length=residual,
                )

            label = f"hf-{backend}-axis{axis}"
            try:
                cache = make()
                with torch.no_grad():
                    model(**inputs, **{arg: cache}, use_cache=True)
                count = lambda c: sum(_hf_layer_bytes(la) for la in c.layers)  # noqa: E731
                record(label, cache, _hf_layer_kv, count(cache), make, model, count)
            except Exception as err:  # a peer setting that cannot run this prompt is reported, not fatal
                rows[label] = {"error": f"{type(err).__name__}: {err}"}

    calib = mmsdk.CalibrationSet.from_any(calibration, session=session)
    exact = dict(prefill_attention="exact")  # a forward's own tokens attended exactly, as QuantizedCache does
    for label, config in (
        ("mmsdk-int4-static", Int4KVConfig()),
        ("mmsdk-int4-static-ste", Int4KVConfig(calibration="ste", ste_steps=300)),
        ("mmsdk-int4-static-exact-prefill", Int4KVConfig(**exact)),
        ("mmsdk-int4-dynamic", Int4KVConfig(scales="dynamic", residual_length=residual)),
        ("mmsdk-int4-dynamic-window0", Int4KVConfig(scales="dynamic", residual_length=0)),
        ("mmsdk-int4-dynamic-window0-exact-prefill", Int4KVConfig(scales="dynamic", residual_length=0, **exact)),
    ):
        m = Optimizer(copy.deepcopy(model), processor, session=session).calibrate(calib).apply(config).model
        state = m._mmsdk_kv
        cache = state.new_cache()
        with torch.no_grad():
            m(**inputs, **{arg: cache}, use_cache=True)
        record(
            label,
            cache,
            lambda layer: (layer.keys, layer.values),
            kv_bytes(cache, m),
            state.new_cache,
            m,
            lambda c, m=m: kv_bytes(c, m),
        )
    return {
        "prompt_tokens": int(inputs["input_ids"].shape[1]),
        "decode_steps": steps,
        "group_size": group,
        "residual_length": residual,
        "fp16_bytes": fp16_bytes,
        "methods": rows,
    }


def accuracy(model: torch.nn.Module, processor: Any, examples: list, session: Session) -> float:
    """Held-out accuracy in percent, scored by the project's ``vqa_accuracy`` (first word of a greedy answer)."""
    from mmsdk.evaluation import vqa_accuracy

    return 100.0 * vqa_accuracy(model, processor, session.adapt(model), examples).accuracy


def accuracy_section(name: str, session: Session, calibration: list, limit: int | None, group: int) -> dict[str, Any]:
    dataset = session.datasets.get("digits")
    examples = dataset.load("test")[:limit]
    results = {}
    configs = {
        "fp": (),
        "int4-weight-awq": (Int4WeightConfig(method="awq", group_size=group),),
        "int4-kv-static": (Int4KVConfig(),),
        "int4-weight-awq+int4-kv-static": (Int4WeightConfig(method="awq", group_size=group), Int4KVConfig()),
    }
    for label, passes in configs.items():
        loaded = mmsdk.load_model(name, session=session)
        model = loaded.model
        if passes:
            model = Optimizer(model, loaded.processor, session=session).calibrate(calibration).apply(*passes).model
        results[label] = accuracy(model, loaded.processor, examples, session)
    return {
        "examples": len(examples),
        "accuracy_pct": results,
        "drop_points": {k: results["fp"] - v for k, v in results.items() if k != "fp"},
    }


def _versions() -> dict[str, str]:
    import onnxruntime
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "onnxruntime": onnxruntime.__version__}
    for module in ("optimum.quanto", "hqq"):
        try:
            from importlib.metadata import version

            out[module] = version("optimum-quanto" if module == "optimum.quanto" else "hqq")
        except Exception as err:  # a peer that cannot be imported is reported, not fatal
            out[module] = f"unavailable: {err}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:llava-digits")
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--eval-limit", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/quant_quality.json")
    parser.add_argument("--sections", default="weights,kv,accuracy", help="comma-separated subset to run")
    args = parser.parse_args()
    torch.manual_seed(0)
    session = Session.create(autoload=False)
    loaded = mmsdk.load_model(args.model, session=session)
    if "digits" in session.datasets:
        calibration: Any = "digits"
        examples = session.datasets.get("digits").load("test")[:8]
        evaluation = [(e.image, e.question) for e in examples]
    else:
        calibration = [(sample_image(500 + i), "what digit is this ?") for i in range(16)]
        evaluation = [(sample_image(600 + i), "what digit is this ?") for i in range(8)]
    calib = mmsdk.CalibrationSet.from_any(calibration, session=session)
    started = time.time()
    report: dict[str, Any] = {
        "model": args.model,
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "versions": _versions(),
    }
    sections = set(args.sections.split(","))
    if "weights" in sections:
        report["weights"] = weight_section(loaded.model, loaded.processor, session, calib, evaluation, args.group)
    if "kv" in sections:
        text = loaded.model.config.get_text_config()
        report["kv_cache"] = kv_section(
            loaded.model,
            loaded.processor,
            session,
            calib,
            evaluation[0],
            steps=16,
            group=text.hidden_size // text.num_attention_heads,
            residual=16,
        )
    if "accuracy" in sections and "digits" in session.datasets and args.model.startswith("builtin:"):
        report["accuracy"] = accuracy_section(args.model, session, calib, args.eval_limit, args.group)
    report["seconds"] = round(time.time() - started, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    _print_tables(report)


def _print_tables(report: dict[str, Any]) -> None:
    print(f"\n{report['model']}  ({report['versions']})")
    for label, v in report.get("weights", {}).get("variants", {}).items():
        group = report["weights"]["group_size"]
        print(f"\nweights int4 g{group} {label}: method | mean rel. output error | logits SQNR dB")
        for method, err in v["mean_relative_output_error"].items():
            print(f"  {method:10s} | {err:.5f} | {v['logits_sqnr_db'][method]:.2f}")
    if "kv_cache" in report:
        _print_kv(report["kv_cache"])
    if "accuracy" in report:
        acc = report["accuracy"]
        scores = ", ".join(f"{k} {v:.2f}%" for k, v in acc["accuracy_pct"].items())
        print(f"\nheld-out accuracy ({acc['examples']} questions): {scores}")
    print(f"\n{report['seconds']} s")


def _print_kv(kv: dict[str, Any]) -> None:
    print(
        f"\nKV cache ({kv['prompt_tokens']} prompt tokens, {kv['decode_steps']} steps, fp16 {kv['fp16_bytes']} B): "
        "method | bytes after prefill | of fp16 | bytes after decode | K/V SQNR dB | logits SQNR dB"
    )
    for method, row in kv["methods"].items():
        if "error" in row:
            print(f"  {method:40s} | failed: {row['error']}")
            continue
        print(
            f"  {method:40s} | {row['kv_bytes_after_prefill']:6d} | {row['fraction_of_fp16']:.3f} | "
            f"{row['kv_bytes_after_decode']:6d} | {row['kv_sqnr_db']:.2f} | {row['logits_sqnr_db']:.2f}"
        )


if __name__ == "__main__":
    main()
