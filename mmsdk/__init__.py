"""mmsdk: make multimodal LLMs small and fast to deploy.

``Optimizer(model).apply("int4-kv", "sparse-xattn").export()``. Importing mmsdk is cheap: names
below load their modules on first use, and nothing here imports onnxruntime, TensorRT-LLM,
Triton or touches CUDA.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("mmsdk")
"""Decorator for plugin hook implementations: ``@mmsdk.hookimpl``."""

_LAZY: dict[str, str] = {
    "Optimizer": "mmsdk.core.optimizer",
    "Session": "mmsdk.core.session",
    "PassSpec": "mmsdk.core.passes",
    "PassContext": "mmsdk.core.passes",
    "PassResult": "mmsdk.core.passes",
    "CheckContext": "mmsdk.core.passes",
    "PassConfig": "mmsdk.core.config",
    "ModelAdapter": "mmsdk.core.adapter",
    "Manifest": "mmsdk.core.manifest",
    "ModelSource": "mmsdk.core.sources",
    "LoadedModel": "mmsdk.core.sources",
    "DatasetSource": "mmsdk.core.datasets",
    "VQAExample": "mmsdk.core.datasets",
    "CalibrationSet": "mmsdk.core.calibration",
    "Recipe": "mmsdk.core.recipes",
    "RecipeStep": "mmsdk.core.recipes",
    "ExportResult": "mmsdk.core.backend",
    "load_model": "mmsdk.core.sources",
    "QKVFuseConfig": "mmsdk.plugins.attention.qkv_fuse",
    "TokenPruneConfig": "mmsdk.plugins.encoders.token_prune",
    "TokenMergeConfig": "mmsdk.plugins.projectors.token_merge",
    "ViTPruneConfig": "mmsdk.plugins.encoders.vit_prune",
    "SparseXAttnConfig": "mmsdk.plugins.attention.sparse_xattn",
    "GatedXAttnConfig": "mmsdk.plugins.attention.gated_xattn",
    "RMSNormRoPEFusionConfig": "mmsdk.plugins.attention.rmsnorm_rope",
    "Int4WeightConfig": "mmsdk.plugins.quantizers.int4_weight",
    "Int4KVConfig": "mmsdk.plugins.quantizers.kv_cache",
    "Int8KVConfig": "mmsdk.plugins.quantizers.kv_cache",
    "FP8KVConfig": "mmsdk.plugins.quantizers.kv_cache",
    "PTQAlignConfig": "mmsdk.plugins.quantizers.ptq_align",
    "CalibrationRecord": "mmsdk.plugins.quantizers.calibration_record",
    "MmsdkError": "mmsdk.core.errors",
    "UnknownNameError": "mmsdk.core.errors",
    "DuplicateNameError": "mmsdk.core.errors",
    "NoAdapterError": "mmsdk.core.errors",
    "ConfigError": "mmsdk.core.errors",
    "IncompatiblePassError": "mmsdk.core.errors",
    "PluginLoadError": "mmsdk.core.errors",
    "BackendUnavailableError": "mmsdk.core.errors",
    "ExportError": "mmsdk.core.errors",
    "OutputExistsError": "mmsdk.core.errors",
    "ArtifactIntegrityError": "mmsdk.core.errors",
    "CalibrationError": "mmsdk.core.errors",
    "UnsupportedInputError": "mmsdk.core.errors",
}

__all__ = ["__version__", "hookimpl", "load", *_LAZY]


def load(path: Any, **options: Any) -> Any:
    """Verify an export folder against its manifest and load it (the torch backend returns the model)."""
    from mmsdk.core.exporting import load as _load

    return _load(path, **options)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mmsdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from mmsdk.core.adapter import ModelAdapter
    from mmsdk.core.backend import ExportResult
    from mmsdk.core.calibration import CalibrationSet
    from mmsdk.core.config import PassConfig
    from mmsdk.core.datasets import DatasetSource, VQAExample
    from mmsdk.core.errors import (
        ArtifactIntegrityError,
        BackendUnavailableError,
        CalibrationError,
        ConfigError,
        DuplicateNameError,
        ExportError,
        IncompatiblePassError,
        MmsdkError,
        NoAdapterError,
        OutputExistsError,
        PluginLoadError,
        UnknownNameError,
        UnsupportedInputError,
    )
    from mmsdk.core.manifest import Manifest
    from mmsdk.core.optimizer import Optimizer
    from mmsdk.core.passes import CheckContext, PassContext, PassResult, PassSpec
    from mmsdk.core.recipes import Recipe, RecipeStep
    from mmsdk.core.session import Session
    from mmsdk.core.sources import LoadedModel, ModelSource, load_model
    from mmsdk.plugins.attention.gated_xattn import GatedXAttnConfig
    from mmsdk.plugins.attention.qkv_fuse import QKVFuseConfig
    from mmsdk.plugins.attention.rmsnorm_rope import RMSNormRoPEFusionConfig
    from mmsdk.plugins.attention.sparse_xattn import SparseXAttnConfig
    from mmsdk.plugins.encoders.token_prune import TokenPruneConfig
    from mmsdk.plugins.encoders.vit_prune import ViTPruneConfig
    from mmsdk.plugins.projectors.token_merge import TokenMergeConfig
    from mmsdk.plugins.quantizers.calibration_record import CalibrationRecord
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig
    from mmsdk.plugins.quantizers.kv_cache import FP8KVConfig, Int4KVConfig, Int8KVConfig
    from mmsdk.plugins.quantizers.ptq_align import PTQAlignConfig
