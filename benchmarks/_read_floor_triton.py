"""A kernel that only reads two buffers (a KV cache's K and V codes): the floor under any decode kernel that reads them.

Imported by benchmarks/gpu_kernel_sweeps.py when it runs on a GPU. Each program XORs its share of the int32 words
and stores one word, so the loads cannot be dropped and nothing else costs time; ``EMPTY`` stores without reading
(the launch alone).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def read_words(a_ptr, b_ptr, out_ptr, n_words, BLOCK: tl.constexpr, EMPTY: tl.constexpr = False):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    if not EMPTY:
        step = tl.num_programs(0) * BLOCK
        for start in range(pid * BLOCK, n_words, step):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < n_words
            acc ^= tl.load(a_ptr + offs, mask=ok, other=0) ^ tl.load(b_ptr + offs, mask=ok, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))
