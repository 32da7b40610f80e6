"""Decode attention over a packed INT4 / INT8 / FP8 KV cache, and the fused quantize-and-append.

The cache stores, per layer, codes ``[B, H_kv, T_max, D/2]`` uint8 (int4, ``q + 8`` two per byte,
even channel low: the layout of :class:`~mmsdk.plugins.quantizers.quantized_cache.StaticCodec`) or
``[B, H_kv, T_max, D]`` int8 / float8_e4m3fn, with static scales per (KV head, channel). The number
of valid tokens lives in a device tensor, so a CUDA graph replays the same launches at every step.

:func:`decode_attention` is flash-decoding: the sequence is cut into splits, one program per
(batch, KV head, split) loads each K/V tile once for all the query heads of its group (GQA),
dequantizes it in registers (K's scale is folded into q, V's into the output) and keeps an online
softmax; a second kernel merges the splits, or in the int4 MHA kernel its own last program per head does
(``merge_counters``). No full-precision copy of the cache is ever made. Which kernel a call takes, its tiles and its
splits: :mod:`mmsdk.kernels.kv_decode_choice`.

:func:`attention_implementation` registers, under a name of its own in transformers' attention
registry, a function that runs this kernel when the cache layer hands it a packed marker instead
of K/V tensors (decode steps on CUDA) and the model's original attention otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from mmsdk.kernels import interpreting, note_fallback, pdl_ready, triton_ready
from mmsdk.kernels.kv_decode_choice import (VARIANTS, byte_pairs, ceil_div, generic_config, launched_without_pdl,
                                            pick_variant, pow2, splits, words_ready)
from mmsdk.kernels.kv_word_config import word_launch

__all__ = ["FORMATS", "VARIANTS", "append_kv", "attention_implementation", "decode_attention", "dequantize_codes",
           "reference_decode_attention"]

FORMATS = {"int4": 0, "int8": 1, "fp8": 2}
_PREFIX = "mmsdk_packed_kv_"
# dequantized K + V bytes of one group of heads in a packed prefill (see _prefill_by_heads)
PREFILL_GROUP_BYTES = 64 << 20


def append_kv(key: torch.Tensor, value: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor,
              key_scale: torch.Tensor, value_scale: torch.Tensor, length: torch.Tensor, fmt: str) -> None:
    """Quantize ``key``/``value`` [B, H, L, D] and write them at positions ``length .. length + L`` (one launch)."""
    from mmsdk.kernels import _kv_triton

    b, h, n, d = key.shape
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    half = key_codes.shape[-1] if fmt == "int4" else (d + 1) // 2
    _kv_triton.append[(b * h, n)](
        key, value, key_codes, value_codes, key_scale, value_scale, length, h, key_codes.shape[2], d, half,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        FMT=FORMATS[fmt], BLOCK_HD=pow2(half), num_warps=1, enable_fp_fusion=True,
    )


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, fmt: str, length: int, dim: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """The first ``length`` tokens of a packed code buffer, dequantized: ``[B, H, length, dim]`` in ``dtype``.

    What :meth:`StaticCodec.decode <mmsdk.plugins.quantizers.quantized_cache.StaticCodec.decode>` computes,
    bitwise, in one launch: the torch decode makes fp32 temporaries (unpacked codes, the code minus 8, the
    product) each four times the size of its bf16 result, and a chunked prefill decodes the whole prefix of
    every layer on every chunk, so they set the prefill's memory peak. ``codes`` is the ``[B, H, T_max, width]``
    buffer or a run of its heads (``buffer[:, h0:h1]``), ``scale`` fp32 ``[H, dim]`` (the same heads).
    """
    from mmsdk.kernels import _kv_triton

    b, h, t_max, width = codes.shape
    if codes.stride(3) != 1 or codes.stride(2) != width or codes.stride(1) != t_max * width:
        raise ValueError("dequantize_codes reads a [B, H, T_max, width] code buffer or a run of its heads; "
                         f"got strides {codes.stride()}: pass the cache's buffer (or buffer[:, h0:h1]).")
    out = torch.empty(b, h, length, dim, device=codes.device, dtype=dtype)
    if length == 0:
        return out
    block_t = 64
    half = width if fmt == "int4" else (dim + 1) // 2
    pairs = byte_pairs(codes, codes, fmt, dim)
    _kv_triton.dequantize[(b * h, ceil_div(length, block_t))](
        codes, scale.contiguous(), out, h, t_max, codes.stride(0) // width, length, dim,
        width if fmt == "int4" else dim // 2 if pairs else dim, out.stride(0), out.stride(1), out.stride(2),
        FMT=FORMATS[fmt], BLOCK_T=block_t, BLOCK_HD=pow2(half), PAIRS=pairs, num_warps=4, enable_fp_fusion=True,
    )
    return out


def decode_attention(query: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor,
                     key_scale: torch.Tensor, value_scale: torch.Tensor, length: torch.Tensor, fmt: str,
                     scaling: float, mask: torch.Tensor | None = None,
                     config: tuple[int, ...] | None = None, variant: str | None = None,
                     append: tuple[torch.Tensor, torch.Tensor] | None = None,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                     merge_counters: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, 1, D] over the first ``length`` cached tokens: ``[B, 1, Hq, D]``.

    ``mask`` (optional, [B, L] with L >= length, nonzero = attend) drops padded tokens. ``variant``
    (one of :data:`VARIANTS`, None = the default for these inputs) and ``config`` (BLOCK_T, num_warps,
    target programs[, num_stages[, ahead]]; ahead: for "generic" each tile's V loaded with its K; for the word kernels
    see :mod:`mmsdk.kernels.kv_word_config`) pick a kernel and override its defaults (tuning).

    ``append`` is the step's new token, K and V ``[B, H_kv, 1, D]``, not yet in the cache: it is quantized
    into the cache at position ``length``, ``length`` grows by one, and the query attends over it too. The
    "subnormal" and "generic" kernels do both in their own launches (no append kernel, no length increment);
    "magic" appends first (:func:`append_kv`).

    ``rope`` (cos, sin ``[B, 1, D]``, or ``[1, 1, D]`` for every row) says that ``query`` and the appended K are not
    rotated yet: the "subnormal" and "generic" kernels rotate them as they load them (rotate-half RoPE, rounded as
    the RoPE kernel rounds), which saves the step a RoPE launch; "magic" rotates them first (one RoPE kernel).

    ``merge_counters`` (int32 zeros, at least ``B * H_kv + 1``): variant "subnormal" merges its splits in its own
    launch, the last program of each head merging them, instead of a combine kernel (one launch fewer), and leaves
    the counters at zero for the next call; the other variants merge with the combine kernel and leave them alone.
    The packed cache passes them unless ``MMSDK_KV_MERGE=0``: on the H200 the merged kernel took 0.4-1.1 µs less
    per call than the two launches at 1280-16k tokens of LLaVA-1.5-7B's heads. (The same merge in the "generic"
    kernel, for grouped-query heads, took 1.4-2.0 µs more per call at Qwen2-VL-7B's 28 / 4 heads, one program per
    KV head summing every split of its 7 query heads alone, and was removed: docs/benchmarks.md, thirty-second
    pass.)
    """
    from mmsdk.kernels import _kv_grouped_triton, _kv_triton, _split_merge_triton

    b, hq, _, d = query.shape
    variant = pick_variant(variant, words_ready(key_codes, value_codes, fmt, d), hq // key_codes.shape[1])
    if rope is not None:
        rope = _rope_rows(rope, b, d)
        if variant == "magic" or (append is not None and append[0].shape[-2] != 1):
            query, append = _rotated_now(query, append, rope)
            rope = None
    rope_args = (rope[0], rope[1], rope[0].stride(0)) if rope is not None else None
    if append is not None and (variant == "magic" or append[0].shape[-2] != 1):
        append_kv(*append, key_codes, value_codes, key_scale, value_scale, length, fmt)
        length.add_(append[0].shape[-2])
        append = None
    if variant != "generic":
        return _decode_int4_words(query, key_codes, value_codes, key_scale, value_scale, length, scaling, mask,
                                  config, variant, append, rope_args, merge_counters)
    h_kv, t_max = key_codes.shape[1], key_codes.shape[2]
    group = hq // h_kv
    half = (d + 1) // 2
    block_hd = pow2(half)
    use_dot = group >= 3 and block_hd >= 16
    block_g = max(16, pow2(group)) if use_dot else pow2(group)
    (block_t, warps, target, stages), v_ahead = generic_config(config, use_dot, block_g * block_hd <= 64, t_max,
                                                                fmt=fmt, rows=b * h_kv)
    n_splits, split_t = splits(b * h_kv, t_max, block_t, target)
    partial = torch.empty(b * hq * n_splits * 2 * block_hd, device=query.device, dtype=torch.float32)
    lse = torch.empty(b * hq * n_splits, device=query.device, dtype=torch.float32)
    out = torch.empty(b, 1, hq, d, device=query.device, dtype=query.dtype)
    mask_arg = mask if mask is not None else lse
    new_key, new_value = _new_token(append, query)
    pdl = pdl_ready(query) and not launched_without_pdl(config, use_dot, fmt, t_max, b * h_kv)
    pairs = byte_pairs(key_codes, value_codes, fmt, d)
    row_width = key_codes.shape[-1] if fmt == "int4" else d // 2 if pairs else d  # in loaded elements
    _kv_grouped_triton.decode_partial[(b * h_kv, n_splits)](
        query, key_codes, value_codes, key_scale, length, mask_arg, partial, lse,
        query.stride(0), query.stride(1), mask.stride(0) if mask is not None else 0,
        mask.shape[-1] if mask is not None else 0, h_kv, group, t_max, d, row_width, split_t,
        float(scaling) * _kv_triton.LOG2E, new_key, new_value, value_scale, new_key.stride(0), new_key.stride(1),
        new_value.stride(0), new_value.stride(1), *(rope_args or _no_rope(query)),
        FMT=FORMATS[fmt], HAS_MASK=mask is not None, USE_DOT=use_dot, BLOCK_G=block_g, BLOCK_T=block_t,
        BLOCK_HD=block_hd, APPEND=append is not None, ROPE=rope is not None, V_AHEAD=v_ahead, ASM=not interpreting(),
        PDL=pdl, PAIRS=pairs, launch_pdl=pdl, num_warps=warps, num_stages=stages, enable_fp_fusion=True,
    )
    _split_merge_triton.decode_combine[(b * hq,)](
        partial, lse, value_scale, out, hq, group, d, n_splits, out.stride(0), out.stride(2), length,
        BLOCK_S=pow2(n_splits), BLOCK_HD=block_hd, ADVANCE=append is not None, PDL=pdl, launch_pdl=pdl,
        num_warps=4 if block_hd >= 64 else 1, enable_fp_fusion=True,
    )
    return out


def _decode_int4_words(query: torch.Tensor, key_codes: torch.Tensor, value_codes: torch.Tensor,
                       key_scale: torch.Tensor, value_scale: torch.Tensor, length: torch.Tensor, scaling: float,
                       mask: torch.Tensor | None, config: tuple[int, ...] | None,
                       variant: str, append: tuple[torch.Tensor, torch.Tensor] | None = None,
                       rope_args: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                       merge_counters: torch.Tensor | None = None) -> torch.Tensor:
    """Flash-decoding over int4 codes read as int32 words (8 channels per load element); ``append``, the RoPE
    rows ``rope_args`` (cos, sin, batch stride) and ``merge_counters`` (variant "subnormal" only) as in
    :func:`decode_attention`."""
    from mmsdk.kernels import _kv_triton, _split_merge_triton

    b, hq, _, d = query.shape
    h_kv, t_max = key_codes.shape[1], key_codes.shape[2]
    group = hq // h_kv
    launch = word_launch(config, variant, group, t_max)
    n_splits, split_t = splits(b * h_kv, t_max, launch.block_t, launch.target)
    partial = torch.empty(b * hq * n_splits * d, device=query.device, dtype=torch.float32)
    lse = torch.empty(b * hq * n_splits, device=query.device, dtype=torch.float32)
    out = torch.empty(b, 1, hq, d, device=query.device, dtype=query.dtype)
    args = (query, key_codes.view(torch.int32), value_codes.view(torch.int32), key_scale,
            length, mask if mask is not None else lse, partial, lse,
            query.stride(0), query.stride(1), mask.stride(0) if mask is not None else 0,
            mask.shape[-1] if mask is not None else 0, h_kv, group, t_max, split_t, float(scaling) * _kv_triton.LOG2E)
    if variant == "subnormal":
        from mmsdk.kernels import _kv_subnormal_triton

        new_key, new_value = _new_token(append, query)
        merge = merge_counters is not None
        if merge:
            _check_counters(merge_counters, b * h_kv + 1, query.device)
        _kv_subnormal_triton.decode_partial_int4_subnormal_mha[(b * h_kv, n_splits)](
            *args, new_key, new_value, value_scale, new_key.stride(0), new_key.stride(1), new_value.stride(0),
            new_value.stride(1), *(rope_args or _no_rope(query)), out, out.stride(0), out.stride(2),
            merge_counters if merge else lse, HAS_MASK=mask is not None, BLOCK_T=launch.block_t,
            W=d // 8, PREFETCH=launch.prefetch, APPEND=append is not None, ROPE=rope_args is not None,
            FOLD=launch.fold, KDOT=launch.kdot, ASM=not interpreting(), STAGES=launch.stages, MERGE=merge,
            BLOCK_S=pow2(n_splits), PDL=pdl_ready(query), num_warps=launch.warps, enable_fp_fusion=True)
        if merge:
            return out
    elif append is not None or rope_args is not None:
        raise ValueError(f"decode variant {variant!r} cannot append or rotate the new token itself: call append_kv "
                         "(and the RoPE op) first")
    else:
        use_dot = group >= 3
        _kv_triton.decode_partial_int4[(b * h_kv, n_splits)](
            *args, HAS_MASK=mask is not None, USE_DOT=use_dot, BLOCK_G=max(16, pow2(group)) if use_dot else
            pow2(group), BLOCK_T=launch.block_t, W=d // 8, num_warps=launch.warps,
            **({"num_stages": launch.stages} if launch.stages is not None else {}), enable_fp_fusion=True)
    _split_merge_triton.decode_combine_natural[(b * hq,)](
        partial, lse, value_scale, out, hq, group, n_splits, out.stride(0), out.stride(2), length,
        BLOCK_S=pow2(n_splits), D=d, PDL=pdl_ready(query), ADVANCE=append is not None,
        num_warps=4 if d >= 64 else 1, enable_fp_fusion=True,
    )
    return out


def _check_counters(counters: torch.Tensor, needed: int, device: torch.device) -> None:
    """``merge_counters`` must be int32 zeros on the query's device, one per (batch, KV head) and one more."""
    if (counters.dtype != torch.int32 or counters.device != device or counters.numel() < needed
            or not counters.is_contiguous()):
        raise ValueError(f"merge_counters: pass contiguous int32 zeros on {device}, at least {needed} of them "
                         f"(batch * KV heads + 1); got {counters.numel()} {counters.dtype} on {counters.device}.")


def _no_rope(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Stand-in cos / sin arguments of a launch without ROPE (the kernels never read them)."""
    return query, query, 0


def _rope_rows(rope: tuple[torch.Tensor, torch.Tensor], batch: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin as ``[B, 1, D]`` rows with unit stride along D and one batch stride for both."""
    cos, sin = rope
    if cos.dim() != 3 or cos.shape[1:] != (1, dim) or cos.shape != sin.shape or cos.shape[0] not in (1, batch):
        raise ValueError(f"rope cos/sin of shapes {tuple(cos.shape)} / {tuple(sin.shape)}: pass the decode step's "
                         f"rows as [B, 1, {dim}] (or [1, 1, {dim}] for every row)")
    cos, sin = cos.expand(batch, 1, dim), sin.expand(batch, 1, dim)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def _rotated_now(query: torch.Tensor, append: tuple[torch.Tensor, torch.Tensor] | None,
                 rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """``query`` and the appended K rotated by the RoPE op (for kernels that do not rotate them)."""
    from mmsdk.kernels.norm_rope_gpu import rope_qk

    key = append[0] if append is not None else query[:, :1]
    query, key = rope_qk(query, key, *rope)
    return query, ((key, append[1]) if append is not None else None)


def _new_token(append: tuple[torch.Tensor, torch.Tensor] | None,
               query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The new token's K and V with unit stride along head_dim (the query stands in when there is none)."""
    new_key, new_value = append if append is not None else (query, query)
    if new_key.stride(-1) != 1 or new_value.stride(-1) != 1:
        new_key, new_value = new_key.contiguous(), new_value.contiguous()
    return new_key, new_value


def reference_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                               mask: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 reference of :func:`decode_attention` on dequantized K/V [B, Hkv, T, D]: ``[B, 1, Hq, D]``."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = (query.double() @ k.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, : k.shape[2]].bool(), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _mask_row(mask: Any, batch: int) -> torch.Tensor | None:
    """The last query row of a 4-D attention mask as [B, L] (bool kept, additive turned into bool)."""
    if not isinstance(mask, torch.Tensor):
        return None
    row = mask[:, 0, -1, :] if mask.dim() == 4 else mask
    if row.dtype != torch.bool:
        row = row > torch.finfo(row.dtype).min / 2
    return row.expand(batch, -1)


def _prefill_by_heads(layer: Any, attend: Any, module: Any, query: torch.Tensor, mask: Any, *args: Any,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``attend`` over the packed prefix a group of KV heads at a time: ``[B, L, Hq, D]``.

    Each group's K/V are dequantized for it alone, at most :data:`PREFILL_GROUP_BYTES` together
    (LLaVA-1.5-7B at batch 4 x 3.7k tokens: 8 of 32 heads, 60 MB where all heads took 240 MB).
    """
    batch, q_heads = query.shape[:2]
    kv_heads = layer.key_codes.shape[1]
    per_head = 2 * batch * layer.cumulative_length * layer.head_dim * query.element_size()
    group = max(1, min(kv_heads, PREFILL_GROUP_BYTES // max(1, per_head)))
    ratio = q_heads // kv_heads
    outputs = []
    for first in range(0, kv_heads, group):
        end = min(kv_heads, first + group)
        key, value = layer.dequantized_heads(first, end)
        heads = slice(first * ratio, end * ratio)
        part_mask = mask[:, heads] if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] > 1 else mask
        outputs.append(attend(module, query[:, heads], key, value, part_mask, *args, **kwargs)[0])
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)), None


def _make_attention(base: str) -> Any:
    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from mmsdk.plugins.quantizers.static_kv import packed_layer

        fallback = ALL_ATTENTION_FUNCTIONS.get(base) if base != "eager" else None
        if fallback is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as fallback
        layer = packed_layer(key)
        unsupported = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
        if layer is not None and not unsupported and query.shape[2] != 1:
            return _prefill_by_heads(layer, fallback, module, query, attention_mask, *args, **kwargs)
        if layer is not None and (unsupported or not triton_ready(query)):
            note_fallback("packed KV decode attention", f"{unsupported or 'no CUDA'}")
            query = layer.rotated_query(query)  # a RoPE left to the kernel (PackedStaticLayer.take_rope) runs now
            key, value = layer.dequantized_heads(0, layer.key_codes.shape[1])
            layer = None
        if layer is None:
            return fallback(module, query, key, value, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        # an unpadded batch needs no mask on a decode step; a graph-captured mask would also freeze its length
        row = None if layer.unpadded else _mask_row(attention_mask, query.shape[0])
        return layer.attend(query, scaling, row), None

    attention.__name__ = f"{_PREFIX}{base}"
    return attention


def attention_implementation(base: str) -> str | None:
    """Register (once) and return the attention implementation that wraps ``base`` with the packed kernel.

    None when ``base`` is not one the wrapper can fall back to (flash / flex implementations take
    no 4-D mask of the form the kernel reads).
    """
    if base.startswith(_PREFIX):
        return base
    if base not in ("sdpa", "eager"):
        return None
    return register_wrapper(f"{_PREFIX}{base}", base, _make_attention)


def register_wrapper(name: str, base: str, make: Any) -> str:
    """Register ``make(base)`` (once) as attention implementation ``name`` in transformers' registry, building its
    masks as ``base`` does; returns ``name``."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, make(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name
