"""What a profile holds: one measured run per waterfall step, each with its stages and modules."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mmsdk.core.memory import format_bytes

__all__ = ["STAGES", "ModuleMemory", "Profile", "RunMemory", "StageMemory"]

# The stages of one generation, in the order they happen; "other" is generate()'s own loop.
STAGES = ("vision_encode", "projector", "prefill", "decode", "other")


@dataclass(frozen=True)
class StageMemory:
    """One stage of a generation: its peak bytes (weights included), working set and time.

    ``peak_bytes`` is the highest total (weights + everything allocated so far) while the stage was
    running; ``activation_bytes`` is the highest count of live bytes that are neither weights nor
    KV cache while it ran; ``seconds`` is the stage's own wall time (nested stages excluded).
    """

    name: str
    peak_bytes: int
    activation_bytes: int
    seconds: float
    calls: int


@dataclass(frozen=True)
class ModuleMemory:
    """One module: its own weights and the most working memory a call of it needed."""

    name: str
    kind: str
    weights_bytes: int
    activation_peak_bytes: int
    allocated_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.activation_peak_bytes


@dataclass(frozen=True)
class RunMemory:
    """One measured generation of the model in one state (unoptimized, or after some passes).

    ``weights_bytes``: parameters + buffers. ``kv_bytes``: the cache after the last decode step
    (``kv_prefill_bytes`` after prefill). ``peak_activation_bytes``: the most live bytes the run
    allocated that were not KV cache. ``peak_bytes``: the most bytes live at once, weights included.
    """

    label: str
    passes: tuple[str, ...]
    device: str
    method: str
    weights_bytes: int
    kv_bytes: int
    kv_prefill_bytes: int
    peak_activation_bytes: int
    peak_bytes: int
    prompt_tokens: int
    new_tokens: int
    seconds: float
    stages: tuple[StageMemory, ...]
    modules: tuple[ModuleMemory, ...] = ()
    components: dict[str, int] = field(default_factory=dict)
    timeline: tuple[tuple[float, int, str], ...] = ()  # (seconds since start, total bytes, stage)
    allocator: dict[str, int] = field(default_factory=dict)  # CUDA allocator statistics, when on CUDA
    answer: str = ""
    weights_after_bytes: int = 0  # parameters + buffers after generating (more: a pass builds weights lazily)
    stage_spans: tuple[tuple[float, float, str], ...] = ()  # (start, end, stage) in seconds, tiling the run

    def stage(self, name: str) -> StageMemory | None:
        """The stage called ``name``, or None if the run had none (a model without a projector)."""
        return next((s for s in self.stages if s.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the timeline as three parallel lists)."""
        data = asdict(self)
        data["timeline"] = {
            "seconds": [round(t, 6) for t, _, _ in self.timeline],
            "bytes": [b for _, b, _ in self.timeline],
            "stage": [s for _, _, s in self.timeline],
        }
        return data


@dataclass(frozen=True)
class Profile:
    """The waterfall: a measured run before any pass and after each one, in order."""

    model: str
    adapter: str
    device: str
    question: str
    runs: tuple[RunMemory, ...]

    @property
    def baseline(self) -> RunMemory:
        return self.runs[0]

    @property
    def final(self) -> RunMemory:
        return self.runs[-1]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, written as profile.json."""
        from mmsdk import __version__

        return {
            "mmsdk_version": __version__,
            "model": self.model,
            "adapter": self.adapter,
            "device": self.device,
            "question": self.question,
            "runs": [run.to_dict() for run in self.runs],
        }

    def table(self) -> str:
        """The waterfall and per-stage tables as plain text."""
        return waterfall_table(self) + "\n\n" + stage_table(self)

    def __str__(self) -> str:
        return self.table()


def _grid(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def waterfall_rows(profile: Profile) -> list[tuple[str, ...]]:
    """Header + one row per run: weights, KV, peak activation, peak total, and saved vs. the first."""
    rows = [("step", "weights", "KV cache", "peak activation", "peak total", "saved", "time")]
    first = profile.baseline.peak_bytes
    for run in profile.runs:
        saved = "" if run is profile.baseline else format_bytes(first - run.peak_bytes)
        rows.append((run.label, format_bytes(run.weights_bytes), format_bytes(run.kv_bytes),
                     format_bytes(run.peak_activation_bytes), format_bytes(run.peak_bytes), saved,
                     f"{run.seconds * 1000:.1f} ms"))
    return rows


def stage_rows(profile: Profile) -> list[tuple[str, ...]]:
    """Header + one row per run and stage: peak total, working set, time, calls."""
    rows = [("step", "stage", "peak total", "activation", "time", "calls")]
    for run in profile.runs:
        for stage in run.stages:
            rows.append((run.label, stage.name, format_bytes(stage.peak_bytes), format_bytes(stage.activation_bytes),
                         f"{stage.seconds * 1000:.1f} ms", str(stage.calls)))
    return rows


def waterfall_notes(profile: Profile) -> list[str]:
    """Warnings worth a line under the table (weights that grew while generating)."""
    return [
        f"note: {run.label}: weights grew from {format_bytes(run.weights_bytes)} to "
        f"{format_bytes(run.weights_after_bytes)} while generating (a module built weights lazily; the growth "
        "counts as activation in this step)"
        for run in profile.runs
        if run.weights_after_bytes > run.weights_bytes
    ]


def waterfall_table(profile: Profile) -> str:
    """Plain-text waterfall table (with notes)."""
    return "\n".join([_grid(waterfall_rows(profile)), *waterfall_notes(profile)])


def stage_table(profile: Profile) -> str:
    """Plain-text per-stage table."""
    return _grid(stage_rows(profile))
