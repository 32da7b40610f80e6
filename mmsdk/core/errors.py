"""The error hierarchy of mmsdk: every message names the problem and how to fix it."""

from __future__ import annotations

__all__ = [
    "ArtifactIntegrityError",
    "BackendUnavailableError",
    "CalibrationError",
    "ConfigError",
    "DuplicateNameError",
    "ExportError",
    "IncompatiblePassError",
    "MmsdkError",
    "NoAdapterError",
    "OutputExistsError",
    "PluginLoadError",
    "UnknownNameError",
    "UnsupportedInputError",
]


class MmsdkError(Exception):
    """Base class of every error mmsdk raises on purpose; the message always says how to fix it."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.problem = message
        self.fix = fix
        super().__init__(message if fix is None else f"{message} Fix: {fix}")

    def __str__(self) -> str:
        return str(self.args[0])


class UnknownNameError(MmsdkError, KeyError):
    """A pass, adapter, backend or model name that no plugin registered."""


class DuplicateNameError(MmsdkError, ValueError):
    """Two plugins registered the same name; the message names both plugins."""


class NoAdapterError(MmsdkError, TypeError):
    """No registered adapter recognises the model."""


class ConfigError(MmsdkError, ValueError):
    """A pass or backend configuration is invalid (unknown field, out of range, wrong type)."""


class IncompatiblePassError(MmsdkError, ValueError):
    """A pass does not fit the model or conflicts with another planned pass."""


class PluginLoadError(MmsdkError, ImportError):
    """A plugin (built-in or installed) failed to import or to register."""


class BackendUnavailableError(MmsdkError, ImportError):
    """A backend needs an optional dependency that is not installed."""


class ExportError(MmsdkError, RuntimeError):
    """An export could not be written."""


class OutputExistsError(ExportError, FileExistsError):
    """The output folder exists and is not empty."""


class ArtifactIntegrityError(MmsdkError, ValueError):
    """An exported folder does not match its manifest (changed, missing or extra files)."""


class CalibrationError(MmsdkError, ValueError):
    """Calibration data is missing, malformed or of the wrong modality."""


class UnsupportedInputError(MmsdkError, ValueError):
    """An input (image, prompt, tensor) that the model or runtime cannot take."""
