"""sparse-xattn: the block rule, exactness at full density, which layers it touches, counts, flex on CUDA."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.backend import LowerTarget
from mmsdk.core.errors import ConfigError, IncompatiblePassError
from mmsdk.plugins.attention._block_sparse import block_layout, drop_mask, layout_csr
from mmsdk.plugins.attention._lowering import OnnxLowering
from mmsdk.plugins.attention.sparse_xattn import BlockSparseSpec, SparseXAttnConfig, sparse_layouts
from mmsdk.plugins.projectors.token_merge import TokenMergeConfig
from mmsdk.testing import sample_image, tiny_inputs

QUESTIONS = ("what digit is this ?", "is it even odd yes no how many strokes ?")


def _brute_force_keep(q, k, text, image, block, density):
    """Loop version of the rule (causal, one batch row) to check the vectorized one against."""
    q_len, k_len = q.shape[1], k.shape[1]
    offset = k_len - q_len
    nq, nk = (offset + q_len - 1) // block + 1, (k_len - 1) // block + 1
    keep = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        rows = [r for r in range(q_len) if (r + offset) // block == i and text[r]]
        if not rows:
            continue
        last = min((i + 1) * block - 1, offset + q_len - 1)
        scored = []
        for j in range(nk):
            cols = [c for c in range(j * block, min((j + 1) * block, k_len)) if image[c]]
            if cols and j * block <= last:
                scored.append((float((q[:, rows].mean(1) * k[:, cols].mean(1)).sum(-1).mean()), j))
        for _, j in sorted(scored, reverse=True)[: max(1, math.ceil(len(scored) * density))]:
            keep[i, j] = True
    return keep


def test_block_rule_matches_a_brute_force_version():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 37, 8), torch.randn(1, 2, 37, 8)
    image = torch.zeros(1, 37, dtype=torch.bool)
    image[0, 5:30] = True
    text = ~image
    for density in (0.25, 0.5, 1.0):
        layout = block_layout(q, k, text, image, block=4, density=density, causal=True)
        assert torch.equal(layout.keep[0], _brute_force_keep(q[0], k[0], text[0], image[0], 4, density))
    dropped = drop_mask(layout, text, image)
    assert not dropped[0, 0, :, ~image[0]].any() and not dropped[0, 0, image[0]].any()  # only text x image
    # the same row behind 3 padding tokens (any values, marked as text) gets the same blocks and mask
    pad = 3
    padded_q, padded_k = torch.cat([torch.randn(1, 2, pad, 8), q], 2), torch.cat([torch.randn(1, 2, pad, 8), k], 2)
    padded_image = torch.cat([torch.zeros(1, pad, dtype=torch.bool), image], 1)
    shifted = block_layout(padded_q, padded_k, ~padded_image, padded_image, block=4, density=density, causal=True,
                           starts=torch.tensor([pad]))
    assert torch.equal(shifted.keep[0, : layout.keep.shape[1], : layout.keep.shape[2]], layout.keep[0])
    assert shifted.kept == layout.kept and shifted.candidates == layout.candidates  # nothing in further blocks
    assert torch.equal(drop_mask(shifted, ~padded_image, padded_image)[..., pad:, pad:], dropped)
    csr = layout_csr(layout.keep[0])
    assert csr["block_row_indices"][-1] == len(csr["block_col_indices"]) == int(layout.keep[0].sum())


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl", "tiny:idefics", "tiny:mllama"])
def test_full_density_is_exact_and_half_density_skips_half(name, session, tiny):
    loaded = tiny(name)
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    with torch.no_grad():
        reference = loaded.model(**inputs).logits
    opt = Optimizer(loaded.model, session=session).apply(SparseXAttnConfig(density=1.0, block_size=4))
    with torch.no_grad():
        assert torch.equal(opt.model(**inputs).logits, reference)  # measured: bit-identical
    other = tiny(name)
    opt = Optimizer(other.model, session=session).apply(SparseXAttnConfig(density=0.5, block_size=4))
    with torch.no_grad():
        sparse = opt.model(**inputs).logits
        opt.model.generate(**inputs, max_new_tokens=3, do_sample=False)  # decode steps: one-token query blocks
    specs = [m for m in opt.model.modules() if isinstance(m, BlockSparseSpec)]
    total, kept = specs[0].score_entries
    assert 0.4 < kept / total < 0.7  # measured 0.56-0.65: ceil() keeps at least half of the blocks
    assert not torch.equal(sparse, reference)
    cross = bool(opt.adapter.cross_attention_blocks(opt.model))
    assert {s.kind for s in specs} == {"cross" if cross else "self"}
    assert len(specs) == len(opt.results[0].records["layers"])
    assert len({id(s.flex) for s in specs}) == 1  # one compiled FlexAttention (and one failure state) per model


def test_masks_are_built_once_per_call_and_counts_stay_on_the_device(session, tiny, monkeypatch):
    from mmsdk.plugins._runtime import ModelRuntime

    loaded = tiny("tiny:llava")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    opt = Optimizer(loaded.model, session=session).apply(SparseXAttnConfig(density=0.5, block_size=4))
    built = []
    real = ModelRuntime.key_image_mask
    monkeypatch.setattr(ModelRuntime, "key_image_mask", lambda self, *a: built.append(a) or real(self, *a))
    specs = [m for m in opt.model.modules() if isinstance(m, BlockSparseSpec)]
    with torch.no_grad():
        opt.model(**inputs)
    assert len(specs) == 2 and len(built) == 1  # both layers took the call's masks from its memo
    first = specs[0].score_entries
    assert isinstance(specs[0].entry_counts, torch.Tensor) and 0 < first[1] < first[0]
    with torch.no_grad():
        opt.model(**inputs)
    assert len(built) == 2 and specs[0].score_entries == [2 * n for n in first]  # summed over calls
    specs[0].reset_score_entries()
    assert specs[0].score_entries == [0, 0]


def test_only_text_to_image_entries_are_dropped(session, tiny):
    loaded = tiny("tiny:llava")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    image = inputs["input_ids"] == loaded.model.config.image_token_id
    opt = Optimizer(loaded.model, session=session).apply(SparseXAttnConfig(density=0.25, block_size=4))
    with torch.no_grad():
        opt.model(**inputs)
    layouts = sparse_layouts(opt.model)
    assert set(layouts) == {f"model.language_model.layers.{i}.self_attn.sparse_xattn" for i in range(2)}
    keep = opt.model.model.language_model.layers[0].self_attn.sparse_xattn.last_keep
    start = int(inputs["attention_mask"][0].argmax())  # row 0 is left padded: its blocks count from here
    first_text_block_after_image = (int(image[0].nonzero().max()) + 1 - start) // 4
    assert keep.shape[0] == 2 and keep[0, first_text_block_after_image + 1].sum() >= 1


def test_composes_with_token_merge(session, tiny):
    loaded = tiny("tiny:qwen2-vl")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    opt = Optimizer(loaded.model, session=session).apply(TokenMergeConfig(keep_ratio=0.5),
                                                         SparseXAttnConfig(density=1.0, block_size=2))
    other = tiny("tiny:qwen2-vl")
    with torch.no_grad():
        merged_only = Optimizer(other.model, session=session).apply(TokenMergeConfig(keep_ratio=0.5)).model(**inputs)
        both = opt.model(**inputs)
    assert torch.equal(both.logits, merged_only.logits)
    spec = opt.model.model.language_model.layers[0].self_attn.sparse_xattn
    assert spec.score_entries[0] > 0  # it saw the (merged) image tokens


def test_lowering_records_and_export(session, tiny, tmp_path):
    loaded = tiny("tiny:idefics")
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate([(sample_image(5), "is it even ?")])
    opt.apply(SparseXAttnConfig(block_size=8))
    spec = opt.model.model.gated_cross_attn_layers[0].cross_attn.sparse_xattn
    lowering = session.lower(spec, LowerTarget("onnxruntime"))
    assert isinstance(lowering, OnnxLowering) and "SparseAttention" in lowering.note
    records = opt.results[0].records
    assert records["density"] == 0.5 and records["block_size"] == 8 and "top" in records["rule"]
    layout = records["example_layout"]["layers"]["model.gated_cross_attn_layers.0.cross_attn.sparse_xattn"]
    assert layout["block_row_indices"][0] == 0 and layout["block_col_indices"]  # CSR for SparseAttention
    with torch.no_grad():
        before = opt.model(**inputs).logits
    opt.export("torch", tmp_path / "out")
    reloaded = mmsdk.load(tmp_path / "out", session=session)
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, before)


def test_bad_config_and_flex_without_cuda_are_refused(session, tiny):
    for bad in (dict(density=0.0), dict(density=1.5), dict(block_size=0)):
        with pytest.raises(ConfigError):
            SparseXAttnConfig(**bad)
    loaded = tiny("tiny:llava")
    if not torch.cuda.is_available():
        with pytest.raises(IncompatiblePassError, match="CUDA"):
            Optimizer(loaded.model, session=session).apply(SparseXAttnConfig(backend="flex"))
        assert "forward" not in loaded.model.__dict__


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention needs a CUDA device")
@pytest.mark.parametrize("name", ["tiny:llava", "tiny:idefics"])
def test_flex_attention_matches_masked_sdpa_on_cuda(name, session, tiny):
    inputs = {k: v.cuda() for k, v in tiny_inputs(tiny(name).processor, QUESTIONS).items()}
    outputs = {}
    for backend in ("sdpa", "flex"):
        model = tiny(name).model.cuda()
        opt = Optimizer(model, session=session).apply(SparseXAttnConfig(density=0.5, block_size=4, backend=backend))
        with torch.no_grad():
            outputs[backend] = opt.model(**inputs).logits
        specs = [m for m in opt.model.modules() if isinstance(m, BlockSparseSpec)]
        assert not specs[0].flex.eager and specs[0].flex.failure is None  # all compiled, nothing fell back
    torch.testing.assert_close(outputs["flex"], outputs["sdpa"], rtol=1e-4, atol=1e-4)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow),
                                    pytest.param("cuda", marks=[pytest.mark.cuda, _CUDA])])
def test_the_compiled_mask_build_matches_the_eager_one(device):
    """The FlexAttention path's mask build (layout, mask, kept count, tile lists) compiled (inductor; ~20 s to build
    on the CPU machine) equals its eager form, with and without padding and the model's own mask, over prompt lengths
    that change (no eager fallback)."""
    from benchmarks.gpu_sparse_build_compile import build_args
    from mmsdk.plugins.attention.flex_blocks import FlexRunner
    from mmsdk.plugins.attention.sparse_xattn import _flex_masks

    runner = FlexRunner()
    # on CUDA the head count and head size change too, as between two models in one process: more dynamic sizes
    cases = ((300, False, 4, 16), (357, True, 4, 16))
    if device == "cuda":
        cases += ((420, True, 4, 16), (333, True, 8, 32), (2048, False, 32, 128))
    for length, padded, heads, dim in cases:
        args = build_args(length, padded, device, heads, dim)
        for got, want in zip(torch.utils._pytree.tree_leaves(runner.run("build", _flex_masks, *args)),
                             torch.utils._pytree.tree_leaves(_flex_masks(*args)), strict=True):
            assert torch.equal(got, want)
    assert not runner.eager


@pytest.mark.slow
def test_flex_code_path_matches_masked_sdpa_on_cpu():
    """FlexAttention also runs (slowly, ~8 s to build) on CPU: the flex branch's mask, GQA and layout are right."""
    from torch.nn.attention.flex_attention import flex_attention

    from mmsdk.plugins.attention.flex_blocks import flex_attention_over

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 37, 16), torch.randn(2, 2, 37, 16), torch.randn(2, 2, 37, 16)
    allowed = (torch.rand(2, 1, 37, 37) > 0.3) | torch.eye(37, dtype=torch.bool)
    for mask in (allowed, allowed[:1]):  # a mask per row, and one mask for the whole batch (broadcast)
        out = flex_attention_over(flex_attention, q, k, v, mask, 0.25)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25,
                                                                    enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # measured 3.6e-7


