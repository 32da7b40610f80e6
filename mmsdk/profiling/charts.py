"""PNG charts of a profile (matplotlib, the ``plots`` extra): waterfall, memory over time, top modules.

Figures are drawn on matplotlib's Agg canvas directly, so pyplot's global state is never touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmsdk.core.errors import BackendUnavailableError
from mmsdk.profiling.results import STAGES

if TYPE_CHECKING:
    from mmsdk.profiling.results import ModuleMemory, Profile, RunMemory

__all__ = ["CHART_FILES", "top_modules", "write_charts"]

CHART_FILES = ("waterfall.png", "timeline.png", "modules.png")
_MIB = 2**20
_STAGE_COLOURS = {"vision_encode": "#8ecae6", "projector": "#ffb703", "prefill": "#90be6d", "decode": "#f4a261",
                  "other": "#e5e5e5"}


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise BackendUnavailableError(
            "the profile charts need matplotlib, which is not installed.", fix="pip install 'mmsdk[plots]'."
        ) from err
    figure = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(figure)
    return figure


def write_charts(profile: Profile, folder: Path, *, top: int = 15) -> list[Path]:
    """Write waterfall.png, timeline.png and modules.png into ``folder``; returns their paths."""
    paths = [folder / name for name in CHART_FILES]
    _waterfall(profile).savefig(paths[0])
    _timeline(profile).savefig(paths[1])
    _modules(profile.final, top).savefig(paths[2])
    return paths


def _waterfall(profile: Profile) -> Any:
    figure = _figure(max(6.0, 1.6 * len(profile.runs) + 2), 4.6)
    axes = figure.add_subplot()
    labels = [run.label for run in profile.runs]
    x = range(len(labels))
    bottom = [0.0] * len(labels)
    for name, colour, values in (
        ("weights", "#4c72b0", [r.weights_bytes for r in profile.runs]),
        ("KV cache", "#dd8452", [r.kv_bytes for r in profile.runs]),
        ("peak activation", "#55a868", [r.peak_activation_bytes for r in profile.runs]),
    ):
        mib = [v / _MIB for v in values]
        axes.bar(x, mib, bottom=bottom, color=colour, label=name, width=0.6)
        bottom = [b + m for b, m in zip(bottom, mib, strict=True)]
    axes.plot(list(x), [r.peak_bytes / _MIB for r in profile.runs], "k_", markersize=28, mew=2,
              label="measured peak total")
    axes.set_xticks(list(x), labels, rotation=15, ha="right")
    axes.set_ylabel("MiB")
    axes.set_title(f"{profile.model}: memory after each pass ({profile.device})")
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _stage_spans(run: RunMemory) -> list[tuple[float, float, str]]:
    """(start, end, stage) bands: the recorded stage changes, else guessed from the timeline's points."""
    if run.stage_spans:
        return list(run.stage_spans)
    starts: list[tuple[float, str]] = []
    for t, _, stage in run.timeline:
        if not starts or starts[-1][1] != stage:
            starts.append((t, stage))
    end = run.timeline[-1][0] if run.timeline else 0.0
    return [(t, starts[i + 1][0] if i + 1 < len(starts) else end, stage) for i, (t, stage) in enumerate(starts)]


def _timeline(profile: Profile) -> Any:
    figure = _figure(9.0, 2.4 * len(profile.runs) + 0.6)
    for index, run in enumerate(profile.runs):
        axes = figure.add_subplot(len(profile.runs), 1, index + 1)
        for start, end, stage in _stage_spans(run):
            axes.axvspan(start * 1000, max(end, start + 1e-6) * 1000, color=_STAGE_COLOURS.get(stage, "#ddd"),
                         alpha=0.6, lw=0)
        axes.plot([t * 1000 for t, _, _ in run.timeline], [b / _MIB for _, b, _ in run.timeline], color="black", lw=1)
        axes.set_ylabel("MiB")
        axes.set_title(run.label, fontsize=9, loc="left")
    axes.set_xlabel("milliseconds since generate() started")
    handles = [_patch(_STAGE_COLOURS[name], name) for name in STAGES]
    figure.legend(handles=handles, loc="upper right", fontsize=8, ncols=len(STAGES))
    figure.tight_layout(rect=(0, 0, 1, 0.95))
    return figure


def _patch(colour: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=colour, label=label)


def top_modules(run: RunMemory, count: int) -> list[ModuleMemory]:
    """The ``count`` leaf modules with the most weights + working memory."""
    parents = {m.name.rsplit(".", 1)[0] for m in run.modules if "." in m.name} | {"(model)"}
    leaves = [m for m in run.modules if m.name not in parents]
    return sorted(leaves, key=lambda m: m.total_bytes, reverse=True)[:count]


def _modules(run: RunMemory, count: int) -> Any:
    chosen = list(reversed(top_modules(run, count)))
    figure = _figure(9.0, 0.32 * len(chosen) + 1.4)
    axes = figure.add_subplot()
    y = range(len(chosen))
    weights = [m.weights_bytes / _MIB for m in chosen]
    axes.barh(y, weights, color="#4c72b0", label="weights")
    axes.barh(y, [m.activation_peak_bytes / _MIB for m in chosen], left=weights, color="#55a868",
              label="peak working memory of one call")
    axes.set_yticks(list(y), [f"{m.name} ({m.kind})" for m in chosen], fontsize=7)
    axes.set_xlabel("MiB")
    axes.set_title(f"top modules by bytes: {run.label}", fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure
