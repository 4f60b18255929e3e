"""The split-K reduce of ``q4k_fp8_gemm``: the float32 partials of ``SPLIT_K`` programs summed.

With ``SPLIT_K > 1`` each GEMM program covers a slice of K and writes float32 partials that
:func:`_splitk_reduce_kernel` sums (deterministic, no atomics); small-M calls use this to spread
one pass over the weight across the whole GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _splitk_reduce_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_pk,
    stride_pm,
    stride_om,
    stride_on,
    stride_bn,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out = sum of SPLIT_K float32 partials (+ bias)``, cast to out's dtype."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = part_ptr + offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ptrs + s * stride_pk, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n * stride_bn, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
