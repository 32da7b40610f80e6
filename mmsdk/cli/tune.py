"""``mmsdk tune MODEL --apply a,b --out FILE``: choose the decode step's INT4 GEMV configurations on this GPU.

The W4A16 tuner times each GEMV candidate alone; inside the batch-1 decode step they do not rank that way, and the
built-in step tables (mmsdk.kernels.step_configs) cover only the benchmarked 7B models on an H100 and an H200. This verb
runs :func:`mmsdk.kernels.step_search.search_decode_step` on the optimized model itself, on the GPU that will serve it,
and writes what it chose into a step-configs file; processes started with ``MMSDK_STEP_CONFIGS=FILE`` take those
configurations untimed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from mmsdk.cli._common import add_model_arguments, console, print_table, prompt_sample, split_list
from mmsdk.core.errors import UnsupportedInputError

__all__ = ["add_parser", "run"]

DTYPES = ("bfloat16", "float16")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "tune", help="choose the decode step's INT4 GEMV configs on this GPU by timing the step (writes a JSON file)"
    )
    add_model_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, metavar="FILE",
                        help="step-configs JSON to write (a file this wrote before keeps its other GPUs' entries)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                        help="the dtype the model will be served in (default bfloat16; configs are kept per dtype)")
    parser.add_argument("--kinds", default="", metavar="K,K",
                        help="try only candidates of these GEMV kinds, comma separated (e.g. idot,idotr; default: "
                             "every kind); where none is faster, the tuner's own pick stays")
    parser.add_argument("--calibrate", default=None, metavar="DATASET", help="calibration data for passes that need it")
    parser.add_argument("--calibration-limit", type=int, default=None, metavar="N", help="use at most N samples")
    parser.add_argument("--image", type=Path, default=None, metavar="FILE",
                        help="image of the prompt (PNG/JPEG via Pillow, or .npy); default: a digits test image")
    parser.add_argument("--prompt", default=None, metavar="TEXT", help="question of the prompt (default: the sample's)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from mmsdk.core.optimizer import Optimizer
    from mmsdk.core.planning import fast_generate_refusal
    from mmsdk.core.session import Session
    from mmsdk.core.sources import load_model
    from mmsdk.kernels.step_search import NoKeptStepError, check_search_settings, search_decode_step
    from mmsdk.profiling.measure import prompt_inputs

    _check_out(args.out)  # refuse before minutes of timing
    kinds = tuple(split_list(args.kinds)) or None
    try:
        check_search_settings(kinds)  # before loading the model, too
    except ValueError as error:
        raise UnsupportedInputError(str(error)) from None
    session = Session.create()
    _refuse_slow_passes(fast_generate_refusal(session, _named_passes(session, split_list(args.apply))))
    if not torch.cuda.is_available():
        raise UnsupportedInputError(
            f"mmsdk tune times the decode step on a GPU, but torch {torch.__version__} sees no CUDA GPU here.",
            fix="run it on the machine (GPU model) that will serve the model: the configurations are kept per GPU.",
        )
    loaded = load_model(args.model, session=session)
    # the passes pack the weights where the model is: on the GPU, in the dtype it will be served in
    loaded.model.to("cuda", getattr(torch, args.dtype))
    opt = Optimizer(loaded, adapter=args.adapter, session=session)
    if args.calibrate:
        opt.calibrate(args.calibrate, limit=args.calibration_limit)
    opt.apply(*split_list(args.apply))
    _refuse_slow_passes(opt.fast_generate_refusal())  # a recipe's passes, known once planned
    model = opt.model
    sample = prompt_sample(args.image, args.prompt, opt.session)
    inputs = prompt_inputs(model, opt.processor, opt.adapter, sample, "cuda")
    try:
        result = search_decode_step(model, inputs, kinds, report=_progress)
    except ValueError as error:  # a model off the fast path, a step with no INT4 GEMV: the message names the fix
        raise UnsupportedInputError(str(error)) from None
    except NoKeptStepError as error:  # fast generate fell back during the call; the warning above says why
        raise UnsupportedInputError(
            str(error), fix="tune the passes fast generate runs with (the mmsdk.kernels warning above names what "
                            "failed), or report the failure with that warning.") from None
    path = result.save(args.out)
    _print(result, path)
    return 0


def _named_passes(session: Any, entries: list[str]) -> list[tuple[str, Any]]:
    """(name, config) of every --apply entry that names a pass; a recipe's passes are known only once the model is
    loaded (a recipe may depend on it), so those are checked after apply()."""
    from mmsdk.core.recipes import RECIPE_PREFIX

    named = [session.pass_spec(entry) for entry in entries if not entry.startswith(RECIPE_PREFIX)]
    return [(spec.name, config) for spec, config in named]


def _refuse_slow_passes(refusal: str | None) -> None:
    """Refuse passes that keep transformers' generate loop: the search times fast generate's CUDA-graph step. Called
    with the named passes before the model loads, and again with a recipe's before the passes pack any weight."""
    if refusal is not None:
        raise UnsupportedInputError(
            f"mmsdk tune times fast generate's CUDA-graph decode step, which this model would not take: {refusal}.",
            fix="drop those passes from --apply (docs/gpu.md lists the passes that take the fast path).")


def _check_out(path: Path) -> None:
    """The output file must be new or a step-configs file (its other entries are kept), in an existing folder."""
    from mmsdk.kernels.step_configs import read_step_configs

    if not path.parent.is_dir():
        raise UnsupportedInputError(f"--out {path}: the folder {path.parent} does not exist.",
                                    fix="create it first, or name a file in an existing folder.")
    if path.is_dir():
        raise UnsupportedInputError(f"--out {path} is a folder.", fix="name a JSON file, e.g. step_configs.json.")
    if path.exists():
        try:
            read_step_configs(path)
        except (ValueError, KeyError, TypeError) as error:
            raise UnsupportedInputError(
                f"--out {path} exists and is not a step-configs file ({error}).",
                fix="name a new file, or one mmsdk tune wrote before (it keeps that file's other GPUs' entries).",
            ) from None


def _progress(line: str) -> None:
    """The search's progress (its first tuning, then each trial as it ends) on stderr; stdout keeps the summary."""
    print(line, file=sys.stderr, flush=True)


def _print(result: Any, path: Path) -> None:
    from rich.markup import escape

    from mmsdk.kernels.step_configs import STEP_CONFIGS_ENV

    rows = [(label, result.started_with.get(label, "-"), kept) for label, kept in result.kept.items()]
    print_table(f"decode step on {result.device_name}: {result.start_ms:.4f} -> {result.final_ms:.4f} ms "
                f"({len(result.trials)} trials)", ("GEMV (tuner key)", "tuner's pick", "kept"), rows)
    out = console()
    out.print(escape(f"wrote {path}"))
    out.print(escape(f"later processes take these configs with {STEP_CONFIGS_ENV}={os.fspath(path.resolve())}"))
