"""One pass of a model over a CalibrationSet, collecting every range the quantizers need.

What is collected (each only when asked for):

* per linear layer: |x| mean and max per input channel, the tensor's min/max, a reservoir of input
  rows (AWQ's search evaluates on them), and which linears read the very same input tensor
  (q/k/v, gate/up) so AWQ can give them one shared scale;
* per cache layer: K (after RoPE, as the attention reads it) and V amax per (KV head, channel),
  the RoPE pair envelope of K, and a reservoir of rows for percentile ranges; cross-attention K/V
  that the model recomputes every step instead of caching (IDEFICS) are read at their projections.

The vision tower's output is memoised per image in the CalibrationSet's cache, so a second
collection (after a pass changed the language model) or a training loop never re-traces it.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mmsdk.core.errors import CalibrationError
from mmsdk.plugins.tensor_keys import version_of

if TYPE_CHECKING:
    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.calibration import CalibrationSet

__all__ = [
    "CalibrationStats",
    "KVStats",
    "LinearInputStats",
    "Reservoir",
    "cache_argument",
    "calibration_inputs",
    "collect_statistics",
    "progress",
    "vision_memo",
]

CACHE_KEY = "mmsdk.quantizers"


def progress(items: Iterable[Any], description: str, total: int | None = None) -> Iterator[Any]:
    """Iterate with a rich progress bar on an interactive terminal, silently elsewhere."""
    if not sys.stderr.isatty():
        yield from items
        return
    from rich.progress import track

    yield from track(items, description=description, total=total, transient=True)


class Reservoir:
    """A uniform random sample of at most ``capacity`` rows out of all rows offered (Algorithm R)."""

    def __init__(self, capacity: int, seed: int = 0) -> None:
        self.capacity, self.seen = capacity, 0
        self.rows: torch.Tensor | None = None
        self._generator = torch.Generator().manual_seed(seed)

    def add(self, rows: torch.Tensor) -> None:
        rows = rows.detach().float().cpu()
        free = self.capacity - (0 if self.rows is None else len(self.rows))
        head, rows = rows[:free], rows[free:]
        if len(head):
            self.rows = head.clone() if self.rows is None else torch.cat([self.rows, head])
            self.seen += len(head)
        if len(rows) == 0 or self.rows is None:
            return
        positions = torch.arange(self.seen + 1, self.seen + len(rows) + 1, dtype=torch.float64)
        slots = (torch.rand(len(rows), generator=self._generator, dtype=torch.float64) * positions).long()
        keep = slots < self.capacity
        self.rows[slots[keep]] = rows[keep]
        self.seen += len(rows)


@dataclass
class LinearInputStats:
    """What one linear layer's input looked like over the calibration set."""

    abs_sum: torch.Tensor
    abs_max: torch.Tensor
    minimum: float
    maximum: float
    tokens: int
    rows: Reservoir
    group: str  # name of the first linear that read the same input tensor

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.tokens, 1)


@dataclass
class KVStats:
    """Per (KV head, channel) ranges of one layer's keys and values, ``[heads, head_dim]`` each."""

    kind: str  # "self", "cross" (cached by the model) or "recomputed" (cross K/V recomputed each step)
    k_amax: torch.Tensor
    v_amax: torch.Tensor
    k_envelope: torch.Tensor
    k_rows: Reservoir
    v_rows: Reservoir
    tokens: int = 0

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fold in ``[B, H, T, D]`` keys and values."""
        k = keys.detach().float().transpose(1, 2).flatten(0, 1)  # [B*T, H, D]
        v = values.detach().float().transpose(1, 2).flatten(0, 1)
        self.k_amax = torch.maximum(self.k_amax, k.abs().amax(0).cpu())
        self.v_amax = torch.maximum(self.v_amax, v.abs().amax(0).cpu())
        half = k.shape[-1] // 2
        pair = torch.sqrt(k[..., :half] ** 2 + k[..., half : 2 * half] ** 2).amax(0).cpu()
        envelope = torch.cat([pair, pair, k[..., 2 * half :].abs().amax(0).cpu()], dim=-1)
        self.k_envelope = torch.maximum(self.k_envelope, envelope)
        self.k_rows.add(k)
        self.v_rows.add(v)
        self.tokens += k.shape[0]


@dataclass
class CalibrationStats:
    """Everything one collection gathered, by linear name and by cache layer index."""

    samples: int
    linears: dict[str, LinearInputStats] = field(default_factory=dict)
    kv: dict[int, KVStats] = field(default_factory=dict)

    def groups(self) -> dict[str, list[str]]:
        """Linears that read the same input tensor, keyed by the first one's name."""
        out: dict[str, list[str]] = {}
        for name, stats in self.linears.items():
            out.setdefault(stats.group, []).append(name)
        return out


