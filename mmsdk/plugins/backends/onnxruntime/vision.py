"""vision.onnx: the vision tower and projector (with whatever passes changed in them), traced for one image.

The vision path is traced rather than written by hand: vision towers differ per family and the
vision passes (token pruning / merging, ViT pruning) change their torch code, which tracing
captures as it is. Shapes are those of the family's processor, one image per run; size and grid
inputs (``image_sizes``, ``image_grid_thw``) are fixed at export and checked by the runtime.
Flamingo-family graphs also project the image states into every open cross-attention block's K/V.
"""

from __future__ import annotations

import io
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np

from mmsdk.core.errors import ExportError
from mmsdk.plugins.backends.onnxruntime import names as N
from mmsdk.plugins.backends.onnxruntime.annotate import annotate_traced, model_metadata
from mmsdk.plugins.backends.onnxruntime.tokens import SLOTS, reduce_image, token_runtime

if TYPE_CHECKING:
    import onnx
    import torch
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.plugins.backends.onnxruntime.plan import ExportPlan

__all__ = ["FIXED_IMAGE_INPUTS", "VisionGraph", "build_vision", "image_inputs_of"]

# Processor outputs that describe an image's size or grid: fixed at export, checked at run time.
FIXED_IMAGE_INPUTS = frozenset({"image_sizes", "image_grid_thw"})
OPSET = 18


@dataclass
class VisionGraph:
    """The traced graph and what the runtime must know to feed it."""

    model: onnx.ModelProto
    inputs: list[str]
    outputs: list[str]
    fixed: dict[str, Any] = field(default_factory=dict)
    exporter: str = ""
    max_abs_error: float = 0.0
    output_shapes: dict[str, list[int]] = field(default_factory=dict)  # per image, as traced

    def details(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "outputs": self.outputs, "fixed_inputs": self.fixed,
                "slots_output": SLOTS if SLOTS in self.outputs else None, "output_shapes": self.output_shapes,
                "exporter": self.exporter, "max_abs_error_vs_torch": self.max_abs_error}


