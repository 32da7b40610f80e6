"""Opening ONNX Runtime sessions, and the zero-copy hand-offs between them (IOBinding, OrtValue, DLPack)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from mmsdk.core.errors import BackendUnavailableError

if TYPE_CHECKING:
    import onnxruntime as ort
    import torch

__all__ = ["import_ort", "SessionConfig", "open_session", "Bound", "to_ortvalue", "as_torch", "empty_ortvalue"]


def import_ort() -> Any:
    """``onnxruntime``, or a BackendUnavailableError naming the extra to install."""
    try:
        import onnxruntime
    except ImportError as err:
        raise BackendUnavailableError(
            "running an ONNX export needs onnxruntime, which is not installed.",
            fix="pip install 'mmsdk[ort]' (CPU) or pip install 'mmsdk[ort-gpu]' (CUDA).",
        ) from err
    return onnxruntime


@dataclass(frozen=True)
class SessionConfig:
    """How sessions are opened: execution providers and thread counts (None: ORT's defaults)."""

    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None


def open_session(source: str | Path | bytes, config: SessionConfig) -> ort.InferenceSession:
    """An InferenceSession on a file (or serialized model bytes)."""
    ort = import_ort()
    options = ort.SessionOptions()
    if config.intra_op_threads is not None:
        options.intra_op_num_threads = config.intra_op_threads
    if config.inter_op_threads is not None:
        options.inter_op_num_threads = config.inter_op_threads
    options.log_severity_level = 3
    model = source if isinstance(source, bytes) else str(source)
    return ort.InferenceSession(model, sess_options=options, providers=list(config.providers))


def to_ortvalue(value: Any) -> Any:
    """An OrtValue sharing ``value``'s memory (numpy array, torch tensor, or an OrtValue as is)."""
    ort = import_ort()
    if isinstance(value, ort.OrtValue):
        return value
    if hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray):
        tensor = value if value.is_contiguous() else value.contiguous()
        return ort.OrtValue.from_dlpack(tensor)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value))


def empty_ortvalue(shape: list[int], dtype: Any) -> Any:
    """A zero-filled OrtValue (for an empty KV cache, shapes with a 0 axis)."""
    return import_ort().OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=dtype))


def as_torch(value: Any) -> torch.Tensor:
    """A torch view of an OrtValue (DLPack, no copy)."""
    import torch

    return torch.from_dlpack(value)


class Bound:
    """One run of a session through IOBinding: inputs bound as OrtValues, outputs allocated by ORT
    (or written into caller-owned memory), results handed on as OrtValues without copies."""

    def __init__(self, session: ort.InferenceSession, binding: Any = None) -> None:
        self.session = session
        self.binding = binding if binding is not None else session.io_binding()
        if binding is not None:  # reused across decode steps: start clean
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
        self._keep: list[Any] = []  # the numpy / torch objects the bound OrtValues point into

    def inputs(self, values: Mapping[str, Any]) -> Bound:
        for name, value in values.items():
            ortvalue = to_ortvalue(value)
            self._keep.append(value)
            self.binding.bind_ortvalue_input(name, ortvalue)
        return self

    def output(self, name: str, into: Any = None) -> Bound:
        """Let ORT allocate ``name``, or write it into ``into`` (a torch tensor / array of the right shape)."""
        if into is None:
            self.binding.bind_output(name, "cpu")
        else:
            self._keep.append(into)
            self.binding.bind_ortvalue_output(name, to_ortvalue(into))
        return self

    def run(self) -> list[Any]:
        """Run and return the outputs as OrtValues, in binding order."""
        self.session.run_with_iobinding(self.binding)
        return list(self.binding.get_outputs())
