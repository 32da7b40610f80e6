"""A small ONNX graph builder: named nodes, deduplicated initializers, modality/stage annotations.

The decoder and embedding graphs are written node by node from the model's weights (see
docs/design-onnxruntime.md for why), so this is the one place that knows how to make names
unique, which opsets are imported and how a node is annotated.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from mmsdk.plugins.backends.onnxruntime.annotate import MODALITY_KEY, MODULE_KEY, STAGE_KEY

if TYPE_CHECKING:
    import onnx

__all__ = ["GraphBuilder", "IR_VERSION", "OPSETS", "FLOAT", "FLOAT16", "INT64", "INT32", "float_type_of"]

# ORT 1.30+ reads IR 10; onnx>=1.23 writes 14 by default, which ORT refuses.
IR_VERSION = 10
OPSETS = {"": 21, "com.microsoft": 1}
FLOAT, INT64, INT32, FLOAT16 = 1, 7, 6, 10  # onnx.TensorProto element types, without importing onnx here


def float_type_of(dtype: str) -> int:
    """The ONNX element type of an export ``dtype`` option ("float32" or "float16")."""
    return {"float32": FLOAT, "float16": FLOAT16}[dtype]


class GraphBuilder:
    """Collects nodes, inputs, outputs and initializers of one graph, then makes a ModelProto."""

    def __init__(self, name: str, *, modality: str, stage: str, float_type: int = FLOAT) -> None:
        self.name = name
        self.float_type = float_type
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._taken: set[str] = set()
        self._prefix: list[str] = []
        self._annotation = {MODALITY_KEY: modality, STAGE_KEY: stage, MODULE_KEY: ""}

    # --- names and annotations ----------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        """A value or node name not used yet, under the current scope."""
        base = "/".join([*self._prefix, hint]) if self._prefix else hint
        name, index = base, 1
        while name in self._taken:
            name, index = f"{base}_{index}", index + 1
        self._taken.add(name)
        return name

    @contextmanager
    def scope(self, prefix: str, *, modality: str | None = None, stage: str | None = None,
              module: str | None = None) -> Iterator[None]:
        """Nodes made inside get ``prefix`` in their names and the given annotations."""
        saved = dict(self._annotation)
        self._prefix.append(prefix)
        for key, value in ((MODALITY_KEY, modality), (STAGE_KEY, stage), (MODULE_KEY, module)):
            if value is not None:
                self._annotation[key] = value
        try:
            yield
        finally:
            self._prefix.pop()
            self._annotation = saved

    # --- graph boundary -----------------------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: Sequence[int | str | None]) -> str:
        """Declare a graph input (its name is kept exactly)."""
        from onnx import helper

        self._taken.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def output(self, value: str, name: str, elem_type: int, shape: Sequence[int | str | None] | None) -> str:
        """Expose ``value`` as graph output ``name`` (an Identity if the names differ)."""
        from onnx import helper

        if value != name:
            self._taken.add(name)
            self.nodes.append(helper.make_node("Identity", [value], [name], name=self.fresh(f"{name}/Identity")))
            self._annotate(self.nodes[-1])
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, None if shape is None else list(shape)))
        return name

    # --- constants ----------------------------------------------------------------------------
    def const(self, hint: str, array: Any, *, keep_dtype: bool = False) -> str:
        """An initializer from ``array``; float arrays take the graph's float type unless ``keep_dtype``."""
        from onnx import helper, numpy_helper

        value = np.asarray(array)
        if np.issubdtype(value.dtype, np.floating) and not keep_dtype:
            value = value.astype(helper.tensor_dtype_to_np_dtype(self.float_type))
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(value if value.ndim == 0 else np.ascontiguousarray(value), name))
        return name

    def ints(self, hint: str, values: Sequence[int]) -> str:
        """An int64 1-D initializer (shapes, axes, indices)."""
        return self.const(hint, np.asarray(values, dtype=np.int64))

    # --- nodes --------------------------------------------------------------------------------
    def op(self, op_type: str, inputs: Sequence[str], *, outputs: int | Sequence[str] = 1, domain: str = "",
           hint: str | None = None, **attrs: Any) -> Any:
        """Add one node; returns its output name (or the list of names when ``outputs`` > 1)."""
        from onnx import helper

        label = hint or op_type
        if isinstance(outputs, int):
            names = [self.fresh(f"{label}/out{i}" if outputs > 1 else f"{label}/out") for i in range(outputs)]
        else:
            names = list(outputs)
            self._taken.update(names)
        node = helper.make_node(op_type, list(inputs), names, name=self.fresh(label), domain=domain or None, **attrs)
        self._annotate(node)
        self.nodes.append(node)
        return names[0] if isinstance(outputs, int) and outputs == 1 else names

    def _annotate(self, node: onnx.NodeProto) -> None:
        for key, value in self._annotation.items():
            if value:
                entry = node.metadata_props.add()
                entry.key, entry.value = key, value

    # --- result -------------------------------------------------------------------------------
    def model(self, metadata: dict[str, str] | None = None, doc: str = "") -> onnx.ModelProto:
        """The ModelProto (IR 10, ai.onnx 21 + com.microsoft 1), with model-level metadata."""
        from onnx import helper

        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid(domain, version) for domain, version in OPSETS.items()]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="mmsdk", doc_string=doc)
        model.ir_version = IR_VERSION
        for key, value in (metadata or {}).items():
            entry = model.metadata_props.add()
            entry.key, entry.value = key, value
        return model
