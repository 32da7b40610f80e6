"""``mmsdk profile MODEL --apply a,b --out DIR``: memory and time before and after each pass."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mmsdk.cli._common import add_model_arguments, console, print_table, prompt_sample, split_list
from mmsdk.core.errors import UnsupportedInputError


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "profile", help="measure weights, KV cache, activations and each stage, before and after each pass"
    )
    add_model_arguments(parser)
    parser.add_argument("--device", default=None, metavar="cpu|cuda",
                        help="where to run (default: cpu; on cuda the allocator's peaks are reported too)")
    parser.add_argument("--image", type=Path, default=None, metavar="FILE",
                        help="image to ask about (PNG/JPEG via Pillow, or .npy); default: a digits test image")
    parser.add_argument("--prompt", default=None, metavar="TEXT", help="question to ask (default: the sample's)")
    parser.add_argument("--max-new-tokens", type=int, default=8, metavar="N", help="tokens to decode (default 8)")
    parser.add_argument("--calibrate", default=None, metavar="DATASET", help="calibration data for passes that need it")
    parser.add_argument("--calibration-limit", type=int, default=None, metavar="N", help="use at most N samples")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder")
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists and is not empty")
    parser.add_argument("--graph-depth", type=int, default=5, metavar="N", help="module graph depth (default 5)")
    parser.add_argument("--top", type=int, default=15, metavar="N", help="modules in the top-modules chart")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from mmsdk.core.fileio import check_output_dir
    from mmsdk.core.optimizer import Optimizer
    from mmsdk.profiling.measure import resolve_device
    from mmsdk.profiling.output import write_profile

    check_output_dir(args.out, overwrite=args.overwrite)  # refuse before minutes of measuring
    if args.max_new_tokens < 1:
        raise UnsupportedInputError(f"--max-new-tokens {args.max_new_tokens}", fix="decode at least 1 token.")
    device = resolve_device(args.device or "cpu")
    opt = Optimizer(args.model, adapter=args.adapter)
    if args.calibrate:
        opt.calibrate(args.calibrate, limit=args.calibration_limit)
    opt.apply(*split_list(args.apply))
    sample = prompt_sample(args.image, args.prompt, opt.session, args.max_new_tokens)
    with _cuda_snapshot(device) as snapshot:
        profile = opt.profile(sample, device=device, max_new_tokens=args.max_new_tokens)
    files = write_profile(profile, args.out, overwrite=args.overwrite, graph_depth=args.graph_depth,
                          top=args.top, extra=snapshot)
    _print(profile, files)
    return 0


@contextmanager
def _cuda_snapshot(device: str) -> Iterator[dict[str, bytes]]:
    """On CUDA, record allocator history; yields the files to add (``memory_snapshot.pickle``)."""
    files: dict[str, bytes] = {}
    if not device.startswith("cuda"):
        yield files
        return
    import pickle

    import torch

    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        yield files
        # Open it at pytorch.org/memory_viz: every allocation with its Python stack.
        files["memory_snapshot.pickle"] = pickle.dumps(torch.cuda.memory._snapshot())
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _print(profile: Any, files: Any) -> None:
    import sys

    from rich.markup import escape

    from mmsdk.profiling.results import stage_rows, waterfall_notes, waterfall_rows

    if sys.stdout.isatty():
        rows = waterfall_rows(profile)
        print_table(f"{profile.model} on {profile.device}: memory after each pass", rows[0], rows[1:])
        for note in waterfall_notes(profile):
            console().print(escape(note))
        rows = stage_rows(profile)
        print_table("stages (peak total includes weights; activation excludes weights and KV cache)", rows[0], rows[1:])
    else:  # logs and pipes get the plain table, never cut to 80 columns
        print(f"{profile.model} on {profile.device}: memory after each pass\n{profile.table()}")
    out = console()
    out.print(escape(f"wrote {', '.join(p.name for p in files)} to {files[0].parent}"))
    for note in files.skipped:
        out.print(f"[yellow]not written[/yellow]: {escape(note)}")
