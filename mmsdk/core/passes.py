"""What a pass is (PassSpec), what it sees when it runs (PassContext) and what it leaves (PassResult)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from mmsdk.core.errors import CalibrationError

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.calibration import CalibrationSet
    from mmsdk.core.session import Session

__all__ = [
    "PASS_KINDS",
    "ApplyFn",
    "CheckContext",
    "CheckFn",
    "PassContext",
    "PassKind",
    "PassResult",
    "PassSpec",
    "RestoreFn",
]

PassKind = Literal["encoder", "projector", "attention", "quantizer"]
PASS_KINDS: tuple[PassKind, ...] = ("encoder", "projector", "attention", "quantizer")

# apply(model, config, context) mutates the model in place and returns JSON-able records (or None).
ApplyFn = Callable[["nn.Module", Any, "PassContext"], Mapping[str, Any] | None]
# check(context) raises IncompatiblePassError / ConfigError before anything is mutated.
CheckFn = Callable[["CheckContext"], None]
# restore(model, config, records, context) rebuilds the pass's module structure on load, without data.
RestoreFn = Callable[["nn.Module", Any, Mapping[str, Any], "PassContext"], None]


@dataclass(frozen=True)
class PassSpec:
    """A named optimization pass: its typed config, how to check, apply and restore it."""

    name: str
    config_cls: type[BaseModel]
    apply: ApplyFn
    summary: str
    check: CheckFn | None = None
    restore: RestoreFn | None = None
    requires: frozenset[str] = frozenset()
    exclusive_group: str | None = None
    repeatable: bool = False
    # True, or a function of the pass's config saying whether this config needs data (awq vs rtn).
    needs_calibration: bool | Callable[[Any], bool] = False
    kind: PassKind | None = None
    # True (or a function of the config saying so) when the pass's model answers the same through
    # mmsdk's fast generate path on CUDA (static cache, chunked prefill, CUDA graphs), checked by the
    # pass's tests; a model with any pass that does not say so generates through transformers' loop.
    fast_generate: bool | Callable[[Any], bool] = False

    def wants_calibration(self, config: Any) -> bool:
        """Whether running this pass with ``config`` needs a calibration set."""
        needs = self.needs_calibration
        return bool(needs(config)) if callable(needs) else bool(needs)

    def takes_fast_generate(self, config: Any) -> bool:
        """Whether a model with this pass (and ``config``) may generate through mmsdk's fast path."""
        safe = self.fast_generate
        return bool(safe(config)) if callable(safe) else bool(safe)

    def with_kind(self, kind: PassKind) -> PassSpec:
        """Return this spec stamped with the kind of the hook that registered it."""
        if self.kind is not None and self.kind != kind:
            msg = f"pass {self.name!r} declares kind {self.kind!r} but was registered through the {kind!r} hook."
            raise ValueError(f"{msg} Register it through mmsdk_register_{self.kind}s or drop `kind=`.")
        return replace(self, kind=kind)


@dataclass(frozen=True)
class CheckContext:
    """What a pass's ``check`` sees: the model, its adapter, the config and the rest of the plan."""

    model: nn.Module
    adapter: ModelAdapter
    config: BaseModel
    before: tuple[str, ...]
    after: tuple[str, ...]
    has_calibration: bool


@dataclass
class PassContext:
    """What a pass's ``apply`` sees besides the model and its config."""

    adapter: ModelAdapter
    session: Session
    processor: Any = None
    calibration: CalibrationSet | None = None
    previous: tuple[PassResult, ...] = ()

    def require_calibration(self, pass_name: str) -> CalibrationSet:
        """Return the calibration set, or raise an error saying how to provide one."""
        if self.calibration is None:
            msg = f"pass {pass_name!r} needs calibration data and none was given."
            fix = "call opt.calibrate(samples) with (image, text) pairs, a Dataset, or a shipped set name."
            raise CalibrationError(msg, fix=fix)
        return self.calibration

    def previous_result(self, name: str) -> PassResult | None:
        """The result of an earlier pass called ``name``, if it ran."""
        return next((r for r in self.previous if r.name == name), None)


@dataclass
class PassResult:
    """What a pass did: its config, JSON-able records, and the bytes and time it took."""

    name: str
    kind: PassKind
    plugin: str
    config: BaseModel
    records: dict[str, Any] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0

    def config_dict(self) -> dict[str, Any]:
        """The config as plain JSON data."""
        return self.config.model_dump(mode="json")
