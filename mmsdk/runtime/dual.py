"""DualPipeline: a dual folder run as two stages, vision on ONNX Runtime and the language model on TensorRT-LLM.

The vision stage runs ``vision/vision.onnx`` through IOBinding with ORT-allocated outputs; the
features reach the language-model stage as a DLPack view of that OrtValue (same device, no host
copy; on CPU the tensor's data pointer is the OrtValue's). The language-model stage is TensorRT-LLM
where it is installed and otherwise the CPU reference of the same ``llm/`` files
(:mod:`mmsdk.runtime.llm_stage`). ``run_many`` double-buffers: the vision stage of request i+1 runs
on a worker thread while request i generates (the scheduler of the onnxruntime runtime, reused),
with at most one request encoded ahead.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmsdk.core.errors import BackendUnavailableError, UnsupportedInputError
from mmsdk.runtime.generation import Encoded, Generation
from mmsdk.runtime.llm_stage import LLMRequest, LLMStage, open_llm_stage

if TYPE_CHECKING:
    from mmsdk.core.manifest import Manifest
    from mmsdk.runtime.pipeline import Request, Result
    from mmsdk.runtime.sampling import SamplingConfig

__all__ = ["DualPipeline", "DualPrepared", "open_vision_session"]

ORT_INSTALL = "pip install 'mmsdk[ort]' (CPU) or pip install 'mmsdk[ort-gpu]' (CUDA)"


@dataclass
class DualPrepared:
    """One request: the processor's token ids, the vision feeds, and its prompt."""

    input_ids: torch.Tensor  # [L]
    feeds: dict[str, np.ndarray]
    prompt: str
    max_new_tokens: int
    grids: list[tuple[int, int, int]] | None = None
    keep: list[Any] = field(default_factory=list)  # OrtValues the features view, kept alive with the request


def open_vision_session(path: Path, intra_op_threads: int | None = None) -> Any:
    """An ORT session on ``vision.onnx``, or an error naming the extra to install (there is no other vision runtime)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as err:
        raise BackendUnavailableError(
            "the vision half (vision/) runs in ONNX Runtime, which is not installed.",
            fix=f"{ORT_INSTALL}. There is no fallback runtime for vision/; without ONNX Runtime, export the model "
            "to the 'torch' backend instead.",
        ) from err
    from mmsdk.runtime.sessions import SessionConfig, open_session

    return open_session(path, SessionConfig(intra_op_threads=intra_op_threads))


class DualPipeline:
    """The two stages of one dual folder and the processor that feeds them."""

    def __init__(self, details: Mapping[str, Any], vision: Any, llm: LLMStage, processor: Any) -> None:
        self.details, self.vision, self.llm, self.processor = details, vision, llm, processor
        self.contract = details["contract"]
        vision_details = details["vision"]
        self.outputs = list(vision_details["outputs"])
        self.fixed = dict(vision_details.get("fixed_inputs") or {})
        self.inputs = [name for name in vision_details["inputs"] if name not in self.fixed]

    @classmethod
    def from_folder(cls, folder: str | Path, manifest: Manifest, *, runtime: str = "auto",
                    intra_op_threads: int | None = None, **llm_options: Any) -> DualPipeline:
        """Open both stages of a verified dual folder."""
        from mmsdk.models.processing import load_processor_if_present

        folder, details = Path(folder), manifest.details
        vision = open_vision_session(folder / details["vision"]["file"], intra_op_threads)
        llm = open_llm_stage(folder, details, runtime, **llm_options)
        processor = load_processor_if_present(folder / details["processor"])
        if processor is None:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(folder / details["processor"])
        return cls(details, vision, llm, processor)

    # --- stages ------------------------------------------------------------------------------
    def prepare(self, images: Sequence[Any], prompts: Sequence[str], max_new_tokens: int = 16) -> DualPrepared:
        """Processor outputs of one (image, prompt) request, checked against the vision graph's fixed inputs."""
        from mmsdk.runtime.inputs import _format, load_image

        if len(images) != 1 or len(prompts) != 1:
            raise UnsupportedInputError(f"{len(images)} images and {len(prompts)} prompts in one request.",
                                        fix="give one image and one prompt per request (run_many takes many).")
        text = _format(self.processor, prompts[0])
        batch = self.processor(images=[load_image(images[0])], text=[text], return_tensors="pt")
        for name, value in self.fixed.items():
            got = batch[name].tolist() if name in batch else None
            if got != value:
                raise UnsupportedInputError(
                    f"{name} is {got}, but vision.onnx was exported for {value}.",
                    fix="resize the image to the export's size (the folder's processor does this for its own sizes).",
                )
        feeds = {name: np.ascontiguousarray(batch[name].numpy()) for name in self.inputs}
        grids = [tuple(int(x) for x in row) for row in batch["image_grid_thw"].tolist()] \
            if "image_grid_thw" in batch else None
        return DualPrepared(batch["input_ids"][0], feeds, text, max_new_tokens, grids)

    def encode(self, prepared: DualPrepared) -> Encoded:
        """The vision stage: one ORT run; its outputs become torch views (DLPack), never host copies."""
        from mmsdk.runtime.sessions import Bound

        start = time.perf_counter()
        bound = Bound(self.vision).inputs(prepared.feeds)
        for name in self.outputs:
            bound.output(name)
        values = bound.run()
        prepared.keep = values
        features = torch.from_dlpack(values[0])
        slots = [torch.from_dlpack(values[1]).numpy()] if len(values) > 1 else None
        end = time.perf_counter()
        return Encoded(features=features, slots=slots, seconds=end - start, span=(start, end))

    def decode(self, prepared: DualPrepared, encoded: Encoded, sampling: SamplingConfig | None = None) -> Generation:
        """The language-model stage (greedy)."""
        if sampling is not None and sampling.do_sample:
            raise UnsupportedInputError("the dual pipeline decodes greedily.", fix="drop do_sample / --sample.")
        start = time.perf_counter()
        slots = torch.from_numpy(encoded.slots[0]) if encoded.slots else None
        request = LLMRequest(prepared.input_ids, encoded.features, slots, prepared.grids, prepared.prompt,
                             prepared.max_new_tokens)
        tokens = self.llm.generate(request)
        end = time.perf_counter()
        return Generation(tokens=[tokens], first_logits=torch.empty(0), seconds=end - start,
                          decode_steps=len(tokens), span=(start, end))

    # --- whole requests ----------------------------------------------------------------------
    def answer(self, image: Any, prompt: str, *, max_new_tokens: int = 16) -> str:
        """The decoded answer to one prompt about one image."""
        prepared = self.prepare([image], [prompt], max_new_tokens)
        tokens = self.decode(prepared, self.encode(prepared)).tokens[0]
        return self.processor.batch_decode([tokens], skip_special_tokens=True)[0]

    def run_many(self, requests: Iterable[Request], *, max_new_tokens: int = 16, overlap: bool = True,
                 **sampling: Any) -> Iterator[Result]:
        """Answer requests in order; with ``overlap`` request i+1's vision runs while request i generates."""
        from mmsdk.runtime.sampling import SamplingConfig
        from mmsdk.runtime.scheduler import run_double_buffered

        yield from run_double_buffered(self, requests, max_new_tokens, SamplingConfig(**sampling),  # type: ignore[arg-type]
                                       overlap=overlap)
