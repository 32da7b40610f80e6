"""Memory and time breakpoints of a generation: weights, KV cache, activations, and each stage.

``Optimizer.profile()`` (and ``report(measure=True)``) measure a model before and after each planned
pass; ``mmsdk profile`` writes the results as a table, ``profile.json``, charts and a module graph.
On CPU the numbers come from exact tensor accounting; on CUDA the allocator's peaks are added.
"""

from __future__ import annotations

from mmsdk.profiling.measure import ProfileSample, measure_run, resolve_device, resolve_sample
from mmsdk.profiling.results import STAGES, ModuleMemory, Profile, RunMemory, StageMemory

__all__ = ["STAGES", "ModuleMemory", "Profile", "ProfileSample", "RunMemory", "StageMemory", "measure_run",
           "resolve_device", "resolve_sample"]
