"""Programmatic dependent launch (PDL, compute capability 9.0+) for the decode-step kernels.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it on the stream still
runs, once every program of that kernel has called ``griddepcontrol.launch_dependents`` (or exited).
Before :func:`wait_for_inputs` it may only read data written before the kernel in front of it started
(the batch-1 GEMVs load their first weight tiles); after it, everything the previous kernel wrote is
visible, and that kernel has finished, so no write-after-read race is left either. Every program of a
PDL-launched kernel must reach :func:`wait_for_inputs` before it stores anything: that also makes the
order transitive (kernel ``i`` finishes only after kernel ``i - 1`` has).

Imported only when a kernel is launched. Triton builds without ``triton.language.extra.cuda``'s
``gdc_*`` functions get no PDL (:func:`mmsdk.kernels.pdl_ready` checks :data:`AVAILABLE`).
"""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = True
except ImportError:  # an older Triton: kernels are launched without PDL, so the PDL branches never compile
    gdc_launch_dependents = gdc_wait = None
    AVAILABLE = False


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """With ``PDL``: wait until the previous kernel has finished and its writes are visible, then let the next
    kernel launch (no-op otherwise)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def let_next_launch(PDL: tl.constexpr):
    """With ``PDL``: let the next kernel launch now (for kernels launched without PDL whose successor loads
    weights before it waits; no-op otherwise)."""
    if PDL:
        gdc_launch_dependents()
