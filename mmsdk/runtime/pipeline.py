"""OrtPipeline: an onnxruntime export loaded as three sessions, generating answers about images."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from mmsdk.runtime.generation import Encoded, Generation, decode
from mmsdk.runtime.inputs import Prepared, prepare
from mmsdk.runtime.sampling import Sampler, SamplingConfig
from mmsdk.runtime.sessions import Bound, SessionConfig, import_ort, open_session
from mmsdk.runtime.spec import ExportSpec

if TYPE_CHECKING:
    import onnxruntime as ort

    from mmsdk.core.manifest import Manifest

__all__ = ["OrtPipeline", "Request", "Result"]


class Request:
    """One (image, prompt) pair for :meth:`OrtPipeline.run_many`."""

    def __init__(self, image: Any, prompt: str) -> None:
        self.image, self.prompt = image, prompt


class Result:
    """The answer to one request, with the time its stages took."""

    def __init__(self, tokens: list[int], text: str, vision_seconds: float, decode_seconds: float,
                 vision_span: tuple[float, float] = (0.0, 0.0), decode_span: tuple[float, float] = (0.0, 0.0)) -> None:
        self.tokens, self.text = tokens, text
        self.vision_seconds, self.decode_seconds = vision_seconds, decode_seconds
        self.vision_span, self.decode_span = vision_span, decode_span  # perf_counter (start, end)

    def __repr__(self) -> str:
        return f"Result(text={self.text!r}, tokens={len(self.tokens)})"


class OrtPipeline:
    """vision -> embedding -> decoder sessions of one export, with the processor that feeds them.

    Tensors move between sessions as OrtValues bound through IOBinding (ORT-allocated outputs handed
    on as inputs; vision outputs written straight into the buffer the embedding/decoder reads), and
    to torch through DLPack for token selection: nothing is copied through the host in between.
    """

    def __init__(self, spec: ExportSpec, sessions: Mapping[str, ort.InferenceSession], processor: Any,
                 manifest: Manifest | None = None) -> None:
        self.spec, self.processor, self.manifest = spec, processor, manifest
        self.vision, self.embedding, self.decoder = (sessions[k] for k in ("vision", "embedding", "decoder"))
        self.vision_shapes = {i.name: list(i.shape) for i in self.vision.get_inputs()}
        self.decoder_inputs = frozenset(i.name for i in self.decoder.get_inputs())
        self.decoder_takes_positions = "position_ids" in self.decoder_inputs
        self.decoder_takes_image_mask = "image_token_mask" in self.decoder_inputs
        # per-image output shapes as traced (token reduction makes them symbolic in the graph)
        self.vision_output_shapes = {o.name: spec.vision_output_shapes.get(o.name, list(o.shape))
                                     for o in self.vision.get_outputs()}
        hidden = int(self.embedding.get_outputs()[0].shape[-1])
        self.no_features = np.zeros((0, hidden), np.float32)

    # --- loading -----------------------------------------------------------------------------
    @classmethod
    def from_folder(cls, folder: str | Path, manifest: Manifest, config: SessionConfig | None = None) -> OrtPipeline:
        """Open the sessions of a verified export folder."""
        from mmsdk.models.processing import load_processor_if_present

        import_ort()
        folder, config = Path(folder), config or SessionConfig()
        spec = ExportSpec.from_details(manifest.details)
        sessions = {k: open_session(folder / spec.files[k], config) for k in ("vision", "embedding", "decoder")}
        processor = load_processor_if_present(folder / spec.processor_dir) or _hf_processor(folder / spec.processor_dir)
        return cls(spec, sessions, processor, manifest)

    # --- stages ------------------------------------------------------------------------------
    def prepare(self, images: Sequence[Any], prompts: Sequence[str], max_new_tokens: int = 16) -> Prepared:
        """Processor + checks (image shapes, fixed grids, prompt length)."""
        return prepare(self.spec, self.processor, images, prompts, max_new_tokens, self.vision_shapes)

    def encode(self, prepared: Prepared) -> Encoded:
        """The vision stage: one vision run per image, each writing into its slice of one shared buffer."""
        import torch

        start = time.perf_counter()
        count = len(prepared.images)
        # each image's outputs are stacked along axis 0 (features [N, hidden]; cross K/V [B, heads, L, D])
        buffers = {name: torch.empty([count * self.vision_output_shapes[name][0], *self.vision_output_shapes[name][1:]])
                   for name in self.spec.vision_outputs}
        slots = [] if self.spec.image_slots else None
        for index, feed in enumerate(prepared.images):
            bound = Bound(self.vision).inputs(feed)
            for name, buffer in buffers.items():
                rows = buffer.shape[0] // count
                bound.output(name, into=buffer[index * rows:(index + 1) * rows])
            if slots is not None:
                bound.output(self.spec.image_slots)
                slots.append(bound.run()[-1].numpy())
            else:
                bound.run()
        end = time.perf_counter()
        if self.spec.inline_images:
            return Encoded(features=buffers[self.spec.vision_outputs[0]], seconds=end - start, slots=slots,
                           span=(start, end))
        return Encoded(cross=buffers, seconds=end - start, span=(start, end))

    def decode(self, prepared: Prepared, encoded: Encoded, sampling: SamplingConfig | None = None) -> Generation:
        """The embedding + decoder stage."""
        return decode(self, prepared, encoded, Sampler(sampling or SamplingConfig()))

    # --- one call ----------------------------------------------------------------------------
    def generate(self, images: Sequence[Any], prompts: Sequence[str], *, max_new_tokens: int = 16,
                 **sampling: Any) -> list[list[int]]:
        """Generated token ids for each (image, prompt) (greedy unless ``do_sample=True``)."""
        prepared = self.prepare(images, prompts, max_new_tokens)
        return self.decode(prepared, self.encode(prepared), SamplingConfig(**sampling)).tokens

    def answer(self, image: Any, prompt: str, *, max_new_tokens: int = 16, **sampling: Any) -> str:
        """The decoded answer to one prompt about one image."""
        tokens = self.generate([image], [prompt], max_new_tokens=max_new_tokens, **sampling)[0]
        return self.processor.batch_decode([tokens], skip_special_tokens=True)[0]

    def run_many(self, requests: Iterable[Request], *, max_new_tokens: int = 16, overlap: bool = True,
                 **sampling: Any) -> Iterator[Result]:
        """Answer requests one by one; with ``overlap`` the next image is encoded while this one decodes."""
        from mmsdk.runtime.scheduler import run_double_buffered

        config = SamplingConfig(**sampling)
        yield from run_double_buffered(self, requests, max_new_tokens, config, overlap=overlap)


def _hf_processor(folder: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)
