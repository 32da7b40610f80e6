"""Session: one plugin manager and the registries it filled. No module-level state anywhere."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from mmsdk.core.backend import Backend, LowerTarget
from mmsdk.core.config import make_config, parse_pass_call
from mmsdk.core.datasets import DatasetSource
from mmsdk.core.errors import ConfigError, NoAdapterError, UnknownNameError
from mmsdk.core.passes import PASS_KINDS, PassSpec
from mmsdk.core.plugins import PluginOrigin, create_plugin_manager
from mmsdk.core.recipes import RECIPE_PREFIX, Recipe
from mmsdk.core.registry import Registrar, Registry, suggest
from mmsdk.core.sources import ModelSource

if TYPE_CHECKING:
    import pluggy
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter

__all__ = ["PluginInfo", "Session"]


@dataclass(frozen=True)
class PluginInfo:
    """A plugin and what it contributed, for `mmsdk plugins`."""

    origin: PluginOrigin
    contributions: tuple[tuple[str, str], ...] = field(default=())  # (kind, name)


class Session:
    """Owns a plugin manager and the adapter, pass, backend and model registries built from it."""

    def __init__(self, pm: pluggy.PluginManager, origins: Mapping[str, PluginOrigin]) -> None:
        self.pm = pm
        self.origins = dict(origins)
        self.adapters: Registry[ModelAdapter] = Registry("adapter")
        self.passes: Registry[PassSpec] = Registry("pass", plural="passes")
        self.backends: Registry[Backend] = Registry("backend")
        self.models: Registry[ModelSource] = Registry("model")
        self.datasets: Registry[DatasetSource] = Registry("dataset")
        self.recipes: Registry[Recipe] = Registry("recipe")
        self._collect()

    @classmethod
    def create(
        cls,
        *,
        autoload: bool | None = None,
        extra: Iterable[object] = (),
        disabled: Iterable[str] | None = None,
    ) -> Session:
        """A fresh session: built-ins, installed plugins (unless ``autoload`` is False) and ``extra``."""
        pm, origins = create_plugin_manager(autoload=autoload, extra=extra, disabled=disabled)
        return cls(pm, origins)

    def _collect(self) -> None:
        hooks = self.pm.hook
        self._call_each(hooks.mmsdk_register_adapters, self.adapters)
        for kind in PASS_KINDS:
            hook = getattr(hooks, f"mmsdk_register_{'attention' if kind == 'attention' else kind + 's'}")
            self._call_each(hook, self.passes, prepare=lambda spec, kind=kind: spec.with_kind(kind))
        self._call_each(hooks.mmsdk_register_backends, self.backends)
        self._call_each(hooks.mmsdk_register_models, self.models)
        self._call_each(hooks.mmsdk_register_datasets, self.datasets)
        self._call_each(hooks.mmsdk_register_recipes, self.recipes)

    def _call_each(self, hook: Any, registry: Registry[Any], prepare: Any = None) -> None:
        # Call every implementation with a registrar bound to its plugin, so provenance is exact.
        for impl in hook.get_hookimpls():
            impl.function(register=Registrar(registry, impl.plugin_name, prepare))

    # --- lookups -------------------------------------------------------------------------------
    def adapt(self, model: nn.Module, adapter: str | None = None) -> ModelAdapter:
        """The adapter for ``model``: the one named, else the first that matches (plugins before built-ins)."""
        if adapter is not None:
            return self._accept(self.adapters.get(adapter), model)
        builtin_last = sorted(
            self.adapters.entries(), key=lambda entry: self.origins.get(entry.plugin, _BUILTIN).builtin
        )
        for entry in builtin_last:
            if entry.item.matches(model):
                return self._accept(entry.item, model)
        known = ", ".join(f"{a.name} ({', '.join(sorted(a.architectures))})" for a in self.adapters)
        raise NoAdapterError(
            f"No adapter matches {type(model).__name__}. Known adapters: {known or '(none)'}.",
            fix="pass adapter='<name>' if the model is a known family under another class name, "
            "or install a plugin that provides an adapter for it (docs/adapters.md).",
        )

    @staticmethod
    def _accept(adapter: ModelAdapter, model: nn.Module) -> ModelAdapter:
        reason = adapter.refuse(model)
        if reason:
            raise NoAdapterError(f"adapter {adapter.name!r} recognises {type(model).__name__} but: {reason}")
        return adapter

    def pass_spec(self, item: str | BaseModel) -> tuple[PassSpec, BaseModel]:
        """Resolve a pass name (default config), ``"name(field=value, ...)"`` or a config object to (spec, config)."""
        if isinstance(item, str):
            name, fields = parse_pass_call(item)  # "name" or "name(field=value, ...)"
            spec = self.passes.get(name)
            return spec, make_config(spec.config_cls, fields, what=f"pass {name!r}")
        if isinstance(item, BaseModel):
            matches = [spec for spec in self.passes if type(item) is spec.config_cls]
            if not matches:
                raise UnknownNameError(
                    f"{type(item).__name__} is not the config of any registered pass.",
                    fix="install the plugin that defines it, or pass the pass name as a string.",
                )
            if len(matches) > 1:
                names = ", ".join(spec.name for spec in matches)
                raise ConfigError(
                    f"{type(item).__name__} is the config of several passes ({names}), so it cannot say which to run.",
                    fix="give each pass its own config class (a subclass is enough).",
                )
            return matches[0], item
        raise ConfigError(
            f"apply() takes pass names or pass config objects, not {type(item).__name__}.",
            fix='write opt.apply("int4-kv") or opt.apply(SomePassConfig(...)).',
        )

    def recipe(self, name: str, model: nn.Module, adapter: ModelAdapter) -> Recipe:
        """The recipe ``name`` for this model: the adapter's own first, then plugin recipes of its family."""
        name = name.removeprefix(RECIPE_PREFIX)
        own = adapter.recipes(model)
        if name in own:
            return own[name]
        fitting = {r.name: r for r in self.recipes if r.family in (None, adapter.family)}
        if name in fitting:
            return fitting[name]
        known = sorted({*own, *fitting})
        raise UnknownNameError(
            f"Unknown recipe {name!r} for a {adapter.name} model.{suggest(name, known)} "
            f"Known recipes: {', '.join(known) or '(none)'}.",
            fix="use one of them as apply('recipe:NAME'), or load your own with Recipe.from_file(path).",
        )

    def lower(self, module: nn.Module, target: LowerTarget) -> Any:
        """Ask the plugins how ``target.backend`` should emit ``module`` (None if nobody knows)."""
        return self.pm.hook.mmsdk_lower(module=module, target=target)

    def plugin_infos(self) -> list[PluginInfo]:
        """Every registered plugin with what it contributed, built-ins first."""
        contributions: dict[str, list[tuple[str, str]]] = {name: [] for name in self.origins}
        for kind, registry in (
            ("adapter", self.adapters),
            ("pass", self.passes),
            ("backend", self.backends),
            ("model", self.models),
            ("dataset", self.datasets),
            ("recipe", self.recipes),
        ):
            for entry in registry.entries():
                label = f"{entry.item.kind} pass" if kind == "pass" else kind
                contributions.setdefault(entry.plugin, []).append((label, entry.item.name))
        return [
            PluginInfo(self.origins.get(name, PluginOrigin(name, "?", "?", False)), tuple(items))
            for name, items in contributions.items()
        ]


_BUILTIN = PluginOrigin("", "", "", builtin=True)
