"""The GEMV path's kernels: x as int8 per 32-wide sub-block, and ``dp4a`` against the exact codes.

For decode-sized M on the CUDA cores, no MMA: :func:`_quantize_rows_gemv_kernel` packs x's int8
values four to a word in the order the code words hold their nibbles, and :func:`_q4k_gemv_kernel`
multiplies a code word's low and high nibbles with one ``dp4a`` each.

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

from ._triton_common import _small_as_float, _store_tile


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
