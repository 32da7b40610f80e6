"""The Optimizer facade: ``Optimizer(model).apply("int4-kv", "sparse-xattn").export()``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from mmsdk.core.backend import ExportContext
from mmsdk.core.calibration import CalibrationSet
from mmsdk.core.exporting import default_output_path, export
from mmsdk.core.manifest import SourceModel
from mmsdk.core.memory import MemoryReport, PassMemory, component_bytes, module_bytes
from mmsdk.core.passes import PassContext, PassResult
from mmsdk.core.planning import PlannedPass, plan_passes
from mmsdk.core.recipes import RECIPE_PREFIX, Recipe, RecipeStep
from mmsdk.core.session import Session

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.backend import ExportResult

__all__ = ["Optimizer"]


class Optimizer:
    """Plans, runs and exports optimization passes on one model (which it changes in place).

    ``apply`` only validates and plans: every problem is raised before the model is touched.
    The passes run when the optimized model is first needed (``.model``, ``report()``,
    ``export()``), in the order they were applied, so ``calibrate()`` may come before or after.
    """

    def __init__(
        self, model: nn.Module | str, processor: Any = None, adapter: str | None = None, *, session: Session | None = None
    ) -> None:
        self.session = session or Session.create()
        name = model if isinstance(model, str) else None
        if isinstance(model, str):
            from mmsdk.core.sources import load_model

            loaded = load_model(model, session=self.session)
            model, processor = loaded.model, processor if processor is not None else loaded.processor
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
            self.session, self._model, self.adapter, items, earlier=earlier, has_calibration=self.calibration is not None
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
        done = [(r.name, r.config) for r in self.results] + [(p.name, p.config) for p in self._pending]
        steps = tuple(RecipeStep(pass_name=n, config=c.model_dump(mode="json", exclude_defaults=True)) for n, c in done)
        return Recipe(name=name, family=self.adapter.family, steps=steps)

    def calibrate(self, samples: Any, *, limit: int | None = None) -> Optimizer:
        """Use ``samples`` ((image, text) pairs, a Dataset, or a dataset name) for passes that need data."""
        self.calibration = CalibrationSet.from_any(samples, session=self.session, limit=limit)
        return self

    @property
    def model(self) -> nn.Module:
        """The optimized torch module (runs any planned passes first)."""
        self._run_pending()
        return self._model

    def report(self) -> MemoryReport:
        """Weights bytes before, after each pass, and per component now."""
        self._run_pending()
        return MemoryReport(
            baseline_bytes=self._baseline_bytes,
            current_bytes=module_bytes(self._model),
            passes=tuple(PassMemory(r.name, r.bytes_before, r.bytes_after, r.seconds) for r in self.results),
            components=component_bytes(self.adapter.components(self._model)),
        )

    def export(
        self, backend: str = "onnxruntime", path: str | Path | None = None, *, overwrite: bool = False, **options: Any
    ) -> ExportResult:
        """Write the optimized model for ``backend`` into ``path`` (default ./mmsdk-out/<model>)."""
        self.session.backends.get(backend)  # an unknown backend fails before any pass runs
        self._run_pending()
        target = Path(path) if path is not None else default_output_path(self.source.name)
        return export(self.export_context(), backend, target, overwrite=overwrite, options=options)

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
        )

    def _run_pending(self) -> None:
        for planned in self._pending:
            if planned.spec.needs_calibration:
                self._context().require_calibration(planned.name)  # raises before any pass mutates
        while self._pending:
            self.results.append(self._run_one(self._pending.pop(0)))

    def _run_one(self, planned: PlannedPass) -> PassResult:
        before = module_bytes(self._model)
        start = time.perf_counter()
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
