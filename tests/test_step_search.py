"""mmsdk.kernels.step_search and the step-configs file: the decode step's GEMV configs chosen by timing the step, saved
for later processes. On CPU the step's time is made up (the real one needs a GPU); the CUDA test searches a tiny
model's step for real."""

from __future__ import annotations

import json

import pytest
import torch

from mmsdk.kernels import step_configs
from mmsdk.kernels.step_configs import (STEP_CONFIGS_ENV, read_step_configs, step_measured_config,
                                        write_step_configs)
from mmsdk.kernels.step_search import (StepSearch, descend, kept_step_ms, one_row_kinds, one_row_trials,
                                       search_decode_step)
from mmsdk.kernels.w4a16_tuning import tuning

GEMV = ("gemv", 1, 96, 4, 32, torch.bfloat16, False, False, True)
GATED = ("gated", 128, 4, 32, torch.bfloat16, False, False)


@pytest.fixture()
def table():
    """The tuner's table, emptied for the test and restored after it."""
    chosen = tuning().chosen
    saved = dict(chosen)
    chosen.clear()
    yield chosen
    chosen.clear()
    chosen.update(saved)


def test_the_search_descends_over_the_tuned_one_row_gemvs_and_keeps_the_fastest(table):
    """one_row_trials names every one-row GEMV the tuner chose for (plain and paired, the tuner's own split-K
    candidates, ``kinds`` filtering them), not the batched or fused ones; descend pins each candidate in turn, keeps
    the fastest per key, records a failing one and leaves the table with its choices."""
    from mmsdk.kernels.w4a16 import gemv_candidates
    from mmsdk.kernels.w4a16_gated import _paired_candidates

    batched = ("gemv", 4, 96, 4, 32, torch.bfloat16, False, False, False)
    table.update({GEMV: gemv_candidates(1, 32)[0], GATED: _paired_candidates(32)[0], batched: (1, 2, 3, 4, "mma")})
    trials = one_row_trials()
    assert [key for key, _ in trials.values()] == [GEMV, GATED]
    assert list(trials)[0] == "gemv 1 96 4 32 bfloat16 False False True"
    plain, paired = (candidates for _, candidates in trials.values())
    assert plain == tuple(c for c in gemv_candidates(1, 32) if len(c) > 4) and len(plain) >= 4
    assert paired == tuple(c for c in _paired_candidates(32) if len(c) > 4)
    only = one_row_trials(("idotr",))
    assert all({c[4] for c in candidates} == {"idotr"} for _, candidates in only.values())

    faster = {(GEMV, plain[2]): 0.05, (GATED, paired[-1]): 0.02}
    failing = (GEMV, plain[1])
    seen = []

    def step_ms():
        if table[GEMV] == failing[1]:
            raise RuntimeError("out of resources")
        seen.append((table[GEMV], table[GATED]))
        return 2.0 - sum(gain for (key, cfg), gain in faster.items() if table[key] == cfg)

    lines = []
    found = descend(trials, step_ms, lines.append)
    assert found.start_ms == 2.0 and found.final_ms == pytest.approx(1.93)
    assert found.chosen == {GEMV: plain[2], GATED: paired[-1]} and table[GEMV] == plain[2]
    assert found.started_with == {label: candidates[0] for label, (_, candidates) in trials.items()}
    assert [t for t in found.trials if "error" in t] == [
        {"label": next(iter(trials)), "cfg": plain[1], "error": "RuntimeError('out of resources')"}]
    assert len(found.trials) == len(plain) - 1 + len(paired) - 1 and len(lines) == len(found.trials)
    assert f"{plain[1]}: failed, RuntimeError('out of resources')" in lines[0]  # the log says which did not run
    # each timing changed at most one key from the choices so far
    assert all(g in (plain[0], plain[2]) or p == paired[0] for g, p in seen)
    table.pop(GATED)
    assert descend(trials, lambda: 1.0).kept[list(trials)[1]] == "not run by this step (no such tuner key)"


