"""mmsdk hook specifications: the whole contract between the core and its plugins.

Every built-in technique, adapter, backend and model source is a plugin implementing these hooks,
exactly as a third-party package would. Hooks only *contribute* objects; no pass runs inside a hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from torch import nn

    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.backend import Backend, LowerTarget
    from mmsdk.core.datasets import DatasetSource
    from mmsdk.core.passes import PassSpec
    from mmsdk.core.recipes import Recipe
    from mmsdk.core.registry import Registrar
    from mmsdk.core.sources import ModelSource

PROJECT = "mmsdk"
hookspec = pluggy.HookspecMarker(PROJECT)


@hookspec
def mmsdk_register_adapters(register: Registrar[ModelAdapter]) -> None:
    """Add model-family adapters with ``register(MyAdapter())``.

    Called once per :class:`~mmsdk.core.session.Session`, when it is created. Adapters of
    plugins registered later are tried first when a model is matched, so a third-party adapter
    can take over a family from a built-in one. Returns nothing.
    """


@hookspec
def mmsdk_register_encoders(register: Registrar[PassSpec]) -> None:
    """Add passes of kind ``encoder`` (they act on the vision tower) with ``register(PassSpec(...))``.

    Called once per Session. Pass names are unique across all kinds. Returns nothing.
    """


@hookspec
def mmsdk_register_projectors(register: Registrar[PassSpec]) -> None:
    """Add passes of kind ``projector`` (they act on the vision-to-language projector or resampler).

    Called once per Session. Returns nothing.
    """


@hookspec
def mmsdk_register_attention(register: Registrar[PassSpec]) -> None:
    """Add passes of kind ``attention`` (attention, cross-attention, norms and rotary embeddings).

    Called once per Session. Returns nothing.
    """


@hookspec
def mmsdk_register_quantizers(register: Registrar[PassSpec]) -> None:
    """Add passes of kind ``quantizer`` (weights, activations, KV cache).

    Called once per Session. Returns nothing.
    """


@hookspec
def mmsdk_register_backends(register: Registrar[Backend]) -> None:
    """Add export targets and their runtimes with ``register(MyBackend())``.

    Called once per Session. A backend's module must import its heavy runtime (onnxruntime,
    tensorrt_llm) only inside its methods, so registering it stays cheap. Returns nothing.
    """


@hookspec
def mmsdk_register_models(register: Registrar[ModelSource]) -> None:
    """Add named model sources (``tiny:llava``, ``builtin:llava-digits``) with ``register(ModelSource(...))``.

    Called once per Session. ``mmsdk.load_model(name)`` and every CLI verb taking MODEL resolve
    names through these. Returns nothing.
    """


@hookspec
def mmsdk_register_datasets(register: Registrar[DatasetSource]) -> None:
    """Add named (image, question, answer) datasets with ``register(DatasetSource(...))``.

    Called once per Session. ``opt.calibrate("name")`` draws calibration samples from a dataset's
    calibration split and ``mmsdk eval --task name`` scores a model on its test split. Returns nothing.
    """


@hookspec
def mmsdk_register_recipes(register: Registrar[Recipe]) -> None:
    """Add named recipes (ordered passes with configs) with ``register(Recipe(...))``.

    Called once per Session. ``apply("recipe:NAME")`` looks first at the model's adapter's own
    recipes (``ModelAdapter.recipes``), then at these; a recipe whose ``family`` is set only applies
    to models of that family. Returns nothing.
    """


@hookspec(firstresult=True)
def mmsdk_lower(module: nn.Module, target: LowerTarget) -> Any:
    """Say how ``target.backend`` should emit ``module``; return ``None`` to let another plugin answer.

    Called by a backend for every module a pass introduced (and any module it cannot emit on its
    own), before anything is written. firstresult: the first non-``None`` answer wins; plugins
    registered later are asked first. What the answer is depends on the backend and is documented
    by it (the ``torch`` backend never asks; ONNX Runtime expects a lowering object that emits
    contrib ops; TensorRT-LLM expects a mapping of tensor names to arrays). A backend that gets no
    answer for a module it needs raises an error naming the module and the pass that made it.
    """
