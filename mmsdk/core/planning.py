"""Validating a list of requested passes against the model and each other, before anything runs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel

from mmsdk.core.errors import IncompatiblePassError
from mmsdk.core.passes import CheckContext, PassSpec

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.session import Session

__all__ = ["PlannedPass", "fast_generate_refusal", "plan_passes"]


@dataclass(frozen=True)
class PlannedPass:
    """A validated pass waiting to run: its spec, config and the plugin that provides it."""

    spec: PassSpec
    config: BaseModel
    plugin: str

    @property
    def name(self) -> str:
        return self.spec.name


def plan_passes(
    session: Session,
    model: nn.Module,
    adapter: ModelAdapter,
    items: Sequence[str | BaseModel],
    *,
    earlier: Sequence[str],
    has_calibration: bool,
) -> list[PlannedPass]:
    """Resolve and validate ``items``; raise on the first problem, so nothing is planned half-way."""
    planned = [_resolve(session, item) for item in items]
    names = [p.name for p in planned]
    capabilities = adapter.capabilities(model)
    for index, item in enumerate(planned):
        before = (*earlier, *names[:index])
        _check_capabilities(session, item.spec, adapter, capabilities, model)
        _check_repeat_and_group(session, item.spec, before)
        if item.spec.check is not None:
            item.spec.check(
                CheckContext(
                    model=model,
                    adapter=adapter,
                    config=item.config,
                    before=tuple(before),
                    after=tuple(names[index + 1 :]),
                    has_calibration=has_calibration,
                )
            )
    return planned


def fast_generate_refusal(session: Session, passes: Iterable[tuple[str, BaseModel]]) -> str | None:
    """Why a model with these passes (name, config) would keep transformers' generate loop: the passes that are not
    declared safe for the fast path (None when every one is). It needs neither the model nor a pass run, so a caller
    that needs the fast path can refuse from the pass names alone."""
    unproven = [name for name, config in passes if not session.passes.get(name).takes_fast_generate(config)]
    return f"passes {unproven} are not declared safe for the fast path" if unproven else None


def _resolve(session: Session, item: str | BaseModel) -> PlannedPass:
    spec, config = session.pass_spec(item)
    return PlannedPass(spec=spec, config=config, plugin=session.passes.plugin_of(spec.name))


def _check_capabilities(
    session: Session, spec: PassSpec, adapter: ModelAdapter, capabilities: frozenset[str], model: nn.Module
) -> None:
    missing = sorted(spec.requires - capabilities)
    if not missing:
        return
    fitting = sorted(s.name for s in session.passes if s.requires <= capabilities)
    raise IncompatiblePassError(
        f"pass {spec.name!r} needs a model with {', '.join(missing)}; this {adapter.name} model "
        f"({type(model).__name__}) has {', '.join(sorted(capabilities)) or 'none of that'}.",
        fix=f"drop {spec.name!r}, or use a model family that has it. Passes that fit this model: {', '.join(fitting)}.",
    )


def _check_repeat_and_group(session: Session, spec: PassSpec, before: Sequence[str]) -> None:
    if spec.name in before and not spec.repeatable:
        raise IncompatiblePassError(
            f"pass {spec.name!r} is already applied or planned on this model; it cannot run twice.",
            fix=f"remove the second {spec.name!r}, or start again from the unoptimized model with one config.",
        )
    if spec.exclusive_group is None:
        return
    rivals = [n for n in before if n != spec.name and _group_of(session, n) == spec.exclusive_group]
    if rivals:
        raise IncompatiblePassError(
            f"passes {rivals[0]!r} and {spec.name!r} both belong to group {spec.exclusive_group!r}; "
            "only one of them can apply to a model.",
            fix=f"keep either {rivals[0]!r} or {spec.name!r}.",
        )


def _group_of(session: Session, name: str) -> str | None:
    return session.passes.get(name).exclusive_group if name in session.passes else None
