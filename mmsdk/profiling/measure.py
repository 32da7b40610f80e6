"""Measure one generation of a torch model: weights, KV cache, activation peaks, stage times."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmsdk.core.errors import UnsupportedInputError
from mmsdk.core.memory import component_bytes, module_bytes
from mmsdk.profiling.recorder import Recorder, instrument
from mmsdk.profiling.results import STAGES, ModuleMemory, RunMemory, StageMemory

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.session import Session

__all__ = ["DEFAULT_QUESTION", "TIMELINE_POINTS", "ProfileSample", "measure_run", "resolve_device", "resolve_sample"]

DEFAULT_QUESTION = "what digit is this ?"

TIMELINE_POINTS = 2000  # the timeline kept per run is reduced to about this many points (bin maxima)


@dataclass(frozen=True)
class ProfileSample:
    """The prompt a profile generates from: one image, one question, and how many tokens to decode."""

    image: Any
    question: str
    max_new_tokens: int = 8


def resolve_sample(sample: Any, session: Session, max_new_tokens: int = 8) -> ProfileSample:
    """A ProfileSample from ``sample``: a ProfileSample, an (image, question) pair, an example with
    ``image`` and ``question``, or None (the first test example of the ``digits`` dataset when one is
    registered, else a synthetic 8x8 image)."""
    if isinstance(sample, ProfileSample):
        return sample
    if sample is None:
        if "digits" in session.datasets:
            example = session.datasets.get("digits").load("test")[0]
            return ProfileSample(example.image, example.question, max_new_tokens)
        from mmsdk.testing import sample_image

        return ProfileSample(sample_image(0, 32), DEFAULT_QUESTION, max_new_tokens)
    if hasattr(sample, "image") and hasattr(sample, "question"):
        return ProfileSample(sample.image, sample.question, max_new_tokens)
    if isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[1], str):
        return ProfileSample(sample[0], sample[1], max_new_tokens)
    raise UnsupportedInputError(
        f"cannot profile with a sample of type {type(sample).__name__}.",
        fix="pass (image, question), e.g. opt.profile((image, 'what digit is this ?')), or leave it out.",
    )


def resolve_device(device: str | None) -> str:
    """``cuda`` or ``cpu`` (None: cuda when available); ``cuda`` without a GPU is a clear error."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = device.split(":")[0]
    if kind not in ("cuda", "cpu"):
        raise UnsupportedInputError(f"device {device!r} is not supported for profiling.",
                                    fix="use --device cpu or --device cuda (or cuda:N).")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UnsupportedInputError(
            f"device {device!r} was asked for, but torch {torch.__version__} sees no CUDA GPU on this machine.",
            fix="use --device cpu (the profile is exact tensor accounting there), or install a CUDA build of torch.",
        )
    return device


def measure_run(
    model: nn.Module, processor: Any, adapter: ModelAdapter, sample: ProfileSample, *,
    device: str = "cpu", label: str = "unoptimized", passes: tuple[str, ...] = (), modules: bool = True,
) -> RunMemory:
    """Generate ``sample.max_new_tokens`` tokens greedily and account for every byte on the way."""
    import torch

    from mmsdk.profiling.accounting import TensorAccountant
    from mmsdk.telemetry import span

    model.to(device).eval()
    inputs = prompt_inputs(model, processor, adapter, sample, device)
    cuda = device.startswith("cuda")
    weights = module_bytes(model)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    allocated_before = torch.cuda.memory_allocated() if cuda else 0
    recorder = Recorder(cuda=cuda)
    accountant = TensorAccountant(recorder.on_change, preexisting=[*_held_tensors(model), *inputs.values()])
    recorder.accountant = accountant
    started = time.perf_counter()
    with span("mmsdk.profile.run", label=label, device=device), torch.inference_mode():
        with instrument(model, adapter, recorder, modules=modules), accountant:
            output = model.generate(**inputs, max_new_tokens=sample.max_new_tokens,
                                    min_new_tokens=sample.max_new_tokens, do_sample=False)
        recorder.finish()
    seconds = time.perf_counter() - started
    accountant.detach()
    prompt = inputs["input_ids"].shape[1]
    answer = processor.batch_decode(output[:, prompt:], skip_special_tokens=True)[0] if processor else ""
    return _summarise(model, adapter, recorder, weights, label=label, passes=passes, device=device,
                      weights_after=module_bytes(model),
                      prompt=prompt, new=int(output.shape[1] - prompt), seconds=seconds, answer=answer,
                      allocated_before=allocated_before)


def _held_tensors(model: nn.Module) -> list[Any]:
    """Tensors the model holds before generating: parameters, buffers and plain tensor attributes
    (packed weights or scales a pass keeps outside the state dict)."""
    from mmsdk.profiling.kv import cache_tensors

    held: list[Any] = []
    for module in model.modules():
        held += cache_tensors(vars(module))  # _parameters, _buffers and any tensor attribute
    return held


