"""Double buffering: the vision stage of request i+1 runs on a worker thread while request i decodes.

ONNX Runtime releases the GIL inside ``run``, so the two sessions really run at the same time;
each request's vision output lands in its own buffer (two in flight at most), so the decoder
never reads a buffer that the vision stage is writing.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    from mmsdk.runtime.generation import Encoded
    from mmsdk.runtime.inputs import Prepared
    from mmsdk.runtime.pipeline import OrtPipeline, Request, Result
    from mmsdk.runtime.sampling import SamplingConfig

__all__ = ["run_double_buffered"]


def run_double_buffered(pipe: OrtPipeline, requests: Iterable[Request], max_new_tokens: int,
                        sampling: SamplingConfig, *, overlap: bool = True) -> Iterator[Result]:
    """Yield one Result per request, in order."""
    from mmsdk.runtime.pipeline import Result

    pending = iter(requests)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmsdk-vision") as pool:
        current = _submit(pipe, pool, next(pending, None), max_new_tokens, overlap)
        while current is not None:
            prepared, future = current
            encoded: Encoded = future.result()
            current = _submit(pipe, pool, next(pending, None), max_new_tokens, overlap)
            generation = pipe.decode(prepared, encoded, sampling)
            tokens = generation.tokens[0]
            text = pipe.processor.batch_decode([tokens], skip_special_tokens=True)[0]
            yield Result(tokens, text, encoded.seconds, generation.seconds, encoded.span, generation.span)


def _submit(pipe: OrtPipeline, pool: ThreadPoolExecutor, request: Request | None, max_new_tokens: int,
            overlap: bool) -> tuple[Prepared, Future[Encoded]] | None:
    if request is None:
        return None
    prepared = pipe.prepare([request.image], [request.prompt], max_new_tokens)
    if overlap:
        return prepared, pool.submit(pipe.encode, prepared)
    done: Future[Encoded] = Future()
    done.set_result(pipe.encode(prepared))
    return prepared, done
