"""The generation settings a ``generate()`` call runs with, resolved as transformers' generate resolves them.

Fast generate decides what a call does (sampling, the repetition penalty, how many tokens) before transformers sees
it, so it must read each setting from the same place transformers would: the call's keyword, else the model's
generation config, else the defaults transformers falls back on when neither sets it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["generation_setting", "transformers_defaults"]


def transformers_defaults(model: Any) -> dict[str, Any]:
    """The defaults transformers' generate uses for settings neither the call nor the generation config sets
    (``GenerationConfig._get_default_generation_params``; empty in transformers releases without it)."""
    defaults = getattr(type(model.generation_config), "_get_default_generation_params", None)
    return dict(defaults()) if callable(defaults) else {}


def generation_setting(model: Any, kwargs: dict[str, Any], name: str, fallback: Any = None) -> Any:
    """The value of ``name`` the call runs with: the call's (None included: it switches a warper off), else the
    generation config's unless None, else transformers' default, else ``fallback`` (for releases without one)."""
    if name in kwargs:
        return kwargs[name]
    value = getattr(model.generation_config, name, None)
    if value is not None:
        return value
    return transformers_defaults(model).get(name, fallback)