def test_kept_step_ms_sizes_the_call_so_the_cache_has_room_for_the_replays(monkeypatch):
    """Each round drops the kept graph, runs one greedy call whose new tokens leave exactly ``replays`` free slots in
    the cache that call sizes, and replays the kept step that many times; no kept step is an error that says why."""
    from mmsdk.kernels import decode_state, fast_generate
    from mmsdk.kernels.decode_state import capacity_for

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = len(replayed)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 0.5 * (end.at - self.at)

    replayed, calls, released = [], [], []
    state = type("State", (), {"step": type("Step", (), {"replay": lambda self: replayed.append(1)})()})()
    model = type("Model", (), {"generate": lambda self, **kw: calls.append(kw)})()
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(fast_generate, "release", lambda m: released.append(m))
    monkeypatch.setattr(decode_state, "kept", lambda m: state)
    for prompt in (5, 1000, 1024 - 73, 1024 - 72):
        calls.clear()
        ms = kept_step_ms(model, {"input_ids": torch.zeros(1, prompt, dtype=torch.long)}, replays=64, rounds=3)
        assert ms == 0.5 and len(calls) == 3
        new = calls[0]["max_new_tokens"]
        assert new >= 8 and calls[0]["do_sample"] is False
        assert capacity_for(prompt + new + 1) - prompt - new - 1 == 64  # the cache fast generate sizes for it
    assert len(released) == 4 * 4  # before each round, and after the last
    monkeypatch.setattr(decode_state, "kept", lambda m: None)
    with pytest.raises(RuntimeError, match="fast generate did not run"):
        kept_step_ms(model, {"input_ids": torch.zeros(1, 5, dtype=torch.long)})