def _flex_problem(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [2, 4, 200, 16] over k / v [2, 2, 300, 16] (grouped heads) and a mask whose 128 x 128 tiles are of every kind:
    all allowed (key columns 0-127 of query rows 0-127), none allowed (columns 128-255 of those rows; query rows
    128-199 see their diagonal there), and mixed (the rest, and the partial last tiles)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 200, 16, generator=generator)
    k, v = torch.randn(2, 2, 300, 16, generator=generator), torch.randn(2, 2, 300, 16, generator=generator)
    allowed = torch.rand(2, 1, 200, 300, generator=generator) > 0.5
    allowed[..., :128] = True
    allowed[..., 128:256] = False
    return q, k, v, allowed | torch.eye(200, 300, dtype=torch.bool)


def test_the_block_mask_built_from_a_dense_mask_is_flex_attentions_own():
    """block_mask_from_dense (allowed entries counted per tile) gives the tiles create_block_mask finds by evaluating
    a mask_mod over the whole grid (3.7-4 ms a call on an H100): skipped and full tiles, partial last tiles, whole
    tiles read without padding."""
    from torch.nn.attention.flex_attention import create_block_mask

    from mmsdk.plugins.attention.flex_blocks import block_mask_from_dense

    allowed = _flex_problem()[3]
    whole = torch.ones(1, 1, 256, 384, dtype=torch.bool).tril(diagonal=128)  # whole tiles: read without padding
    whole[..., 100:150, 256:] = False
    for mask in (allowed, whole):
        ours = block_mask_from_dense(mask, for_backward=True)
        assert block_mask_from_dense(mask).q_indices is None  # inference builds no query-major lists
        theirs = create_block_mask(lambda b, h, q, k: mask[b, 0, q, k], mask.shape[0], None, *mask.shape[2:],
                                   device="cpu")
        assert int(ours.full_kv_num_blocks.sum()) > 0  # some tiles run unmasked
        assert int(ours.kv_num_blocks.sum() + ours.full_kv_num_blocks.sum()) < ours.kv_indices.numel()  # some skipped
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
        assert ours.seq_lengths == tuple(mask.shape[2:])


