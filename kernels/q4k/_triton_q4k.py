"""Triton kernels of ``q4k_fp8_gemm``: ``out[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias)``.

The weight arrives in :class:`~tritune.kernels.q4k.weight.Q4KWeight`'s layout: nibbles ``qs``
``[N, K/2]`` in natural order, 6-bit ``scales``/``mins`` ``[N, K/32]``, and ``(d, dmin)`` fp16
``[N, K/256, 2]``. With ``s = d*sc`` and ``o = dmin*m`` for a 32-wide sub-block, a weight is
``s*q - o``.

* The portable kernel dequantizes a ``[BLOCK_N, BLOCK_K]`` weight tile in registers (float32
  ``s*q - o``, then x's dtype) and accumulates ``tl.dot`` in float32.
* The fp8 kernel never rounds the weight. Writing ``q = (q - 8) + 8``, one 32-wide sub-block
  contributes ``s * dot(x, q - 8) + (8s - o) * sum(x)``. ``q - 8`` (-8..7) is exact in e4m3, so
  each sub-block is one fp8 ``tl.dot`` of the row-scaled e4m3 activations against ``q - 8``,
  scaled by ``s`` into the float32 accumulator; after the loop the row scale is applied and the
  "centre" term ``sum_g rowsum(x)[m, g] * (8s - o)[n, g]`` is added as a small float32 dot over
  the sub-block index. The row sums are of the exact activations (the pre-pass computes them),
  so only the centred part ``s*(q-8)`` sees the e4m3 rounding of x: centring keeps that part
  small, which is what holds the SQNR near 31 dB.
* The folded fp8 kernel (``SCALE_FOLD``) dequantizes ``s*q - o`` in float32, multiplies it by
  one power of two per column (chosen from the ``d``/``dmin`` of the program's super-blocks so
  that no weight exceeds e4m3's 448) and rounds it to e4m3. One fp8 ``tl.dot`` then spans the
  whole K tile and accumulates in place; the row scale and the column's power of two are applied
  once after the loop. Both roundings, x's and the weight's, reach the result: about 28.5 dB.
* The swapped folded kernel (``SWAP_AB``) makes the same e4m3 weights but computes ``out^T``
  tiles, ``acc_t[BLOCK_N, BLOCK_M] += w @ x^T``. On Hopper the register-made weight is then
  wgmma's A operand, read straight from registers, while x^T (K-major, as e4m3 wgmma needs its B
  operand) arrives in shared memory through the pipelined loads: wgmma runs asynchronously while
  the next chunk is dequantized, where the unswapped kernel stores each weight tile to shared
  memory and waits for its wgmma. BLOCK_N is wgmma's M side (64 rows per warpgroup), so small M
  (BLOCK_M=16 as wgmma's N) gets wgmma instead of mma.sync.
* The staged path (``path="staged"``) never dequantizes inside a GEMM: :func:`_staged_prepass_kernel`
  quantizes x and writes each column's inverse power of two in one launch,
  :func:`_q4k_dequant_fp8_kernel` turns ``CHUNK_N`` weight rows at a time into the folded e4m3 tile
  ``_folded_weight_tile`` makes (the same weights as ``SCALE_FOLD``) in one reused scratch buffer,
  and cuBLASLt's fp8 GEMM
  (``torch._scaled_mm`` with row and column scales) multiplies each chunk. Each weight is
  dequantized once per call instead of once per M tile: the path for large M.
* With ``SPLIT_K > 1`` each program covers a slice of K and writes float32 partials that
  :func:`_splitk_reduce_kernel` sums (deterministic, no atomics); small-M calls use this to
  spread one pass over the weight across the whole GPU.

Loop trip counts are compile-time (``K_TILES``): the Triton 3.6 interpreter cannot take a run-time
``range`` bound under numpy 2.4, and on a GPU a model has only a few distinct K.
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
def _quantize_rows_fp8_kernel(
    x_ptr,
    xq_ptr,
    row_scale_ptr,
    rowsum_ptr,
    K,
    stride_xm,
    stride_xk,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    ROW_SUMS: tl.constexpr,
):
    """One row per program: e4m3 row with scale ``amax / 448``, and exact 32-wide row sums."""
    pid_m = tl.program_id(0).to(tl.int64)
    _quantize_row(
        x_ptr + pid_m * stride_xm, xq_ptr + pid_m * K, row_scale_ptr + pid_m, rowsum_ptr + pid_m * (K // 32),
        stride_xk, BLOCK_K, K_TILES, ROUND_IN_FP32, ROW_SUMS,
    )  # fmt: skip


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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """Each program reduces ``K_TILES`` tiles of K (its split): fp8 dots of e4m3 x with folded e4m3 weights."""
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

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(K_TILES):
        # BLOCK_K divides 256, so the whole tile shares one super-block's (d, dmin).
        d_ptrs = ss_row + (k_start + i * BLOCK_K) // 256 * 2
        w = _folded_weight_tile(q_ptrs, sc_ptrs, mn_ptrs, d_ptrs, fold, BLOCK_N, BLOCK_K, ROUND_IN_FP32)
        x = tl.load(x_ptrs)  # [BLOCK_M, BLOCK_K] e4m3
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 4
        sc_ptrs += G
        mn_ptrs += G

    row_scale = tl.load(row_scale_ptr + rows_m)
    acc = acc * row_scale[:, None] * (1.0 / fold)[None, :]
    _store_tile(
        acc, out_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k,
        stride_om, stride_on, stride_ok, stride_bn, HAS_BIAS, SPLIT_K,
    )  # fmt: skip


@triton.jit
def _q4k_gemm_fp8_fold_swap_kernel(
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """Each program reduces ``K_TILES`` tiles of K (its split) into a tile of ``out^T``: folded e4m3
    weights (wgmma's A operand, from registers) against e4m3 ``x^T`` (its B operand, from shared
    memory)."""
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

    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(K_TILES):
        d_ptrs = ss_row + (k_start + i * BLOCK_K) // 256 * 2
        w = _folded_weight_tile(q_ptrs, sc_ptrs, mn_ptrs, d_ptrs, fold, BLOCK_N, BLOCK_K, ROUND_IN_FP32)
        x = tl.load(x_ptrs)  # [BLOCK_M, BLOCK_K] e4m3
        # x's rows run along K, so x^T is the K-major B operand e4m3 wgmma requires, with no copy.
        acc_t = tl.dot(w, tl.trans(x), acc_t)  # [BLOCK_N, BLOCK_M]
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 4
        sc_ptrs += G
        mn_ptrs += G

    # The transposed scaling: a column's fold now runs along acc_t's rows, x's row scale along its columns.
    row_scale = tl.load(row_scale_ptr + rows_m)
    acc_t = acc_t * (1.0 / fold)[:, None] * row_scale[None, :]
    # The transposed tile stores as the folded kernel's does: Triton folds the trans into the
    # epilogue's layout conversion (the same IR as storing acc_t through swapped strides).
    _store_tile(
        tl.trans(acc_t), out_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k,
        stride_om, stride_on, stride_ok, stride_bn, HAS_BIAS, SPLIT_K,
    )  # fmt: skip


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


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr, FIRST: tl.constexpr = False):
    """``c`` plus the dot product of the four signed bytes of ``a`` with those of ``b`` (int32 words);
    with ``FIRST``, ``c`` is ignored and the sum starts from zero.

    ``ASM`` (a GPU build) issues PTX ``dp4a``, one instruction; the interpreter, which cannot run
    PTX, takes the same sum from shifts: each byte sign-extended by a left then an arithmetic
    right shift. ``FIRST`` keeps a zero constant out of the chain: Triton would give the constant
    a layout of its own and convert the operands to it.
    """
    if ASM:
        if FIRST:
            total = tl.inline_asm_elementwise(
                "dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            total = tl.inline_asm_elementwise(
                "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
            )
    else:
        total = ((a << 24) >> 24) * ((b << 24) >> 24)
        if not FIRST:
            total += c
        for j in tl.static_range(1, 4):
            total += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
    return total


@triton.jit
def _quantize_rows_gemv_kernel(
    x_ptr,
    xw_ptr,
    xs_ptr,
    xlost_ptr,
    xsum_ptr,
    K,
    stride_xm,
    stride_xk,
    SUBS: tl.constexpr,
    TILE: tl.constexpr,
):
    """``TILE`` 32-wide sub-blocks of one row of x per program, as the GEMV kernel reads them.

    Each sub-block becomes int8 values with its own scale ``amax / 127`` (as ggml's Q8_1), packed
    four to a 32-bit word in the order the packed codes hold their nibbles: row ``m`` of ``xw``
    (int32 ``[M, K/4]``) holds first the ``K/8`` words of x's positions ``8i, 8i+2, 8i+4, 8i+6``
    (the low nibbles of code word ``i``), then the ``K/8`` words of ``8i+1, ..., 8i+7`` (the high
    ones). Per sub-block also: the scale, what its sum lost to the rounding
    (``sum(x) - scale * sum(xi)``) and its exact sum. Divisions are IEEE (``div_rn``), so the
    rounding is the same on the GPU as on the interpreter and in a PyTorch emulation.
    """
    pid_m = tl.program_id(0).to(tl.int64)
    sub = tl.program_id(1) * TILE + tl.arange(0, TILE)  # [TILE] sub-blocks
    ok = sub < SUBS
    offs = tl.arange(0, 32)
    x = tl.load(
        x_ptr + pid_m * stride_xm + (sub[:, None] * 32 + offs[None, :]) * stride_xk, mask=ok[:, None], other=0.0
    ).to(tl.float32)  # [TILE, 32]
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full([TILE], 127.0, tl.float32)), 1.0)
    # Adding 1.5 * 2**23 leaves no fraction bits: float32 addition rounds to an integer, ties to even.
    quotient = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], (TILE, 32)))
    xr = tl.clamp((quotient + 12582912.0) - 12582912.0, -127.0, 127.0)
    at = pid_m * SUBS + sub
    tl.store(xs_ptr + at, scale, mask=ok)
    tl.store(xlost_ptr + at, tl.sum(x - scale[:, None] * xr, axis=1), mask=ok)
    tl.store(xsum_ptr + at, tl.sum(x, axis=1), mask=ok)
    # [TILE, word, byte, parity] -> bytes of each word's even and odd positions, four to an int32.
    even, odd = tl.split(tl.reshape(xr.to(tl.int32) & 0xFF, (TILE, 4, 4, 2)))
    shifts = (8 * tl.arange(0, 4))[None, None, :]
    words = (sub * 4)[:, None] + tl.arange(0, 4)[None, :]  # [TILE, 4] word indices
    row = xw_ptr + pid_m * (K // 4)
    tl.store(row + words, tl.sum(even << shifts, axis=2), mask=ok[:, None])
    tl.store(row + K // 8 + words, tl.sum(odd << shifts, axis=2), mask=ok[:, None])


@triton.jit
def _gemv_tile(
    x_even, q_ptrs, sc_ptrs, mn_ptrs, ss_row, xg, xs_ptr, xlost_ptr, xsum_ptr, k_start, K, i,
    W: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    """Everything iteration ``i`` of the GEMV kernel reads: the code words ``[BLOCK_N, G, 4]``, x's
    even and odd words ``[ROWS, BLOCK_N, G, 4]``, the sub-blocks' ``s = d*sc`` and ``o = dmin*m``
    ``[BLOCK_N, G]``, and x's scales, lost sums and exact sums ``[ROWS, G]``."""
    qw = tl.load(q_ptrs + i * W)  # [BLOCK_N, G, 4]
    xe = tl.load(x_even + i * W)  # [ROWS, BLOCK_N, G, 4]
    xo = tl.load(x_even + i * W + K // 8)
    # d of each sub-block's super-block, dmin one element on.
    d_ptrs = ss_row + ((k_start // 32 + i * G + tl.arange(0, G)) // 8 * 2)[None, :]
    s = tl.load(d_ptrs).to(tl.float32) * _small_as_float(tl.load(sc_ptrs + i * G))
    o = tl.load(d_ptrs + 1).to(tl.float32) * _small_as_float(tl.load(mn_ptrs + i * G))
    xs = tl.load(xs_ptr + xg + i * G)
    lost = tl.load(xlost_ptr + xg + i * G)
    xsum = tl.load(xsum_ptr + xg + i * G)
    return qw, xe, xo, s, o, xs, lost, xsum


@triton.jit
def _q4k_gemv_kernel(
    xw_ptr,
    xs_ptr,
    xlost_ptr,
    xsum_ptr,
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
    ASM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """Decode-sized rows (``ROWS`` per program) on the CUDA cores, integer dot products, no MMA.

    A 32-bit word of packed codes holds eight codes; its low nibbles (``& 0x0F0F0F0F``) are the
    codes of positions ``8i, 8i+2, 8i+4, 8i+6`` as four bytes, its high ones those of the odd
    positions, and ``dp4a`` multiplies each against the matching word of int8 x (see
    :func:`_quantize_rows_gemv_kernel`): about five instructions for eight weights and a row, where
    dequantizing to floats costs about four a weight. The integer sum of each 32-wide sub-block
    then enters a float32 accumulator as ``s * (xs * isum + 8 * lost) - o * sum(x)``: the codes
    centred on 8 (as in the fp8 kernel) against the rounded x, so that the rounding meets
    ``q - 8`` and not each code's mean of 7.5, and the centre and the mins against x's exact sums.
    """
    W: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_start = pid_k * (K_TILES * BLOCK_K)
    offs_m = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_g = tl.arange(0, G)
    # Word j of sub-block g at g*4 + j: the four words of a sub-block stay in one thread.
    offs_w = (offs_g * 4)[:, None] + tl.arange(0, 4)[None, :]  # [G, 4]

    # x's words are read at the full [ROWS, BLOCK_N, G, 4] shape of the products (each row's words
    # once per weight row, from L1): a load that small on its own would get a layout of its own,
    # and Triton would convert the codes to it, through shared memory, on every iteration.
    x_even = tl.broadcast_to(
        (xw_ptr + rows_m[:, None, None, None] * (K // 4) + (k_start // 8 + offs_w)[None, None, :, :]),
        (ROWS, BLOCK_N, G, 4),
    )
    q_row = (qs_ptr + rows_n * stride_qn + k_start // 2).to(tl.pointer_type(tl.int32))
    q_ptrs = q_row[:, None, None] + offs_w[None, :, :]  # [BLOCK_N, G, 4]
    xg = rows_m[:, None] * (K // 32) + (k_start // 32 + offs_g)[None, :]  # [ROWS, G]
    sc_ptrs = sc_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]  # [BLOCK_N, G]
    mn_ptrs = mn_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    ss_row = ss_ptr + rows_n[:, None] * stride_ssn

    acc = tl.zeros((ROWS, BLOCK_N, G), dtype=tl.float32)
    # Triton pipelines only the loads that feed a dot: every load of an iteration is issued one
    # iteration ahead, so that its latency hides behind the previous iteration's work.
    qw, xe, xo, s, o, xs, lost, xsum = _gemv_tile(
        x_even, q_ptrs, sc_ptrs, mn_ptrs, ss_row, xg, xs_ptr, xlost_ptr, xsum_ptr, k_start, K, 0, W, G
    )
    for i in range(K_TILES):
        ahead = tl.minimum(i + 1, K_TILES - 1)
        next_qw, next_xe, next_xo, next_s, next_o, next_xs, next_lost, next_xsum = _gemv_tile(
            x_even, q_ptrs, sc_ptrs, mn_ptrs, ss_row, xg, xs_ptr, xlost_ptr, xsum_ptr, k_start, K, ahead, W, G
        )
        shape: tl.constexpr = (ROWS, BLOCK_N, G, 4)
        lo = tl.broadcast_to((qw & 0x0F0F0F0F)[None, :, :, :], shape)
        hi = tl.broadcast_to(((qw >> 4) & 0x0F0F0F0F)[None, :, :, :], shape)
        isum = tl.sum(_dp4a(lo, xe, _dp4a(hi, xo, hi, ASM, True), ASM), axis=3)  # [ROWS, BLOCK_N, G]
        centred = xs[:, None, :] * isum.to(tl.float32) + 8.0 * lost[:, None, :]
        acc += s[None, :, :] * centred - o[None, :, :] * xsum[:, None, :]
        qw, xe, xo, s, o, xs, lost, xsum = next_qw, next_xe, next_xo, next_s, next_o, next_xs, next_lost, next_xsum
    _store_tile(
        tl.sum(acc, axis=2), out_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k,
        stride_om, stride_on, stride_ok, stride_bn, HAS_BIAS, SPLIT_K,
    )  # fmt: skip


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