def prompt_inputs(model: nn.Module, processor: Any, adapter: ModelAdapter, sample: ProfileSample, device: str) -> dict:
    """``sample`` as ``model.generate`` takes it: the adapter's prompt through the processor, tensors on ``device``,
    floating ones in the model's dtype."""
    if processor is None:
        raise UnsupportedInputError(
            "generating from an image and a prompt needs the model's processor, but this model came without one.",
            fix="pass the model's processor: Optimizer(model, processor).",
        )
    prompt = adapter.format_prompt(sample.question, processor)
    batch = processor(images=[sample.image], text=[prompt], return_tensors="pt")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    out = {}
    for key, value in dict(batch).items():
        if hasattr(value, "to"):
            value = value.to(device)
            if value.is_floating_point() and dtype is not None:
                value = value.to(dtype)
        out[key] = value
    return out


def _summarise(model: nn.Module, adapter: ModelAdapter, recorder: Recorder, weights: int, **info: Any) -> RunMemory:
    stage_live, stage_act, peak_live, peak_act, timeline = _replay(recorder, weights)
    cuda = bool(recorder.cuda_peaks)
    allocated_before = info.pop("allocated_before")
    stages = tuple(
        StageMemory(
            name=name,
            # On CUDA the allocator's own peak (it also sees workspace the accounting cannot).
            peak_bytes=recorder.cuda_peaks.get(name, 0) if cuda else weights + stage_live.get(name, 0),
            activation_bytes=stage_act.get(name, 0),
            seconds=recorder.stage_seconds.get(name, 0.0),
            calls=recorder.stage_calls.get(name, 0),
        )
        for name in STAGES
        if name in recorder.stage_calls or (name == "other" and name in recorder.stage_seconds)
    )
    allocator = {}
    if cuda:
        import torch

        # tensor_accounting_peak: the same peak from the accounting (bytes on the device before the run
        # + the most live bytes it allocated); the gap to max_allocated is allocator rounding and workspaces.
        allocator = {"allocated_before": allocated_before, "max_allocated": max(recorder.cuda_peaks.values()),
                     "reserved": torch.cuda.memory_reserved(), "tensor_accounting_peak": allocated_before + peak_live}
    return RunMemory(
        label=info["label"], passes=tuple(info["passes"]), device=info["device"],
        method="cuda-allocator+tensor-accounting" if cuda else "tensor-accounting",
        weights_bytes=weights,
        kv_bytes=recorder.kv_after_step[-1] if recorder.kv_after_step else 0,
        kv_prefill_bytes=recorder.kv_after_step[0] if recorder.kv_after_step else 0,
        peak_activation_bytes=peak_act,
        peak_bytes=allocator["max_allocated"] if cuda else weights + peak_live,
        prompt_tokens=info["prompt"], new_tokens=info["new"], seconds=info["seconds"],
        stages=stages, modules=_modules(model, recorder),
        components=component_bytes(adapter.components(model)),
        timeline=timeline, allocator=allocator, answer=info["answer"], weights_after_bytes=info["weights_after"],
        stage_spans=_spans(recorder),
    )


def _spans(recorder: Recorder) -> tuple[tuple[float, float, str], ...]:
    """(start, end, stage) from the recorded stage changes; each lasts until the next change."""
    changes = [(0.0, "other"), *recorder.transitions]
    end = time.perf_counter() - recorder.start
    spans = [(t, changes[i + 1][0] if i + 1 < len(changes) else end, stage) for i, (t, stage) in enumerate(changes)]
    return tuple(span for span in spans if span[1] > span[0])


def _replay(recorder: Recorder, weights: int) -> tuple[dict[str, int], dict[str, int], int, int, tuple]:
    """Replay the event log: per-stage peak live and peak non-KV bytes, overall peaks, the timeline."""
    live = kv = peak_live = peak_act = 0
    stage_live: dict[str, int] = {}
    stage_act: dict[str, int] = {}
    points: list[tuple[float, int, str]] = []
    for t, delta, serial, stage in recorder.events:
        live += delta
        if serial in recorder.kv_serials:
            kv += delta
        peak_live, peak_act = max(peak_live, live), max(peak_act, live - kv)
        stage_live[stage] = max(stage_live.get(stage, 0), live)
        stage_act[stage] = max(stage_act.get(stage, 0), live - kv)
        points.append((t, weights + live, stage))
    return stage_live, stage_act, peak_live, peak_act, _downsample(points, TIMELINE_POINTS)


def _downsample(points: list[tuple[float, int, str]], limit: int) -> tuple[tuple[float, int, str], ...]:
    """At most about ``limit`` points, keeping the highest point of each bin so peaks survive."""
    if len(points) <= limit:
        return tuple(points)
    size = -(-len(points) // limit)
    return tuple(max(points[i : i + size], key=lambda p: p[1]) for i in range(0, len(points), size))


def _modules(model: nn.Module, recorder: Recorder) -> tuple[ModuleMemory, ...]:
    out = []
    for name, module in model.named_modules():
        key = name or "(model)"
        out.append(ModuleMemory(
            name=key, kind=type(module).__name__, weights_bytes=module_bytes(module),
            activation_peak_bytes=recorder.module_peak.get(key, 0),
            allocated_bytes=recorder.module_allocated.get(key, 0),
        ))
    return tuple(out)
