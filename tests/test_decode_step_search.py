"""benchmarks/gpu_decode_reuse.py --search: the coordinate descent over the step's GEMV configs, with the step's time
made up (the real one needs a GPU): it keeps the fastest config per GEMV, skips configs that fail, and leaves the
tuner's table as it chose."""

from __future__ import annotations

import pytest


def test_search_keeps_the_fastest_config_of_each_step_gemv(monkeypatch):
    import benchmarks.gpu_decode_reuse as reuse
    from mmsdk.kernels import fast_generate
    from mmsdk.kernels.w4a16_tuning import tuning

    shapes = reuse.shape_keys("llava", 32)
    keys = {name: reuse._tuner_key(shape) for name, shape in shapes.items()}
    candidates = {name: reuse.search_candidates(shape) for name, shape in shapes.items()}
    assert all(len(c) >= 4 for c in candidates.values())
    assert {c[4] for c in candidates["gated"]} == {"gated", "idot", "idotr"}
    assert {c[4] for c in candidates["qkv"]} == {"quad", "quadp", "idot", "idotr"}
    only_idot = {name: reuse.search_candidates(shape, ("idot",)) for name, shape in shapes.items()}
    assert all(c and {cfg[4] for cfg in c} == {"idot"} for c in only_idot.values())
    table = tuning().chosen
    saved = dict(table)
    try:
        for name in ("qkv", "o_proj", "gated"):  # down, q/k/v with statistics: not run by this "step" (no tuner entry)
            table[keys[name]] = candidates[name][0]
        table.pop(keys["down"], None)
        table.pop(keys["qkv_statistics"], None)
        faster = {("qkv", candidates["qkv"][2]): 0.05, ("gated", candidates["gated"][-1]): 0.03}
        failing = ("o_proj", candidates["o_proj"][1])
        captured = []

        def step_ms(model, inputs):  # what one call and the replays would measure with the table as it is
            if table[keys[failing[0]]] == failing[1]:
                raise RuntimeError("out of resources")
            captured.append(dict(table))
            return 2.0 - sum(gain for (name, cfg), gain in faster.items() if table[keys[name]] == cfg)

        monkeypatch.setattr(reuse, "_replay_after_call", step_ms)
        monkeypatch.setattr(fast_generate, "release", lambda model: None)
        only = reuse.search_step(object(), {}, "llava", 32, projections=("o_proj",), kinds=("idot",))
        assert list(only["kept"]) == ["o_proj"]
        assert [(t["projection"], t["cfg"]) for t in only["trials"]] == [("o_proj", c) for c in only_idot["o_proj"]]
        with pytest.raises(ValueError, match="the step's projections are"):
            reuse.search_step(object(), {}, "llava", 32, projections=("o-proj",))
        for name in ("qkv", "o_proj", "gated"):
            table[keys[name]] = candidates[name][0]
        captured.clear()
        out = reuse.search_step(object(), {}, "llava", 32)
        unrun = "not run by this step (no such tuner key)"
        assert out["kept"] == {"qkv": candidates["qkv"][2], "qkv_statistics": unrun, "o_proj": candidates["o_proj"][0],
                               "down": unrun, "gated": candidates["gated"][-1]}
        assert out["start_ms"] == 2.0 and out["final_ms"] == pytest.approx(1.92)
        assert [t for t in out["trials"] if "error" in t] == [
            {"projection": "o_proj", "cfg": failing[1], "error": "RuntimeError('out of resources')"}]
        tried = [(t["projection"], t["cfg"]) for t in out["trials"]]
        assert len(tried) == len(set(tried)) == sum(len(candidates[n]) - 1 for n in ("qkv", "o_proj", "gated"))
        # each trial changed one GEMV's config, the others as chosen so far; the table keeps the choices
        assert all(sum(trial[keys[n]] != captured[0][keys[n]] for n in ("qkv", "o_proj", "gated")) <= 2
                   for trial in captured)
        assert table[keys["qkv"]] == candidates["qkv"][2] and table[keys["gated"]] == candidates["gated"][-1]
        # what --save writes: the kept configs of the projections the step ran, by their tuner keys
        assert reuse.kept_configs(out, "llava", 32) == {keys["qkv"]: candidates["qkv"][2],
                                                        keys["o_proj"]: candidates["o_proj"][0],
                                                        keys["gated"]: candidates["gated"][-1]}
    finally:
        table.clear()
        table.update(saved)


