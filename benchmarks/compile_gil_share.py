"""How much of a Triton compile holds Python's GIL: the bound on compiling a tuner's candidates on threads.

mmsdk.kernels.parallel_compile compiles a tuner's candidates on a thread pool, which pays only while a compile leaves
the GIL (in LLVM's passes and ptxas). If a fraction ``f`` of each compile holds it, ``n`` threads compile at most
``1 / (f + (1 - f) / n)`` times as fast as one (Amdahl), however many CPUs there are.

This measures ``f`` on any machine, no GPU needed: the batch-1 integer-dot GEMV tiles of benchmarks/sm90_gemv_builds.py
are compiled for sm_90 (Triton's bundled ptxas; ``always_compile``, so the cache is not read) while a probe thread runs
a pure Python loop. The probe's rate while a compile runs, against its rate alone just before each compile, is the share
of the time the compile left it the GIL. (Each window of the probe is a chunk of loop iterations; the share is counted
over the compiles' own time, not the SASS dumps around them.)

    python benchmarks/compile_gil_share.py [--repeats 3] [--out gil_share.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's root

from benchmarks.sm90_gemv_builds import IDOT_TILES, build_idot  # noqa: E402

PROBE_CHUNK = 20_000  # loop iterations per probe window (about 0.3 ms of one CPU)
SOLO_SECONDS = 0.75  # the probe alone, before each compile


def probe_rate_windows(stop: threading.Event, stamps: list[float]) -> None:
    """Append a timestamp after every chunk of a pure Python loop, until ``stop``."""
    while not stop.is_set():
        for _ in range(PROBE_CHUNK):
            pass
        stamps.append(time.perf_counter())


def measure_once() -> dict[str, Any]:
    """One round: each IDOT tile compiled (timed inside ``triton.compile`` only), after a window of the probe alone."""
    import triton

    intervals: list[tuple[float, float]] = []
    compile_function = triton.compile

    def timed_compile(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return compile_function(*args, **kwargs)
        finally:
            intervals.append((started, time.perf_counter()))

    stop, stamps, alone = threading.Event(), [], []
    probe = threading.Thread(target=probe_rate_windows, args=(stop, stamps), daemon=True)
    triton.compile = timed_compile
    try:
        probe.start()
        for tile in IDOT_TILES:  # a window of the probe alone before each compile: the machine's pace just then
            mark = len(stamps)
            time.sleep(SOLO_SECONDS)
            alone.append(len(stamps) - mark)
            build_idot(*tile)
    finally:
        stop.set()
        probe.join()
        triton.compile = compile_function
    compiling = sum(end - start for start, end in intervals)
    inside = sum(1 for stamp in stamps if any(start <= stamp <= end for start, end in intervals))
    alone_rate = sum(alone) / (SOLO_SECONDS * len(alone))
    share = 1 - inside / compiling / alone_rate
    return {"compiles": len(intervals), "compile_s": round(compiling, 2), "probe_alone_per_s": round(alone_rate),
            "probe_while_compiling_per_s": round(inside / compiling), "gil_share": round(share, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch
    import triton
    from triton import knobs

    knobs.compilation.always_compile = True  # every build compiles; none is read from Triton's cache
    build_idot(*IDOT_TILES[0])  # imports and the backend's first set-up, outside the rounds
    rounds = []
    for _ in range(args.repeats):
        rounds.append(measure_once())
        print(json.dumps(rounds[-1]), flush=True)
    share = statistics.median(entry["gil_share"] for entry in rounds)
    bound = {threads: round(1 / (max(share, 0.0) + (1 - max(share, 0.0)) / threads), 1) for threads in (2, 8, 16, 32)}
    result = {"triton": triton.__version__, "torch": torch.__version__, "python": platform.python_version(),
              "machine": platform.processor() or platform.machine(), "rounds": rounds, "median_gil_share": share,
              "thread_speedup_bound": bound}
    print(f"Triton {triton.__version__}: a compile holds the GIL {share:.0%} of its time (median of {args.repeats}); "
          f"threads can compile at most {bound} times as fast as one")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