@pytest.mark.slow
def test_compiled_flex_attention_matches_sdpa_and_a_new_mask_needs_no_new_compile():
    """The kernel the CUDA path runs (torch.compile of flex_attention; here inductor's CPU backend, ~25 s to build):
    the same output as masked SDPA, and a second call with another mask (a new mask_mod closure) reuses the build."""
    import torch._dynamo

    from mmsdk.plugins.attention.flex_blocks import compiled_flex_attention, flex_attention_over

    kernel = compiled_flex_attention()
    q, k, v, allowed = _flex_problem()
    for seed, mask in enumerate((allowed, _flex_problem(1)[3])):
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            out = flex_attention_over(kernel, q, k, v, mask, None)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)  # measured 2.4e-7


def _flex_call(spec: BlockSparseSpec) -> tuple[torch.Tensor, ...] | None:
    """sparse-xattn's FlexAttention path on one call of _flex_problem's shapes (every row text, every key an image)."""
    from mmsdk.plugins.attention.sparse_xattn import _CallMasks, _flex_attention

    q, k, v, _ = _flex_problem()
    rows = _CallMasks(torch.ones(2, 200, dtype=torch.bool), torch.ones(2, 300, dtype=torch.bool), None, True)
    return _flex_attention(spec, q, k, v, rows, None, None)


