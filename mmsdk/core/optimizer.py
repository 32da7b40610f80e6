"""The Optimizer facade: ``Optimizer(model).apply("int4-kv", "sparse-xattn").export()``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from mmsdk.core.backend import ExportContext
from mmsdk.core.calibration import CalibrationSet
from mmsdk.core.exporting import default_output_path, export, merged_calibration
from mmsdk.core.manifest import SourceModel
from mmsdk.core.memory import MemoryReport, PassMemory, component_bytes, module_bytes
from mmsdk.core.passes import PassContext, PassResult
from mmsdk.core.planning import PlannedPass, fast_generate_refusal, plan_passes
from mmsdk.core.recipes import RECIPE_PREFIX, Recipe, RecipeStep
from mmsdk.core.session import Session
from mmsdk.core.sources import LoadedModel

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.backend import ExportResult
    from mmsdk.profiling.results import Profile

__all__ = ["Optimizer"]


class Optimizer:
    """Plans, runs and exports optimization passes on one model (which it changes in place).

    ``apply`` only validates and plans: every problem is raised before the model is touched.
    The passes run when the optimized model is first needed (``.model``, ``report()``,
    ``export()``), in the order they were applied, so ``calibrate()`` may come before or after.
    """

    def __init__(
        self,
        model: nn.Module | str | LoadedModel,
        processor: Any = None,
        adapter: str | None = None,
        *,
        session: Session | None = None,
    ) -> None:
        self.session = session or Session.create()
        name = model if isinstance(model, str) else None
        if isinstance(model, str):
            from mmsdk.core.sources import load_model

            model = load_model(model, session=self.session)
        if isinstance(model, LoadedModel):  # what load_model and mmsdk.models.tiny return: the model and its processor
            name = name or model.name
            model, processor = model.model, processor if processor is not None else model.processor
        self._model = model
        self.processor = processor
        self.adapter = self.session.adapt(model, adapter)
        self.source = SourceModel(
            name=name or str(getattr(model, "name_or_path", "") or type(model).__name__),
            architecture=type(model).__name__,
            adapter=self.adapter.name,
            family=self.adapter.family,
            description=self.adapter.describe(model),
        )
        self.calibration: CalibrationSet | None = None
        self.results: list[PassResult] = []
        self._pending: list[PlannedPass] = []
        self._baseline_bytes = module_bytes(model)

    def apply(self, *passes: str | BaseModel | Recipe) -> Optimizer:
        """Validate passes (names, config objects, ``"recipe:NAME"`` or Recipe objects) and plan them; returns self."""
        items = [item for entry in passes for item in self._expand(entry)]
        earlier = [r.name for r in self.results] + [p.name for p in self._pending]
        planned = plan_passes(
            self.session, self._model, self.adapter, items, earlier=earlier,
            has_calibration=self.calibration is not None,
        )
        self._pending.extend(planned)
        return self

    def _expand(self, entry: str | BaseModel | Recipe) -> list[str | BaseModel]:
        if isinstance(entry, str) and entry.startswith(RECIPE_PREFIX):
            entry = self.session.recipe(entry, self._model, self.adapter)
        if isinstance(entry, Recipe):
            return list(entry.configs(self.session))
        return [entry]

    def recipe(self, name: str = "custom") -> Recipe:
        """The passes applied and planned so far, with their configs, as a Recipe you can save."""
        steps = tuple(RecipeStep(pass_name=n, config=c.model_dump(mode="json", exclude_defaults=True))
                      for n, c in self._passes_so_far())
        return Recipe(name=name, family=self.adapter.family, steps=steps)

    def _passes_so_far(self) -> list[tuple[str, BaseModel]]:
        """(name, config) of every pass applied, then of every pass planned, in order."""
        return [(r.name, r.config) for r in self.results] + [(p.name, p.config) for p in self._pending]

    def calibrate(self, samples: Any, *, limit: int | None = None) -> Optimizer:
        """Use ``samples`` ((image, text) pairs, a Dataset, or a dataset name) for passes that need data."""
        self.calibration = CalibrationSet.from_any(samples, session=self.session, limit=limit)
        return self

    @property
    def model(self) -> nn.Module:
        """The optimized torch module (runs any planned passes first); on CUDA its generate() is the fast path."""
        self._run_pending()
        from mmsdk.kernels.fast_generate import install

        install(self._model, self.adapter, refusal=self.fast_generate_refusal())
        return self._model

    def fast_generate_refusal(self) -> str | None:
        """Why the optimized model's generate() will keep transformers' loop because of its passes (applied or
        planned; None when every one is declared safe for the fast path). Cheap: it runs no pass, so a caller that
        needs the fast path (``mmsdk tune``) can refuse before minutes of packing weights."""
        return fast_generate_refusal(self.session, self._passes_so_far())

    def report(
        self, *, measure: bool = False, sample: Any = None, device: str | None = None, max_new_tokens: int = 8
    ) -> MemoryReport:
        """Weights bytes before, after each pass, and per component now.

        Cheap by default (it only counts parameter and buffer bytes). ``measure=True`` also runs
        :meth:`profile` (a generation before and after each pass not yet run) and attaches it.
        """
        profile = self.profile(sample, device=device, max_new_tokens=max_new_tokens) if measure else None
        self._run_pending()
        return MemoryReport(
            baseline_bytes=self._baseline_bytes,
            current_bytes=module_bytes(self._model),
            passes=tuple(PassMemory(r.name, r.bytes_before, r.bytes_after, r.seconds) for r in self.results),
            components=component_bytes(self.adapter.components(self._model)),
            profile=profile,
        )

    def profile(
        self, sample: Any = None, *, device: str | None = None, max_new_tokens: int = 8, modules: bool = True
    ) -> Profile:
        """Measure a greedy generation now and again after each planned pass, running the passes.

        ``sample`` is (image, question) (default: a digits test example, or a synthetic image).
        Each step reports weights, KV cache and activation bytes, and every stage's peak and time
        (vision encode, projector, prefill, decode). ``device`` is ``cpu`` or ``cuda`` (default:
        where the model is); the model is moved there. See docs/profiling.md.
        """
        from mmsdk.profiling.measure import measure_run, resolve_device, resolve_sample
        from mmsdk.profiling.results import Profile
        from mmsdk.progress import progress

        target = resolve_device(device or next(self._model.parameters()).device.type)
        prompt = resolve_sample(sample, self.session, max_new_tokens)
        self._check_pending()

        def measure() -> Any:
            names = tuple(r.name for r in self.results)
            label = f"+ {names[-1]}" if names else "unoptimized"
            return measure_run(self._model, self.processor, self.adapter, prompt, device=target, label=label,
                               passes=names, modules=modules)

        with progress("profiling", total=len(self._pending) + 1) as advance:
            runs = [measure()]
            advance(1)
            while self._pending:
                self.results.append(self._run_one(self._pending.pop(0)))
                runs.append(measure())
                advance(1)
        return Profile(model=self.source.name, adapter=self.adapter.name, device=target,
                       question=prompt.question, runs=tuple(runs))

    def export(
        self, backend: str = "onnxruntime", path: str | Path | None = None, *, overwrite: bool = False, **options: Any
    ) -> ExportResult:
        """Write the optimized model for ``backend`` into ``path`` (default ./mmsdk-out/<model>)."""
        self.session.backends.get(backend)  # an unknown backend fails before any pass runs
        self._run_pending()
        target = Path(path) if path is not None else default_output_path(self.source.name)
        context = self.export_context()
        return export(context, backend, target, overwrite=overwrite, options=options, calibration=context.calibration)

    def export_context(self) -> ExportContext:
        """What backends see: the optimized model, its adapter and every pass result."""
        self._run_pending()
        return ExportContext(
            model=self._model,
            adapter=self.adapter,
            results=tuple(self.results),
            source=self.source,
            session=self.session,
            processor=self.processor,
            calibration=merged_calibration(self.results),
        )

    def _check_pending(self) -> None:
        """Raise before any pass mutates if a pending pass needs calibration data and none was given."""
        for planned in self._pending:
            if planned.spec.wants_calibration(planned.config):
                self._default_calibration()
                self._context().require_calibration(planned.name)

    def _run_pending(self) -> None:
        self._check_pending()
        while self._pending:
            self.results.append(self._run_one(self._pending.pop(0)))

    def _default_calibration(self) -> None:
        # mmsdk's embedded processors name the dataset their models calibrate on by default.
        name = getattr(self.processor, "default_calibration", None)
        if self.calibration is None and name and name in self.session.datasets:
            self.calibrate(name)

    def _run_one(self, planned: PlannedPass) -> PassResult:
        from mmsdk.telemetry import span

        before = module_bytes(self._model)
        start = time.perf_counter()
        with span("mmsdk.optimize.pass", name=planned.name, kind=planned.spec.kind, plugin=planned.plugin):
            records = planned.spec.apply(self._model, planned.config, self._context()) or {}
        assert planned.spec.kind is not None  # stamped by the registrar
        return PassResult(
            name=planned.name,
            kind=planned.spec.kind,
            plugin=planned.plugin,
            config=planned.config,
            records=dict(records),
            bytes_before=before,
            bytes_after=module_bytes(self._model),
            seconds=time.perf_counter() - start,
        )

    def _context(self) -> PassContext:
        return PassContext(
            adapter=self.adapter,
            session=self.session,
            processor=self.processor,
            calibration=self.calibration,
            previous=tuple(self.results),
        )
