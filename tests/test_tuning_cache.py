"""The W4A16 tuner's choices kept on disk between processes (mmsdk.kernels.tuning_cache), checked without a GPU: the
toolchain is a stand-in string, the timing a table of fake times."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from mmsdk.kernels import tuning_cache
from mmsdk.kernels.tuning_cache import FILE_FORMAT, TUNING_CACHE_ENV, TuningChoices, tuning_cache_path

CANDIDATES = ((8, 128, 4, 1, "quad"), (16, 32, 2, 1, "idot"), (32, 32, 4, 1, "idotr"))
KEY = ("gemv", 1, 12288, 128, 32, torch.bfloat16, False, False, "statistics")


@pytest.fixture
def gpu(monkeypatch):
    """Every device reports one toolchain, as one GPU with one software stack would."""
    chain = {"name": "Stand-in GPU; sm_90; torch x; triton y; mmsdk z; kernels 0"}
    monkeypatch.setattr(tuning_cache, "toolchain", lambda device: chain["name"])
    return chain


@pytest.fixture
def choices_file(monkeypatch, tmp_path):
    path = tmp_path / "cache" / "tuning-choices.json"
    monkeypatch.setenv(TUNING_CACHE_ENV, str(path))
    return path


def test_the_file_is_where_the_environment_says_or_in_the_users_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(TUNING_CACHE_ENV, "0")
    assert tuning_cache_path() is None
    monkeypatch.setenv(TUNING_CACHE_ENV, str(tmp_path / "mine.json"))
    assert tuning_cache_path() == tmp_path / "mine.json"
    monkeypatch.delenv(TUNING_CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning_cache_path() == tmp_path / "xdg" / "mmsdk" / "tuning-choices.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning_cache_path() == tmp_path / "home" / ".cache" / "mmsdk" / "tuning-choices.json"


def test_a_choice_kept_by_one_process_is_taken_by_the_next_with_the_same_toolchain_and_candidates(gpu, choices_file):
    device = torch.device("cuda", 0)  # only its type is read: the toolchain is the stand-in's
    first = TuningChoices()
    assert first.chosen(KEY, CANDIDATES, 0.0, device) is None
    first.remember(KEY, CANDIDATES, 0.0, device, CANDIDATES[1])
    assert first.chosen(KEY, CANDIDATES, 0.0, device) == CANDIDATES[1]
    assert not [p.name for p in choices_file.parent.iterdir() if p.name != choices_file.name]  # no temporary left

    later = TuningChoices()  # a later process reads the file
    assert later.chosen(KEY, CANDIDATES, 0.0, device) == CANDIDATES[1]
    assert later.chosen(KEY[:-1] + (True,), CANDIDATES, 0.0, device) is None  # another key
    assert later.chosen(KEY, CANDIDATES[:2] + ((64, 32, 4, 1, "idotr"),), 0.0, device) is None  # other candidates
    assert later.chosen(KEY, CANDIDATES, 0.03, device) is None  # another margin
    gpu["name"] = "Stand-in GPU; sm_90; torch x; triton y; mmsdk z; kernels 1"  # a kernel's source changed
    assert TuningChoices().chosen(KEY, CANDIDATES, 0.0, device) is None


def test_processes_saving_one_after_another_keep_each_others_choices(gpu, choices_file):
    device = torch.device("cuda", 0)
    one, two = TuningChoices(), TuningChoices()
    assert one.chosen(KEY, CANDIDATES, 0.0, device) is None and two.chosen(KEY, CANDIDATES, 0.0, device) is None
    one.remember(KEY, CANDIDATES, 0.0, device, CANDIDATES[0])
    gpu["name"] = "Another GPU"
    two.remember(("gated", 11008, 128, 32, torch.bfloat16, False, False), CANDIDATES, 0.0, device, CANDIDATES[2])
    data = json.loads(choices_file.read_text())
    assert data["format"] == FILE_FORMAT and len(data["toolchains"]) == 2
    assert TuningChoices().chosen(("gated", 11008, 128, 32, torch.bfloat16, False, False), CANDIDATES, 0.0,
                                  device) == CANDIDATES[2]
    gpu["name"] = "Stand-in GPU; sm_90; torch x; triton y; mmsdk z; kernels 0"
    assert TuningChoices().chosen(KEY, CANDIDATES, 0.0, device) == CANDIDATES[0]


def test_the_file_keeps_the_toolchains_that_saved_last(gpu, choices_file):
    device = torch.device("cuda", 0)
    for version in range(tuning_cache.KEPT_TOOLCHAINS + 2):
        gpu["name"] = f"Stand-in GPU; mmsdk {version}"
        TuningChoices().remember(KEY, CANDIDATES, 0.0, device, CANDIDATES[0])
    gpu["name"] = "Stand-in GPU; mmsdk 1"  # saved again: now the newest
    TuningChoices().remember(KEY, CANDIDATES, 0.0, device, CANDIDATES[2])
    kept = list(json.loads(choices_file.read_text())["toolchains"])
    assert kept == [f"Stand-in GPU; mmsdk {v}" for v in (3, 4, 5, 6, 7, 8, 9, 1)]  # 0 and 2 dropped, 1 back
    assert TuningChoices().chosen(KEY, CANDIDATES, 0.0, device) == CANDIDATES[2]


def test_a_kept_config_that_is_not_among_the_candidates_or_unreadable_is_not_taken(gpu, choices_file):
    device = torch.device("cuda", 0)
    TuningChoices().remember(KEY, CANDIDATES, 0.0, device, (4, 4, 4, 4, "made up"))
    assert TuningChoices().chosen(KEY, CANDIDATES, 0.0, device) is None
    TuningChoices().remember(KEY, CANDIDATES, 0.0, device, CANDIDATES[0])
    edited = choices_file.read_text().replace('"quad"', '{"dtype": "no such dtype"}')  # an entry edited by hand
    choices_file.write_text(edited)
    assert TuningChoices().chosen(KEY, CANDIDATES, 0.0, device) is None


def test_a_named_file_that_is_no_choices_file_is_refused_and_left_alone(gpu, choices_file):
    choices_file.parent.mkdir(parents=True)
    choices_file.write_text('{"my": "notes"}')
    with pytest.raises(ValueError, match=f"{TUNING_CACHE_ENV}=.* is not a tuning-choices file.*set it to 0"):
        TuningChoices().chosen(KEY, CANDIDATES, 0.0, torch.device("cuda", 0))
    assert choices_file.read_text() == '{"my": "notes"}'


def test_a_broken_file_at_the_default_place_is_replaced_with_one_warning(gpu, monkeypatch, tmp_path, caplog):
    monkeypatch.delenv(TUNING_CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tmp_path / "mmsdk" / "tuning-choices.json"
    path.parent.mkdir()
    path.write_text('{"format": "mmsdk-tuning-choices/1", "toolch')  # cut short by hand
    device = torch.device("cuda", 0)
    choices = TuningChoices()
    with caplog.at_level(logging.WARNING, logger="mmsdk.kernels"):
        assert choices.chosen(KEY, CANDIDATES, 0.0, device) is None
        choices.remember(KEY, CANDIDATES, 0.0, device, CANDIDATES[2])
    assert [r.getMessage() for r in caplog.records].count(
        f"mmsdk.kernels: {path} is not a tuning-choices file (format '{FILE_FORMAT}'); it is replaced at the next "
        "save.") == 1
    assert TuningChoices().chosen(KEY, CANDIDATES, 0.0, device) == CANDIDATES[2]


def test_a_file_that_cannot_be_read_or_written_costs_one_warning_and_nothing_else(gpu, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(TUNING_CACHE_ENV, str(blocker / "tuning-choices.json"))  # its folder is a file
    device = torch.device("cuda", 0)
    choices = TuningChoices()
    with caplog.at_level(logging.WARNING, logger="mmsdk.kernels"):
        for config in CANDIDATES:
            assert choices.chosen(KEY, CANDIDATES, 0.0, device) is None
            choices.remember(KEY, CANDIDATES, 0.0, device, config)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "could not be read" in warnings[0] and f"Set {TUNING_CACHE_ENV}" in warnings[0]


def test_off_nothing_is_read_or_written(gpu, monkeypatch, tmp_path):
    monkeypatch.setenv(TUNING_CACHE_ENV, "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    choices = TuningChoices()
    choices.remember(KEY, CANDIDATES, 0.0, torch.device("cuda", 0), CANDIDATES[0])
    assert choices.chosen(KEY, CANDIDATES, 0.0, torch.device("cuda", 0)) is None and not list(tmp_path.iterdir())


def test_off_cuda_there_is_no_toolchain_to_keep_a_choice_for():
    assert tuning_cache.toolchain(torch.device("cpu")) is None


def test_the_tuner_times_once_and_a_later_process_takes_its_choice_untimed(gpu, choices_file, monkeypatch):
    """The first process compiles and times every candidate and keeps the fastest; a later one (a new ``Tuning``)
    compiles and times nothing and runs that choice. A step search's first tuning times anew."""
    from mmsdk.kernels import w4a16_tuning
    from tests.tuner_fakes import fake_timings

    fake = fake_timings(monkeypatch, {"quad": 10.0, "idot": 9.0, "idotr": 9.5})
    timed, compiled, launch = fake.timed, fake.compiled, fake.launch
    monkeypatch.setattr(w4a16_tuning, "tuning", lambda: process["tuning"])

    process = {"tuning": w4a16_tuning.Tuning()}
    fake.capturing = True  # met first inside a capture (a step compiled ahead): the first candidate, not kept
    assert w4a16_tuning.tuned_config(KEY, launch, CANDIDATES, 32, (torch.zeros(4),)) == CANDIDATES[0]
    fake.capturing = False
    assert w4a16_tuning.tuned_config(KEY, launch, CANDIDATES, 32, (torch.zeros(4),)) == CANDIDATES[1]
    assert compiled == [3] and sorted(set(timed)) == ["idot", "idotr", "quad"]

    timed.clear()
    compiled.clear()
    process["tuning"] = w4a16_tuning.Tuning()  # a later process, met first inside a capture: its kept choice
    fake.capturing = True
    assert w4a16_tuning.tuned_config(KEY, launch, CANDIDATES, 32, (torch.zeros(4),)) == CANDIDATES[1]
    fake.capturing = False
    assert w4a16_tuning.tuned_config(KEY, launch, CANDIDATES, 32, (torch.zeros(4),)) == CANDIDATES[1]
    assert compiled == [] and timed == []

    process["tuning"] = w4a16_tuning.Tuning()
    process["tuning"].use_kept_choices = False  # a step search's first tuning
    fake.times.update(idot=11.0)
    assert w4a16_tuning.tuned_config(KEY, launch, CANDIDATES, 32, (torch.zeros(4),)) == CANDIDATES[2]
    assert compiled == [3]
    process["tuning"] = w4a16_tuning.Tuning()  # and what it found is kept for the next
    assert w4a16_tuning.tuned_config(KEY, launch, CANDIDATES, 32, (torch.zeros(4),)) == CANDIDATES[2]


