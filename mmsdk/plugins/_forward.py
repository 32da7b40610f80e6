"""Composable forward overrides: several passes may wrap one module, one may replace what it computes.

A module's ``forward`` becomes a dispatcher that calls its *body* (the class's forward unless a
pass installed another, e.g. a fused decoder layer) through any number of *wrappers* (e.g. token
pruning's gathers). Wrappers look the body up at call time, so the order in which passes install
them does not matter. ``rebind_global`` builds a copy of a forward function that sees another
object under one global name (how a fused RoPE op or a sparse attention function reaches code
that calls a module-level function), keeping the function's decorators.

``plus_residual(module, x, residual)`` is ``residual + module(x)``; a module may compute it in fewer
kernels (a decoder layer's last residual add folded into its MLP's down projection): a class
through a ``residual_forward(x, residual)`` method, an instance through :func:`set_residual_body`.
Either must be bitwise equal to the two steps; it is skipped while anything else observes the
module's calls (forward wrappers or hooks) or once another body replaced what the module computes.
:func:`normed_residual_body` is the same for ``residual + module(norm(x))`` (an RMSNorm folded into the
module's first kernels, or applied from the statistics the store of ``x`` left, where rounding may differ:
mmsdk.kernels.norm_fold), installed by :func:`set_normed_residual_body`.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = [
    "add_forward_wrapper",
    "body_function",
    "foreign_forward",
    "has_forward_body",
    "innermost_override",
    "module_body",
    "normed_residual_body",
    "observed",
    "plus_residual",
    "rebind_global",
    "referenced_global",
    "set_forward_body",
    "set_normed_residual_body",
    "set_residual_body",
]

BODY_ATTR = "_mmsdk_body"
_DISPATCH_ATTR = "_mmsdk_dispatch"
_RESIDUAL_ATTR = "_mmsdk_residual_body"
_NORMED_RESIDUAL_ATTR = "_mmsdk_normed_residual_body"


def module_body(module: nn.Module) -> Callable[..., Any]:
    """What the module computes now: an installed body, else the class's forward bound to it."""
    body = module.__dict__.get(BODY_ATTR)
    return body if body is not None else types.MethodType(type(module).forward, module)


def has_forward_body(module: nn.Module) -> bool:
    """True when a pass (or another component) already replaced what the module computes."""
    return module.__dict__.get(BODY_ATTR) is not None or foreign_forward(module) is not None


def foreign_forward(module: nn.Module) -> Callable[..., Any] | None:
    """A forward override another component installed (not through these helpers), or None."""
    forward = module.__dict__.get("forward")
    return None if forward is None or module.__dict__.get(_DISPATCH_ATTR) else forward


def body_function(module: nn.Module) -> Callable[..., Any]:
    """The plain function behind :func:`module_body` (for :func:`rebind_global`)."""
    body = module_body(module)
    return body.__func__ if isinstance(body, types.MethodType) else body


def _refuse_deepcopy(memo: Any) -> Any:
    from mmsdk.core.errors import UnsupportedInputError

    raise UnsupportedInputError(
        "this module carries forward overrides installed by mmsdk passes, which refer to the original model, "
        "so a deep copy would silently share their state.",
        fix="deep-copy the model before the passes run (Optimizer runs them at .model/.export()), or export it "
        "and load another copy with mmsdk.load(folder).",
    )


def _ensure_dispatch(module: nn.Module) -> None:
    if module.__dict__.get(_DISPATCH_ATTR):
        return
    module.__dict__["__deepcopy__"] = _refuse_deepcopy  # copy.deepcopy looks it up on the instance
    foreign = foreign_forward(module)
    if foreign is not None and BODY_ATTR not in module.__dict__:
        module.__dict__[BODY_ATTR] = foreign  # an override installed elsewhere becomes the body we wrap

    @functools.wraps(type(module).forward.__get__(module))
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return module_body(module)(*args, **kwargs)

    module.forward = dispatch
    module.__dict__[_DISPATCH_ATTR] = dispatch


def set_forward_body(module: nn.Module, body: Callable[..., Any]) -> None:
    """Make ``body`` (a callable taking the forward's arguments) what the module computes."""
    _ensure_dispatch(module)
    module.__dict__[BODY_ATTR] = body


def set_residual_body(module: nn.Module, body: Callable[..., Any]) -> None:
    """Make ``body(x, residual)`` how :func:`plus_residual` computes ``residual + module(x)`` while the module's
    current body (:func:`module_body`) stays what it computes."""
    module.__dict__[_RESIDUAL_ATTR] = (module.__dict__.get(BODY_ATTR), body)


