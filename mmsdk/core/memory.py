"""Exact memory accounting of modules: parameter and buffer bytes, shared storage counted once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mmsdk.profiling.results import Profile

__all__ = ["MemoryReport", "PassMemory", "component_bytes", "format_bytes", "module_bytes", "tensor_bytes"]


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return (storage.data_ptr(), storage.nbytes()) if tensor.device.type != "meta" else (id(tensor), 0)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``tensors``, counting each underlying storage once (tied weights, views)."""
    seen: dict[tuple[int, int], int] = {}
    for tensor in tensors:
        key = _storage_key(tensor)
        if key not in seen:
            seen[key] = tensor.untyped_storage().nbytes() if tensor.device.type != "meta" else 0
    return sum(seen.values())


def _module_tensors(module: nn.Module) -> list[torch.Tensor]:
    tensors = [p for _, p in module.named_parameters(remove_duplicate=False)]
    tensors += [b for _, b in module.named_buffers(remove_duplicate=False)]
    return tensors


def module_bytes(module: nn.Module) -> int:
    """Parameter + buffer bytes of ``module`` (non-persistent buffers included; shared storage once)."""
    return tensor_bytes(_module_tensors(module))


def component_bytes(parts: dict[str, nn.Module]) -> dict[str, int]:
    """Bytes per named component; a storage shared by two components counts in the first only."""
    counted: set[tuple[int, int]] = set()
    out: dict[str, int] = {}
    for name, module in parts.items():
        total = 0
        for tensor in _module_tensors(module):
            key = _storage_key(tensor)
            if key in counted:
                continue
            counted.add(key)
            total += tensor.untyped_storage().nbytes() if tensor.device.type != "meta" else 0
        out[name] = total
    return out


def format_bytes(n: float) -> str:
    """Human-readable bytes (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


@dataclass(frozen=True)
class PassMemory:
    """Weights bytes before and after one pass."""

    name: str
    bytes_before: int
    bytes_after: int
    seconds: float

    @property
    def saved(self) -> int:
        return self.bytes_before - self.bytes_after


@dataclass(frozen=True)
class MemoryReport:
    """Model bytes before any pass, after each pass, and per component now.

    ``profile`` is set when the report was measured (``opt.report(measure=True)``): a generation
    before and after each pass, with KV cache, activation peaks and each stage's peak and time.
    """

    baseline_bytes: int
    current_bytes: int
    passes: tuple[PassMemory, ...]
    components: dict[str, int] = field(default_factory=dict)
    profile: Profile | None = None

    def table(self) -> str:
        """A plain-text table of the waterfall."""
        rows = [("stage", "weights", "saved", "time")]
        rows.append(("unoptimized", format_bytes(self.baseline_bytes), "", ""))
        for p in self.passes:
            rows.append((f"+ {p.name}", format_bytes(p.bytes_after), format_bytes(p.saved), f"{p.seconds:.2f}s"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.components.items())
        text = "\n".join(lines + ([f"components now: {parts}"] if parts else []))
        return text if self.profile is None else f"{text}\n\nmeasured ({self.profile.device}):\n{self.profile.table()}"

    def __str__(self) -> str:
        return self.table()
