"""Do kernels that merge their own splits make a decode step faster? An A/B in one process.

The switch is an environment variable read when the step is captured (its two settings in brackets):

* ``--switch kv`` (``MMSDK_KV_MERGE`` 0 / 1, 1 the default): the int4 MHA decode kernel merges its splits itself, or
  a combine kernel does; LLaVA-1.5-7B shapes.

(Two more switches, removed with what they switched once measured here, made the decode step no faster: the
grouped-query decode kernel merging its own splits, 1.871 -> 1.937 ms per Qwen2-VL-7B step at a 1k prompt, and the
batch-1 INT4 GEMVs summing their own K slices, 1.761 -> 1.761 ms per LLaVA step: docs/benchmarks.md, thirty-second
pass.)

Random bf16 weights built on the GPU, qkv-fuse + int4-weight + rmsnorm-rope-fusion + int4-kv, batch 1, a text prompt.
Each round captures the kept decode step once with each setting, in alternating order, and times:

* ``--measure replay`` (default): the kept step's graph replayed 64 times after a 128-token call, CUDA events
  (benchmarks/gpu_decode_reuse.py), median of 3, at 1k and 4k prompts;
* ``--measure wall``: ``(t(256 new) - t(128 new)) / 128`` from whole generate calls (medians of 3), at a 1k prompt.
  Its spread between rounds (about 0.4 ms per step on the H200) is far larger than the differences sought.

    python benchmarks/gpu_merge_step.py --out merge_step.json [--switch kv] [--measure replay|wall]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import torch

from benchmarks.gpu_decode_reuse import _replay_after_call, call_ms, text_prompt
from benchmarks.gpu_suite import build_llava, optimized, section_env, timed_calls
from mmsdk.kernels import KV_MERGE_ENV

ROUNDS = 3
# switch -> (variable, (setting without the merge, setting with it))
SWITCHES = {"kv": (KV_MERGE_ENV, ("0", "1"))}
MODEL = "llava"  # gpu_decode_reuse.text_prompt's name for LLaVA-1.5-7B's prompt


def llava_model() -> Any:
    """The optimized model: LLaVA-1.5-7B shapes, INT4 weights in groups of 32."""
    return optimized(build_llava(), ("qkv-fuse", "int4-weight", "rmsnorm-rope-fusion"), kv=True)


def setting(model: Any, variable: str, value: str) -> None:
    """``variable=value`` for the next capture: the kept decode state goes, since a kept graph keeps the kernels it
    was captured with whatever the variable says now."""
    from mmsdk.kernels.fast_generate import release

    os.environ[variable] = value
    release(model)


def replay_ms(model: Any, inputs: dict[str, Any]) -> float:
    call_ms(model, inputs, 128, 1)
    return statistics.median(_replay_after_call(model, inputs) for _ in range(3))


def wall_step_ms(model: Any, inputs: dict[str, Any]) -> float:
    model.generate(**inputs, max_new_tokens=256, do_sample=False)  # a cache for both lengths, captured now
    tn = statistics.median(timed_calls(model.generate, inputs, 128, 3))
    t2n = statistics.median(timed_calls(model.generate, inputs, 256, 3))
    return (t2n - tn) / 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--measure", choices=("replay", "wall"), default="replay")
    parser.add_argument("--switch", choices=tuple(SWITCHES), default="kv")
    args = parser.parse_args()
    variable, (separate, merged) = SWITCHES[args.switch]
    model = llava_model()
    result: dict[str, Any] = {"env": section_env(), "measure": args.measure, "variable": variable, "model": MODEL,
                              "settings": [separate, merged], "rows": [], "medians": {}}
    measure = replay_ms if args.measure == "replay" else wall_step_ms
    for ctx in (1024, 4096) if args.measure == "replay" else (1024,):
        inputs = text_prompt(MODEL, ctx)
        answers = {}
        for value in (separate, merged):
            setting(model, variable, value)
            answers[value] = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        result[f"ctx{ctx}_tokens_equal"] = bool(torch.equal(answers[separate], answers[merged]))
        for round_ in range(ROUNDS):
            for value in (separate, merged) if round_ % 2 == 0 else (merged, separate):
                setting(model, variable, value)
                row = {"ctx": ctx, "round": round_, "merge": value == merged, "step_ms": measure(model, inputs)}
                result["rows"].append(row)
                print(row, flush=True)
        for merge in (False, True):
            result["medians"][f"ctx{ctx}_{'merged' if merge else 'separate'}_ms"] = statistics.median(
                r["step_ms"] for r in result["rows"] if r["ctx"] == ctx and r["merge"] == merge)
        print(result["medians"], flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
