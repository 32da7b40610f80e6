"""The accuracy harness behind ``mmsdk eval``: a torch model or an exported folder, scored on a task.

A torch model (a name, a Hugging Face folder or a module) is optimized with the requested passes and
scored with :func:`mmsdk.evaluation.vqa_accuracy`. An exported folder is verified and loaded with
the backend that wrote it: the ``torch`` backend gives the module back; any other backend returns a
runtime object, scored through the runtime protocol below.

Runtime protocol (what a backend's ``load`` must return to be scored), tried in this order:
``generate(images, prompts, max_new_tokens=N)`` returning the new token ids of each prompt (the ONNX
Runtime pipeline); ``answer(image, prompt, max_new_tokens=N) -> str``; or a Hugging Face style
``generate(**processor_inputs, max_new_tokens=N, do_sample=False)`` returning ids with or without the
prompt in front; or, for reference implementations, ``logits(inputs) -> [1, L, vocab]`` (greedy by
running the whole sequence again for each token). Prompts are already formatted with the family's
image placeholder. The processor is the runtime's ``processor`` attribute, else the one saved in the
folder.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmsdk.core.errors import ConfigError, UnsupportedInputError

if TYPE_CHECKING:
    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.datasets import VQAExample
    from mmsdk.core.session import Session
    from mmsdk.evaluation import AccuracyResult

__all__ = ["EvalReport", "evaluate", "is_export_folder", "score_examples"]

CHUNK = 64  # examples scored per progress step


@dataclass(frozen=True)
class EvalReport:
    """Accuracy of one model (torch or exported) on one task, with what was applied and how long it took."""

    target: str
    runs_on: str
    task: str
    passes: tuple[str, ...]
    accuracy: float
    correct: int
    count: int
    weights_bytes: int | None
    seconds: float
    groups: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        from dataclasses import asdict

        return asdict(self)


def is_export_folder(path: str | Path) -> bool:
    """True when ``path`` is a folder written by ``export()`` (it holds manifest.json)."""
    return Path(path).is_dir() and (Path(path) / "manifest.json").is_file()


def evaluate(
    target: Any, task: str = "digits-vqa", *, apply: Sequence[str] = (), examples: Sequence[VQAExample] | None = None,
    limit: int | None = None, calibrate: str | None = None, adapter: str | None = None, session: Session | None = None,
    batch_size: int = 32, max_new_tokens: int = 3,
) -> EvalReport:
    """Score ``target`` (model name, HF folder, module, or export folder) on ``task`` (or ``examples``)."""
    from mmsdk.core.session import Session
    from mmsdk.tasks import check_examples, get_task
    from mmsdk.telemetry import span

    session = session or Session.create()
    if examples is None:
        examples = get_task(task, session).examples(session, limit)
    else:
        task = "custom"
        examples = list(examples)[:limit] if limit is not None else list(examples)
        check_examples(examples, source="the examples given")
    with span("mmsdk.eval", task=task, target=str(target), passes=list(apply)):
        if not hasattr(target, "forward") and is_export_folder(target):
            return _evaluate_export(Path(target), task, examples, apply, session, batch_size, max_new_tokens)
        return _evaluate_torch(target, task, examples, apply, calibrate, adapter, session, batch_size, max_new_tokens)


def _evaluate_torch(target: Any, task: str, examples: Sequence[VQAExample], apply: Sequence[str],
                    calibrate: str | None, adapter: str | None, session: Session, batch_size: int,
                    max_new_tokens: int) -> EvalReport:
    from mmsdk.core.memory import module_bytes
    from mmsdk.core.optimizer import Optimizer

    opt = Optimizer(target, adapter=adapter, session=session)
    if calibrate:
        opt.calibrate(calibrate)
    opt.apply(*apply)
    model = opt.model
    start = time.perf_counter()
    result = score_examples(model, opt.processor, opt.adapter, examples, batch_size=batch_size,
                            max_new_tokens=max_new_tokens)
    return _report(opt.source.name, "torch", task, tuple(r.name for r in opt.results), result, module_bytes(model),
                   time.perf_counter() - start)


def _evaluate_export(path: Path, task: str, examples: Sequence[VQAExample], apply: Sequence[str], session: Session,
                     batch_size: int, max_new_tokens: int) -> EvalReport:
    from mmsdk.core.exporting import load
    from mmsdk.core.manifest import Manifest
    from mmsdk.core.memory import module_bytes

    if apply:
        raise ConfigError(
            f"{path} is an exported folder: its passes were applied before export, so --apply {','.join(apply)} "
            "cannot be added here.",
            fix="apply the passes to the torch model and export again (mmsdk optimize ... --apply), then evaluate.",
        )
    manifest = Manifest.read(path)
    adapter = session.adapters.get(manifest.source.adapter)
    passes = tuple(p.name for p in manifest.passes)
    start = time.perf_counter()
    if manifest.backend == "torch":
        loaded = load(path, session=session, with_processor=True)
        result = score_examples(loaded.model, loaded.processor, adapter, examples, batch_size=batch_size,
                                max_new_tokens=max_new_tokens)
        weights: int | None = module_bytes(loaded.model)
    else:
        runtime = load(path, session=session)
        processor = getattr(runtime, "processor", None) or _folder_processor(path)
        result = score_examples(runtime, processor, adapter, examples, batch_size=batch_size,
                                max_new_tokens=max_new_tokens)
        weights = None
    return _report(str(path), f"export:{manifest.backend}", task, passes, result, weights, time.perf_counter() - start)


def _folder_processor(path: Path) -> Any:
    from mmsdk.core.sources import _load_processor

    for folder in (path / "processor", path):
        if folder.is_dir():
            processor = _load_processor(folder)
            if processor is not None:
                return processor
    return None


def _report(target: str, runs_on: str, task: str, passes: tuple[str, ...], result: AccuracyResult,
            weights: int | None, seconds: float) -> EvalReport:
    groups = {name: {"accuracy": g.accuracy, "correct": g.correct, "count": g.count}
              for name, g in result.groups.items()}
    return EvalReport(target=target, runs_on=runs_on, task=task, passes=passes, accuracy=result.accuracy,
                      correct=result.correct, count=result.count, weights_bytes=weights, seconds=seconds,
                      groups=groups)


def score_examples(model: Any, processor: Any, adapter: ModelAdapter, examples: Sequence[VQAExample], *,
                   batch_size: int = 32, max_new_tokens: int = 3) -> AccuracyResult:
    """Exact-match accuracy of ``model`` (a torch module or a runtime) on ``examples``, with a progress bar."""
    from mmsdk.evaluation import AccuracyResult, GroupAccuracy
    from mmsdk.progress import progress

    correct, groups = 0, {}
    with progress("evaluating", total=len(examples)) as advance:
        for start in range(0, len(examples), CHUNK):
            chunk = examples[start : start + CHUNK]
            part = _score_chunk(model, processor, adapter, chunk, batch_size, max_new_tokens)
            correct += part.correct
            for name, group in part.groups.items():
                old = groups.get(name, GroupAccuracy(0, 0))
                groups[name] = GroupAccuracy(old.correct + group.correct, old.count + group.count)
            advance(len(chunk))
    count = len(examples)
    return AccuracyResult(correct / count if count else 0.0, correct, count, dict(sorted(groups.items())))


def _score_chunk(model: Any, processor: Any, adapter: ModelAdapter, chunk: Sequence[VQAExample], batch_size: int,
                 max_new_tokens: int) -> AccuracyResult:
    from mmsdk.evaluation import AccuracyResult, GroupAccuracy, normalize_answer, vqa_accuracy

    group_by = _template_of
    if hasattr(model, "parameters") and hasattr(model, "generate"):
        return vqa_accuracy(model, processor, adapter, chunk, batch_size=batch_size, max_new_tokens=max_new_tokens,
                            group_by=group_by)
    answers = _runtime_answers(model, processor, adapter, chunk, max_new_tokens)
    tally: dict[str, list[int]] = {}
    for example, answer in zip(chunk, answers, strict=True):
        hit = int(normalize_answer(answer) == normalize_answer(example.answer))
        counts = tally.setdefault(group_by(example), [0, 0])
        counts[0] += hit
        counts[1] += 1
    correct = sum(c for c, _ in tally.values())
    return AccuracyResult(correct / len(chunk), correct, len(chunk),
                          {name: GroupAccuracy(c, n) for name, (c, n) in tally.items()})


def _template_of(example: VQAExample) -> str:
    # The digits dataset names its question templates; other datasets are one group.
    try:
        from mmsdk.models.digits import template_of
    except ImportError:
        return "all"
    name = template_of(example.question)
    return "all" if name == "other" else name


def _runtime_answers(runtime: Any, processor: Any, adapter: ModelAdapter, chunk: Sequence[VQAExample],
                     max_new_tokens: int) -> list[str]:
    import inspect

    images = [ex.image for ex in chunk]
    prompts = [adapter.format_prompt(ex.question, processor) for ex in chunk]
    generate = getattr(runtime, "generate", None)
    if generate is not None and processor is not None and "images" in inspect.signature(generate).parameters:
        return _decode_new(generate(images, prompts, max_new_tokens=max_new_tokens), None, processor)
    if hasattr(runtime, "answer"):
        return [runtime.answer(image, prompt, max_new_tokens=max_new_tokens) for image, prompt in
                zip(images, prompts, strict=True)]
    if generate is None and hasattr(runtime, "logits") and processor is not None:
        return [_greedy_by_logits(runtime, processor, image, prompt, max_new_tokens)
                for image, prompt in zip(images, prompts, strict=True)]
    if generate is None or processor is None:
        raise UnsupportedInputError(
            f"the loaded {type(runtime).__name__} can be scored only if it has generate(images, prompts), "
            "answer(image, prompt) or a Hugging Face style generate(**inputs), and a processor.",
            fix="load the folder with a backend whose runtime follows the protocol in mmsdk/harness.py.",
        )
    inputs = processor(images=images, text=prompts, return_tensors="pt")
    output = generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return _decode_new(output, inputs["input_ids"], processor)


def _greedy_by_logits(runtime: Any, processor: Any, image: Any, prompt: str, max_new_tokens: int) -> str:
    """Greedy answer from a runtime that only computes ``logits(inputs) -> [1, L, vocab]`` (a reference
    implementation): the whole sequence is run again for each new token, so keep it to short answers."""
    import torch

    inputs = dict(processor(images=[image], text=[prompt], return_tensors="pt"))
    length = inputs["input_ids"].shape[1]
    new: list[int] = []
    for _ in range(max_new_tokens):
        token = int(runtime.logits(inputs)[0, -1].argmax())
        new.append(token)
        # Per-token inputs grow by one: the token for input_ids, 1 for masks, 0 for type ids.
        for key, value in list(inputs.items()):
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == length:
                fill = token if key == "input_ids" else int(key.endswith("mask"))
                inputs[key] = torch.cat([value, value.new_full((1, 1), fill)], dim=1)
        length += 1
    return processor.batch_decode([new], skip_special_tokens=True)[0]


def _decode_new(output: Any, prompt: Any, processor: Any) -> list[str]:
    """Decode generated ids, dropping the prompt ids when a row starts with them."""
    rows = [list(map(int, row)) for row in output]
    if prompt is not None:
        prompt_rows = [list(map(int, row)) for row in prompt]
        rows = [row[len(p):] if row[: len(p)] == p else row for row, p in zip(rows, prompt_rows, strict=True)]
    return processor.batch_decode(rows, skip_special_tokens=True)
