"""The centred fp8 ``q4k_fp8_gemm`` kernel: e4m3 activations against the exact 4-bit codes.

The weight is never rounded. Writing ``q = (q - 8) + 8``, one 32-wide sub-block contributes
``s * dot(x, q - 8) + (8s - o) * sum(x)``. ``q - 8`` (-8..7) is exact in e4m3, so each sub-block
is one fp8 ``tl.dot`` of the row-scaled e4m3 activations against ``q - 8``, scaled by ``s`` into
the float32 accumulator; after the loop the row scale is applied and the "centre" term
``sum_g rowsum(x)[m, g] * (8s - o)[n, g]`` is added as a small float32 dot over the sub-block
index. The row sums are of the exact activations (the pre-pass computes them), so only the
centred part ``s*(q-8)`` sees the e4m3 rounding of x: centring keeps that part small, which is
what holds the SQNR near 31 dB.

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

from ._triton_common import _store_tile, _tile_ids, _unpack_nibbles


@triton.jit
def _q4k_gemm_fp8_kernel(
    xq_ptr,
    row_scale_ptr,
    rowsum_ptr,
    qs_ptr,
    sc_ptr,
    mn_ptr,
    ss_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_qn,
    stride_sn,
    stride_ssn,
    stride_om,
    stride_on,
    stride_ok,
    stride_bn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """Each program reduces ``K_TILES`` tiles of K (its split): fp8 dots of e4m3 x with ``q - 8``."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    k_start = pid_k * (K_TILES * BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_s = tl.arange(0, 32)
    offs_b = tl.arange(0, 16)

    x_ptrs = xq_ptr + rows_m[:, None] * K + (k_start + offs_s)[None, :]
    q_ptrs = qs_ptr + rows_n[:, None] * stride_qn + (k_start // 2 + offs_b)[None, :]
    sc_ptrs = sc_ptr + rows_n * stride_sn + k_start // 32
    ss_row = ss_ptr + rows_n * stride_ssn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(K_TILES):
        # BLOCK_K divides 256, so the whole tile shares one super-block's d.
        d = tl.load(ss_row + (k_start + i * BLOCK_K) // 256 * 2).to(tl.float32)  # [BLOCK_N]
        for j in tl.static_range(BLOCK_K // 32):
            x = tl.load(x_ptrs + j * 32)  # [BLOCK_M, 32] e4m3
            qb = tl.load(q_ptrs + j * 16)  # [BLOCK_N, 16]
            sc = tl.load(sc_ptrs + j).to(tl.float32)  # [BLOCK_N]
            w = (_unpack_nibbles(qb, BLOCK_N, 32).to(tl.float16) - 8.0).to(tl.float8e4nv)
            acc += tl.dot(x, tl.trans(w)) * (d * sc)[None, :]
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 2
        sc_ptrs += BLOCK_K // 32

    row_scale = tl.load(row_scale_ptr + rows_m)
    acc = acc * row_scale[:, None]

    # The centre term: sum over sub-blocks g of rowsum(x)[m, g] * (8*d*sc - dmin*m)[g, n]. tf32
    # operands cost ~55 dB on this (already centred, small) term, far below the e4m3 error.
    GC: tl.constexpr = 16
    GROUPS: tl.constexpr = K_TILES * BLOCK_K // 32
    offs_gc = tl.arange(0, GC)
    for c in range((GROUPS + GC - 1) // GC):
        g_ok = c * GC + offs_gc < GROUPS
        g = k_start // 32 + c * GC + offs_gc
        rs = tl.load(rowsum_ptr + rows_m[:, None] * (K // 32) + g[None, :], mask=g_ok[None, :], other=0.0)
        sc_mn = rows_n[None, :] * stride_sn + g[:, None]  # [GC, BLOCK_N]
        sc = tl.load(sc_ptr + sc_mn, mask=g_ok[:, None], other=0).to(tl.float32)
        mn = tl.load(mn_ptr + sc_mn, mask=g_ok[:, None], other=0).to(tl.float32)
        d_ptrs = ss_ptr + rows_n[None, :] * stride_ssn + (g // 8 * 2)[:, None]
        d = tl.load(d_ptrs, mask=g_ok[:, None], other=0.0).to(tl.float32)
        dmin = tl.load(d_ptrs + 1, mask=g_ok[:, None], other=0.0).to(tl.float32)
        centre = 8.0 * (d * sc) - dmin * mn  # [GC, BLOCK_N]
        acc = tl.dot(rs, centre, acc, input_precision="tf32")

    _store_tile(
        acc, out_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k,
        stride_om, stride_on, stride_ok, stride_bn, HAS_BIAS, SPLIT_K,
    )  # fmt: skip
