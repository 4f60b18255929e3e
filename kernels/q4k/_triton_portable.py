"""The portable ``q4k_fp8_gemm`` kernel: dequantize in registers, multiply in x's dtype.

Each program dequantizes a ``[BLOCK_N, BLOCK_K]`` weight tile (float32 ``s*q - o``, then x's
dtype) and accumulates ``tl.dot`` in float32; it runs on any CUDA GPU.

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

from ._triton_common import _codes_as_float, _small_as_float, _store_tile, _tile_ids


@triton.jit
def _q4k_gemm_portable_kernel(
    x_ptr,
    qs_ptr,
    sc_ptr,
    mn_ptr,
    ss_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_sn,
    stride_ssn,
    stride_om,
    stride_on,
    stride_ok,
    stride_bn,
    HAS_BIAS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """Each program reduces ``K_TILES`` tiles of K (its split), dequantized to x's dtype."""
    G: tl.constexpr = BLOCK_K // 32
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    k_start = pid_k * (K_TILES * BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows and columns read row 0 / column 0 (valid memory); their results are masked.
    rows_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_g = tl.arange(0, G)

    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    # The packed codes as 32-bit words (K is a multiple of 256, so rows and tiles are word-aligned).
    q_row = (qs_ptr + rows_n[:, None] * stride_qn + k_start // 2).to(tl.pointer_type(tl.int32))
    q_ptrs = q_row + offs_w[None, :]
    sc_ptrs = sc_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    mn_ptrs = mn_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    ss_row = ss_ptr + rows_n[:, None] * stride_ssn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(K_TILES):
        # d of each sub-block's super-block, dmin one element on: [BLOCK_N, G] pointers.
        d_ptrs = ss_row + ((k_start // 32 + i * G + offs_g) // 8 * 2)[None, :]
        x = tl.load(x_ptrs)  # [BLOCK_M, BLOCK_K]
        qw = tl.load(q_ptrs)  # [BLOCK_N, BLOCK_K / 8]
        scale = tl.load(d_ptrs).to(tl.float32) * _small_as_float(tl.load(sc_ptrs))  # [BLOCK_N, G]
        offset = tl.load(d_ptrs + 1).to(tl.float32) * _small_as_float(tl.load(mn_ptrs))
        q = tl.reshape(_codes_as_float(qw, BLOCK_N, BLOCK_K, 8), (BLOCK_N, G, 32))
        w = tl.reshape(q * scale[:, :, None] - offset[:, :, None], (BLOCK_N, BLOCK_K)).to(x.dtype)
        if DOT_IN_FP32:
            # The interpreter multiplies bf16 tiles wrongly; fp32 operands hold the same values.
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K * stride_xk
        q_ptrs += BLOCK_K // 8
        sc_ptrs += G
        mn_ptrs += G

    _store_tile(
        acc, out_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k,
        stride_om, stride_on, stride_ok, stride_bn, HAS_BIAS, SPLIT_K,
    )  # fmt: skip
