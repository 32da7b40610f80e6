"""Optimize a Qwen2-VL or Qwen2.5-VL model and export it.

    python examples/qwen_vl/optimize_qwen_vl.py                         # tiny:qwen2-vl, random weights
    python examples/qwen_vl/optimize_qwen_vl.py /models/Qwen2-VL-7B-Instruct --out out/qwen --backend onnxruntime
"""

from __future__ import annotations

import argparse

import mmsdk
from mmsdk import Optimizer
from mmsdk.testing import sample_image


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="tiny:qwen2-vl", help="HF folder or mmsdk model name")
    parser.add_argument("--apply", default="qkv-fuse", help="comma-separated passes")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--out", default="mmsdk-out/qwen_vl")
    args = parser.parse_args(argv)

    model, processor = mmsdk.load_model(args.model)
    opt = Optimizer(model, processor).apply(*args.apply.split(","))
    prompt = opt.adapter.format_prompt("what digit is this ?", processor)
    inputs = processor(images=[sample_image()], text=[prompt])
    answer = opt.model.generate(**inputs, max_new_tokens=4, do_sample=False)
    print("answer:", processor.batch_decode(answer[:, inputs["input_ids"].shape[1]:])[0])
    print(opt.report())
    print("exported:", opt.export(args.backend, args.out, overwrite=True).path)


if __name__ == "__main__":
    main()