def test_step_shape_keys_follow_the_group_size_and_name_the_step_tables_entries():
    """The search's tuner keys for each model and group size: K counted in groups of the stack's size; and every key
    the step-measured tables answer is one the search tries for a benchmarked model and group size."""
    import benchmarks.gpu_decode_reuse as reuse
    from mmsdk.kernels.step_configs import _measured
    from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig

    assert reuse.stack_group(reuse.stacks()["g128"][2]) == 128
    assert reuse.stack_group(reuse.stacks()["g32"][2]) == Int4WeightConfig().group_size == 32
    assert reuse.stack_group(reuse.stacks()["qwen_g128"][2]) == 128
    g128 = reuse.shape_keys("llava", 128)
    assert g128["down"] == ("gemv", 1, 4096, 86, 128, False, False)
    assert g128["gated"] == ("gated", 11008, 32, 128, False)
    assert reuse.shape_keys("llava", 32)["down"][3] == 344 and reuse.shape_keys("qwen2-vl", 128)["qkv"][5] is True
    searched = {reuse._tuner_key(shape) for model, group in (("llava", 32), ("llava", 128), ("qwen2-vl", 128))
                for shape in reuse.shape_keys(model, group).values()}
    for gpu, table in _measured().items():
        assert table and set(table) <= searched, (gpu, set(table) - searched)
    pinned = reuse.pinned_configs("qwen_g128_one_slice_down", 128)
    assert list(pinned) == [reuse._tuner_key(reuse.shape_keys("qwen2-vl", 128)["down"])]


def test_attention_search_times_each_kv_config_and_restores_the_kernel(monkeypatch):
    """--search-attention: every candidate reaches decode_attention as its config (unless a caller passes one), a
    launch trial turns the kernel's PDL checks off for its step only, a failing candidate is recorded, and
    decode_attention and the checks are the original functions afterwards."""
    import benchmarks.gpu_decode_reuse as reuse
    import mmsdk.kernels.kv_decode as kv_decode
    from mmsdk.kernels import fast_generate

    original = kv_decode.decode_attention
    checks = {name: getattr(kv_decode, name) for names in reuse._LAUNCH_TRIALS.values() for name in names}
    seen = []

    def fake_attention(*args, config=None, **kwargs):
        seen.append(config)
        return config

    monkeypatch.setattr(kv_decode, "decode_attention", fake_attention)
    candidates = reuse._ATTENTION_CANDIDATES["qwen2-vl"]
    assert {c for c in candidates if isinstance(c, str)} == set(reuse._LAUNCH_TRIALS)
    # what each candidate looks like from inside the step: its config, or the checks answering False
    keys = [c if not isinstance(c, str) else reuse._LAUNCH_TRIALS[c] for c in candidates]
    failing = keys[1]

    def step_ms(model, inputs):  # the step "calls" the kernel as static_kv does: nine positional arguments
        config = kv_decode.decode_attention(*range(9), append=None, rope=None)
        assert kv_decode.decode_attention(*range(9), config=(1, 2, 3)) == (1, 2, 3)  # a caller's config stays
        off = tuple(name for name, check in checks.items() if getattr(kv_decode, name) is not check)
        assert all(getattr(kv_decode, name)(None) is False for name in off)
        key = config if config is not None else off or None
        if key == failing:
            raise RuntimeError("out of resources")
        return 2.0 if key is None else 1.0 + keys.index(key) / 100

    monkeypatch.setattr(reuse, "_replay_after_call", step_ms)
    monkeypatch.setattr(fast_generate, "release", lambda model: None)
    out = reuse.search_attention(object(), {}, "qwen2-vl")
    assert out["default_ms"] == out["default_again_ms"] == 2.0
    assert [t["cfg"] for t in out["trials"]] == candidates
    assert out["trials"][1] == {"cfg": candidates[1], "error": "RuntimeError('out of resources')"}
    assert [t.get("step_ms") for t in out["trials"]] == [pytest.approx(1.0 + i / 100) if i != 1 else None
                                                         for i in range(len(candidates))]
    assert kv_decode.decode_attention is fake_attention
    assert all(getattr(kv_decode, name) is check for name, check in checks.items())
    assert set(seen) >= {None, (1, 2, 3), *(c for c in candidates if not isinstance(c, str))}
    monkeypatch.undo()
    assert kv_decode.decode_attention is original


def test_timing_only_stacks_replace_their_kernels_and_restore_them():
    """The ``_free`` stacks: "combine" stands in a launch-nothing for both attention combines (MHA's and grouped
    heads'), "norms" makes the RMSNorms return their input; everything is as before after the block."""
    pytest.importorskip("triton")
    import benchmarks.gpu_decode_reuse as reuse
    import mmsdk.kernels._split_merge_triton as merging
    import mmsdk.kernels.norm_rope_gpu as norm_ops

    combines = (merging.decode_combine_natural, merging.decode_combine)
    norms = (norm_ops.rms_norm, norm_ops.add_rms_norm)
    assert reuse.stacks()["qwen_g128_combine_free"][1] == "qwen2-vl"
    for stack in ("g32_combine_free", "qwen_g128_combine_free"):
        with reuse.kernels_made_free(stack):
            for kernel in (merging.decode_combine_natural, merging.decode_combine):
                assert kernel not in combines and kernel[(4,)](1, 2, PDL=True) is None
            assert (norm_ops.rms_norm, norm_ops.add_rms_norm) == norms
        assert (merging.decode_combine_natural, merging.decode_combine) == combines
    with reuse.kernels_made_free("g32_norms_free"):
        assert norm_ops.rms_norm("x", None, 1e-6) == "x" and norm_ops.add_rms_norm("x", "r", None, 1e-6) == ("x", "x")
        assert (merging.decode_combine_natural, merging.decode_combine) == combines
    with reuse.kernels_made_free("qwen_g128"):  # a real stack: nothing replaced
        assert (merging.decode_combine_natural, merging.decode_combine) == combines
    assert (norm_ops.rms_norm, norm_ops.add_rms_norm) == norms