def cache_argument(model: nn.Module) -> str:
    """The keyword ``model.forward`` takes its Cache by (``cache`` from transformers 5.2x, else ``past_key_values``)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def calibration_inputs(calibration: CalibrationSet, adapter: ModelAdapter, processor: Any) -> list[dict[str, Any]]:
    """Model inputs for each sample (batch of one), built once per set and processor."""
    if processor is None:
        raise CalibrationError(
            "calibration needs the model's processor to turn (image, text) samples into inputs.",
            fix="construct the Optimizer with processor=... (mmsdk.load_model returns one with every model).",
        )
    key = ("inputs", id(processor))
    store = calibration.cache.setdefault(CACHE_KEY, {})
    if key not in store:
        prompts = calibration.prompts(adapter, processor)
        store[key] = [
            dict(processor(images=[sample.image], text=[prompt], return_tensors="pt"))
            for sample, prompt in zip(calibration.samples, prompts, strict=True)
        ]
    return store[key]


def _fingerprint(module: nn.Module) -> tuple[Any, ...]:
    return tuple((name, id(t), version_of(t)) for name, t in module.state_dict(keep_vars=True).items())


def _digest(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    digest = hashlib.sha1()
    for value in (*args, *(kwargs[k] for k in sorted(kwargs))):
        if isinstance(value, torch.Tensor):
            digest.update(str((value.shape, value.dtype)).encode())
            digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    digest.update(repr(sorted(kwargs)).encode())
    return digest.hexdigest()


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return type(value)(_detach(v) for v in value) if not hasattr(value, "_fields") else value
    if isinstance(value, dict):
        for key in list(value.keys()):
            value[key] = _detach(value[key])
    return value


@contextlib.contextmanager
def vision_memo(model: nn.Module, adapter: ModelAdapter, calibration: CalibrationSet) -> Iterator[None]:
    """Within the block, the vision tower answers repeated images from the set's cache."""
    tower = adapter.vision_tower(model)
    store = calibration.cache.setdefault(CACHE_KEY, {})
    memo: dict[str, Any] = store.setdefault(("vision", _fingerprint(tower)), {})
    original: Callable[..., Any] = tower.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        key = _digest(args, kwargs)
        if key not in memo:
            with torch.no_grad():
                memo[key] = _detach(original(*args, **kwargs))
        cached = memo[key]
        # Models reassign fields of the output they get (Qwen splits pooler_output): hand out a copy.
        return type(cached)(**cached) if isinstance(cached, dict) else cached

    tower.forward = forward
    try:
        yield
    finally:
        del tower.forward  # back to the class's forward


def _input_group(seen: dict[int, tuple[str, Any]], x: torch.Tensor, name: str) -> str:
    """The first linear that read this very tensor in the current forward (q/k/v share one input)."""
    import weakref

    entry = seen.get(x.data_ptr())
    if entry is not None and entry[1]() is x:
        return entry[0]
    seen[x.data_ptr()] = (name, weakref.ref(x))
    return name


def _linear_hook(stats: dict[str, LinearInputStats], seen: dict[int, tuple[str, Any]], name: str, max_rows: int):
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0]
        group = _input_group(seen, x, name)
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        if not torch.isfinite(rows).all():
            raise CalibrationError(
                f"the input of {name} holds NaN/inf values during calibration.",
                fix="check the calibration samples and the model's dtype (fp16 overflow?) before quantizing.",
            )
        entry = stats.get(name)
        if entry is None:
            width = rows.shape[-1]
            entry = stats[name] = LinearInputStats(
                torch.zeros(width, dtype=torch.float64),
                torch.zeros(width),
                float("inf"),
                float("-inf"),
                0,
                Reservoir(max_rows, seed=len(stats)),
                group,
            )
        entry.abs_sum += rows.abs().sum(0).double().cpu()
        entry.abs_max = torch.maximum(entry.abs_max, rows.abs().amax(0).cpu())
        entry.minimum, entry.maximum = min(entry.minimum, rows.min().item()), max(entry.maximum, rows.max().item())
        entry.tokens += rows.shape[0]
        entry.rows.add(rows)

    return hook


