"""Ahead-of-time compilation of a Triton kernel for sm_90 without a GPU: the signature Triton's compiler wants.

A launch fills a kernel's defaulted constexpr parameters from their defaults; ``triton.compile`` on an ``ASTSource``
does not, and takes any parameter missing from the signature's constexprs as a runtime argument, which turns a
constexpr branch into a runtime one (two return types, or code that only compiles under the other branch). So every
offline build fills them here, as a launch would.
"""

from __future__ import annotations

import inspect
from typing import Any


def launch_constants(kernel: Any, constants: dict[str, Any]) -> dict[str, Any]:
    """``constants`` plus the default of every constexpr parameter of ``kernel`` that it leaves out."""
    filled = dict(constants)
    for name, parameter in inspect.signature(kernel.fn).parameters.items():
        if (name not in filled and parameter.default is not inspect.Parameter.empty
                and "constexpr" in str(parameter.annotation)):
            filled[name] = parameter.default
    return filled


def aot_signature(kernel: Any, constants: dict[str, Any], types: dict[str, str],
                  default: str = "i32") -> tuple[dict[str, str], dict[str, Any]]:
    """(signature, constants) for ``ASTSource(kernel, signature, constants)``: the constants with the kernel's
    constexpr defaults filled in (:func:`launch_constants`), every other parameter typed by ``types`` or
    ``default``."""
    filled = launch_constants(kernel, constants)
    names = list(inspect.signature(kernel.fn).parameters)
    return {name: "constexpr" if name in filled else types.get(name, default) for name in names}, filled
