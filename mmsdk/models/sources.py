"""Built-in plugin that registers mmsdk's embedded models (``tiny:*``, ``builtin:*``) and the ``digits`` dataset."""

from __future__ import annotations

import mmsdk
from mmsdk.core.datasets import DatasetSource
from mmsdk.core.registry import Registrar
from mmsdk.core.sources import ModelSource


@mmsdk.hookimpl
def mmsdk_register_models(register: Registrar[ModelSource]) -> None:
    from mmsdk.models import builtin_models, tiny

    for name, build in tiny.TINY_BUILDERS.items():
        doc = (build.__doc__ or "").strip().splitlines()[0]
        register(ModelSource(name=name, build=build, summary=f"random weights: {doc}"))
    for source in builtin_models.builtin_sources():
        register(source)


@mmsdk.hookimpl
def mmsdk_register_datasets(register: Registrar[DatasetSource]) -> None:
    from mmsdk.models import digits

    register(digits.dataset_source())