def set_normed_residual_body(module: nn.Module, body: Callable[..., Any]) -> None:
    """Make ``body(x, norm, residual, statistics=None, leave=None)`` compute ``residual + module(norm(x))`` while the
    module's current body stays what it computes (:func:`normed_residual_body`); ``statistics``, where given, are what
    the store of ``x`` left for ``norm`` (mmsdk.kernels.norm_fold.NormStatistics), and ``leave`` the RMSNorm that
    reads the sum, for the module's last store to leave its statistics where it can (as :func:`plus_residual`)."""
    module.__dict__[_NORMED_RESIDUAL_ATTR] = (module.__dict__.get(BODY_ATTR), body)


def normed_residual_body(module: nn.Module) -> Callable[..., Any] | None:
    """The module's ``body(x, norm, residual[, statistics])`` (:func:`set_normed_residual_body`), or None when it has
    none, another body replaced what the module computes since, or something else observes its calls."""
    installed = module.__dict__.get(_NORMED_RESIDUAL_ATTR)
    if installed is None or installed[0] is not module.__dict__.get(BODY_ATTR) or observed(module):
        return None
    return installed[1]


def plus_residual(module: nn.Module, x: Any, residual: Any, leave: nn.Module | None = None) -> Any:
    """``residual + module(x)``, through the module's residual forward where it has a valid one (module docstring).
    ``leave`` (the RMSNorm that reads the sum) goes to that forward as ``leave=`` when given: ask it only of a class
    whose ``residual_forward`` takes it (mmsdk.plugins.quantizers.int4_linear.Int4Linear)."""
    state = module.__dict__
    installed = state.get(_RESIDUAL_ATTR)
    body = None
    if installed is not None and installed[0] is state.get(BODY_ATTR):
        body = installed[1]
    elif installed is None and not has_forward_body(module):
        body = getattr(module, "residual_forward", None)
    if body is None or observed(module):
        return residual + module(x)
    return body(x, residual) if leave is None else body(x, residual, leave=leave)


def observed(module: nn.Module) -> bool:
    """True when something besides the module's body sees its calls: forward wrappers, or forward hooks."""
    from torch.nn.modules import module as torch_module

    forward = module.__dict__.get("forward")
    wrapped = forward is not None and forward is not module.__dict__.get(_DISPATCH_ATTR)
    hooks = (module._forward_hooks, module._forward_pre_hooks, torch_module._global_forward_hooks,
             torch_module._global_forward_pre_hooks)
    return wrapped or any(len(h) > 0 for h in hooks)


def add_forward_wrapper(module: nn.Module, handler: Callable[..., Any]) -> None:
    """Wrap the module's forward: ``handler(inner, *args, **kwargs)`` decides how to call ``inner``."""
    _ensure_dispatch(module)
    inner = module.forward

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return handler(inner, *args, **kwargs)

    module.forward = wrapper


def referenced_global(function: Callable[..., Any], name: str) -> Any:
    """What ``function``'s code, or the code of a function its decorators wrap (``__wrapped__``), sees under global
    ``name`` (what :func:`rebind_global` would replace); None where none of them refers to ``name``."""
    inner: Any = function
    while inner is not None and name not in inner.__code__.co_names:
        inner = getattr(inner, "__wrapped__", None)
    return None if inner is None else inner.__globals__.get(name)


def rebind_global(function: Callable[..., Any], name: str, value: Any) -> Callable[..., Any]:
    """A copy of ``function`` whose code sees ``value`` under global ``name``; decorators are kept.

    Decorator wrappers (``functools.wraps`` with ``__wrapped__``) are rebuilt around the rebound
    innermost function. Raises ValueError if no function in the chain refers to ``name``.
    """
    inner = getattr(function, "__wrapped__", None)
    if inner is not None and name not in function.__code__.co_names:
        new_inner = rebind_global(inner, name, value)
        closure = function.__closure__ or ()
        cells = tuple(types.CellType(new_inner) if c.cell_contents is inner else c for c in closure)
        if not any(c.cell_contents is new_inner for c in cells):
            return new_inner  # the wrapper reaches its function some other way: drop the wrapper
        copy = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                                  function.__defaults__, cells)
        copy.__kwdefaults__ = function.__kwdefaults__
        copy.__dict__.update(function.__dict__)
        copy.__wrapped__ = new_inner
        return copy
    if name not in function.__code__.co_names:
        raise ValueError(f"{function.__qualname__} does not refer to a global named {name!r}")
    namespace = dict(function.__globals__)
    namespace[name] = value
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__dict__.update(function.__dict__)
    return copy


@contextmanager
def innermost_override(module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Within the block the module computes ``make(what it computes now)``, inside every pass wrapper.

    Pass wrappers (token pruning's compaction, for one) still see the call first; the module is
    left exactly as it was on exit, dispatcher or not.
    """
    state = module.__dict__
    key = BODY_ATTR if state.get(_DISPATCH_ATTR) else "forward"
    had, previous = key in state, state.get(key)
    state[key] = make(module_body(module) if key == BODY_ATTR else module.forward)
    try:
        yield
    finally:
        if had:
            state[key] = previous
        else:
            del state[key]
