"""The folded fp8 ``q4k_fp8_gemm`` kernel (``SCALE_FOLD``): e4m3 weights with their scales folded in.

The kernel dequantizes ``s*q - o`` in float32, multiplies it by one power of two per column
(chosen from the ``d``/``dmin`` of the program's super-blocks so that no weight exceeds e4m3's
448) and rounds it to e4m3. One fp8 ``tl.dot`` then spans the whole K tile and accumulates in
place; the row scale and the column's power of two are applied once after the loop. Both
roundings, x's and the weight's, reach the result: about 28.5 dB.

``SWAP_AB`` makes the same e4m3 weights but computes ``out^T`` tiles,
``acc[BLOCK_N, BLOCK_M] += w @ x^T``. On Hopper the register-made weight is then wgmma's A
operand, read straight from registers, while x^T (K-major, as e4m3 wgmma needs its B operand)
arrives in shared memory through the pipelined loads: wgmma runs asynchronously while the next
chunk is dequantized, where the unswapped tile stores each weight tile to shared memory and waits
for its wgmma. BLOCK_N is wgmma's M side (64 rows per warpgroup), so small M (BLOCK_M=16 as
wgmma's N) gets wgmma instead of mma.sync. ``SWAP_AB`` is a ``constexpr``: each setting compiles
to exactly the code of a kernel written for it alone (the same PTX and SASS on sm_90).

The weight arrives in :class:`~tritune.kernels.q4k.weight.Q4KWeight`'s layout: nibbles ``qs``
``[N, K/2]`` in natural order, 6-bit ``scales``/``mins`` ``[N, K/32]``, and ``(d, dmin)`` fp16
``[N, K/256, 2]``. With ``s = d*sc`` and ``o = dmin*m`` for a 32-wide sub-block, a weight is
``s*q - o``. Loop trip counts are compile-time (``K_TILES``): the Triton 3.6 interpreter cannot
take a run-time ``range`` bound under numpy 2.4, and on a GPU a model has only a few distinct K.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_common import _column_fold, _folded_weight_tile, _store_tile, _tile_ids


@triton.jit
def _q4k_gemm_fp8_fold_kernel(
    xq_ptr,
    row_scale_ptr,
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
    ROUND_IN_FP32: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """Each program reduces ``K_TILES`` tiles of K (its split): fp8 dots of e4m3 x with folded e4m3
    weights; with ``SWAP_AB`` into a tile of ``out^T``, the weights as wgmma's A operand (from
    registers) against e4m3 ``x^T`` (its B operand, from shared memory)."""
    G: tl.constexpr = BLOCK_K // 32
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    k_start = pid_k * (K_TILES * BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 4)
    offs_g = tl.arange(0, G)
    ss_row = ss_ptr + rows_n * stride_ssn
    fold = _column_fold(ss_row, k_start, K_TILES * BLOCK_K, BLOCK_N)  # [BLOCK_N]

    x_ptrs = xq_ptr + rows_m[:, None] * K + (k_start + offs_k)[None, :]
    # The packed codes as 16-bit words of four (K is a multiple of 256: rows and tiles are aligned).
    q_row = (qs_ptr + rows_n[:, None] * stride_qn + k_start // 2).to(tl.pointer_type(tl.uint16))
    q_ptrs = q_row + offs_w[None, :]
    sc_ptrs = sc_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    mn_ptrs = mn_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(K_TILES):
        # BLOCK_K divides 256, so the whole tile shares one super-block's (d, dmin).
        d_ptrs = ss_row + (k_start + i * BLOCK_K) // 256 * 2
        w = _folded_weight_tile(q_ptrs, sc_ptrs, mn_ptrs, d_ptrs, fold, BLOCK_N, BLOCK_K, ROUND_IN_FP32)
        x = tl.load(x_ptrs)  # [BLOCK_M, BLOCK_K] e4m3
        if SWAP_AB:
            # x's rows run along K, so x^T is the K-major B operand e4m3 wgmma requires, with no copy.
            acc = tl.dot(w, tl.trans(x), acc)  # [BLOCK_N, BLOCK_M]
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 4
        sc_ptrs += G
        mn_ptrs += G

    row_scale = tl.load(row_scale_ptr + rows_m)
    if SWAP_AB:
        # The transposed scaling: a column's fold runs along acc's rows, x's row scale along its
        # columns. The transposed tile stores as the unswapped one does: Triton folds the trans
        # into the epilogue's layout conversion (the same IR as storing through swapped strides).
        acc = tl.trans(acc * (1.0 / fold)[:, None] * row_scale[None, :])
    else:
        acc = acc * row_scale[:, None] * (1.0 / fold)[None, :]
    _store_tile(
        acc, out_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k,
        stride_om, stride_on, stride_ok, stride_bn, HAS_BIAS, SPLIT_K,
    )  # fmt: skip
