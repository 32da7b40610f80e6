"""Base class of every pass and backend config: frozen, unknown fields refused, readable errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from mmsdk.core.errors import ConfigError

__all__ = ["PassConfig", "format_validation_error", "make_config"]


class PassConfig(BaseModel):
    """Base of pass configs. Invalid values raise ConfigError naming the field and the valid ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            cls = type(self)
            raise ConfigError(format_validation_error(err, what=cls.__name__, cls=cls)) from None


def make_config(cls: type[BaseModel], data: Mapping[str, Any], *, what: str) -> BaseModel:
    """Validate ``data`` into ``cls``; a bad field becomes a ConfigError naming the field and the fix."""
    try:
        return cls.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, what=what, cls=cls)) from None


def format_validation_error(err: ValidationError, *, what: str, cls: type[BaseModel]) -> str:
    """One readable message for a pydantic error: the fields, what is wrong, and the valid fields."""
    lines = []
    for problem in err.errors():
        field_name = ".".join(str(part) for part in problem["loc"]) or "(config)"
        lines.append(f"{field_name}: {problem['msg']} (got {problem.get('input')!r})")
    fields = ", ".join(cls.model_fields) or "(none)"
    return (
        f"Invalid config for {what}: "
        + "; ".join(lines)
        + f". Valid fields of {cls.__name__}: {fields}. Fix: correct the field(s) above."
    )
