"""Nsight Compute raw CSV exports -> a short JSON per profiled launch: duration, grid, registers, occupancy, issue
rate, DRAM throughput and the stall reasons (average warps stalled per issued instruction, largest first).

The GPU machine has ``ncu`` (/usr/local/cuda/bin/ncu) with performance counters. Profile, export, then summarise here
(the report itself is a few MB and stays out of git):

    MMSDK_TUNE=0 ncu --clock-control none --target-processes all -k regex:"subnormal|gemv_quad|decode_partial" \\
        --launch-count 40 --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats \\
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio -o prof \\
        python3 benchmarks/ncu_targets.py
    ncu --import prof.ncu-rep --page raw --csv > prof.csv
    python benchmarks/ncu_summary.py prof.csv [more.csv ...] --out summary.json
"""

from __future__ import annotations

import argparse
import csv
import json
from typing import Any

_STALL_PREFIX, _STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
_FIELDS = {"duration_us": "gpu__time_duration.sum", "registers": "launch__registers_per_thread",
           "theoretical_occupancy_pct": "sm__maximum_warps_per_active_cycle_pct",
           "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
           "issued_per_scheduler": "smsp__issue_active.avg.per_cycle_active",
           "dram_throughput_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarise(path: str) -> list[dict[str, Any]]:
    """One entry per profiled launch of an ``ncu --page raw --csv`` export (header row, units row, then launches)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, units, launches = rows[0], rows[1], rows[2:]
    column = {name: i for i, name in enumerate(header)}
    duration_unit = units[column[_FIELDS["duration_us"]]] if _FIELDS["duration_us"] in column else "us"
    to_us = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(duration_unit, 1.0)
    out = []
    for row in launches:
        entry: dict[str, Any] = {"kernel": row[column["Kernel Name"]], "grid": row[column["Grid Size"]],
                                 "block": row[column["Block Size"]]}
        for key, metric in _FIELDS.items():
            if metric in column:
                entry[key] = _number(row[column[metric]])
        if entry.get("duration_us") is not None:
            entry["duration_us"] *= to_us  # exported in the unit of the units row
        stalls = {name[len(_STALL_PREFIX):-len(_STALL_SUFFIX)]: _number(row[i]) for name, i in column.items()
                  if name.startswith(_STALL_PREFIX) and name.endswith(_STALL_SUFFIX)}
        entry["stalls_per_issue"] = dict(sorted(((k, round(v, 3)) for k, v in stalls.items() if v),
                                                key=lambda item: -item[1])[:8])
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("exports", nargs="+")
    parser.add_argument("--out", default="ncu_summary.json")
    args = parser.parse_args()
    result = {path: summarise(path) for path in args.exports}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for path, entries in result.items():
        for e in entries:
            print(path, e["kernel"][:36], e["grid"], e.get("duration_us"), e.get("registers"),
                  e.get("achieved_occupancy_pct"), list(e["stalls_per_issue"].items())[:3])


if __name__ == "__main__":
    main()
