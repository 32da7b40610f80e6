"""Typed name registries: each entry remembers which plugin added it."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from mmsdk.core.errors import DuplicateNameError, UnknownNameError

__all__ = ["Entry", "Named", "Registrar", "Registry", "suggest"]


class Named(Protocol):
    """Anything registered by name."""

    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


@dataclass(frozen=True)
class Entry(Generic[T]):
    """A registered item and the plugin that added it."""

    item: T
    plugin: str


def suggest(name: str, known: list[str]) -> str:
    """Return ' Did you mean ...?' for close matches of ``name`` in ``known`` (or '')."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


class Registry(Generic[T]):
    """Name -> item map for one extension kind (adapters, passes, backends, models)."""

    def __init__(self, kind: str, *, plural: str | None = None) -> None:
        self.kind = kind
        self.plural = plural or f"{kind}s"
        self._entries: dict[str, Entry[T]] = {}

    def add(self, item: T, *, plugin: str) -> None:
        """Register ``item``; a name already taken raises and names both plugins."""
        old = self._entries.get(item.name)
        if old is not None:
            msg = (
                f"{self.kind} {item.name!r} from plugin {plugin!r} clashes with the one "
                f"already registered by plugin {old.plugin!r}."
            )
            fix = (
                f"uninstall or disable one of them (MMSDK_DISABLE_PLUGINS={plugin}), "
                "or give the new one another name."
            )
            raise DuplicateNameError(msg, fix=fix)
        self._entries[item.name] = Entry(item, plugin)

    def get(self, name: str) -> T:
        """Return the item called ``name``, or raise with close matches and the known names."""
        return self.entry(name).item

    def entry(self, name: str) -> Entry[T]:
        """Return the entry (item and provenance) called ``name``."""
        try:
            return self._entries[name]
        except KeyError:
            pass
        known = sorted(self._entries)
        msg = (
            f"Unknown {self.kind} {name!r}.{suggest(name, known)} "
            f"Known {self.plural}: {', '.join(known) or '(none)'}."
        )
        raise UnknownNameError(
            msg, fix="use one of the known names, or install the plugin that provides it (see `mmsdk plugins`)."
        ) from None

    def plugin_of(self, name: str) -> str:
        """Return the name of the plugin that registered ``name``."""
        return self.entry(name).plugin

    def names(self) -> list[str]:
        """Return all registered names, sorted."""
        return sorted(self._entries)

    def entries(self) -> list[Entry[T]]:
        """Return all entries in registration order."""
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[T]:
        return iter(entry.item for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


class Registrar(Generic[T]):
    """The ``register`` callable a plugin receives: ``register(item)`` adds under that plugin's name."""

    def __init__(self, registry: Registry[T], plugin: str, prepare: Callable[[T], T] | None = None) -> None:
        self._registry = registry
        self._plugin = plugin
        self._prepare = prepare

    @property
    def plugin(self) -> str:
        """The plugin this registrar records as the source of what it adds."""
        return self._plugin

    def __call__(self, item: T) -> None:
        """Register one item on behalf of this plugin."""
        self._registry.add(self._prepare(item) if self._prepare else item, plugin=self._plugin)

    add = __call__
