"""``mmsdk run``: the verb's parser and handler on an exported folder."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

import mmsdk
from mmsdk.cli import run as run_verb
from tests.ort_helpers import export_tiny

pytest.importorskip("onnxruntime")
Image = pytest.importorskip("PIL.Image")


def _parse(argv):
    parser = argparse.ArgumentParser(prog="mmsdk")
    run_verb.add_parser(parser.add_subparsers(dest="verb"))
    return parser.parse_args(argv)


def test_run_answers_with_the_folder(tmp_path, capsys):
    export_tiny("tiny:llava", tmp_path / "out", verify=False)
    image = tmp_path / "digit.png"
    Image.fromarray((np.random.RandomState(0).rand(30, 30, 3) * 255).astype(np.uint8)).save(image)
    args = _parse(["run", str(tmp_path / "out"), "--image", str(image), "--prompt", "what digit is this ?",
                   "--image", str(image), "--prompt", "is it even ?", "--max-new-tokens", "4", "--json"])
    assert args.handler(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    pipe = mmsdk.load(tmp_path / "out")
    assert [line["tokens"] for line in lines] == [
        pipe.generate([str(image)], [q], max_new_tokens=4)[0] for q in ("what digit is this ?", "is it even ?")]


def test_run_refuses_unpaired_images_and_prompts(tmp_path):
    from mmsdk.core.errors import UnsupportedInputError

    args = _parse(["run", str(tmp_path), "--image", "a.png", "--image", "b.png", "--prompt", "what ?"])
    with pytest.raises(UnsupportedInputError, match="one --prompt per --image"):
        args.handler(args)
