"""The dequant path's kernel: Q4_K weight rows dequantized exactly and rounded to x's dtype.

The dequant path (``path="dequant"``) makes ``CHUNK_N`` weight rows at a time into a dense
``[CHUNK_N, K]`` scratch in x's dtype (bf16 or fp16), which cuBLAS multiplies with x: each weight
is dequantized once per call instead of once per M tile, and the GEMM is the dense one a
pre-dequantized weight would get. The weights are gguf's float32 values ``d*sc*q - dmin*m``
(every product exact, as :meth:`~tritune.kernels.q4k.weight.Q4KWeight.dequantize` computes them)
rounded once to x's dtype, as the portable kernel rounds its operands: the same accuracy.

The weight arrives in :class:`~tritune.kernels.q4k.weight.Q4KWeight`'s layout: nibbles ``qs``
``[N, K/2]`` in natural order, 6-bit ``scales``/``mins`` ``[N, K/32]``, and ``(d, dmin)`` fp16
``[N, K/256, 2]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_common import _codes_as_float, _small_as_float


@triton.jit
def _bf16_grid(x):
    """``x`` rounded to the nearest bfloat16 value, ties to even, in float32 (finite ``x``)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _q4k_dequant_kernel(
    qs_ptr,
    sc_ptr,
    mn_ptr,
    ss_ptr,
    w_ptr,
    row0,
    ROWS,
    K,
    stride_qn,
    stride_sn,
    stride_ssn,
    ROUND_BF16_IN_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Weight rows ``row0 .. row0 + ROWS - 1``, K tile ``program_id(1)``, in ``w``'s dtype into
    ``w[ROWS, K]`` (row-major: the column-major ``[K, ROWS]`` operand the GEMM reads as ``w.t()``)."""
    G: tl.constexpr = BLOCK_K // 32
    offs_r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    # Rows past the chunk re-read its first row (valid memory); their stores are masked.
    rows_n = (row0 + tl.where(offs_r < ROWS, offs_r, 0)).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_g = tl.arange(0, G)
    # BLOCK_K divides 256: the whole tile shares one super-block's (d, dmin).
    d_ptrs = ss_ptr + rows_n * stride_ssn + k0 // 256 * 2
    d = tl.load(d_ptrs).to(tl.float32)  # [BLOCK_N]
    dmin = tl.load(d_ptrs + 1).to(tl.float32)
    sc = _small_as_float(tl.load(sc_ptr + rows_n[:, None] * stride_sn + (k0 // 32 + offs_g)[None, :]))
    mn = _small_as_float(tl.load(mn_ptr + rows_n[:, None] * stride_sn + (k0 // 32 + offs_g)[None, :]))
    # gguf's order of operations: (d*sc)*q - dmin*m, each product exact in float32.
    scale = d[:, None] * sc  # [BLOCK_N, G]
    offset = dmin[:, None] * mn
    # Eight codes a 32-bit word: the fewest instructions a weight, with no dot operand layout to keep.
    q_ptrs = (qs_ptr + rows_n[:, None] * stride_qn + k0 // 2).to(tl.pointer_type(tl.int32)) + offs_w[None, :]
    q = tl.reshape(_codes_as_float(tl.load(q_ptrs), BLOCK_N, BLOCK_K, 8), (BLOCK_N, G, 32))
    w = tl.reshape(q * scale[:, :, None] - offset[:, :, None], (BLOCK_N, BLOCK_K))
    if ROUND_BF16_IN_FP32:
        # The interpreter's bfloat16 cast truncates: round to nearest even first, so that it is exact.
        w = _bf16_grid(w)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + offs_r[:, None].to(tl.int64) * K + offs_k[None, :]
    tl.store(ptrs, w.to(w_ptr.dtype.element_ty), mask=(offs_r < ROWS)[:, None])
