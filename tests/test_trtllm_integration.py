"""TensorRT-LLM itself: load a target-B export with LLM() and build a checkpoint with trtllm-build.

Runs only where tensorrt_llm is installed with an NVIDIA GPU; skipped everywhere else (CI, laptops).
Also checks, everywhere, that mmsdk never imports tensorrt_llm or onnxruntime on its own.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from mmsdk import Optimizer


def _trtllm_with_gpu() -> bool:
    try:
        import tensorrt_llm  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


needs_trtllm = pytest.mark.skipif(not _trtllm_with_gpu(), reason="needs tensorrt_llm and an NVIDIA GPU")


def test_importing_mmsdk_and_registering_the_backend_stays_light():
    code = ("import sys, mmsdk; from mmsdk.core.session import Session; s = Session.create(autoload=False); "
            "s.backends.get('tensorrt-llm'); "
            "print(sorted(m for m in ('tensorrt_llm', 'onnxruntime', 'tensorrt') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.cuda
@needs_trtllm
def test_llm_api_generates_from_a_target_b_export(session, tiny, tmp_path):
    from tensorrt_llm import LLM, SamplingParams

    loaded = tiny("tiny:qwen2-vl")
    Optimizer(loaded.model, loaded.processor, session=session).export("tensorrt-llm", tmp_path / "out", target="hf")
    llm = LLM(model=str(tmp_path / "out"), skip_tokenizer_init=True)
    outputs = llm.generate([[1, 5, 6, 7]], SamplingParams(max_tokens=4))
    assert len(outputs[0].outputs[0].token_ids) == 4


@pytest.mark.cuda
@needs_trtllm
@pytest.mark.skipif(shutil.which("trtllm-build") is None, reason="this TensorRT-LLM has no trtllm-build")
def test_trtllm_build_dry_run_accepts_a_sharded_checkpoint(session, tiny, tmp_path):
    loaded = tiny("tiny:llava-tp")
    Optimizer(loaded.model, loaded.processor, session=session).export(
        "tensorrt-llm", tmp_path / "out", target="checkpoint", tp_size=2, trtllm_version="1.2.0")
    subprocess.run(["trtllm-build", "--checkpoint_dir", str(tmp_path / "out" / "llm"), "--output_dir",
                    str(tmp_path / "engine"), "--max_multimodal_len", "50", "--dry_run"], check=True)