_ONE_PROCESS = """
import hashlib, json, torch
from triton import knobs
from mmsdk.kernels.w4a16 import int4_linear
from mmsdk.kernels.w4a16_tuning import tuning
from mmsdk.plugins.quantizers.packing import quantize_int4

compiles = []
knobs.compilation.listener = lambda *, src, cache_hit, **_: compiles.append(getattr(src, "name", str(src)))
torch.manual_seed(0)
packed = quantize_int4(torch.randn(1536, 1024, device="cuda") * 0.02, 32, scale_dtype=torch.bfloat16)
x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
out = int4_linear(x, packed.qweight, packed.scales, packed.zero_points, 1024, 32)
torch.cuda.synchronize()
print(json.dumps({"chosen": [repr(v) for v in tuning().chosen.values()], "compiles": len(compiles),
                  "out": hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest()}))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_a_later_process_runs_the_kept_choice_without_compiling_or_timing_the_others(tmp_path):
    """Two processes, one Triton cache and one choices file: the first compiles and times every candidate of the
    one-row GEMV; the second takes its choice, loads (or compiles) only that kernel and gives the same output
    bitwise. With the file off, a third process loads every candidate again."""
    import os
    import subprocess
    import sys

    def one_process(choices: str) -> dict:
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), TUNING_CACHE_ENV: choices,
               "MMSDK_TUNE": "1", "MMSDK_STEP_CONFIGS": "0", "MMSDK_COMPILE_THREADS": "4",
               "MMSDK_TUNE_MIN_BYTES": "0"}  # timed whatever the default size below which weights are not
        run = subprocess.run([sys.executable, "-c", _ONE_PROCESS], env=env, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    choices = str(tmp_path / "tuning-choices.json")
    first, second, without = one_process(choices), one_process(choices), one_process("0")
    assert first["chosen"] == second["chosen"] and first["out"] == second["out"]
    assert json.loads((tmp_path / "tuning-choices.json").read_text())["format"] == FILE_FORMAT
    assert second["compiles"] <= 2 < first["compiles"], (first, second)  # the choice's eager and captured variants
    assert without["compiles"] > 2, without
