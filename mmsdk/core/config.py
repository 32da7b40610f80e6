"""Base class of every pass and backend config: frozen, unknown fields refused, readable errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from mmsdk.core.errors import ConfigError

__all__ = ["PassConfig", "format_validation_error", "make_config", "parse_pass_call", "split_pass_list"]


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


def parse_pass_call(text: str) -> tuple[str, dict[str, Any]]:
    """``"int4-weight(group_size=64, method=awq)"`` -> ``("int4-weight", {"group_size": 64, "method": "awq"})``.

    Values are read as JSON where they parse (numbers, true/false, null, quoted strings, lists), else
    taken as text; a bare name gives no fields. Lets the CLI and ``apply("...")`` carry configs.
    """
    import json

    name, paren, rest = text.partition("(")
    name = name.strip()
    if not paren:
        return name, {}
    if not rest.rstrip().endswith(")"):
        raise ConfigError(f"pass {text!r} opens '(' without closing it.",
                          fix=f"write {name}(field=value, ...), e.g. int4-weight(group_size=64).")
    fields: dict[str, Any] = {}
    for item in _split_top_level(rest.rstrip()[:-1]):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise ConfigError(f"pass {text!r}: {item.strip()!r} is not field=value.",
                              fix=f"write {name}(field=value, ...), e.g. int4-weight(group_size=64).")
        try:
            fields[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            fields[key.strip()] = value.strip()
    return name, fields


def split_pass_list(text: str | None) -> list[str]:
    """``"a, b(x=1, y=2),c"`` -> ``["a", "b(x=1, y=2)", "c"]``: commas inside parentheses or brackets stay."""
    return [item.strip() for item in _split_top_level(text or "") if item.strip()]


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += char in "(["
        depth -= char in ")]"
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return [item for item in items if item.strip()]
