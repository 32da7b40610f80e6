"""The validator's checks of a vision folder: ONNX validity, I/O names and ranks, runner config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmsdk.plugins.backends.tensorrt_llm.validate import ValidationReport

__all__ = ["VISION_IO", "check_vision"]

# model_type -> (inputs as (name, rank), output rank), after TensorRT-LLM's multimodal builder.
VISION_IO: dict[str, tuple[tuple[tuple[str, int], ...], int]] = {
    "llava": ((("input", 4),), 3),
    "llava_next": ((("input", 4),), 3),
    "qwen2_vl": ((("input", 2), ("rotary_pos_emb", 2), ("attention_mask", 3)), 2),
    "qwen2_5_vl": ((("input", 2), ("rotary_pos_emb", 2), ("attention_mask", 3), ("window_attention_mask", 3)), 2),
    "mllama": ((("pixel_values", 6), ("aspect_ratio_ids", 2), ("aspect_ratio_mask", 3)), 3),
}


def check_vision(folder: Path, report: ValidationReport, llm_hidden: int | None) -> None:
    """Check ``folder/model.onnx`` and ``folder/config.json`` against the builder's I/O contract."""
    where = folder.name + "/"
    try:
        builder = json.loads((folder / "config.json").read_text())["builder_config"]
        model_type, precision = builder["model_type"], builder["precision"]
    except (OSError, ValueError, KeyError, TypeError):
        report.error(where + "config.json", "needs builder_config.model_type and builder_config.precision")
        return
    if precision not in ("float16", "bfloat16", "float32"):
        report.error(where + "config.json", f"precision {precision!r} is not float16, bfloat16 or float32")
    if model_type not in VISION_IO:
        report.error(where + "config.json", f"model_type {model_type!r} is not one of {sorted(VISION_IO)}")
        return
    _check_graph(folder / "model.onnx", model_type, report, llm_hidden)
    if model_type == "llava_next":
        _check_newline(folder / "image_newlines.safetensors", report, llm_hidden)
    report.checked.append(f"vision graph ({model_type})")


def _check_graph(path: Path, model_type: str, report: ValidationReport, llm_hidden: int | None) -> None:
    import onnx

    where = f"{path.parent.name}/{path.name}"
    if not path.is_file():
        report.error(where, "missing")
        return
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as err:
        report.error(where, f"onnx.checker: {err}")
        return
    graph = onnx.load(str(path), load_external_data=False).graph
    inputs = {i.name: len(i.type.tensor_type.shape.dim) for i in graph.input}
    expected_inputs, output_rank = VISION_IO[model_type]
    if list(inputs) != [name for name, _ in expected_inputs]:
        report.error(where, f"inputs are {list(inputs)}, expected {[n for n, _ in expected_inputs]} for {model_type}")
    for name, rank in expected_inputs:
        if name in inputs and inputs[name] != rank:
            report.error(where, f"input {name!r} has rank {inputs[name]}, expected {rank}")
    outputs = {o.name: o for o in graph.output}
    if list(outputs) != ["encoder_output"]:
        report.error(where, f"outputs are {list(outputs)}, expected ['encoder_output']")
        return
    dims = outputs["encoder_output"].type.tensor_type.shape.dim
    if len(dims) != output_rank:
        report.error(where, f"encoder_output has rank {len(dims)}, expected {output_rank}")
    elif llm_hidden is not None and dims[-1].HasField("dim_value") and dims[-1].dim_value != llm_hidden:
        report.error(where, f"encoder_output width {dims[-1].dim_value} != the language model's hidden size "
                            f"{llm_hidden} (the prompt table must be full width)")


def _check_newline(path: Path, report: ValidationReport, llm_hidden: int | None) -> None:
    from safetensors import safe_open

    where = f"{path.parent.name}/{path.name}"
    if not path.is_file():
        report.error(where, "missing (LLaVA-NeXT's runner inserts this vector after every row of tiles)")
        return
    with safe_open(str(path), framework="pt") as handle:
        if "image_newline" not in handle.keys():
            report.error(where, "holds no 'image_newline' tensor")
            return
        shape = handle.get_slice("image_newline").get_shape()
    if len(shape) != 1 or (llm_hidden is not None and shape[0] != llm_hidden):
        report.error(where, f"image_newline has shape {shape}, expected [{llm_hidden or 'hidden_size'}]")
