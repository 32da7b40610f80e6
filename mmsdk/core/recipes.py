"""Recipes: a build (pass names + configs, in order) as data that can be saved, shared and replayed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mmsdk.core.config import make_config
from mmsdk.core.errors import ConfigError, UnknownNameError

if TYPE_CHECKING:
    from mmsdk.core.session import Session

__all__ = ["RECIPE_PREFIX", "Recipe", "RecipeStep"]

RECIPE_PREFIX = "recipe:"


class RecipeStep(BaseModel):
    """One pass of a recipe: its name, its config fields, and where it was written (for errors)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    pass_name: str = Field(alias="pass", description="The registered pass name.")
    config: dict[str, Any] = Field(default_factory=dict, description="Config fields; omitted ones take defaults.")
    line: int | None = Field(default=None, exclude=True, description="Line in the recipe file, if read from one.")


class Recipe(BaseModel):
    """A named, ordered list of passes with configs; ``Optimizer.apply(recipe)`` validates it as a whole."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    family: str | None = Field(default=None, description="Model family it was written for (None: any).")
    steps: tuple[RecipeStep, ...]

    @classmethod
    def from_passes(cls, name: str, items: list[str | BaseModel], *, session: Session, **fields: Any) -> Recipe:
        """A recipe from pass names and/or config objects (names take default configs)."""
        steps = []
        for item in items:
            spec, config = session.pass_spec(item)
            steps.append(RecipeStep(pass_name=spec.name, config=config.model_dump(mode="json", exclude_defaults=True)))
        return cls(name=name, steps=tuple(steps), **fields)

    @classmethod
    def from_yaml(cls, text: str, *, source: str = "<yaml>") -> Recipe:
        """Parse YAML (``name``, ``description``, ``steps: [{pass: ..., config: {...}}]``)."""
        import yaml

        try:
            root = yaml.compose(text)
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{source} is not valid YAML: {err}", fix="fix the syntax at the line shown.") from err
        lines = _step_lines(root)
        return cls._validate(data, source, lines)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<json>") -> Recipe:
        """Parse the JSON form written by :meth:`save`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{source} is not valid JSON: {err}", fix="fix the syntax at the line shown.") from err
        return cls._validate(data, source, [])

    @classmethod
    def from_file(cls, path: str | Path) -> Recipe:
        """Read a ``.yaml``/``.yml`` or ``.json`` recipe file."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe file {path} does not exist.", fix="check the path, or use recipe:NAME.")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            return cls.from_yaml(text, source=str(path))
        if path.suffix == ".json":
            return cls.from_json(text, source=str(path))
        raise ConfigError(f"recipe file {path} has suffix {path.suffix!r}.", fix="name it .yaml, .yml or .json.")

    @classmethod
    def _validate(cls, data: Any, source: str, lines: list[int]) -> Recipe:
        if not isinstance(data, dict) or "steps" not in data:
            raise ConfigError(f"{source} has no 'steps' list.", fix="write steps: [{pass: int4-weight}, ...].")
        steps = data.get("steps") or []
        try:
            parsed = [
                RecipeStep.model_validate({**step, "line": lines[i] if i < len(lines) else None})
                if isinstance(step, dict) else RecipeStep(pass_name=str(step))
                for i, step in enumerate(steps)
            ]
            return cls.model_validate({**data, "steps": parsed, "name": data.get("name", Path(source).stem)})
        except ValidationError as err:
            raise ConfigError(f"{source}: {err}", fix="each step is {pass: NAME, config: {...}}.") from err

    def save(self, path: str | Path) -> Path:
        """Write as YAML (``.yaml``/``.yml``) or JSON (``.json``); returns the path."""
        import yaml

        path = Path(path)
        data = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        if path.suffix in (".yaml", ".yml"):
            path.write_text(yaml.safe_dump(data, sort_keys=False))
        else:
            path.write_text(json.dumps(data, indent=2) + "\n")
        return path

    def configs(self, session: Session) -> list[BaseModel]:
        """Each step's typed config; a bad entry is an error naming its position, line and pass."""
        out = []
        for index, step in enumerate(self.steps, start=1):
            where = f"recipe {self.name!r} step {index}" + (f" (line {step.line})" if step.line else "")
            try:
                spec = session.passes.get(step.pass_name)
            except UnknownNameError as err:
                raise UnknownNameError(f"{where}: {err.problem}", fix=err.fix) from None
            out.append(make_config(spec.config_cls, step.config, what=f"{where}, pass {step.pass_name!r}"))
        return out


def _step_lines(root: Any) -> list[int]:
    """1-based line of each item under the top-level ``steps`` key of a composed YAML document."""
    if root is None or not hasattr(root, "value") or not isinstance(root.value, list):
        return []
    for key, value in root.value:
        if getattr(key, "value", None) == "steps" and isinstance(getattr(value, "value", None), list):
            return [item.start_mark.line + 1 for item in value.value]
    return []