def test_a_flex_kernel_that_cannot_compile_hands_auto_to_sdpa_and_refuses_flex(caplog):
    """backend="auto": the model's layers (one FlexRunner) log why once and answer None (masked SDPA takes the call,
    never eager FlexAttention, torch's unfused reference); backend="flex": a clear error naming the fix. A mask build
    that cannot compile runs eagerly instead, also stated once."""
    from mmsdk.plugins.attention.flex_blocks import FlexRunner

    def broken(*args, **kwargs):
        raise RuntimeError("no triton")

    shared = FlexRunner()
    shared.functions["flex_attention"] = broken
    shared.functions["sparse-xattn mask build"] = broken
    layers = [BlockSparseSpec(SparseXAttnConfig(backend="auto"), "self", shared) for _ in range(3)]
    with caplog.at_level("WARNING", logger="mmsdk.plugins"):
        assert all(_flex_call(spec) is None for spec in layers + layers)
    assert [r.getMessage() for r in caplog.records] == [
        "sparse-xattn mask build could not compile (RuntimeError: no triton); it runs eagerly",
        "sparse-xattn: FlexAttention could not run (RuntimeError: no triton); its layers run masked SDPA"]
    required = BlockSparseSpec(SparseXAttnConfig(backend="flex"), "self")
    required.flex.functions["flex_attention"] = broken
    required.flex.eager["sparse-xattn mask build"] = "not compiled on CPU here"
    with pytest.raises(IncompatiblePassError, match="backend=\"auto\""):
        _flex_call(required)
    copy = pickle.loads(pickle.dumps(layers[0]))  # compiled functions are not pickled; what failed is
    assert copy.flex.functions == {} and copy.flex.failure == shared.failure and copy.flex.eager == shared.eager


