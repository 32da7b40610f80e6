"""Write a profile folder: profile.json, profile.txt, PNG charts and the module graph."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from mmsdk.core.errors import BackendUnavailableError
from mmsdk.core.fileio import atomic_output_dir

if TYPE_CHECKING:
    from mmsdk.profiling.results import Profile

__all__ = ["ProfileFiles", "write_profile"]


class ProfileFiles(list):
    """The paths written, plus ``skipped``: what could not be written and why (e.g. no matplotlib)."""

    skipped: list[str]


def write_profile(
    profile: Profile, path: str | Path, *, overwrite: bool = False, graph_depth: int = 5, top: int = 15,
    extra: Mapping[str, bytes] | None = None,
) -> ProfileFiles:
    """Write every output of ``profile`` into ``path`` atomically (a non-empty folder needs ``overwrite``)."""
    from mmsdk.profiling.charts import write_charts
    from mmsdk.profiling.graph import write_graph

    folder = Path(path)
    written = ProfileFiles()
    written.skipped = []
    with atomic_output_dir(folder, overwrite=overwrite) as staging:
        (staging / "profile.json").write_text(json.dumps(profile.to_dict(), indent=1))
        (staging / "profile.txt").write_text(profile.table() + "\n")
        names = ["profile.json", "profile.txt"]
        try:
            names += [p.name for p in write_charts(profile, staging, top=top)]
        except BackendUnavailableError as err:
            written.skipped.append(f"charts: {err}")
        names += [p.name for p in write_graph(profile.final, staging, max_depth=graph_depth)]
        if not any(name.endswith(".svg") for name in names):
            written.skipped.append("modules.svg: Graphviz's `dot` is not installed (the .dot file is written)")
        for name, data in (extra or {}).items():
            (staging / name).write_bytes(data)
            names.append(name)
    written.extend(folder / name for name in names)
    return written
