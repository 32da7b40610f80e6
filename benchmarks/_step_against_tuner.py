"""The decode step with the tuner's own picks instead of the step-measured configs (mmsdk.kernels.step_configs), in
the same process: what the table buys the step (``gpu_decode_reuse.py --against-tuner``)."""

from __future__ import annotations

import os
from typing import Any

import torch


def step_with_tuner_picks(model: Any, inputs: dict[str, Any], step_ms: Any) -> dict[str, Any]:
    """The step after the tuner timed, alone as it does, every GEMV key the step-measured table answered; the table's
    answers are put back afterwards and the graph captured with the tuner's picks is dropped.

    ``step_ms(model, inputs)`` is gpu_decode_reuse's ``step_ms_recaptured`` (its first call tunes the keys again)."""
    from mmsdk.kernels.fast_generate import release
    from mmsdk.kernels.step_configs import STEP_CONFIGS_ENV, step_measured_config
    from mmsdk.kernels.w4a16_tuning import tuning

    table = tuning().chosen
    device = torch.device("cuda", torch.cuda.current_device())
    answered = {key: cfg for key, cfg in table.items() if step_measured_config(key, device, (cfg,)) == cfg}
    if not answered:
        return {"note": "no GEMV of this step has a step-measured config on this GPU"}
    previous = os.environ.get(STEP_CONFIGS_ENV)
    os.environ[STEP_CONFIGS_ENV] = "0"
    kept_choices = tuning().use_kept_choices
    tuning().use_kept_choices = False  # the tuner's own picks, timed now, not what an earlier process kept
    try:
        for key in answered:
            del table[key]
        out = {"step_ms": step_ms(model, inputs),
               "tuner_picks": {str(key): table.get(key) for key in answered},
               "step_measured": {str(key): cfg for key, cfg in answered.items()}}
    finally:
        tuning().use_kept_choices = kept_choices
        if previous is None:
            os.environ.pop(STEP_CONFIGS_ENV, None)
        else:
            os.environ[STEP_CONFIGS_ENV] = previous
        table.update(answered)
        release(model)
    return out