def image_inputs_of(adapter: ModelAdapter, model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The first image's vision inputs out of a processor batch (every entry split along axis 0)."""
    images = len(batch["input_ids"])
    picked = {}
    for name in adapter.image_input_names(model):
        if name in batch:
            value = batch[name]
            picked[name] = value[: len(value) // images]
    return picked


class _Wrapper:
    """Builds the nn.Module the exporters trace (kept out of module scope: torch imports lazily)."""

    @staticmethod
    def make(model: nn.Module, adapter: ModelAdapter, keys: list[str], fixed: dict[str, Any],
             plan: ExportPlan) -> nn.Module:
        import torch

        blocks = adapter.cross_attention_blocks(model)
        cross = [blocks[c.block_index] for c in plan.cross_with_kv()]
        recipe = plan.recipe
        layout = adapter.kv_layout(model)

        class CrossKV(torch.nn.Module):
            """One block's K/V projection; a module of its own so the exported nodes carry its name."""

            def __init__(self, attention: nn.Module, names: dict[str, str], quant: Any) -> None:
                super().__init__()
                object.__setattr__(self, "attention", attention)  # not a child: its weights stay the model's
                self.names, self.quant = names, quant

            def forward(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                k, v = _project_kv(self.attention, self.names, states, layout, recipe, self.quant)
                return k, v

        class VisionExport(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model
                self.cross = [CrossKV(block.attention, block.projections.linears(),
                                      plan.cross_kv_quant.get(entry.decoder_index))
                              for block, entry in zip(cross, plan_cross)]
                for entry, module in zip(plan_cross, self.cross):
                    self.add_module(f"{CROSS_KV_SCOPE}{entry.decoder_index}", module)

            def forward(self, *tensors: torch.Tensor) -> Any:
                images = {**fixed, **dict(zip(keys, tensors))}
                states = adapter.image_features(self.model, images)
                if not self.cross:
                    features = states.reshape(-1, states.shape[-1])
                    return reduce_image(reducing, features) if reducing is not None else features
                return tuple(t for module in self.cross for t in module(states))

        plan_cross = plan.cross_with_kv()
        reducing = token_runtime(model) if plan.token_reduction else None
        return VisionExport().eval()


CROSS_KV_SCOPE = "cross_kv_"


def _project_kv(attention: nn.Module, names: dict[str, str], states: torch.Tensor, layout: Any, recipe: Any,
                quant: Any) -> list:
    import torch

    batch, length = states.shape[0], states.shape[1]
    heads, dim = layout.num_heads, layout.head_dim
    out = []
    for index, role in enumerate(("k", "v")):
        projected = _unmemoised(getattr(attention, names[role]))(states)
        kv_heads = projected.shape[-1] // dim
        x = projected.view(batch, length, kv_heads, dim).transpose(1, 2)
        norm = getattr(attention, recipe.k_norm, None) if role == "k" and recipe and recipe.k_norm else None
        if norm is not None:
            x = norm(x)
        if quant is not None:  # the torch cache stores these quantized: reproduce its rounding once
            scale = torch.as_tensor(quant[index], dtype=x.dtype)
            scale = scale.reshape(1, kv_heads, 1, dim) if scale.numel() > 1 else scale.reshape(1)
            qmax = 2 ** (quant[2] - 1)
            x = torch.clamp(torch.round(x / scale), -qmax, qmax - 1) * scale
        out.append(x.repeat_interleave(heads // kv_heads, dim=1).contiguous())
    return out


def _unmemoised(projection: nn.Module) -> Any:
    """The projection itself, without a KV pass's once-per-image memo (whose rounding _project_kv reproduces).

    The memo keys on the input's storage pointer, which torch.export's fake tensors do not have, and
    packs two int4 codes per byte with ``|``, which TorchScript cannot export for uint8; the graph
    needs neither, only the same quantize-dequantize, done once.
    """
    try:
        from mmsdk.plugins.quantizers.kv_runtime import CrossKVMemo
    except ImportError:  # the KV-cache plugin is not installed: nothing can have wrapped the projection
        return projection
    forward = projection.__dict__.get("forward")
    return forward.original if isinstance(forward, CrossKVMemo) else projection


def build_vision(model: nn.Module, adapter: ModelAdapter, plan: ExportPlan, sample: Mapping[str, Any]) -> VisionGraph:
    """Trace the vision path on ``sample`` (one image's processor outputs) and check it against torch."""
    import torch

    keys = [k for k in sample if k not in FIXED_IMAGE_INPUTS]
    fixed = {k: _as_list(v) for k, v in sample.items() if k in FIXED_IMAGE_INPUTS}
    wrapper = _Wrapper.make(model, adapter, keys, fixed, plan)
    args = tuple(sample[k] for k in keys)
    with torch.no_grad():
        reference = wrapper(*args)
    references = [reference] if isinstance(reference, torch.Tensor) else list(reference)
    if plan.cross:
        outputs = [name for c in plan.cross_with_kv() for name in (N.cross_key(c.decoder_index), N.cross_value(c.decoder_index))]
    else:
        outputs = [N.IMAGE_FEATURES, SLOTS] if plan.token_reduction else [N.IMAGE_FEATURES]
    proto, exporter = _export(wrapper, args, keys, outputs)
    graph = VisionGraph(proto, keys, outputs, fixed, exporter,
                        output_shapes={n: list(r.shape) for n, r in zip(outputs, references)})
    graph.max_abs_error = _check(proto, {k: sample[k] for k in keys}, references, outputs)
    for name in fixed:  # kept as graph inputs (ORT GenAI feeds them) though the graph has them built in
        _add_unused_input(proto, name, np.asarray(fixed[name]))
        graph.inputs.append(name)
    annotate_traced(proto, _scopes(model, adapter, plan), "vision_encoder")
    model_metadata(proto, "vision", "vision")
    return graph


def _as_list(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


@contextmanager
def _symbolics() -> Iterator[None]:
    """TorchScript symbolics for ops the token reducers use, registered for one export only.

    ``index_add`` with repeated indices (merging tokens) must accumulate, which the stock symbolic
    does not do; ``isin`` has no stock symbolic at opset 18.
    """
    import torch
    from torch.onnx import symbolic_helper as sh

    @sh.parse_args("v", "i", "v", "v", "v")
    def index_add(g: Any, self: Any, dim: int, index: Any, source: Any, alpha: Any) -> Any:
        rank = sh._get_tensor_rank(source)
        scale = sh._maybe_get_const(alpha, "f")
        if not isinstance(scale, (int, float)) or scale != 1:
            source = g.op("Mul", source, alpha)
        axes = g.op("Constant", value_t=torch.tensor([a for a in range(rank) if a != dim], dtype=torch.long))
        spread = g.op("Expand", g.op("Unsqueeze", index, axes), g.op("Shape", source))
        return g.op("ScatterElements", self, spread, source, axis_i=dim, reduction_s="add")

    @sh.parse_args("v", "v", "b", "b")
    def isin(g: Any, elements: Any, test: Any, assume_unique: bool, invert: bool) -> Any:
        last = g.op("Constant", value_t=torch.tensor([-1]))
        equal = g.op("Equal", g.op("Unsqueeze", elements, last), g.op("Reshape", test, last))
        found = g.op("Cast", g.op("ReduceMax", g.op("Cast", equal, to_i=6), last, keepdims_i=0), to_i=9)
        return g.op("Not", found) if invert else found

    table = {"aten::index_add": index_add, "aten::isin": isin}
    for name, fn in table.items():
        torch.onnx.register_custom_op_symbolic(name, fn, OPSET)
    try:
        yield
    finally:
        for name in table:
            torch.onnx.unregister_custom_op_symbolic(name, OPSET)


def _export(wrapper: nn.Module, args: tuple, keys: list[str], outputs: list[str]) -> tuple[onnx.ModelProto, str]:
    import onnx
    import torch

    errors = []
    with warnings.catch_warnings(), torch.no_grad(), _symbolics():
        warnings.simplefilter("ignore")
        try:  # TorchScript tracing follows data-dependent Python control flow of vision code as traced
            buffer = io.BytesIO()
            torch.onnx.export(wrapper, args, buffer, dynamo=False, input_names=keys, output_names=outputs,
                              opset_version=OPSET)
            return onnx.load_from_string(buffer.getvalue()), "torchscript"
        except Exception as err:  # noqa: BLE001 - try the other exporter, report both
            errors.append(f"torchscript: {type(err).__name__}: {str(err)[:300]}")
        try:
            program = torch.onnx.export(wrapper, args, dynamo=True, input_names=keys, output_names=outputs,
                                        verbose=False)
            return program.model_proto, "dynamo"
        except Exception as err:  # noqa: BLE001
            errors.append(f"dynamo: {type(err).__name__}: {str(err)[:300]}")
    raise ExportError(
        "the vision path (vision tower + projector) could not be exported to ONNX by either torch exporter: "
        + " | ".join(errors),
        fix="export to the 'torch' backend, or check that the passes applied to the vision tower are traceable.",
    )


def _check(proto: onnx.ModelProto, feeds: Mapping[str, Any], references: list, outputs: list[str]) -> float:
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    got = session.run(outputs, {k: np.asarray(v) for k, v in feeds.items() if k in names})
    worst = 0.0
    for name, value, ref in zip(outputs, got, references):
        want = ref.detach().float().cpu().numpy()
        error = float(np.abs(value - want).max()) if want.size else 0.0
        worst = max(worst, error)
        if error > 1e-3 * max(1.0, float(np.abs(want).max())):
            raise ExportError(
                f"the exported vision graph does not reproduce the torch vision path: {name} differs by {error:.3g}.",
                fix="a pass changed the vision tower in a way the exporter did not trace faithfully; export to "
                "'torch', or report the pass and model.",
            )
    return worst


def _add_unused_input(proto: onnx.ModelProto, name: str, value: np.ndarray) -> None:
    from onnx import helper

    if any(i.name == name for i in proto.graph.input):
        return
    proto.graph.input.append(helper.make_tensor_value_info(name, 7, list(value.shape)))


def _scopes(model: nn.Module, adapter: ModelAdapter, plan: ExportPlan) -> dict[str, str]:
    names = {id(m): n for n, m in model.named_modules()}
    scopes = {}
    for module, stage in ((adapter.vision_tower(model), "vision_encoder"), (adapter.projector(model), "projector")):
        if module is not None and id(module) in names:
            scopes["model." + names[id(module)]] = stage
    for c in plan.cross_with_kv():
        scopes[f"{CROSS_KV_SCOPE}{c.decoder_index}"] = "cross_kv"
    return scopes
