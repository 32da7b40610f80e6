"""W4A16 configurations measured inside the decode step, per GPU: the tuner's answer for the shapes they cover.

The tuner (mmsdk.kernels.w4a16_tuning) times each candidate alone. For the batch-1 GEMVs of a decode step that does not
rank the candidates as the step does: what runs next (the attention's kernels after q/k/v, the gated MLP after o_proj)
fills the multiprocessors while a GEMV's last programs finish, and which tile wins alone changed from one process to
the next. On an H200 the step's q/k/v pick alone moved Qwen2-VL-7B's step by ~45 µs between processes
(docs/benchmarks.md, seventeenth pass). The configurations below were each chosen by timing the replayed step itself
with every candidate pinned in turn (benchmarks/gpu_decode_reuse.py ``--search``: coordinate descent over q/k/v, o_proj,
down and the gated MLP); the tuner returns them for these keys on that GPU instead of timing. Other shapes, dtypes and
GPUs are timed as before. ``MMSDK_STEP_CONFIGS=0`` turns the table off (to measure the tuner's own picks);
``MMSDK_STEP_CONFIGS=<path>`` adds the configs a JSON file holds for this GPU, ahead of the built-in ones: what
mmsdk.kernels.step_search found on another GPU, model or group size (:func:`write_step_configs` writes it).

Keys are the tuner's: ``("gemv", rows bucket, N, K groups, group, dtype, zero points, bias, norm folded)`` and
``("gated", N, K groups, group, dtype, zero points, norm folded)``. A one-row GEMV handed the statistics of its input
norm ("norm folded" = "statistics": the q/k/v GEMVs after the first layer with rmsnorm-rope-fusion's
``qkv_norm_statistics``) takes the entry of the same GEMV with the norm folded (True) where the table has none of its
own: its kind then decides whether it reads them (mmsdk.kernels.w4a16.w4a16_gemv), as it was measured without them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmsdk.core.fileio import write_json_atomically

__all__ = ["STEP_CONFIGS_ENV", "StepConfigs", "StepConfigsFile", "decode_item", "encode_item", "read_step_configs",
           "step_measured_config", "write_step_configs"]

STEP_CONFIGS_ENV = "MMSDK_STEP_CONFIGS"  # "0" turns the table off, a file path adds that file's configs
FILE_FORMAT = "mmsdk-step-configs/1"

StepConfigs = dict[str, dict[tuple[Any, ...], tuple[Any, ...]]]  # GPU name -> tuner key -> configuration


def _measured() -> StepConfigs:
    """Device name (``torch.cuda.get_device_name``) -> tuner key -> configuration (built per call: no module state)."""
    bf16 = torch.bfloat16
    return {
        "NVIDIA H200": {
            # LLaVA-1.5-7B, int4-weight g32, rmsnorm-rope-fusion's defaults (h200_step_search_g32.json in
            # benchmarks/results, with the gated MLP then on "gated" 8x32x1: the step 1.816 ms; q/k/v 8x64x2 +29 µs,
            # 8x128x4 +34, 16x32x2 +60; o_proj's other tiles +230-365 µs except 8x128x4 at 264 programs, equal; down
            # 8x128x4 at 528 programs +44; with the gated MLP on "idot", h200_step_search_idot_gemvs.json, the "idot"
            # kind for q/k/v, o_proj and down +53-161 µs)
            ("gemv", 1, 12288, 128, 32, bf16, False, False, True): (16, 64, 2, 1, "quad", 528),
            ("gemv", 1, 4096, 128, 32, bf16, False, False, False): (8, 128, 4, 1, "quad", 528),
            ("gemv", 1, 4096, 344, 32, bf16, False, False, False): (8, 128, 4, 1, "quad", 264),
            # gated: kind "idot" (twenty-first pass, h200_step_search_gated_idot.json and _gated_idot2.json: the step
            # 1.764-1.768 ms against 1.804 with "gated" 8x32x1; the other "idot" tiles 1.797-2.114, the other "gated"
            # tiles 1.838-2.453)
            ("gated", 11008, 128, 32, bf16, False, False): (8, 64, 4, 1, "idot", 528),
            # Qwen2-VL-7B, int4-weight g128, same passes (h200_step_search_qwen.json, with the gated MLP then on
            # "gated" 8x128x4: 2.107 ms; q/k/v 8x64x2 +47 µs, 16x64x4 +31, 16x64x2 +144; o_proj 8x128x4 at 264
            # programs equal, the others +42-233; down 8x128x4 at 264 programs +8, the others +33-443; with the gated
            # MLP on "idot", h200_step_search_idot_gemvs.json: "idot" q/k/v 16x64x4 -2 µs, within the spread, the
            # others +17-36; o_proj and down on "idot" +24-106)
            ("gemv", 1, 4608, 28, 128, bf16, False, True, True): (8, 128, 4, 1, "quad", 264),
            ("gemv", 1, 3584, 28, 128, bf16, False, False, False): (8, 128, 4, 1, "quad", 528),
            ("gemv", 1, 3584, 148, 128, bf16, False, False, False): (8, 128, 4, 1, "quad", 528),
            # gated: kind "idot" (twenty-first pass, h200_step_search_gated_idot.json and _gated_idot2.json: the step
            # 1.883-1.894 ms against 2.001 with "gated" 8x128x4; 4x64x2 1.887 in the second run, within the spread;
            # the other "idot" tiles 1.895-2.176, the other "gated" tiles 2.058-2.790)
            ("gated", 18944, 28, 128, bf16, False, False): (8, 64, 4, 1, "idot", 528),
        },
        "NVIDIA H100 80GB HBM3": {
            # LLaVA-1.5-7B g32, same passes (thirty-eighth pass, h100_step_search_g32_38.json: the step 2.059 ms with
            # the tuner's picks, 2.030 with these; down 8x128x4 at 528 programs -20 µs, the q/k/v and o_proj picks
            # within the ~8 µs spread; the gated MLP stays on "gated" 8x32x1, the "idot" tiles +63-146 µs. A fresh
            # process, h100_step_against_tuner_38.json: 2.035 ms against 2.049 with the tuner's picks)
            ("gemv", 1, 12288, 128, 32, bf16, False, False, True): (16, 32, 2, 1, "idot", 528),
            # q/k/v handed the input norm's statistics: "idotr" (forty-second pass,
            # h100_step_search_qkv_statistics_42.json: 2.007 ms against 2.030 with "idot" 16x32x2, the other "idot" /
            # "idotr" tiles 2.035-2.100; against the unchained step in one process, h100_qkv_statistics_ab_42.json:
            # 2.006-2.012 against 2.042-2.047 over four processes)
            ("gemv", 1, 12288, 128, 32, bf16, False, False, "statistics"): (16, 32, 2, 1, "idotr", 528),
            ("gemv", 1, 4096, 128, 32, bf16, False, False, False): (8, 128, 4, 1, "quad", 264),
            # down: kind "idotr" (forty-first pass, h100_step_search_g32_idotr_41.json: the step 1.995 ms against
            # 2.025 with "quad" 8x128x4; "idot" 16x32x2 2.061, "idotr" 16x32x2 and 16x64x4 2.032)
            ("gemv", 1, 4096, 344, 32, bf16, False, False, False): (32, 32, 4, 1, "idotr", 528),
            ("gated", 11008, 128, 32, bf16, False, False): (8, 32, 1, 1, "gated", 528),
            # LLaVA-1.5-7B g128, o_proj (forty-fifth pass, h100_step_search_g128_45.json: the step 1.968 ms against
            # 1.994 with the tuner's "idotr" 16x64x4; "quad" 8x128x4 at 528 programs and 8x128x2 at 264 within 2 µs,
            # the other tiles 2.020-2.089; the forty-third pass's unchained search had the same lead, -33-42 µs. Fresh
            # processes with this and down's "idotr" 16x64x4 (-15 µs, under twice the 8 µs between its "idot" and
            # "idotr" tiles of that size, so not kept here): 1.974 ms against 2.001)
            ("gemv", 1, 4096, 32, 128, bf16, False, False, False): (8, 128, 4, 1, "quad", 264),
            # g128, q/k/v handed the statistics: "idotr" 16x32x2 (forty-ninth pass,
            # h100_step_search_g128_qkv_statistics_49.json: the step 1.903 ms against 1.906-1.910 with the tuner's
            # "idotr" 32x32x4, "idotr" 16x64x4 1.915, the "idot" / "quad" tiles 1.931-1.988; the tuner had picked
            # 16x32x2 in the forty-fifth pass and 32x32x4 here. Fresh processes: 1.900-1.902 ms against 1.910-1.911)
            ("gemv", 1, 12288, 32, 128, bf16, False, False, "statistics"): (16, 32, 2, 1, "idotr", 528),
            # g128, the gated MLP: "gated" 8x32x1 (forty-eighth pass, h100_step_search_g128_gated_48.json: the step
            # 1.905 ms, no candidate nearer than +10 µs; the tuner's pick changed between fresh processes, 1.903-1.904
            # ms with 8x32x1, 1.951 with "idotr" 8x64x4, 1.977-1.981 with "gated" 8x128x4; with this entry 1.906 twice)
            ("gated", 11008, 32, 128, bf16, False, False): (8, 32, 1, 1, "gated", 528),
            # Qwen2-VL-7B g128 (h100_step_search_qwen_38.json: 2.258 ms with the tuner's picks, 2.169 with these;
            # q/k/v 8x128x4 at 528 programs -82 µs against the tuner's 8x64x2, the rest within ~5 µs; a fresh
            # process: 2.178 against 2.260)
            ("gemv", 1, 4608, 28, 128, bf16, False, True, True): (8, 128, 4, 1, "quad", 528),
            # handed the statistics: "idotr" (h100_step_search_qkv_statistics_42.json: 2.177 ms against 2.207 with
            # "quad" 8x128x4, which folds the norm; the other tiles 2.216-2.239; in one process against the unchained
            # step: 2.175-2.178 against 2.194-2.196)
            ("gemv", 1, 4608, 28, 128, bf16, False, True, "statistics"): (16, 64, 4, 1, "idotr", 528),
            ("gemv", 1, 3584, 28, 128, bf16, False, False, False): (8, 128, 4, 1, "quad", 264),
            # down: kind "idotr" (forty-first pass, h100_step_search_down_idotr_41.json: the step 2.155 ms against 2.177
            # with "idot" 16x64x4, the earlier pick; "quad" 8x128x4 2.162, "idotr" 32x32x4 2.160)
            ("gemv", 1, 3584, 148, 128, bf16, False, False, False): (16, 64, 4, 1, "idotr", 528),
            ("gated", 18944, 28, 128, bf16, False, False): (4, 64, 2, 1, "idot", 528),
        },
    }


def step_measured_config(key: tuple[Any, ...], device: torch.device, candidates: tuple[tuple[Any, ...], ...],
                         read: Callable[[str], StepConfigs] | None = None) -> tuple[Any, ...] | None:
    """The step-measured configuration for ``key`` on ``device``'s GPU (from the file ``MMSDK_STEP_CONFIGS`` names,
    else the built-in table), or None (not CUDA, no entry, the table off with ``MMSDK_STEP_CONFIGS=0``, or an entry
    that is not among ``candidates``: the candidates changed since it was measured, so the tuner times them
    instead). ``read`` reads that file (default :func:`read_step_configs`; the tuner passes its own
    :class:`StepConfigsFile`, which reads it once per process while it is unchanged)."""
    setting = os.environ.get(STEP_CONFIGS_ENV, "1")
    if device.type != "cuda" or setting == "0":
        return None
    name = torch.cuda.get_device_name(device)
    table = _measured().get(name, {})
    if setting != "1":
        table = {**table, **(read or read_step_configs)(setting).get(name, {})}
    config = table.get(key)
    if config is None and key[0] == "gemv" and key[-1] == "statistics":
        config = table.get((*key[:-1], True))
    return config if config in candidates else None


def encode_item(item: Any) -> Any:
    """A key or config element as JSON holds it (dtypes by name)."""
    if isinstance(item, torch.dtype):
        return {"dtype": str(item).removeprefix("torch.")}
    if item is None or isinstance(item, (bool, int, float, str)):
        return item
    raise TypeError(f"a step config key or value holds {item!r}, which a step-configs file cannot store")


def decode_item(item: Any, path: Path) -> Any:
    if isinstance(item, dict):
        dtype = getattr(torch, str(item.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{path}: {item} names no torch dtype; write the file with write_step_configs")
        return dtype
    return item


def read_step_configs(path: str | Path) -> StepConfigs:
    """GPU name -> tuner key -> config, from a file :func:`write_step_configs` wrote."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{STEP_CONFIGS_ENV}={path}: no such file. Point it at a file that "
                                "`mmsdk tune` (or mmsdk.kernels.step_search's StepSearch.save) wrote, or set it to "
                                "0 or 1.") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{STEP_CONFIGS_ENV}={path} is not JSON ({error}): write it with `mmsdk tune` "
                         "(or StepSearch.save)") from None
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT or not isinstance(data.get("gpus"), dict):
        raise ValueError(f"{STEP_CONFIGS_ENV}={path} is not a step-configs file (format {FILE_FORMAT!r}): write it "
                         "with `mmsdk tune` (or StepSearch.save, mmsdk.kernels.step_search)")
    return {gpu: {tuple(decode_item(i, path) for i in entry["key"]):
                      tuple(decode_item(i, path) for i in entry["config"]) for entry in entries}
            for gpu, entries in data["gpus"].items()}


