"""Exact live-tensor accounting: every storage an op creates, counted until the allocator frees it.

A ``TorchDispatchMode`` sees every op's outputs. Each new storage gets a serial number and a weak
reference whose callback fires when the storage is really freed (PyTorch keeps a storage's Python
object alive as long as the storage lives), so ``live`` is exact bytes allocated minus bytes freed,
on any device, without asking the allocator. Views share their base's storage and count once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["TensorAccountant", "storages_of"]

# on_change(delta_bytes, serial): positive when a storage appears, negative when it is freed.
ChangeCallback = Callable[[int, int], None]


def _plain_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors that own storage: tensor subclasses (packed weights, quantized caches) are unwrapped."""
    if not isinstance(value, torch.Tensor):
        return
    if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        for name in names:
            yield from _plain_tensors(getattr(value, name))
        return
    yield value


def storages_of(values: Iterable[Any]) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``values`` (tensors and tensor subclasses; meta tensors skipped)."""
    for value in values:
        for tensor in _plain_tensors(value):
            if tensor.device.type == "meta":
                continue
            try:
                yield tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):  # wrapper tensors without storage of their own
                continue


class TensorAccountant(TorchDispatchMode):
    """Counts bytes of storages created while active; ``live`` falls as they are freed.

    Storages created before the mode was entered are not counted when they are passed in
    ``preexisting`` (weights and inputs: an op that returns a view of a weight, such as ``weight.t()``,
    must not count the weight as a new allocation). ``serial_of`` maps a live storage to the serial it
    got when it appeared, so callers can classify storages later (for instance as KV cache) and
    replay the event log.
    """

    def __init__(self, on_change: ChangeCallback, preexisting: Iterable[Any] = ()) -> None:
        super().__init__()
        self.on_change = on_change
        self._preexisting = {s.data_ptr() for s in storages_of(preexisting) if s.data_ptr()}
        self.live = 0
        self._refs: dict[int, tuple[weakref.ref, int, int]] = {}  # id(storage) -> (ref, serial, bytes)
        self._next_serial = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for storage in storages_of(tree_flatten(out)[0]):
            self._track(storage)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        known = self._refs.get(key)
        if (known is not None and known[0]() is storage) or storage.data_ptr() in self._preexisting:
            return
        nbytes = storage.nbytes()
        serial = self._next_serial
        self._next_serial += 1
        self._refs[key] = (weakref.ref(storage, lambda _ref, key=key, serial=serial: self._freed(key, serial)),
                           serial, nbytes)
        self.live += nbytes
        self.on_change(nbytes, serial)

    def _freed(self, key: int, serial: int) -> None:
        known = self._refs.get(key)
        if known is None or known[1] != serial:
            return
        del self._refs[key]
        self.live -= known[2]
        self.on_change(-known[2], serial)

    def serial_of(self, storage: torch.UntypedStorage) -> int | None:
        """The serial of a storage this accountant counts, or None (weights, inputs, untracked)."""
        known = self._refs.get(id(storage))
        return known[1] if known is not None and known[0]() is storage else None

    def detach(self) -> None:
        """Stop reacting to frees (call after the measured run; later frees are not this run's)."""
        self.on_change = lambda _delta, _serial: None
        self._refs.clear()
