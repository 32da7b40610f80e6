"""sparse-xattn over a quantized KV cache: the image keys' block sums, carried as decoder state.

sparse-xattn ranks image-key blocks by their mean key. With int4-kv / int8-kv the torch model
ranks with the keys its quantized cache returns, i.e. quantized and dequantized (K after RoPE,
``clamp(rint(k / k_scale)) * k_scale``, from the first forward on; ``prefill_attention="exact"``,
which reads a forward's own keys in float, is refused at export). In ONNX the cached keys live
packed inside GroupQueryAttention, but the ranking only needs per-block sums of the image keys, so
the decoder keeps those in float32 as one more past/present pair per layer
(``past_key_values.{i}.image_key_sums`` -> ``present.{i}.image_key_sums``, [B, kv_heads, blocks,
head_dim]): each call quantizes and dequantizes its new keys exactly as the cache does and adds the
image ones to their blocks (of the row's own grid, which starts at its first real token, as in the
pass). The state covers the blocks up to the last image key, so it stops growing once the prompt
is in (new tokens are text): for a 576-token image with 16-token blocks, 37 blocks per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mmsdk.plugins.backends.onnxruntime import names as N
from mmsdk.plugins.backends.onnxruntime.graph import FLOAT
from mmsdk.plugins.backends.onnxruntime.sparse import pad_blocks

if TYPE_CHECKING:
    from mmsdk.plugins.backends.onnxruntime.graph import GraphBuilder
    from mmsdk.plugins.backends.onnxruntime.kvcache import KVQuant
    from mmsdk.plugins.backends.onnxruntime.sparse import SparseRule

__all__ = ["BLOCKS_PAST", "BLOCKS_PRESENT", "declare_image_key_state", "image_key_sums"]

BLOCKS_PAST = "past_image_key_blocks"
BLOCKS_PRESENT = "image_key_blocks"


def declare_image_key_state(g: GraphBuilder, layers: tuple[int, ...], kv_heads: int, head_dim: int) -> None:
    """The past inputs of every self-attention layer (the present outputs are added by :func:`image_key_sums`)."""
    for i in layers:
        g.input(N.past_image_key_sums(i), FLOAT, [N.BATCH, kv_heads, BLOCKS_PAST, head_dim])


def _dequantized(g: GraphBuilder, k: str, kv: KVQuant, index: int, kv_heads: int, dim: int) -> str:
    """k [B, kv_heads, S, D] as the quantized cache returns it: clamp(rint(k / s), -q, q - 1) * s."""
    scale = np.asarray(kv.k_scales[index], np.float32)
    scale = scale.reshape(1, kv_heads, 1, dim) if scale.size > 1 else scale.reshape(1)
    s = g.const(f"k_scale_rank.{index}", scale, keep_dtype=True)
    qmax = float(2 ** (kv.bits - 1))
    codes = g.op("Clip", [g.op("Round", [g.op("Div", [k, s])]), g.const("qmin", np.float32(-qmax), keep_dtype=True),
                          g.const("qmax", np.float32(qmax - 1), keep_dtype=True)])
    return g.op("Mul", [codes, s], hint="k_dequantized")


def _relative_blocks(g: GraphBuilder, begin: str, end: str, starts: str, block: str) -> str:
    """[B, end - begin]: blocks of positions begin..end-1, each row's grid starting at ``starts`` [B] (padding: 0)."""
    positions = g.op("Unsqueeze", [g.op("Range", [begin, end, g.const("step", np.int64(1))]), g.ints("ax0p", [0])])
    relative = g.op("Sub", [positions, g.op("Unsqueeze", [starts, g.ints("ax1s", [1])])])
    return g.op("Div", [g.op("Max", [relative, g.const("zero_p", np.int64(0))]), block])


def _state_blocks(g: GraphBuilder, past: str, image_cols: str, starts: str, block: str) -> str:
    """Blocks the state covers: the past's, or up to the last image key if that is further (int64 scalar)."""
    total = g.op("Gather", [g.op("Shape", [image_cols]), g.const("one_t", np.int64(1))], axis=0)
    ends = g.op("Add", [_relative_blocks(g, g.const("zero", np.int64(0)), total, starts, block),
                        g.const("one_b", np.int64(1))])  # block index + 1
    needed = g.op("ReduceMax", [g.op("Mul", [g.op("Cast", [image_cols], to=7), ends])], keepdims=0)
    have = g.op("Gather", [g.op("Shape", [past]), g.const("two", np.int64(2))], axis=0)
    return g.op("Max", [have, needed])


def image_key_sums(g: GraphBuilder, k_new: str, image_cols: str, starts: str, kv: KVQuant, index: int,
                   rule: SparseRule, kv_heads: int, dim: int) -> str:
    """Sums of the image keys per block [B, kv_heads, NB, D] to rank with; writes ``present.{i}.image_key_sums``.

    ``k_new`` [B, kv_heads, S, D] float32: this call's keys after RoPE; ``image_cols`` [B, T] bool
    over the whole row (the call's tokens are the last S); ``starts`` [B] each row's first real
    token, where its block grid starts (as in the pass, so the sums are per block of the row's own grid).
    """
    with g.scope("image_key_sums"):
        past = N.past_image_key_sums(index)
        block = g.const("block", np.int64(rule.block))
        blocks = _state_blocks(g, past, image_cols, starts, block)
        total = g.op("Gather", [g.op("Shape", [image_cols]), g.const("one_i", np.int64(1))], axis=0)
        seq = g.op("Gather", [g.op("Shape", [k_new]), g.const("two_s", np.int64(2))], axis=0)
        ids = _relative_blocks(g, g.op("Sub", [total, seq]), total, starts, block)  # [B, S]
        grid = g.op("Range", [g.const("zero_r", np.int64(0)), blocks, g.const("one_g", np.int64(1))])
        onehot = g.op("Cast", [g.op("Equal", [g.op("Unsqueeze", [ids, g.ints("ax2o", [2])]), grid])], to=FLOAT)
        new_images = g.op("Slice", [g.op("Cast", [image_cols], to=FLOAT), g.op("Unsqueeze", [g.op("Neg", [seq]),
                                    g.ints("ax0", [0])]), g.ints("end", [2**62]), g.ints("axis", [1])])  # [B, S]
        member = g.op("Mul", [g.op("Unsqueeze", [new_images, g.ints("ax2", [2])]), onehot])  # [B, S, NB]
        spread = g.op("Unsqueeze", [g.op("Transpose", [member], perm=[0, 2, 1]), g.ints("axh", [1])])  # [B, 1, NB, S]
        carried = pad_blocks(g, past, blocks, "past")
        stored = g.op("MatMul", [spread, _dequantized(g, k_new, kv, index, kv_heads, dim)])
        present = g.op("Add", [carried, stored], hint="present")
        return g.output(present, N.present_image_key_sums(index), FLOAT, [N.BATCH, kv_heads, BLOCKS_PRESENT, dim])
