"""Triton helpers the ``q4k_fp8_gemm`` kernels share: tile order, code unpacking, stores, folding.

The weight arrives in :class:`~tritune.kernels.q4k.weight.Q4KWeight`'s layout: nibbles ``qs``
``[N, K/2]`` in natural order, 6-bit ``scales``/``mins`` ``[N, K/32]``, and ``(d, dmin)`` fp16
``[N, K/256, 2]``. With ``s = d*sc`` and ``o = dmin*m`` for a 32-wide sub-block, a weight is
``s*q - o``. Every GEMM kernel computes ``out[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias)``.

Loop trip counts are compile-time (``K_TILES``): the Triton 3.6 interpreter cannot take a run-time
``range`` bound under numpy 2.4, and on a GPU a model has only a few distinct K.

The folding helpers (:func:`_column_fold`, :func:`_folded_weight_tile`) are shared by the folded
GEMM kernel and the staged path's dequantization, so that the two make identical e4m3 weights.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e4m3_grid(x):
    """``x`` (``|x| <= 448``) rounded to the nearest e4m3 value, ties to even, in float32."""
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    # Adding 1.5 * 2**23 leaves no fraction bits: float32 addition rounds to an integer, ties to even.
    return ((x / ulp + 12582912.0) - 12582912.0) * ulp


@triton.jit
def _quantize_row(
    x_row,
    xq_row,
    row_scale_ptr,
    rowsum_row,
    stride_xk,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    ROW_SUMS: tl.constexpr,
):
    """One row of x: its e4m3 values with scale ``amax / 448`` and, if asked, its exact 32-wide sums."""
    offs_k = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in range(K_TILES):
        x = tl.load(x_row + (i * BLOCK_K + offs_k) * stride_xk).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    row_max = tl.max(amax, axis=0)
    scale = tl.where(row_max > 0, row_max / 448.0, 1.0)
    tl.store(row_scale_ptr, scale)
    offs_g = tl.arange(0, BLOCK_K // 32)
    for i in range(K_TILES):
        k0 = i * BLOCK_K
        x = tl.load(x_row + (k0 + offs_k) * stride_xk).to(tl.float32)
        xq = tl.clamp(x / scale, -448.0, 448.0)
        if ROUND_IN_FP32:
            # The interpreter's e4m3 cast drops the carry when rounding up to a power of two
            # (31.3 -> 16): round on the e4m3 grid first so that the cast is exact.
            xq = _e4m3_grid(xq)
        tl.store(xq_row + k0 + offs_k, xq.to(tl.float8e4nv))
        if ROW_SUMS:
            sums = tl.sum(tl.reshape(x, (BLOCK_K // 32, 32)), axis=1)
            tl.store(rowsum_row + k0 // 32 + offs_g, sums)


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program, GROUP_M row tiles at a time so weight tiles stay in L2."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _unpack_nibbles(qb, ROWS: tl.constexpr, COLS: tl.constexpr):
    """uint8 ``[ROWS, COLS/2]`` of packed pairs -> ``[ROWS, COLS]`` values 0..15 in natural order."""
    return tl.reshape(tl.join(qb & 0xF, qb >> 4), (ROWS, COLS))


@triton.jit
def _codes_as_float(qw, ROWS: tl.constexpr, COLS: tl.constexpr, CODES: tl.constexpr):
    """``[ROWS, COLS/CODES]`` words of ``CODES`` (8: int32, 4: uint16) codes -> float32 ``[ROWS, COLS]``
    codes 0..15 in natural order (code ``j`` of a word in bits ``4j..4j+3``, as ``qs``'s
    little-endian bytes hold them).

    Full-rate bit operations and additions instead of int-to-float conversions (a quarter of the
    rate on Hopper): the codes come out as the same exact floats. Eight codes a word unpack in the
    fewest instructions; four keep each thread's codes in the 4-wide K runs that the fp8 dot operand
    layout holds, where eight would send them through shared memory.
    """
    if CODES == 8:
        # Codes 4i..4i+3 of a word in bits 0..15 (the masks below drop what the shift extends).
        qw = tl.join(qw, qw >> 16)
    # Under exponent bits 158, which hold each exponent below as a subset.
    t = qw.to(tl.int32) | 0x4F000000
    # A float32 with exponent 2**(23-p) and q in mantissa bits p..p+3 is exactly 2**(23-p) + q: one
    # AND keeps one code and that exponent, and the subtraction is exact.
    c0 = (t & 0x4B00000F).to(tl.float32, bitcast=True) - 8388608.0
    c1 = (t & 0x490000F0).to(tl.float32, bitcast=True) - 524288.0
    c2 = (t & 0x47000F00).to(tl.float32, bitcast=True) - 32768.0
    c3 = (t & 0x4500F000).to(tl.float32, bitcast=True) - 2048.0
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (ROWS, COLS))


@triton.jit
def _small_as_float(x):
    """Integers ``0 <= x < 2**23`` (uint8 scales and mins here) as float32, without a conversion."""
    # 2**23 + x is a float32 with exponent 2**23 and x as its mantissa: exact, and so is the subtraction.
    return (x.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _store_tile(
    acc,
    out_ptr,
    bias_ptr,
    offs_m,
    offs_n,
    M,
    N,
    pid_k,
    stride_om,
    stride_on,
    stride_ok,
    stride_bn,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n * stride_bn, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Float32 partials [SPLIT_K, M, N]; the reduce kernel adds the bias.
        ptrs = out_ptr + pid_k * stride_ok + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _column_fold(ss_row, k_start, K_RANGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_N]`` powers of two ``f`` with ``|f * w| <= 448`` for every weight of the super-blocks
    that ``[k_start, k_start + K_RANGE)`` touches: ``|w| <= 15*63*|d| + 63*|dmin|``."""
    CHUNK: tl.constexpr = 8
    # A range that is not a whole number of super-blocks may straddle one more.
    CHUNKS: tl.constexpr = ((K_RANGE + 511) // 256 + CHUNK - 1) // CHUNK
    first = k_start // 256
    last = (k_start + K_RANGE - 1) // 256
    offs_c = tl.arange(0, CHUNK)
    bound = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in range(CHUNKS):
        sb = first + c * CHUNK + offs_c
        ptrs = ss_row[:, None] + (sb * 2)[None, :]  # [BLOCK_N, CHUNK]
        d = tl.load(ptrs, mask=(sb <= last)[None, :], other=0.0).to(tl.float32)
        dmin = tl.load(ptrs + 1, mask=(sb <= last)[None, :], other=0.0).to(tl.float32)
        bound = tl.maximum(bound, tl.max(945.0 * tl.abs(d) + 63.0 * tl.abs(dmin), axis=1))
    # The largest power of two not above 448 / bound: keep the exponent bits, clear the mantissa.
    # An all-zero column gets 2**108, harmless on zeros and still invertible in float32.
    ratio = 448.0 / tl.maximum(bound, 1e-30)
    return (ratio.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _folded_weight_tile(
    q_ptrs,
    sc_ptrs,
    mn_ptrs,
    d_ptrs,
    fold,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    CODES: tl.constexpr = 4,
):
    """The ``[BLOCK_N, BLOCK_K]`` e4m3 tile ``e4m3(f * (d*sc*q - dmin*m))`` of one super-block's
    (``d_ptrs``) K range, from ``[BLOCK_N, BLOCK_K/CODES]`` pointers to its code words (``CODES``
    4: 16-bit words, the layout the fp8 dot operand holds; 8: 32-bit words, for the staged
    dequantization, which feeds no dot); every kernel that folds shares it, so all round every
    weight alike."""
    G: tl.constexpr = BLOCK_K // 32
    # Times a power of two, d*sc, q*d*sc and dmin*m stay exact: w is f * (gguf's weight).
    d = tl.load(d_ptrs).to(tl.float32) * fold  # [BLOCK_N]
    dmin = tl.load(d_ptrs + 1).to(tl.float32) * fold
    scale = d[:, None] * _small_as_float(tl.load(sc_ptrs))  # [BLOCK_N, G]
    offset = dmin[:, None] * _small_as_float(tl.load(mn_ptrs))
    q = tl.reshape(_codes_as_float(tl.load(q_ptrs), BLOCK_N, BLOCK_K, CODES), (BLOCK_N, G, 32))
    w = tl.reshape(q * scale[:, :, None] - offset[:, :, None], (BLOCK_N, BLOCK_K))
    if ROUND_IN_FP32:
        w = _e4m3_grid(w)
    return w.to(tl.float8e4nv)
