"""``mmsdk run DIR --image F --prompt "..."``: answer a prompt with an exported folder (onnxruntime)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("run", help="answer a prompt about an image with an exported folder")
    parser.add_argument("folder", type=Path, metavar="DIR", help="a folder written by `mmsdk optimize --export onnxruntime`")
    parser.add_argument("--image", required=True, action="append", metavar="FILE",
                        help="image file (repeat --image and --prompt to run several requests, double-buffered)")
    parser.add_argument("--prompt", required=True, action="append", metavar="TEXT", help="the question about the image")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, metavar="N", help="ONNX Runtime intra-op threads")
    parser.add_argument("--json", action="store_true", help="print one JSON object per answer (tokens, timings)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from mmsdk.core.errors import UnsupportedInputError
    from mmsdk.runtime import load
    from mmsdk.runtime.pipeline import Request

    if len(args.image) != len(args.prompt):
        raise UnsupportedInputError(
            f"{len(args.image)} --image for {len(args.prompt)} --prompt.", fix="give one --prompt per --image."
        )
    options = {"intra_op_threads": args.threads} if args.threads else {}
    pipe = load(args.folder, **options)
    sampling = dict(do_sample=args.sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    seed=args.seed)
    requests = [Request(image, prompt) for image, prompt in zip(args.image, args.prompt)]
    for request, result in zip(requests, pipe.run_many(requests, max_new_tokens=args.max_new_tokens, **sampling)):
        if args.json:
            print(json.dumps({"image": str(request.image), "prompt": request.prompt, "answer": result.text,
                              "tokens": result.tokens, "vision_seconds": round(result.vision_seconds, 4),
                              "decode_seconds": round(result.decode_seconds, 4)}))
        else:
            print(result.text)
    return 0