def _new_kv(kind: str, heads: int, head_dim: int, max_rows: int, seed: int) -> KVStats:
    zeros = torch.zeros(heads, head_dim)
    return KVStats(
        kind, zeros.clone(), zeros.clone(), zeros.clone(), Reservoir(max_rows, seed), Reservoir(max_rows, seed + 1)
    )


def _recording_cache(stats: CalibrationStats, kinds: Mapping[int, str], max_rows: int) -> Any:
    from transformers import DynamicCache

    class RecordingCache(DynamicCache):
        """A DynamicCache that also folds every K/V update into the statistics."""

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            entry = stats.kv.get(layer_idx)
            if entry is None:
                _, heads, _, head_dim = key_states.shape
                entry = stats.kv[layer_idx] = _new_kv(
                    kinds.get(layer_idx, "self"), heads, head_dim, max_rows, 2 * layer_idx
                )
            entry.add(key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return RecordingCache()


def _recomputed_cross_hooks(
    model: nn.Module, adapter: ModelAdapter, stats: CalibrationStats, max_rows: int
) -> list[Any]:
    """Hooks reading K/V at the projections of cross-attention blocks whose K/V are not cached."""
    layout = adapter.kv_layout(model)
    handles = []
    for index, block in enumerate(adapter.cross_attention_blocks(model)):
        if block.kv_cached:
            continue
        pending: dict[str, torch.Tensor] = {}

        def hook(
            module: nn.Module,
            args: Any,
            output: torch.Tensor,
            role: str = "",
            index: int = index,
            pending: dict[str, torch.Tensor] = pending,
        ) -> None:
            b, t, _ = output.shape
            pending[role] = output.detach().reshape(b, t, -1, layout.head_dim).transpose(1, 2)
            if len(pending) == 2:
                key = recomputed_index(index)
                if key not in stats.kv:
                    heads = pending["k"].shape[1]
                    stats.kv[key] = _new_kv("recomputed", heads, layout.head_dim, max_rows, 2 * key)
                stats.kv[key].add(pending.pop("k"), pending.pop("v"))

        names = block.projections
        for role, attr in (("k", names.k), ("v", names.v)):
            handles.append(getattr(block.attention, attr).register_forward_hook(_bind(hook, role)))
    return handles


def _bind(hook: Callable[..., None], role: str) -> Callable[..., None]:
    return lambda module, args, output: hook(module, args, output, role=role)


def recomputed_index(block_index: int) -> int:
    """The key under which cross-attention block ``block_index``'s recomputed K/V are recorded (negative)."""
    return -1 - block_index


def _check_kv_finite(stats: CalibrationStats) -> None:
    for index, entry in stats.kv.items():
        if not (torch.isfinite(entry.k_amax).all() and torch.isfinite(entry.v_amax).all()):
            raise CalibrationError(
                f"keys/values of cache layer {index} hold NaN/inf values during calibration.",
                fix="check the calibration samples and the model's dtype (fp16 overflow?) before quantizing.",
            )


def collect_statistics(
    model: nn.Module,
    adapter: ModelAdapter,
    calibration: CalibrationSet,
    processor: Any,
    *,
    linears: Mapping[str, nn.Module] | None = None,
    kv: bool = False,
    max_rows: int = 512,
    description: str = "calibrating",
) -> CalibrationStats:
    """Run every calibration sample through ``model`` once and gather the requested statistics."""
    inputs = calibration_inputs(calibration, adapter, processor)
    stats = CalibrationStats(samples=len(inputs))
    linears = dict(linears or {})
    seen: dict[int, tuple[str, Any]] = {}
    handles = [m.register_forward_pre_hook(_linear_hook(stats.linears, seen, n, max_rows)) for n, m in linears.items()]
    if kv:
        handles += _recomputed_cross_hooks(model, adapter, stats, max_rows)
    tower_modules = {id(m) for m in adapter.vision_tower(model).modules()}
    memo = contextlib.nullcontext() if any(id(m) in tower_modules for m in linears.values()) else None
    kinds = {block.decoder_index: "cross" for block in adapter.cross_attention_blocks(model) if block.kv_cached}
    device = next(model.parameters()).device
    try:
        with memo or vision_memo(model, adapter, calibration), torch.no_grad():
            for batch in progress(inputs, description, total=len(inputs)):
                seen.clear()
                extra = {cache_argument(model): _recording_cache(stats, kinds, max_rows)} if kv else {}
                model(**{k: v.to(device) for k, v in batch.items()}, use_cache=kv, **extra)
    finally:
        for handle in handles:
            handle.remove()
    _check_kv_finite(stats)
    return stats