def test_search_decode_step_refuses_what_it_cannot_time(monkeypatch):
    from mmsdk.kernels import TUNE_ENV

    monkeypatch.setenv(TUNE_ENV, "0")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # past the device check
    with pytest.raises(ValueError, match="unset MMSDK_TUNE"):
        search_decode_step(torch.nn.Linear(2, 2), {"input_ids": torch.zeros(1, 5, dtype=torch.long)})
    monkeypatch.undo()
    with pytest.raises(ValueError, match="batch-1"):
        search_decode_step(torch.nn.Linear(2, 2), {"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    with pytest.raises(ValueError, match="CUDA device"):
        search_decode_step(torch.nn.Linear(2, 2), {"input_ids": torch.zeros(1, 5, dtype=torch.long)})
    with pytest.raises(ValueError, match="names no GPU"):
        StepSearch(1.0, 1.0, {}, []).save("unused.json")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr("mmsdk.kernels.timing_enabled", lambda: True)
    assert {"quad", "idot", "idotr", "gated"} <= set(one_row_kinds())
    with pytest.raises(ValueError, match=r"of kind \['idott'\]: name kinds among .*'idotr'"):
        search_decode_step(torch.nn.Linear(2, 2), {"input_ids": torch.zeros(1, 5, dtype=torch.long)},
                           kinds=("idotr", "idott"))
    # a module whose generate is not fast generate, or one off the GPU: refused before any timing
    with pytest.raises(ValueError, match=r"would not take: model.generate is not mmsdk's .*Optimizer\(...\).model"):
        search_decode_step(torch.nn.Linear(2, 2), {"input_ids": torch.zeros(1, 5, dtype=torch.long)})


def test_search_decode_step_tunes_the_step_first_then_descends_and_keeps_other_models_choices(table, monkeypatch):
    """The first timing tunes exactly the GEMVs the step runs (the table is emptied for it); the search reports what
    it will try, then each trial, to ``report``; another model's entries come back afterwards; the result names the
    GPU. The step's time is made up here (the CUDA test times a real one)."""
    from mmsdk.kernels import step_search
    from mmsdk.kernels.w4a16 import gemv_candidates

    other = ("gemv", 1, 8, 1, 32, torch.bfloat16, False, False, False)
    table[other] = (8, 128, 4, 1, "quad", 528)
    plain = tuple(c for c in gemv_candidates(1, 32) if len(c) > 4 and c[4] == "idotr")
    timings = []

    def fake_step_ms(model, inputs):
        assert other not in table  # only this step's GEMVs are in the table while it is searched
        # the trials run each candidate eagerly too: the first tuning compiles both variants side by side
        assert tuning().warm_up == "eager"
        # and every GEMV is timed, even a tiny model's under MMSDK_TUNE_MIN_BYTES, with no earlier process's choice
        assert tuning().times_small_weights and not tuning().use_kept_choices
        table.setdefault(GEMV, plain[0])  # the first timing tunes the step's GEMV
        timings.append(table[GEMV])
        return 1.0 if table[GEMV] == plain[1] else 2.0

    monkeypatch.setattr(step_search, "kept_step_ms", fake_step_ms)
    monkeypatch.setattr(step_search, "fast_path_refusal", lambda model, inputs: None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr("mmsdk.kernels.timing_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    lines = []
    found = search_decode_step(torch.nn.Linear(2, 2), {"input_ids": torch.zeros(1, 5, dtype=torch.long)},
                               kinds=("idotr",), report=lines.append)
    assert found.chosen == {GEMV: plain[1]} and found.final_ms == 1.0 and found.device_name == "Test GPU"
    # the silent first timing is announced (a fresh machine compiles there for minutes), then what it tuned
    assert lines[0].startswith("tuning the decode step's GEMVs on their own first")
    assert lines[1].startswith("tuned 1 GEMVs and ran the step in ") and lines[1].endswith(" s")
    assert lines[2] == f"timing the decode step with up to {len(plain)} candidates over 1 one-row GEMVs"
    assert len(lines) == 3 + len(plain) - 1 and all("ms (best" in line for line in lines[3:])
    assert timings[:2] == [plain[0], plain[0]] and table[other] == (8, 128, 4, 1, "quad", 528)
    assert tuning().warm_up == "captured"  # the tuner's own warm-up again afterwards
    assert not tuning().times_small_weights and tuning().use_kept_choices


def test_the_search_names_why_a_model_would_not_take_the_fast_path(session, tiny):
    """fast_path_refusal: None for an optimized model on the GPU (the CUDA tests below); otherwise why not, in words
    that name the fix: a module that did not come from Optimizer.model, weights off the GPU (a pass not declared safe
    for the fast path: the tune verb's CUDA test)."""
    from mmsdk import Optimizer
    from mmsdk.kernels.step_search import fast_path_refusal

    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    inputs = {"input_ids": torch.zeros(1, 5, dtype=torch.long)}
    assert "Optimizer(...).model" in fast_path_refusal(loaded.model, inputs)
    model = opt.model
    assert "move the model to the GPU" in fast_path_refusal(model, inputs)


def test_tune_verb_refuses_a_bad_output_file_or_a_machine_without_a_gpu(tmp_path, monkeypatch, capsys):
    """``mmsdk tune`` checks its output, its search's settings and its passes before loading anything, and says where
    it has to run."""
    from mmsdk.cli import main as cli
    from mmsdk.kernels import TUNE_ENV

    monkeypatch.delenv(TUNE_ENV, raising=False)
    assert cli(["tune", "tiny:llava", "--apply", "int4-weight", "--out", str(tmp_path / "no" / "f.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text('{"format": "something else"}')
    assert cli(["tune", "tiny:llava", "--apply", "int4-weight", "--out", str(other)]) == 2
    assert "not a step-configs file" in capsys.readouterr().err
    assert other.read_text() == '{"format": "something else"}'  # left as it was
    assert cli(["tune", "tiny:llava", "--apply", "int4-weight", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    new = str(tmp_path / "f.json")
    assert cli(["tune", "tiny:llava", "--apply", "int4-weight", "--kinds", "idotr,nope", "--out", new]) == 2
    assert "of kind ['nope']: name kinds among" in capsys.readouterr().err
    monkeypatch.setenv(TUNE_ENV, "0")
    assert cli(["tune", "tiny:llava", "--apply", "int4-weight", "--out", new]) == 2
    assert f"unset {TUNE_ENV}" in capsys.readouterr().err
    monkeypatch.delenv(TUNE_ENV)
    # a pass that keeps transformers' generate loop, or an unknown one, is refused from its name, before the model
    # loads (a model that does not exist shows that nothing was loaded), on any machine
    unsafe = "int4-weight,token-prune(strategy=fastv,layer=1)"
    assert cli(["tune", "no/such-model", "--apply", unsafe, "--out", new]) == 2
    assert "['token-prune'] are not declared safe for the fast path" in capsys.readouterr().err
    assert cli(["tune", "no/such-model", "--apply", "int4-weight,int9-weight", "--out", new]) == 2
    assert "int9-weight" in capsys.readouterr().err and not (tmp_path / "f.json").exists()
    if not torch.cuda.is_available():
        assert cli(["tune", "tiny:llava", "--apply", "int4-weight", "--out", new]) == 2
        assert "sees no CUDA GPU" in capsys.readouterr().err and not (tmp_path / "f.json").exists()


def test_saved_step_configs_are_what_a_later_process_takes_for_its_gpu(tmp_path, monkeypatch):
    """StepSearch.save writes its choices for its GPU beside the file's other GPUs and keys (temporary file, then a
    rename: nothing else left in the folder); with MMSDK_STEP_CONFIGS=<file> the tuner takes them untimed for that GPU
    only, ahead of the built-in table, and only while they are among the candidates."""
    path = tmp_path / "configs" / "step.json"
    cfg, other = (16, 32, 2, 1, "idotr", 528), (8, 128, 4, 1, "quad", 264)
    StepSearch(2.0, 1.9, {}, [], chosen={GEMV: cfg}, device_name="GPU A").save(path)
    write_step_configs(path, "GPU B", {GEMV: other})
    StepSearch(2.0, 1.9, {}, [], chosen={GATED: other}, device_name="GPU A").save(path)
    assert read_step_configs(path) == {"GPU A": {GEMV: cfg, GATED: other}, "GPU B": {GEMV: other}}
    assert [p.name for p in path.parent.iterdir()] == ["step.json"]
    assert json.loads(path.read_text())["format"] == "mmsdk-step-configs/1"

    names = {0: "GPU A", 1: "GPU B", 2: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[device.index])
    built_in_key = next(iter(step_configs._measured()["NVIDIA H100 80GB HBM3"]))
    built_in = step_configs._measured()["NVIDIA H100 80GB HBM3"][built_in_key]
    monkeypatch.setenv(STEP_CONFIGS_ENV, str(path))
    assert step_measured_config(GEMV, torch.device("cuda", 0), (other, cfg)) == cfg
    assert step_measured_config(GEMV, torch.device("cuda", 1), (other, cfg)) == other
    assert step_measured_config(GEMV, torch.device("cuda", 0), (other,)) is None  # no longer a candidate
    assert step_measured_config(built_in_key, torch.device("cuda", 2), (built_in,)) == built_in  # built-ins stay
    assert step_measured_config(GEMV, torch.device("cpu"), (cfg,)) is None
    monkeypatch.setenv(STEP_CONFIGS_ENV, "0")
    assert step_measured_config(GEMV, torch.device("cuda", 0), (cfg,)) is None


def test_the_tuner_reads_the_step_configs_file_once_while_it_is_unchanged(tmp_path, monkeypatch):
    """The tuner asks for a step-measured config at each GEMV shape it meets; its StepConfigsFile reads the file the
    first time and again only once the file changed (another search saved into it)."""
    path = tmp_path / "step.json"
    cfg, other = (16, 32, 2, 1, "idotr", 528), (8, 128, 4, 1, "quad", 264)
    write_step_configs(path, "GPU A", {GEMV: cfg})
    reads = []
    monkeypatch.setattr(step_configs, "read_step_configs", lambda p: reads.append(p) or read_step_configs(p))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "GPU A")
    monkeypatch.setenv(STEP_CONFIGS_ENV, str(path))
    read = step_configs.StepConfigsFile()
    for key in (GEMV, GATED, GEMV):
        step_measured_config(key, torch.device("cuda", 0), (cfg, other), read)
    assert len(reads) == 1
    write_step_configs(path, "GPU A", {GEMV: other, GATED: other})
    assert step_measured_config(GEMV, torch.device("cuda", 0), (cfg, other), read) == other
    assert step_measured_config(GATED, torch.device("cuda", 0), (cfg, other), read) == other
    assert len(reads) == 3  # once more for the change (and once inside write_step_configs, which merges)
    path.unlink()
    with pytest.raises(FileNotFoundError, match=r"`mmsdk tune` \(or .*StepSearch.save\) wrote"):
        step_measured_config(GEMV, torch.device("cuda", 0), (cfg, other), read)


def test_a_bad_step_configs_file_is_an_error_that_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "GPU A")
    monkeypatch.setenv(STEP_CONFIGS_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match=r"`mmsdk tune` \(or .*StepSearch.save\) wrote"):
        step_measured_config(GEMV, torch.device("cuda", 0), ())
    for text, match in (("{not json", "is not JSON"), ('{"gpus": {}}', "is not a step-configs file"),
                        ('{"format": "mmsdk-step-configs/1", "gpus": {"GPU A": [{"key": [{"dtype": "nope"}], '
                         '"config": [1]}]}}', "names no torch dtype")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=match):
            read_step_configs(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="cannot store"):
        write_step_configs(tmp_path / "out.json", "GPU A", {GEMV: (object(),)})
    assert not (tmp_path / "out.json").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_real_step_search_on_a_tiny_model_keeps_its_answers(session, tiny, tmp_path, monkeypatch):
    """search_decode_step on a bf16 tiny LLaVA with the full decode stack (the tuner timing, as it does outside
    tests): it times the real kept step, tries the "idotr" candidates of every one-row GEMV the step ran, and what it
    saves is what the tuner takes in a fresh table with the file named."""
    from mmsdk import Optimizer
    from mmsdk.kernels import TUNE_ENV
    from mmsdk.kernels.fast_generate import release
    from mmsdk.kernels.step_search import fast_path_refusal
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig
    from mmsdk.testing import tiny_inputs

    loaded = tiny("tiny:llava")
    opt = Optimizer(loaded.model.cuda().to(torch.bfloat16), loaded.processor, session=session)
    opt.apply("qkv-fuse", Int4WeightConfig(indivisible="pad"), "rmsnorm-rope-fusion", "int4-kv")
    inputs = {k: v.cuda() for k, v in tiny_inputs(loaded.processor, ("what digit is this ?",)).items()}
    monkeypatch.setenv(TUNE_ENV, "1")  # untimed, the tuner keeps no choice to search from
    chosen = tuning().chosen
    saved = dict(chosen)
    stale = ("gemv", 1, 8, 1, 32, torch.bfloat16, False, False, False)  # another model's GEMV, tuned earlier
    try:
        chosen.clear()
        chosen[stale] = (8, 128, 4, 1, "quad", 528)
        assert fast_path_refusal(opt.model, inputs) is None
        found = search_decode_step(opt.model, inputs, kinds=("idotr",))
        assert chosen[stale] == (8, 128, 4, 1, "quad", 528) and stale not in found.chosen
        assert found.start_ms > 0 and found.final_ms > 0 and found.chosen
        assert found.device_name == torch.cuda.get_device_name()
        assert all(chosen[key] == cfg for key, cfg in found.chosen.items())
        assert len(found.trials) >= len(found.chosen)
        path = found.save(tmp_path / "step.json")
        chosen.clear()
        monkeypatch.setenv(STEP_CONFIGS_ENV, str(path))
        release(opt.model)
        with torch.no_grad():
            opt.model.generate(**inputs, max_new_tokens=6, do_sample=False)
        assert all(chosen[key] == cfg for key, cfg in found.chosen.items())
    finally:
        chosen.clear()
        chosen.update(saved)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_the_tune_verb_searches_a_tiny_model_and_writes_what_a_later_process_takes(tmp_path, monkeypatch, capsys):
    """``mmsdk tune`` on a tiny LLaVA with the full decode stack ("idotr" candidates only, to keep it short): the file
    it writes holds this GPU's kept configs, which the tuner then takes untimed; an unknown kind, and a pass that keeps
    transformers' generate loop, are refused."""
    from mmsdk.cli import main as cli
    from mmsdk.kernels import TUNE_ENV

    monkeypatch.setenv(TUNE_ENV, "1")
    passes = "qkv-fuse,int4-weight(indivisible=pad),rmsnorm-rope-fusion,int4-kv"
    out = tmp_path / "step.json"
    saved = dict(tuning().chosen)
    tuning().chosen.clear()  # so the table afterwards holds this step's GEMVs only
    try:
        assert cli(["tune", "tiny:llava", "--apply", passes, "--kinds", "idotr", "--out", str(out)]) == 0
        captured = capsys.readouterr()
        printed = captured.out
        assert f"{STEP_CONFIGS_ENV}={out.resolve()}" in printed and "idotr" in printed
        # the progress goes to stderr as the search runs: its first tuning, what it will try, then each trial
        assert "tuning the decode step's GEMVs on their own first" in captured.err
        assert "timing the decode step with up to" in captured.err and "ms (best" in captured.err
        kept = read_step_configs(out)[torch.cuda.get_device_name()]
        # every one-row GEMV the step ran is in the file, with the choice the search left in the table
        assert kept and set(kept) == {key for key, _ in one_row_trials(("idotr",)).values()}
        assert all(tuning().chosen[key] == config for key, config in kept.items())
        tuning().chosen.clear()
        monkeypatch.setenv(STEP_CONFIGS_ENV, str(out))
        for key, config in kept.items():
            assert step_measured_config(key, torch.device("cuda"), (config,)) == config
        assert cli(["tune", "tiny:llava", "--apply", passes, "--kinds", "nope", "--out", str(out)]) == 2
        assert "name kinds among" in capsys.readouterr().err
        # a pass that keeps transformers' loop (token-prune's fastv): refused by name before the model loads
        unsafe = "int4-weight(indivisible=pad),token-prune(strategy=fastv,layer=1)"
        assert cli(["tune", "tiny:llava", "--apply", unsafe, "--out", str(out)]) == 2
        assert "not declared safe for the fast path" in capsys.readouterr().err
        assert read_step_configs(out)[torch.cuda.get_device_name()] == kept  # the refused runs left the file alone
    finally:
        tuning().chosen.clear()
        tuning().chosen.update(saved)
