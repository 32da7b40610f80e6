"""KV-cache quantization for TensorRT-LLM: which algorithm, and one calibrated scale per layer.

TensorRT-LLM keeps one dequantization scale per attention layer for K and V together
(``x = x_q * s``): INT8 ``s = amax / 127``, FP8-E4M3 ``s = amax / 448``, where amax is the larger of
the layer's K and V amax. The amax values are the calibrated ones the passes recorded, so the ONNX
Runtime export and this one quantize the cache from the same numbers.

Where the numbers are read, first found wins:
1. the export's calibration record (``Manifest.calibration``: ``kv_cache``, else ``kv_ranges``, each
   with ``layers`` of ``{"layer", "kind", "k_amax", "v_amax"}``; per-channel lists reduce to their max);
2. the records of ``ptq-align`` and then of the KV pass, under ``"kv_amax"``:
   ``{layer index: {"k": amax, "v": amax}}`` (numbers or per-channel lists).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mmsdk.core.errors import ExportError

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext

__all__ = ["KV_PASSES", "QMAX", "kv_algorithm", "kv_scales", "layer_amax"]

# mmsdk pass name -> TensorRT-LLM kv_cache_quant_algo (None: TensorRT-LLM cannot store it).
KV_PASSES: dict[str, str | None] = {"int8-kv": "INT8", "fp8-kv": "FP8", "int4-kv": None}
QMAX = {"INT8": 127.0, "FP8": 448.0}
CALIBRATION_PASSES = ("ptq-align",)


def kv_algorithm(pass_names: list[str], int4_fallback: str = "error") -> str | None:
    """TensorRT-LLM's kv_cache_quant_algo for the applied passes (None: the cache stays in model dtype).

    ``int4_fallback`` ("int8"/"fp8") is the explicit opt-in to store an int4-kv model's cache in that
    8-bit format, scaled from the same calibrated ranges; the default refuses.
    """
    for name in pass_names:
        if name in KV_PASSES:
            algo = KV_PASSES[name]
            if algo is None and int4_fallback != "error":
                return int4_fallback.upper()
            if algo is None:
                raise ExportError(
                    f"TensorRT-LLM has no INT4 KV cache (its KV formats are the model dtype, INT8, FP8 and "
                    f"NVFP4), so {name!r} cannot be exported to it.",
                    fix="apply 'int8-kv' (TensorRT-LLM <= 1.2 checkpoint) or 'fp8-kv' (any version) instead of "
                    f"{name!r}, export the int4-kv model to ONNX Runtime, or opt in to an 8-bit cache scaled from "
                    "the same ranges with int4_kv_fallback='int8' or 'fp8'.",
                )
            return algo
    return None


def layer_amax(context: ExportContext) -> dict[int, float] | None:
    """Per-layer max(K amax, V amax) from the calibration records, or None when nothing was calibrated."""
    record = _record_amax(getattr(context, "calibration", None))
    if record is not None:
        return record
    for name in (*CALIBRATION_PASSES, *KV_PASSES):
        result = context.result(name)
        table = result.records.get("kv_amax") if result is not None else None
        if table:
            return {int(layer): max(_amax(entry.get("k")), _amax(entry.get("v"))) for layer, entry in table.items()}
    return None


def kv_scales(context: ExportContext, algo: str, num_layers: int) -> tuple[dict[int, float], bool]:
    """(layer -> dequantization scale, calibrated?) for ``algo``; uncalibrated INT8 raises."""
    amax = layer_amax(context)
    if amax is None:
        if algo == "FP8":  # TensorRT-LLM's own converters write 1.0 when FP8 KV has no calibration
            return {layer: 1.0 for layer in range(num_layers)}, False
        raise ExportError(
            "an INT8 KV cache needs calibrated scales and this model has none.",
            fix="call opt.calibrate(samples) and apply 'ptq-align' with 'int8-kv' before exporting.",
        )
    missing = sorted(set(range(num_layers)) - set(amax))
    if missing:
        raise ExportError(
            f"the KV calibration has no amax for decoder layer(s) {missing}.",
            fix="re-run the calibration ('ptq-align') on this model before exporting.",
        )
    return {layer: max(amax[layer], 1e-8) / QMAX[algo] for layer in range(num_layers)}, True


def _record_amax(calibration: Mapping[str, Any] | None) -> dict[int, float] | None:
    kv = (calibration or {}).get("kv_cache") or (calibration or {}).get("kv_ranges")
    if not kv or not kv.get("layers"):
        return None
    if kv.get("scales") == "dynamic":
        raise ExportError(
            "the KV cache uses dynamic per-token scales, which only the torch backend runs; TensorRT-LLM needs one "
            "static scale per layer.",
            fix="apply the KV pass with scales='static' (calibrated), or export to 'torch'.",
        )
    return {int(layer["layer"]): max(_amax(layer.get("k_amax")), _amax(layer.get("v_amax")))
            for layer in kv["layers"] if layer.get("kind", "self") == "self"}


def _amax(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return max((_amax(v) for v in value), default=0.0)
    return abs(float(value))
