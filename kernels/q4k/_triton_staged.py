"""The staged path's kernels: a pre-pass over x and the weight's scales, then folded e4m3 chunks.

The staged path (``path="staged"``) never dequantizes inside a GEMM: :func:`_staged_prepass_kernel`
quantizes x and writes each column's inverse power of two in one launch, and
:func:`_q4k_dequant_fp8_kernel` turns ``CHUNK_N`` weight rows at a time into the folded e4m3 tile
``_folded_weight_tile`` makes (the same weights as ``SCALE_FOLD``) in one reused scratch buffer,
which cuBLASLt's fp8 GEMM (``torch._scaled_mm`` with row and column scales) multiplies. Each
weight is dequantized once per call instead of once per M tile: the path for large M.

The weight arrives in :class:`~tritune.kernels.q4k.weight.Q4KWeight`'s layout: nibbles ``qs``
``[N, K/2]`` in natural order, 6-bit ``scales``/``mins`` ``[N, K/32]``, and ``(d, dmin)`` fp16
``[N, K/256, 2]``. With ``s = d*sc`` and ``o = dmin*m`` for a 32-wide sub-block, a weight is
``s*q - o``. Every GEMM kernel computes ``out[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias)``.

Loop trip counts are compile-time (``K_TILES``): the Triton 3.6 interpreter cannot take a run-time
``range`` bound under numpy 2.4, and on a GPU a model has only a few distinct K.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_common import _column_fold, _folded_weight_tile, _quantize_row


@triton.jit
def _staged_prepass_kernel(
    x_ptr,
    xq_ptr,
    row_scale_ptr,
    ss_ptr,
    inv_fold_ptr,
    M,
    N,
    stride_xm,
    stride_xk,
    stride_ssn,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    FOLD_BLOCK_N: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    """The staged path's two small jobs in one launch (a launch costs tens of microseconds of host
    time): programs ``0 .. M-1`` quantize one row of x each (as ``_quantize_rows_fp8_kernel``), the
    rest write ``inv_fold[n] = 1 / f`` for ``FOLD_BLOCK_N`` columns each (``_column_fold``'s power
    of two over the whole of K)."""
    pid = tl.program_id(0)
    if pid < M:
        row = pid.to(tl.int64)
        _quantize_row(
            x_ptr + row * stride_xm, xq_ptr + row * K, row_scale_ptr + row, row_scale_ptr,
            stride_xk, BLOCK_K, K_TILES, ROUND_IN_FP32, False,
        )  # fmt: skip
    else:
        offs_n = (pid - M) * FOLD_BLOCK_N + tl.arange(0, FOLD_BLOCK_N)
        rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        fold = _column_fold(ss_ptr + rows_n * stride_ssn, 0, K, FOLD_BLOCK_N)
        tl.store(inv_fold_ptr + offs_n, 1.0 / fold, mask=offs_n < N)


@triton.jit
def _q4k_dequant_fp8_kernel(
    qs_ptr,
    sc_ptr,
    mn_ptr,
    ss_ptr,
    inv_fold_ptr,
    w8_ptr,
    row0,
    ROWS,
    K,
    stride_qn,
    stride_sn,
    stride_ssn,
    ROUND_IN_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Weight rows ``row0 .. row0 + ROWS - 1``, K tile ``program_id(1)``, as folded e4m3 into
    ``w8[ROWS, K]`` (row-major: the column-major ``[K, ROWS]`` operand ``_scaled_mm`` wants)."""
    G: tl.constexpr = BLOCK_K // 32
    offs_r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    # Rows past the chunk re-read its first row (valid memory); their stores are masked.
    rows_n = (row0 + tl.where(offs_r < ROWS, offs_r, 0)).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_g = tl.arange(0, G)
    # Each column's power of two, exact as the inverse of an inverse power of two.
    fold = 1.0 / tl.load(inv_fold_ptr + rows_n)
    # Eight codes a 32-bit word: the fewest instructions a weight, with no dot operand layout to keep.
    q_ptrs = (qs_ptr + rows_n[:, None] * stride_qn + k0 // 2).to(tl.pointer_type(tl.int32)) + offs_w[None, :]
    sc_ptrs = sc_ptr + rows_n[:, None] * stride_sn + (k0 // 32 + offs_g)[None, :]
    mn_ptrs = mn_ptr + rows_n[:, None] * stride_sn + (k0 // 32 + offs_g)[None, :]
    d_ptrs = ss_ptr + rows_n * stride_ssn + k0 // 256 * 2
    w = _folded_weight_tile(q_ptrs, sc_ptrs, mn_ptrs, d_ptrs, fold, BLOCK_N, BLOCK_K, ROUND_IN_FP32, 8)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w8_ptr + offs_r[:, None].to(tl.int64) * K + offs_k[None, :]
    tl.store(ptrs, w, mask=(offs_r < ROWS)[:, None])