class StepConfigsFile:
    """:func:`read_step_configs` that keeps what it read: the tuner asks once per GEMV shape it meets (about six times
    per 7B model), and the file is read again only when its path, inode, size or modification time changes (a save
    renames a new file into place, so it changes the inode)."""

    def __init__(self) -> None:
        self._read: tuple[tuple[str, int, int, int], StepConfigs] | None = None

    def __call__(self, path: str | Path) -> StepConfigs:
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return read_step_configs(path)  # its error names the fix
        stamp = (os.fspath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if self._read is None or self._read[0] != stamp:
            self._read = (stamp, read_step_configs(path))
        return self._read[1]


def write_step_configs(path: str | Path, gpu: str, configs: dict[tuple[Any, ...], tuple[Any, ...]]) -> Path:
    """Put ``configs`` (tuner key -> config) for the GPU named ``gpu`` (``torch.cuda.get_device_name``) into the file at
    ``path``: a new file, or one this wrote before, whose other GPUs' entries and this GPU's other keys stay. Written
    to a temporary file beside it, then renamed, so a reader never sees half a file."""
    path = Path(path)
    existing = read_step_configs(path) if path.exists() else {}
    merged = {**existing.get(gpu, {}), **configs}
    existing[gpu] = merged
    data = {"format": FILE_FORMAT,
            "gpus": {name: [{"key": [encode_item(i) for i in key], "config": [encode_item(i) for i in config]}
                            for key, config in table.items()]
                     for name, table in existing.items()}}
    return write_json_atomically(path, data)
