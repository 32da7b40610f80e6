"""The W4A16 tuner's choices kept on disk, so a later process on the same machine takes them untimed.

The tuner (mmsdk.kernels.w4a16_tuning) compiles and times every candidate of a shape the first time a process meets
it; a 7B model's first ``generate`` spends most of its first call there. With the choices kept, a later process
compiles (or reads from Triton's cache) only the chosen kernel of each shape, and runs the kernels the first process
ran, so two processes on one machine give the same outputs bitwise.

A choice is taken only by a process with the same toolchain (GPU name and compute capability, torch, CUDA, Triton,
mmsdk and the source of mmsdk's Triton kernels) and the same candidates for its key; anything else times anew.
``MMSDK_TUNING_CACHE`` says where: unset, ``$XDG_CACHE_HOME/mmsdk/tuning-choices.json`` (``~/.cache`` without
it); ``0``, nowhere (every process times); a path, that file. Each save reads the file again and merges its new
choice into what other processes saved meanwhile (two saving at the same instant may lose one new choice, which a
later process then times again), writes a temporary file beside it and renames that into place, so a reader never
sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import torch

from mmsdk.core.fileio import write_json_atomically
from mmsdk.kernels import LOG
from mmsdk.kernels.step_configs import decode_item, encode_item

__all__ = ["FILE_FORMAT", "KEPT_TOOLCHAINS", "TUNING_CACHE_ENV", "TuningChoices", "candidates_digest", "toolchain",
           "tuning_cache_path"]

TUNING_CACHE_ENV = "MMSDK_TUNING_CACHE"
FILE_FORMAT = "mmsdk-tuning-choices/1"
KEPT_TOOLCHAINS = 8  # the file keeps the choices of the toolchains that saved last (upgrades leave older ones behind)

Entries = dict[str, dict[str, dict[str, Any]]]  # toolchain -> encoded key -> {"candidates": digest, "config": [...]}


def tuning_cache_path() -> Path | None:
    """The file ``MMSDK_TUNING_CACHE`` names (see the module), or None when it is ``0``."""
    setting = os.environ.get(TUNING_CACHE_ENV, "").strip()
    if setting == "0":
        return None
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mmsdk" / "tuning-choices.json"


def toolchain(device: torch.device) -> str | None:
    """What a choice was timed with, as one string: the GPU, its compute capability, the software versions and a
    digest of mmsdk's Triton kernel sources (a kernel changed since is timed anew); None off CUDA (nothing kept)."""
    if device.type != "cuda":
        return None
    import triton

    import mmsdk

    major, minor = torch.cuda.get_device_capability(device)
    return (f"{torch.cuda.get_device_name(device)}; sm_{major}{minor}; torch {torch.__version__}; "
            f"cuda {torch.version.cuda}; triton {triton.__version__}; mmsdk {mmsdk.__version__}; "
            f"kernels {_kernel_sources_digest()}")


@cache
def _kernel_sources_digest() -> str:
    """sha256 (16 hex digits) over the source of mmsdk's Triton kernel modules (``mmsdk/kernels/_*_triton.py``),
    read once per process."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("_*_triton.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def candidates_digest(candidates: tuple[tuple[Any, ...], ...], within: float) -> str:
    """sha256 (16 hex digits) of the candidates a choice was made among and the tuner's ``within`` margin."""
    text = json.dumps([[encode_item(item) for item in config] for config in candidates] + [within])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _key_text(key: tuple[Any, ...]) -> str:
    return json.dumps([encode_item(item) for item in key])


class TuningChoices:
    """This process's view of the choices file: read at the first lookup, written at each new choice.

    One per process, held by mmsdk.kernels.w4a16_tuning's ``Tuning``. A file that cannot be read or written costs a
    warning, once per process, and the tuner times as without it; a file that ``MMSDK_TUNING_CACHE`` names but is not
    a choices file raises, so it is not overwritten."""

    def __init__(self) -> None:
        self._entries: Entries | None = None
        self._path: Path | None = None
        self._warned = False

    def chosen(self, key: tuple[Any, ...], candidates: tuple[tuple[Any, ...], ...], within: float,
               device: torch.device) -> tuple[Any, ...] | None:
        """The config kept for ``key`` with this toolchain and these candidates, or None (off, none kept, the
        candidates changed, or the kept config is not among them)."""
        path, chain = tuning_cache_path(), toolchain(device)
        if path is None or chain is None:
            return None
        entry = self._read(path).get(chain, {}).get(_key_text(key))
        if entry is None or entry.get("candidates") != candidates_digest(candidates, within):
            return None
        try:
            config = tuple(decode_item(item, path) for item in entry.get("config", ()))
        except ValueError:  # an entry edited by hand: timed again, and the new choice replaces it
            return None
        return config if config in candidates else None

    def remember(self, key: tuple[Any, ...], candidates: tuple[tuple[Any, ...], ...], within: float,
                 device: torch.device, config: tuple[Any, ...]) -> None:
        """Keep ``config`` as the choice for ``key`` among ``candidates``, merged into the file as it is now."""
        path, chain = tuning_cache_path(), toolchain(device)
        if path is None or chain is None:
            return
        entry = {"candidates": candidates_digest(candidates, within), "config": [encode_item(i) for i in config]}
        text = _key_text(key)
        try:
            current = self._load(path)
            current[chain] = {**current.pop(chain, {}), text: entry}  # the newest toolchain last
            for stale in list(current)[:-KEPT_TOOLCHAINS]:  # older versions' choices, never read again
                del current[stale]
            write_json_atomically(path, {"format": FILE_FORMAT, "toolchains": current})
        except OSError as error:
            self._warn(f"the tuner's choices could not be saved to {path} ({type(error).__name__}: {error}); later "
                       f"processes will time them again. Set {TUNING_CACHE_ENV} to a writable file, or to 0.")
            return
        self._entries, self._path = current, path

    def _read(self, path: Path) -> Entries:
        if self._entries is None or self._path != path:
            try:
                self._entries = self._load(path)
            except OSError as error:
                self._warn(f"the tuner's choices could not be read from {path} ({type(error).__name__}: {error}); "
                           f"timing every shape. Set {TUNING_CACHE_ENV} to a readable file, or to 0.")
                self._entries = {}
            self._path = path
        return self._entries

    def _load(self, path: Path) -> Entries:
        """The file's entries ({} when it does not exist). One that is not a choices file raises ValueError when the
        user named it (``MMSDK_TUNING_CACHE``); at the default place it is ours, so it is replaced (with a warning)."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            data = {"error": str(error)}
        if isinstance(data, dict) and data.get("format") == FILE_FORMAT and isinstance(data.get("toolchains"), dict):
            return {chain: dict(entries) for chain, entries in data["toolchains"].items() if isinstance(entries, dict)}
        if TUNING_CACHE_ENV in os.environ:
            raise ValueError(f"{TUNING_CACHE_ENV}={path} is not a tuning-choices file (format {FILE_FORMAT!r}): point "
                             f"it at a new or earlier such file, or set it to 0 to keep no choices.")
        self._warn(f"{path} is not a tuning-choices file (format {FILE_FORMAT!r}); it is replaced at the next save.")
        return {}

    def _warn(self, message: str) -> None:
        if not self._warned:
            LOG.warning("mmsdk.kernels: %s", message)
            self._warned = True

