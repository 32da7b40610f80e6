"""A new decode step made into a CUDA graph: run once eagerly on a side stream, then captured on that stream.

Used by fast generate (mmsdk.kernels.fast_generate) for every step it builds; a kept step is replayed without either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mmsdk.kernels import weights_settled
from mmsdk.kernels.fast_generate_scope import Unsupported
from mmsdk.kernels.parallel_compile import compile_before_first_call

__all__ = ["captured_replay", "warm_up"]


def warm_up(step: Callable[[], Any], device: torch.device, compile_ahead: bool = False) -> torch.cuda.Stream:
    """Run ``step`` once eagerly on a new side stream of ``device``, as graph capture wants, and return that stream
    for the capture: cuBLAS keeps a workspace (32 MiB on an H200) for every stream it ran on, so warming up and
    capturing on two streams would keep two.

    With ``compile_ahead`` the step's Triton kernels are first compiled side by side, from a dropped capture of it
    (mmsdk.kernels.parallel_compile.compile_before_first_call), instead of one at a time as it launches them, and the
    eager step launches the kernel variants its graph will hold (mmsdk.kernels.weights_settled: the GEMVs load their
    first weights before they wait, as in the graph), so it compiles none of its own.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        if not compile_ahead:
            step()
        else:
            compile_before_first_call(step, side)
            with weights_settled():  # the side stream waited for the weights' making, and the step writes none
                step()
    torch.cuda.current_stream(device).wait_stream(side)
    return side


def captured_replay(step: Callable[[], Any], stream: torch.cuda.Stream | None) -> Callable[[], None]:
    """The replay of a CUDA graph of ``step`` captured on ``stream``; a step that cannot be captured is Unsupported
    (fast generate then runs transformers' generate)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            step()
    except Exception as error:  # a host sync or an uncapturable op in the model
        raise Unsupported(f"the decode step could not be captured ({type(error).__name__}: {error})") from error
    return graph.replay
