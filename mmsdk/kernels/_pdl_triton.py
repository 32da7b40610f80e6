"""Programmatic dependent launch (Hopper and later) for the decode-step kernels.

A kernel launched with ``launch_pdl=True`` may be scheduled while the kernel before it on the stream
is still running; a decode step is hundreds of kernels of a few microseconds each, so each launch's
latency hides behind its predecessor's tail instead of adding to the step. Every such kernel starts
with :func:`pdl_start`: it waits until the previous kernel has finished and its writes are visible
(before touching any memory, so neither read-after-write nor write-after-read can race), then lets
its own successor start launching.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """With ``PDL``: wait for the previous kernel, then allow the next one to launch (no-op otherwise)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