def test_a_compiled_function_says_once_that_its_first_call_compiles(caplog, monkeypatch):
    """The mask build's first call compiles it, which takes tens of seconds on a GPU host: one INFO line says so,
    and later calls say nothing (torch.compile stands in here: the line, not the compile, is under test)."""
    from mmsdk.plugins.attention.flex_blocks import FlexRunner

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda function, **options: compiled.append(options) or function)
    runner = FlexRunner()
    values = torch.randn(5)
    with caplog.at_level("INFO", logger="mmsdk.plugins"):
        for _ in range(3):
            torch.testing.assert_close(runner.run("twice", torch.mul, values, 2), values * 2)
    assert [r.getMessage() for r in caplog.records] == [
        "twice: compiling with torch.compile on its first call (tens of seconds; once more when a size first changes)"]
    assert len(compiled) == 1 and not runner.eager


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2-vl", "tiny:idefics"])
def test_the_one_liner_with_int4_kv(name, session, tiny, tmp_path):
    """``Optimizer(model).apply("int4-kv", "sparse-xattn").export(...)``, reloaded, generates the same."""
    if "int4-kv" not in session.passes:
        pytest.skip("int4-kv is provided by the quantizer plugin, not installed in this tree")
    loaded = tiny(name)
    inputs = tiny_inputs(loaded.processor, QUESTIONS)
    opt = Optimizer(loaded.model, loaded.processor, session=session)
    if session.passes.get("int4-kv").needs_calibration:  # static KV scales come from calibration prompts
        opt.calibrate([(sample_image(i), "what digit is this ?") for i in range(4)])
    result = opt.apply("int4-kv", "sparse-xattn").export("torch", tmp_path / "out")
    with torch.no_grad():
        expected = opt.model.generate(**inputs, max_new_tokens=4, do_sample=False)
        reloaded = mmsdk.load(result.path, session=session)
        assert torch.equal(reloaded.generate(**inputs, max_new_tokens=4, do_sample=False), expected)
    assert [p.name for p in result.manifest.passes] == ["int4-kv", "sparse-xattn"]