def test_against_tuner_times_the_step_with_the_tuners_own_picks_and_restores_the_table(monkeypatch):
    """--against-tuner: the keys the step-measured table answered are dropped and the table turned off while the
    step is timed (so the tuner times them), then the table's answers and the environment are as before."""
    import torch

    from benchmarks._step_against_tuner import step_with_tuner_picks
    from mmsdk.kernels import fast_generate, step_configs
    from mmsdk.kernels.w4a16_tuning import tuning

    answered, other = ("test", "answered"), ("test", "tuned alone")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(step_configs, "step_measured_config",
                        lambda key, device, candidates: (1,) if key == answered and candidates == ((1,),) else None)
    monkeypatch.setattr(fast_generate, "release", lambda model: None)
    monkeypatch.delenv(step_configs.STEP_CONFIGS_ENV, raising=False)
    table = tuning().chosen
    table.update({answered: (1,), other: (5,)})

    def step_ms(model, inputs):
        assert step_configs.os.environ[step_configs.STEP_CONFIGS_ENV] == "0" and answered not in table
        table[answered] = (2,)  # what the tuner picks when it times the key itself
        return 3.5

    try:
        out = step_with_tuner_picks(object(), {}, step_ms)
        assert out["step_ms"] == 3.5 and out["tuner_picks"] == {str(answered): (2,)}
        assert out["step_measured"] == {str(answered): (1,)}
        assert table[answered] == (1,) and table[other] == (5,)
        assert step_configs.STEP_CONFIGS_ENV not in step_configs.os.environ
    finally:
        table.pop(answered, None)
        table.pop(other, None)


def test_fresh_process_ab_alternates_processes_without_and_with_the_saved_configs(monkeypatch):
    """--ab-rounds: per stack, pairs of new processes of this benchmark (--step-only), the first of each pair with
    MMSDK_STEP_CONFIGS unset (even where this process had it set), the second with the saved file; a child that
    fails is an error that shows its output. Each process's configs are kept, and the shapes whose config varied
    between the processes of one arm are named."""
    import json
    from pathlib import Path

    import benchmarks.gpu_decode_reuse as reuse
    from mmsdk.kernels.step_configs import STEP_CONFIGS_ENV

    monkeypatch.setenv(STEP_CONFIGS_ENV, "0")
    calls = []

    class Finished:
        returncode, stderr = 0, ""

    def run(command, env, capture_output, text):
        stack = command[command.index("--stacks") + 1]
        configs = env.get(STEP_CONFIGS_ENV)
        calls.append((stack, configs))
        assert command[-3:-1] == ["--step-only", "--out"] and Path(command[1]).name == "gpu_decode_reuse.py"
        step = {"g32": 2.0, "g128": 2.1}[stack] - (0.05 if configs else 0.0) + 0.001 * len(calls)
        # the saved file answers "down"; the tuner's "o_proj" pick differs in the second g128 process without the file
        picks = {"down": [16, 64, 4, 1, "idotr" if configs else "quad", 528], "o_proj": [8, 128, 4, 1, "quad", 264]}
        if stack == "g128" and not configs and len(calls) == 7:
            picks["o_proj"] = [16, 64, 4, 1, "idotr", 528]
        Path(command[-1]).write_text(json.dumps({"rows": [{"step_ms": step, "gemv_configs": picks}]}))
        return Finished()

    out = reuse.fresh_process_ab(["g32", "g128"], "/tmp/saved.json", 2, 5, run)
    assert calls == [("g32", None), ("g32", "/tmp/saved.json")] * 2 + [("g128", None), ("g128", "/tmp/saved.json")] * 2
    assert out["g32"]["tuner_ms"] == pytest.approx([2.001, 2.003])
    assert out["g32"]["saved_ms"] == pytest.approx([1.952, 1.954])
    assert out["g128"]["saved_median_ms"] == pytest.approx(2.057)
    assert out["g128"]["tuner_median_ms"] == pytest.approx(2.106)
    assert out["g32"]["tuner_configs"][0]["down"][4] == "quad" and out["g32"]["saved_configs"][1]["down"][4] == "idotr"
    assert out["g32"]["tuner_varied"] == out["g32"]["saved_varied"] == out["g128"]["saved_varied"] == []
    assert out["g128"]["tuner_varied"] == ["o_proj"]

    class Failed:
        returncode, stderr = 1, "CUDA out of memory"

    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        reuse.fresh_step("g32", None, 5, lambda command, **kwargs: Failed())
