"""Grouped-query decode attention over unquantized K/V with a mask (mmsdk.kernels.grouped_decode)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmsdk.kernels import grouped_decode
from mmsdk.kernels.grouped_decode import attention_implementation, grouped_decode_steps, takes

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # set before Triton first compiles anything


def _step(batch=2, heads=8, kv_heads=2, tokens=37, dim=16, device="cpu", dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, 1, dim, generator=generator).to(device, dtype)
    key, value = (torch.randn(batch, kv_heads, tokens, dim, generator=generator).to(device, dtype) for _ in range(2))
    mask = torch.ones(batch, 1, 1, tokens, dtype=torch.bool, device=device)
    mask[1, ..., tokens // 2:] = False  # row 1: a static cache's empty slots, or an image's padding tiles
    return query, key, value, mask


def test_takes_only_what_the_kernel_computes(monkeypatch):
    monkeypatch.setattr("mmsdk.kernels.triton_ready", lambda *tensors: True)
    query, key, value, mask = _step()
    assert takes(query, key, value, mask, {}) and takes(query, key, value, None, {"scaling": 0.3})
    refused = {
        "a prompt": (torch.cat([query, query], 2), key, value, mask, {}),
        "one KV head per query head": (query, key.repeat_interleave(4, 1), value.repeat_interleave(4, 1), mask, {}),
        "fp32": (query.float(), key.float(), value.float(), mask, {}),
        "K laid out as [B, T, H, D]": (query, key.transpose(1, 2).contiguous().transpose(1, 2), value, mask, {}),
        "a mask per head": (query, key, value, mask.expand(-1, 8, -1, -1), {}),
        "a mask over other keys": (query, key, value, mask[..., :-1], {}),
        "a 2-D mask": (query, key, value, mask[:, 0, 0], {}),
        "an integer mask": (query, key, value, mask.long(), {}),
        "a mask row read with a stride": (query, key, value, torch.cat([mask, mask], -1)[..., ::2], {}),
        "a sliding window": (query, key, value, mask, {"sliding_window": 16}),
        "dropout": (query, key, value, mask, {"dropout": 0.1}),
        "a packed cache's marker": (query, torch.empty(1), torch.empty(1), mask, {}),
    }
    for why, case in refused.items():
        assert not takes(*case), why
    monkeypatch.undo()
    assert not takes(query, key, value, mask, {})  # CPU tensors: no kernel (unless Triton's interpreter is on)


def test_decode_steps_swap_the_attention_and_put_it_back():
    config = SimpleNamespace(_attn_implementation="sdpa")
    with grouped_decode_steps(config):
        assert config._attn_implementation == "mmsdk_grouped_decode_sdpa"
    assert config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError):
        with grouped_decode_steps(config):
            raise RuntimeError
    assert config._attn_implementation == "sdpa"
    for base in ("flash_attention_2", "flex_attention", "eager"):  # not wrapped: left alone
        config._attn_implementation = base
        with grouped_decode_steps(config):
            assert config._attn_implementation == base
    from mmsdk.kernels import kv_decode

    packed = kv_decode.attention_implementation("sdpa")  # a packed-KV cache's wrapper is wrapped in turn
    assert attention_implementation(packed) == "mmsdk_grouped_decode_mmsdk_packed_kv_sdpa"
    assert attention_implementation("mmsdk_packed_kv_flash") is None  # never registered


def test_decode_steps_leave_sub_configs_attention_alone(session, tiny):
    """IDEFICS's text config is the whole model's: its vision and perceiver configs keep their own implementation."""
    config = tiny("tiny:idefics").model.config
    config.vision_config._attn_implementation = "eager"
    base = config._attn_implementation
    with grouped_decode_steps(config):
        assert config._attn_implementation == f"mmsdk_grouped_decode_{base}"
        assert config.vision_config._attn_implementation == "eager"
    assert config._attn_implementation == base and config.vision_config._attn_implementation == "eager"


def test_calls_the_kernel_does_not_take_run_the_wrapped_attention():
    """On CPU every call goes to the model's own attention: the same numbers as calling it directly."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    query, key, value, mask = _step(dtype=torch.float32)
    module = SimpleNamespace(num_key_value_groups=4, is_causal=False, training=False)
    wrapped = ALL_ATTENTION_FUNCTIONS[attention_implementation("sdpa")]
    got, _ = wrapped(module, query, key, value, mask, scaling=0.25)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert torch.equal(got, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("heads,kv_heads,tokens,dim,dtype", [(32, 8, 6404, 128, torch.bfloat16),
                                                             (28, 4, 1280, 128, torch.bfloat16),
                                                             (8, 4, 333, 128, torch.float16),
                                                             (3, 1, 40, 16, torch.bfloat16)])
def test_kernel_matches_sdpa_on_cuda(heads, kv_heads, tokens, dim, dtype, monkeypatch):
    """Llama-3.2-Vision's cross-attention (32 / 8 heads over a 4-tile image), Qwen2-VL-7B's heads over a static
    cache, groups of 2 and the tiny test models' 16-wide heads (no tensor cores): within 1e-2 of fp64, through the
    kernel, as close as SDPA itself."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from mmsdk.kernels.kv_decode import reference_decode_attention

    calls, original = [], grouped_decode.decode_attention
    monkeypatch.setattr(grouped_decode, "decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query, key, value, mask = _step(2, heads, kv_heads, tokens, dim, "cuda", dtype)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=False, training=False)
    got, _ = ALL_ATTENTION_FUNCTIONS[attention_implementation("sdpa")](module, query, key, value, mask,
                                                                      scaling=dim**-0.5)
    expected = reference_decode_attention(query, key, value, dim**-0.5, mask[:, 0, 0])
    assert calls == [1] and got.shape == (2, 1, heads, dim) and got.dtype == dtype
    error = float((got.double() - expected).norm() / expected.norm())
    sdpa, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    sdpa_error = float((sdpa.double() - expected).norm() / expected.norm())
    assert error < 1e-2 and error < 2 * sdpa_error + 1e-3, (error, sdpa_error)
    additive = torch.zeros(mask.shape, dtype=dtype, device="cuda").masked_fill(~mask, torch.finfo(dtype).min)
    again, _ = ALL_ATTENTION_FUNCTIONS[attention_implementation("sdpa")](module, query, key, value, additive,
                                                                        scaling=dim**-0.5)
    assert torch.equal(again, got)  # an additive mask drops the same keys


@pytest.mark.skipif(not HAS_TRITON or CUDA or not INTERPRETING, reason="Triton's interpreter, in its own process")
@pytest.mark.parametrize("heads,kv_heads,tokens,dim", [(8, 2, 300, 64), (3, 1, 40, 16), (6, 2, 129, 32)])
def test_kernel_under_the_interpreter_matches_reference(heads, kv_heads, tokens, dim):
    """fp16 (the interpreter mishandles bf16): groups of 4 and of 3 (padded to the tensor cores' 16 rows), a row
    whose tail is masked, one with nothing masked, and no mask at all."""
    from mmsdk.kernels.kv_decode import reference_decode_attention
    from tests import _interpreter

    _interpreter.patch()
    query, key, value, mask = _step(2, heads, kv_heads, tokens, dim, dtype=torch.float16)
    for row in (mask[:, 0, 0], None):
        got = grouped_decode.decode_attention(query, key, value, dim**-0.5, row)
        expected = reference_decode_attention(query, key, value, dim**-0.5, row)
        assert got.dtype == torch.float16 and got.shape == (2, 1, heads, dim)
        assert float((got.double() - expected).norm() / expected.norm()) < 5e-3


@pytest.mark.skipif(not HAS_TRITON or CUDA or INTERPRETING, reason="needs Triton, on a machine without a GPU")
def test_grouped_decode_under_the_interpreter():
    """Runs this file's interpreter checks in a process where TRITON_INTERPRET=1 is set from the start."""
    from tests import _interpreter

    result = _interpreter.run_file(str(Path(__file__)), "under_the_interpreter_matches")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "3 passed" in result.stdout, result.stdout[-2000:]


def test_module_has_no_state():
    assert not [name for name, value in vars(grouped_decode).items()
                if isinstance(value, (dict, list, set)) and not name.startswith("__")]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", ["tiny:qwen2-vl", "tiny:mllama"])
def test_a_models_decode_step_through_the_kernel_matches_sdpa(name, tiny, monkeypatch):
    """In the model's own code (its masks, scaling and cache): the first decode step's logits with the kernel within
    2e-2 of SDPA's (bf16; the prompt, and so the step's token, are the same)."""
    from contextlib import nullcontext

    from mmsdk.testing import tiny_inputs

    loaded = tiny(name)
    model = loaded.model.cuda().to(torch.bfloat16)
    inputs = {k: v.cuda() for k, v in tiny_inputs(loaded.processor, ("what digit is this ?",) * 2).items()}
    calls, original = [], grouped_decode.decode_attention
    monkeypatch.setattr(grouped_decode, "decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))

    def step_logits(scope):
        with scope:
            out = type(model).generate(model, **inputs, max_new_tokens=2, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True)
        return out.logits[1].float()

    sdpa = step_logits(nullcontext())
    assert not calls
    kernel = step_logits(grouped_decode_steps(model.config.get_text_config()))
    assert calls  # the self-attention layers took the kernel
    assert float((kernel - sdpa).norm() / sdpa.norm()) < 2e-2
