"""Batch-1 decode of IDEFICS-9B shapes (random bf16 weights, CUDA only): what projecting the image K/V once per call
instead of at every step buys.

IDEFICS's 8 gated cross-attention layers (one before every 4th decoder layer) receive the perceiver's 64 image
latents (1280 wide) and project them to K and V (4096 wide) at every forward. Fast generate's decode steps now read
products made once per call (mmsdk/kernels/step_projections.py); before, the captured step replayed those 16 GEMMs
(with int4-kv also the rounding of their products) at every token. For each stack this script captures the kept
step with and without the stand-in (the "without" row patches ``StepProjections.standing_in`` to do nothing, as the
code before it did) and times the kept graph's replays with CUDA events. Both answers are compared token by token.

Shapes (IDEFICS-9B): Llama-7B text (4096 hidden, 11008 MLP, 32 layers, 32 heads, vocab 32000 + 2), cross-attention
every 4 layers, ViT-H/14 vision (1280 wide, 32 layers, 224-pixel images), perceiver resampler (6 layers, 16 heads of
96, 64 latents). Gates set to 0.5 (a random model's are 0). A 64-token prompt after one image, 96 new tokens, then
the kept step replayed 32 times (the cache has room: capacity 256 slots).

    python benchmarks/gpu_idefics_decode.py --out idefics_decode.json
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

    from benchmarks.gpu_models import bf16_model

    model = bf16_model(IdeficsForVisionText2Text, idefics_config())
    with torch.no_grad():
        for name, gate in model.named_parameters():
            if name.endswith(("alpha_cross_attn", "alpha_dense")):
                gate.fill_(0.5)
    model.generation_config.eos_token_id = None  # random weights: decode the full length every time
    model.generation_config.pad_token_id = 0
    return model


def idefics_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(3, 32000, (1, PROMPT), device="cuda", generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(1, 1, 3, 224, 224, device="cuda", dtype=torch.bfloat16, generator=gen),
            "image_attention_mask": torch.ones(1, PROMPT, 1, dtype=torch.long, device="cuda")}


@contextmanager
def projecting_every_step() -> Iterator[None]:
    """The decode step as it was before the stand-in: each step projects the image states itself."""
    from mmsdk.kernels.step_projections import StepProjections

    @contextmanager
    def nothing(self: StepProjections) -> Iterator[None]:
        yield

    before = StepProjections.standing_in
    StepProjections.standing_in = nothing  # type: ignore[method-assign]
    try:
        yield
    finally:
        StepProjections.standing_in = before  # type: ignore[method-assign]


def replay_ms(model: Any, inputs: dict[str, Any]) -> tuple[float, torch.Tensor]:
    """(ms per replay of the kept step after a fresh capture, the capturing call's answer)."""
    from mmsdk.kernels.decode_state import kept
    from mmsdk.kernels.fast_generate import release

    release(model)
    answer = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    times = []
    for _ in range(3):
        model.generate(**inputs, max_new_tokens=NEW, do_sample=False)  # refills the kept step
        step = kept(model).step
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            step.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPLAYS)
    return statistics.median(times), answer


def main() -> None:
    from benchmarks.gpu_models import attach_int4_kv
    from benchmarks.gpu_suite import release_memory, section_env
    from mmsdk import Optimizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result: dict[str, Any] = {"env": section_env(), "rows": []}
    inputs = idefics_inputs()
    stacks = (("bf16", (), False), ("int4-weight", ("int4-weight",), False),
              ("int4-weight + int4-kv", ("int4-weight",), True))
    for name, passes, kv in stacks:
        opt = Optimizer(build_idefics(), None)
        if passes:
            opt.apply(*passes)
        if kv:
            attach_int4_kv(opt.model, opt.adapter)
        model = opt.model
        row: dict[str, Any] = {"stack": name}
        for label in ("every_step", "once_per_call", "every_step_again", "once_per_call_again"):
            if label.startswith("every_step"):
                with projecting_every_step():
                    row[f"{label}_ms"], answer = replay_ms(model, inputs)
            else:
                row[f"{label}_ms"], answer = replay_ms(model, inputs)
            row.setdefault("answers", []).append(answer)
        answers = row.pop("answers")
        row["answers_equal"] = all(torch.equal(answers[0], a) for a in answers[1:])
        row["saved_ms"] = (statistics.mean([row["every_step_ms"], row["every_step_again_ms"]])
                           - statistics.mean([row["once_per_call_ms"], row["once_per_call_again_ms"]]))
        result["rows"].append(row)
        print(row, flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        del opt, model
        release_memory()


if __name__ == "__main__":
    main()
