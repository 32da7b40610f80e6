"""A transformers streamer (``generate(..., streamer=TextIteratorStreamer(...))``) fed by fast generate.

transformers' generate hands its streamer the prompt's ids, then each step's new token per row (pad for a row that
has finished), and calls ``end()`` once every row has finished or ``max_new_tokens`` are made; chat front ends read
the text from it as it comes. Fast generate refused such calls, which then ran transformers' eager loop.

:class:`TokenStream` puts the same tensors in the same order. Each put copies the step's tokens to the host (with
whether every row has ended, in the same copy), so with a streamer the decode loop waits for every step and stops
at the step where transformers' would (without one it looks every 16 steps and cuts the answer afterwards).
Nothing is put before the decode step is ready (built, warmed up, captured): the tokens made before that are held
on the device and put when streaming starts, so an error while the step is made still falls back to transformers'
generate, which streams from the start, and nothing reaches the streamer twice. An error after streaming started
is raised instead (:attr:`TokenStream.started`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TokenStream"]


class TokenStream:
    """The prompt and the new tokens of one fast generate call, put to ``streamer`` as transformers' generate puts
    them."""

    def __init__(self, streamer: Any, prompt: torch.Tensor) -> None:
        self.streamer, self.prompt = streamer, prompt
        self.held: list[torch.Tensor] = []  # tokens made before streaming started, copied off the step's buffers
        self.started = False

    def hold(self, token: torch.Tensor) -> None:
        """Keep a copy of ``token`` ([B], the device's) to put when streaming starts."""
        self.held.append(token.clone())

    def start(self) -> None:
        """Put the prompt and the held tokens (once)."""
        if self.started:
            return
        self.started = True
        self.streamer.put(self.prompt.cpu())
        for token in self.held:
            self.streamer.put(token.cpu())
        self.held.clear()

    def put(self, token: torch.Tensor, finished: torch.Tensor) -> bool:
        """Put one step's tokens ([B]); streaming must have started. Returns whether every row has finished
        (``finished``, [B] bool), read in the same copy to the host as the tokens: one wait per step, not two."""
        rows = token.shape[0]
        both = torch.cat([token, finished.to(token.dtype)]).cpu()
        self.streamer.put(both[:rows])
        return bool(both[rows:].all())

    def end(self) -> None:
        """Put whatever is held, then end the stream."""
        self.start()
        self.streamer.end()
