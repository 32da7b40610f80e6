"""Tensor-parallel rules of the checkpoint: fused QKV order, KV-head replication, padding, divisibility."""

from __future__ import annotations

import torch

from mmsdk.plugins.backends.tensorrt_llm import sharding as sh


def _rows(heads: int, hd: int, tag: float) -> torch.Tensor:
    # Row r of head h holds tag + h (so the head order is readable); 2 input columns.
    return (tag + torch.arange(heads).repeat_interleave(hd)).float()[:, None].expand(-1, 2)


def test_gqa_split_gives_each_rank_its_q_heads_then_its_k_then_its_v():
    heads = sh.Heads(num_heads=4, num_kv_heads=2, head_dim=3)
    q, k, v = _rows(4, 3, 0), _rows(2, 3, 100), _rows(2, 3, 200)
    ranks = sh.split_qkv(q, k, v, heads, tp=2)
    assert [r[:, 0].unique_consecutive().tolist() for r in ranks] == [[0, 1, 100, 200], [2, 3, 101, 201]]


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    heads = sh.Heads(num_heads=4, num_kv_heads=2, head_dim=3)
    q, k, v = _rows(4, 3, 0), _rows(2, 3, 100), _rows(2, 3, 200)
    ranks = sh.split_qkv(q, k, v, heads, tp=4)
    # dup_kv_weight order [h0, h0, h1, h1]: ranks 0 and 1 share KV head 0, ranks 2 and 3 head 1
    assert [r[:, 0].unique_consecutive().tolist() for r in ranks] == [[0, 100, 200], [1, 100, 200],
                                                                      [2, 101, 201], [3, 101, 201]]
    assert all(r.shape == (9, 2) for r in ranks)  # (4/4 + 2 * ceil(2/4)) * 3 rows


def test_mha_split_matches_trtllm_mha_formula():
    heads = sh.Heads(num_heads=4, num_kv_heads=4, head_dim=2)
    w = torch.randn(3 * 8, 5, generator=torch.Generator().manual_seed(0))
    q, k, v = w.split(8)
    ours = sh.split_qkv(q, k, v, heads, tp=2)
    # TensorRT-LLM's MHA path: cat([q,k,v]).reshape(3, nh*hd, H), split dim 1, reshape(3*nh*hd/T, H)
    theirs = [t.reshape(-1, 5) for t in torch.cat([q, k, v]).reshape(3, 8, 5).chunk(2, dim=1)]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_lm_head_is_padded_to_a_multiple_of_tp():
    head = torch.ones(101, 4)
    padded = sh.pad_rows(head, 4)
    assert padded.shape == (104, 4) and bool((padded[101:] == 0).all())
    assert [c.shape[0] for c in sh.split_column(padded, 4)] == [26] * 4


def test_pipeline_stages_and_rank_numbering():
    assert sh.pp_layer_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert [sh.rank_of(t, p, 4) for p in range(2) for t in range(4)] == list(range(8))


def test_divisibility_problems_name_the_numbers():
    tiny = sh.Heads(num_heads=3, num_kv_heads=1, head_dim=16)
    problems = sh.check_parallelism(tiny, intermediate=74, num_layers=2, tp=4, pp=1)
    assert problems == ["num_attention_heads 3 is not divisible by tp_size 4",
                        "intermediate_size 74 is not divisible by tp_size 4"]
    assert sh.check_parallelism(sh.Heads(4, 2, 64), 512, 2, 4, 2) == []
    assert sh.check_parallelism(sh.Heads(8, 3, 64), 512, 3, 2, 2) == [
        "num_key_value_heads 3 is not divisible by tp_size 2", "num_hidden_layers 3 is not divisible by pp_size 2"]


def test_int4_padding_trap_of_llava_7b_at_tp4():
    # specs/tensorrt-llm.md 1.4: 11008 / (128 * 4) = 21.5 -> TensorRT-LLM would pad; fine at tp 2.
    assert sh.check_quantized_widths("mlp.proj", 4096, 11008, 128, 2, row_parallel=True) == []
    assert any("11008" in p for p in sh.check_quantized_widths("mlp.proj", 4096, 11008, 128, 4, row_parallel=True))
