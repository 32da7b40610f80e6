"""Batch-1 decode of IDEFICS-9B shapes (random bf16 weights, CUDA only): what projecting the image K/V once per call
instead of at every step buys.

IDEFICS's 8 gated cross-attention layers (one before every 4th decoder layer) receive the perceiver's 64 image
latents (1280 wide) and project them to K and V (4096 wide) at every forward. Fast generate's decode steps now read
products made once per call (mmsdk/kernels/step_projections.py); before, the captured step replayed those 16 GEMMs
(with int4-kv also the rounding of their products) at every token. transformers also hands every step the vision
encoder's states and runs the perceiver resampler on them again at every step; fast generate now resamples them
once after the prefill. For each stack this script captures the kept step as before (both at every step), with the
perceiver once, and as now, twice each in turn (:func:`as_before` patches the two changes out), and times the kept
graph's replays with CUDA events. The answers are compared token by token. Each stack's model is also timed through
transformers' own generate (``(t(96 new) - t(1 new)) / 95``, medians of 3), the unoptimized loop.

Shapes (IDEFICS-9B): Llama-7B text (4096 hidden, 11008 MLP, 32 layers, 32 heads, vocab 32000 + 2), cross-attention
every 4 layers, ViT-H/14 vision (1280 wide, 32 layers, 224-pixel images), perceiver resampler (6 layers, 16 heads of
96, 64 latents). Gates set to 0.5 (a random model's are 0). A 64-token prompt after one image, 96 new tokens, then
the kept step replayed 32 times (the cache has room: capacity 256 slots).

    python benchmarks/gpu_idefics_decode.py --out idefics_decode.json [--stacks 0,1,2,3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

PROMPT, NEW, REPLAYS = 64, 96, 32


def idefics_config() -> Any:
    from transformers import IdeficsConfig

    vision = dict(embed_dim=1280, image_size=224, patch_size=14, num_hidden_layers=32, num_attention_heads=16,
                  intermediate_size=5120)
    perceiver = dict(use_resampler=True, resampler_n_latents=64, resampler_depth=6, resampler_n_heads=16,
                     resampler_head_dim=96)
    config = IdeficsConfig(vocab_size=32000, additional_vocab_size=2, hidden_size=4096, intermediate_size=11008,
                           num_hidden_layers=32, num_attention_heads=32, cross_layer_interval=4, alpha_type="float",
                           use_resampler=True, vision_config=vision, perceiver_config=perceiver, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    return config


def build_idefics() -> Any:
    from transformers import IdeficsForVisionText2Text

    from benchmarks.gpu_models import cross_attention_model

    return cross_attention_model(IdeficsForVisionText2Text, idefics_config(), ("alpha_cross_attn", "alpha_dense"), 0)


def idefics_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(3, 32000, (1, PROMPT), device="cuda", generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(1, 1, 3, 224, 224, device="cuda", dtype=torch.bfloat16, generator=gen),
            "image_attention_mask": torch.ones(1, PROMPT, 1, dtype=torch.long, device="cuda")}


@contextmanager
def as_before(resample: bool, project: bool) -> Iterator[None]:
    """The decode step as it was before: with ``resample`` each step runs the perceiver on the encoder's states (the
    adapter hands the steps those, as transformers does), with ``project`` each step projects the image states."""
    from mmsdk.kernels.step_projections import StepProjections
    from mmsdk.plugins.adapters.flamingo import IdeficsAdapter

    @contextmanager
    def nothing(self: StepProjections) -> Iterator[None]:
        yield

    def encoder_states(self: Any, model: Any, prompt_inputs: Any, prefill_output: Any) -> dict[str, Any]:
        inputs = step_inputs(self, model, prompt_inputs, prefill_output)
        # releases whose output carries no encoder states (5.17) hand the steps the resampled states themselves
        if "perceiver_embeddings" in inputs and getattr(prefill_output, "image_outputs", None) is not None:
            del inputs["perceiver_embeddings"]
            inputs["image_encoder_embeddings"] = prefill_output.image_outputs.last_hidden_state
        return inputs

    standing_in, step_inputs = StepProjections.standing_in, IdeficsAdapter.decode_step_inputs
    if project:
        StepProjections.standing_in = nothing  # type: ignore[method-assign]
    if resample:
        IdeficsAdapter.decode_step_inputs = encoder_states  # type: ignore[method-assign]
    try:
        yield
    finally:
        StepProjections.standing_in = standing_in  # type: ignore[method-assign]
        IdeficsAdapter.decode_step_inputs = step_inputs  # type: ignore[method-assign]


VARIANTS = {"before (perceiver + projections every step)": (True, True),
            "perceiver once, projections every step": (False, True),
            "now (both once per call)": (False, False)}


def replay_ms(model: Any, inputs: dict[str, Any]) -> tuple[float, torch.Tensor]:
    """(ms per replay of the kept step after a fresh capture, the capturing call's answer)."""
    from mmsdk.kernels.fast_generate import release
    from mmsdk.kernels.step_search import replay_kept_step_ms

    release(model)
    answer = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    times = []
    for _ in range(3):
        model.generate(**inputs, max_new_tokens=NEW, do_sample=False)  # refills the kept step
        times.append(replay_kept_step_ms(model, REPLAYS))
    return statistics.median(times), answer


def main() -> None:
    from benchmarks.gpu_models import attach_int4_kv
    from benchmarks.gpu_suite import release_memory, section_env, timed_calls
    from mmsdk import Optimizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--stacks", default="0,1,2,3", help="which stacks, by index (bf16, int4-weight, "
                        "int4-weight + int4-kv, int4-kv)")
    args = parser.parse_args()
    result: dict[str, Any] = {"env": section_env(), "rows": [], "note": "with transformers releases whose generate "
                              "hands the steps the resampled states (5.17), 'before' resamples once as well"}
    inputs = idefics_inputs()
    stacks = (("bf16", (), False), ("int4-weight", ("int4-weight",), False),
              ("int4-weight + int4-kv", ("int4-weight",), True), ("int4-kv", (), True))
    for name, passes, kv in (stacks[int(i)] for i in args.stacks.split(",")):
        opt = Optimizer(build_idefics(), None)
        if passes:
            opt.apply(*passes)
        if kv:
            attach_int4_kv(opt.model, opt.adapter)
        model = opt.model
        row: dict[str, Any] = {"stack": name, "step_ms": {}}
        answers = []
        for round_ in range(2):  # each variant twice, in turn
            for variant, (resample, project) in VARIANTS.items():
                with as_before(resample, project):
                    ms, answer = replay_ms(model, inputs)
                row["step_ms"].setdefault(variant, []).append(ms)
                answers.append(answer)
        row["answers_equal"] = all(torch.equal(answers[0], a) for a in answers[1:])
        row["median_step_ms"] = {v: statistics.median(t) for v, t in row["step_ms"].items()}
        # the unoptimized baseline: transformers' own generate on the same model (its passes applied)
        t1, tn = (statistics.median(timed_calls(type(model).generate.__get__(model), inputs, n, 3)) for n in (1, NEW))
        row["transformers_generate_step_ms"] = (tn - t1) / (NEW - 1)
        result["rows"].append(row)
        print(row, flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        del opt, model
        release_memory()


if __name__ == "__main__":
    main()
