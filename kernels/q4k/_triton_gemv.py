"""The GEMV path's kernels: x as int8 per 32-wide sub-block, and ``dp4a`` against the exact codes.

For decode-sized M on the CUDA cores, no MMA: :func:`_quantize_rows_gemv_kernel` packs x's int8
values four to a word in the order the code words hold their nibbles, and :func:`_q4k_gemv_kernel`
multiplies a code word's low and high nibbles with one ``dp4a`` each. :func:`_q4k_gemv_fused_kernel`
computes the same bits with the pre-pass and the split-K reduce in its own launch (the config's
``FUSE_QUANT`` and ``FUSED_REDUCE``): one launch a call instead of two or three.

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
def _round_subblocks(x):
    """Each 32-wide sub-block (the last axis) of float32 ``x`` as int8 values with the scale
    ``amax / 127`` (as ggml's Q8_1): the rounded values (as floats) and the scales.

    Shared by the pre-pass and the fused GEMV kernel (``FUSE_QUANT``), as is
    :func:`_lost_to_rounding`, so that both quantize alike. Divisions are IEEE (``div_rn``), so
    the rounding is the same on the GPU as on the interpreter and in a PyTorch emulation.
    """
    amax = tl.max(tl.abs(x), axis=len(x.shape) - 1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), 1.0)
    # Adding 1.5 * 2**23 leaves no fraction bits: float32 addition rounds to an integer, ties to even.
    quotient = tl.math.div_rn(x, tl.broadcast_to(tl.expand_dims(scale, len(x.shape) - 1), x.shape))
    return tl.clamp((quotient + 12582912.0) - 12582912.0, -127.0, 127.0), scale


@triton.jit
def _lost_to_rounding(x, xr, scale):
    """Per sub-block of :func:`_round_subblocks`: ``sum(x) - scale * sum(xr)``, summed as one float
    sum of the 32 differences (its order is the reduction's: see :func:`_q4k_gemv_fused_kernel`)."""
    return tl.sum(x - tl.expand_dims(scale, len(x.shape) - 1) * xr, axis=len(x.shape) - 1)


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
    (``sum(x) - scale * sum(xi)``) and its exact sum (:func:`_round_subblocks`).
    """
    pid_m = tl.program_id(0).to(tl.int64)
    sub = tl.program_id(1) * TILE + tl.arange(0, TILE)  # [TILE] sub-blocks
    ok = sub < SUBS
    offs = tl.arange(0, 32)
    x = tl.load(
        x_ptr + pid_m * stride_xm + (sub[:, None] * 32 + offs[None, :]) * stride_xk, mask=ok[:, None], other=0.0
    ).to(tl.float32)  # [TILE, 32]
    xr, scale = _round_subblocks(x)
    at = pid_m * SUBS + sub
    tl.store(xs_ptr + at, scale, mask=ok)
    tl.store(xlost_ptr + at, _lost_to_rounding(x, xr, scale), mask=ok)
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
def _gemv_weights(
    q_ptrs, sc_ptrs, mn_ptrs, ss_row, k_start, i, W: tl.constexpr, G: tl.constexpr, K_LANES: tl.constexpr = False
):  # fmt: skip
    """The weight half of :func:`_gemv_tile`: code words (at ``q_ptrs``' shape), ``s`` and ``o`` ``[BLOCK_N, G]``."""
    qw = tl.load(q_ptrs + i * W)
    if K_LANES:
        qw = tl.reshape(qw, (qw.shape[0], qw.shape[1], G, 4))
        SUPERS: tl.constexpr = (G + 7) // 8
        pairs = tl.load(ss_row + ((k_start + i * (G * 32)) // 256 + tl.arange(0, SUPERS))[None, :])
        pairs = tl.reshape(
            tl.broadcast_to(pairs[:, :, None], (pairs.shape[0], SUPERS, G // SUPERS)), (pairs.shape[0], G)
        )
        d = pairs.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        s = d * _small_as_float(tl.load(sc_ptrs + i * G))
        o = dmin * _small_as_float(tl.load(mn_ptrs + i * G))
    else:
        d_ptrs = ss_row + ((k_start // 32 + i * G + tl.arange(0, G)) // 8 * 2)[None, :]
        s = tl.load(d_ptrs).to(tl.float32) * _small_as_float(tl.load(sc_ptrs + i * G))
        o = tl.load(d_ptrs + 1).to(tl.float32) * _small_as_float(tl.load(mn_ptrs + i * G))
    return qw, s, o


@triton.jit
def _gemv_x(
    x_tile, x_even, xs_ptr, xlost_ptr, xsum_ptr, xg, K, i,
    FUSE_QUANT: tl.constexpr, BLOCK_K: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    """The x half of iteration ``i``: with ``FUSE_QUANT`` x's float values ``[ROWS, COPIES, G, 32]``
    (quantized by :func:`_quantize_tile`); else the pre-pass's even and odd words at the products'
    shape and its scales, lost sums and exact sums ``[ROWS, G]``."""
    if FUSE_QUANT:
        xv = tl.load(x_tile + i * BLOCK_K).to(tl.float32)
        return xv, xv, xv, xv, xv
    else:
        xe = tl.load(x_even + i * W)
        xo = tl.load(x_even + i * W + K // 8)
        return xe, xo, tl.load(xs_ptr + xg + i * G), tl.load(xlost_ptr + xg + i * G), tl.load(xsum_ptr + xg + i * G)


@triton.jit
def _quantize_tile(xv, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, COPIES: tl.constexpr):
    """x's float values ``[ROWS, COPIES, G, 32]`` (``COPIES`` equal copies of a tile's ``G``
    sub-blocks) -> what the pre-pass would give the GEMV loop for them: the even and odd words at
    the products' shape ``[ROWS, BLOCK_N, G, 4]``, and per sub-block ``[ROWS, G]`` the scale, the
    lost sum and the exact sum.

    The words are packed as the pre-pass packs them (sums of shifted bytes: exact), the copies
    reduced by a maximum (exact: they are equal).
    """
    xr, scale = _round_subblocks(xv)
    lost = _lost_to_rounding(xv, xr, scale)
    sums = tl.sum(xv, axis=3)
    # [ROWS, COPIES, G, word, byte, parity] -> the bytes of each word's even and odd positions.
    even, odd = tl.split(tl.reshape(xr.to(tl.int32) & 0xFF, (ROWS, COPIES, G, 4, 4, 2)))
    shifts = (8 * tl.arange(0, 4))[None, None, None, None, :]
    words_even = tl.max(tl.sum(even << shifts, axis=4), axis=1)  # [ROWS, G, 4]
    words_odd = tl.max(tl.sum(odd << shifts, axis=4), axis=1)
    shape: tl.constexpr = (ROWS, BLOCK_N, G, 4)
    xe = tl.broadcast_to(words_even[:, None, :, :], shape)
    xo = tl.broadcast_to(words_odd[:, None, :, :], shape)
    return xe, xo, tl.max(scale, axis=1), tl.max(lost, axis=1), tl.max(sums, axis=1)


@triton.jit
def _q4k_gemv_fused_kernel(
    x_ptr,
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
    part_ptr,
    counters_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_ssn,
    stride_om,
    stride_on,
    stride_pk,
    stride_pm,
    stride_bn,
    HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_TILES: tl.constexpr,
    FUSE_QUANT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    COPIES: tl.constexpr,
    K_LANES: tl.constexpr = False,
):
    """:func:`_q4k_gemv_kernel`'s products with the pre-pass (``FUSE_QUANT``) and the split-K reduce
    (``FUSED_REDUCE``) in the same launch: with both, a decode step's GEMV is one launch.

    ``FUSE_QUANT``: each program quantizes the x values of its K range itself, a tile per
    iteration (``x_ptr``, K contiguous; one row of x is a few KB and stays in L2), with the
    pre-pass's helpers. The two float sums per sub-block add in the order of the reduction's
    layout: the tile is loaded ``COPIES`` times over (``[ROWS, COPIES, G, 32]``, as many copies as
    make ``4 * 32 * num_warps`` values) so that each thread holds four consecutive values of a
    sub-block and the eight lowest lanes share it, as in the pre-pass's ``[16, 32]`` tile at 4
    warps. The products, the accumulator and its final sum take the layout of the codes' load,
    which is the one :func:`_q4k_gemv_kernel` gives them. So the results are bit-identical to
    the pre-pass path (``tests/test_sm90_build.py`` checks both layouts on sm_90, where
    ``ROWS * BLOCK_K <= 128 * num_warps``: the search space's rule at one row).

    ``K_LANES``: Triton lays a load's lanes along its pointers' contiguous last axis. At the
    products' rank that axis is a sub-block's 4 code words, so a warp's 32 lanes read 16 bytes of
    each of 32 weight rows an instruction, and the per-sub-block d and dmin gather 2 bytes of 32
    rows; Nsight Compute counted about two thirds of such a kernel's global sectors as excess,
    with the L1 the busiest unit. With ``K_LANES`` the lanes read consecutive 16-byte pieces of
    each row's K tile, and each super-block's (d, dmin) is one 32-bit load shared by its sub-blocks
    in registers. The values are the same; the final sum over the K tile adds in the new layout's
    order, so the results differ from the other layout's in the last bits.

    ``FUSED_REDUCE`` (``SPLIT_K > 1``): each program writes its float32 partial to ``part_ptr``
    (``[SPLIT_K, M, N]``), then counts itself on its output tile's arrival counter; the last to
    arrive sums the tile's partials in split order (as :func:`_splitk_reduce_kernel`, so the result
    does not depend on the arrival order), adds the bias, writes ``out`` and puts the counter back
    to 0 for the next launch or graph replay (counters from :func:`tritune.kernels._launch.arrival_counters`).
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
    offs_w = (offs_g * 4)[:, None] + tl.arange(0, 4)[None, :]  # [G, 4]

    if FUSE_QUANT:
        # [ROWS, COPIES, G, 32]: the tile's sub-blocks, COPIES times (the copies' pointers are equal).
        x_tile = (
            x_ptr + rows_m[:, None, None, None] * stride_xm + tl.zeros((COPIES,), tl.int32)[None, :, None, None]
            + (k_start + offs_g * 32)[None, None, :, None] + tl.arange(0, 32)[None, None, None, :]
        )  # fmt: skip
        x_even = x_tile
        xg = rows_m
    else:
        x_tile = x_ptr
        x_even = tl.broadcast_to(
            (xw_ptr + rows_m[:, None, None, None] * (K // 4) + (k_start // 8 + offs_w)[None, None, :, :]),
            (ROWS, BLOCK_N, G, 4),
        )
        xg = rows_m[:, None] * (K // 32) + (k_start // 32 + offs_g)[None, :]  # [ROWS, G]
    q_row = (qs_ptr + rows_n * stride_qn + k_start // 2).to(tl.pointer_type(tl.int32))
    # The codes are read at the products' rank, [1, BLOCK_N, G, 4]: that load's layout is then the
    # one _q4k_gemv_kernel's x load gives its products (and so the order of its final sum), and
    # the small x words are what Triton converts, not the codes. With K_LANES they are read as
    # [1, BLOCK_N, G * 4], whose contiguous last axis puts the lanes along K, then reshaped (in
    # registers) to the products' rank, which then take that layout.
    if K_LANES:
        q_ptrs = q_row[None, :, None] + tl.arange(0, G * 4)[None, None, :]
    else:
        q_ptrs = q_row[None, :, None, None] + offs_w[None, None, :, :]
    sc_ptrs = sc_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]  # [BLOCK_N, G]
    mn_ptrs = mn_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    if K_LANES:
        # Each super-block's (d, dmin) as one 32-bit word.
        ss_row = (ss_ptr + rows_n[:, None] * stride_ssn).to(tl.pointer_type(tl.int32))
    else:
        ss_row = ss_ptr + rows_n[:, None] * stride_ssn

    acc = tl.zeros((ROWS, BLOCK_N, G), dtype=tl.float32)
    # As in _q4k_gemv_kernel, every load of an iteration is issued one iteration ahead. The codes'
    # loads come last, after x's and after the quantization's reshape: Triton 3.6 propagates the
    # layout of the last of those in program order first, and the products, the accumulator and
    # its final sum must take the codes' (as in _q4k_gemv_kernel, so the final sum's order is its).
    xa, xb, xc, xd, xf = _gemv_x(x_tile, x_even, xs_ptr, xlost_ptr, xsum_ptr, xg, K, 0, FUSE_QUANT, BLOCK_K, W, G)
    qw, s, o = _gemv_weights(q_ptrs, sc_ptrs, mn_ptrs, ss_row, k_start, 0, W, G, K_LANES)
    for i in range(K_TILES):
        ahead = tl.minimum(i + 1, K_TILES - 1)
        next_xa, next_xb, next_xc, next_xd, next_xf = _gemv_x(
            x_tile, x_even, xs_ptr, xlost_ptr, xsum_ptr, xg, K, ahead, FUSE_QUANT, BLOCK_K, W, G
        )
        if FUSE_QUANT:
            xe, xo, xs, lost, xsum = _quantize_tile(xa, ROWS, BLOCK_N, G, COPIES)
        else:
            xe, xo, xs, lost, xsum = xa, xb, xc, xd, xf
        next_qw, next_s, next_o = _gemv_weights(q_ptrs, sc_ptrs, mn_ptrs, ss_row, k_start, ahead, W, G, K_LANES)
        shape: tl.constexpr = (ROWS, BLOCK_N, G, 4)
        lo = tl.broadcast_to(qw & 0x0F0F0F0F, shape)
        hi = tl.broadcast_to((qw >> 4) & 0x0F0F0F0F, shape)
        isum = tl.sum(_dp4a(lo, xe, _dp4a(hi, xo, hi, ASM, True), ASM), axis=3)  # [ROWS, BLOCK_N, G]
        centred = xs[:, None, :] * isum.to(tl.float32) + 8.0 * lost[:, None, :]
        acc += s[None, :, :] * centred - o[None, :, :] * xsum[:, None, :]
        qw, s, o = next_qw, next_s, next_o
        xa, xb, xc, xd, xf = next_xa, next_xb, next_xc, next_xd, next_xf
    total = tl.sum(acc, axis=2)
    if SPLIT_K == 1:
        _store_tile(total, out_ptr, bias_ptr, offs_m, offs_n, M, N, 0, stride_om, stride_on, 0, stride_bn, HAS_BIAS, 1)
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        part = part_ptr + offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
        tl.store(part + pid_k * stride_pk, total, mask=mask)
        if FUSED_REDUCE:
            # Publish, then count, as the decode kernel's fused merge: bar.sync orders every thread's
            # stores above before the atomic (one thread runs it), whose release at gpu scope makes
            # them visible GPU-wide before the count moves.
            tl.debug_barrier()
            counter = counters_ptr + tl.program_id(2) * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            # The last arrival has acquired every earlier release (a chain of acq_rel atomics); its
            # reads go to L2 (.cg), where the stores went, never to a stale L1 line.
            if arrived == SPLIT_K - 1:
                reduced = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                for split in tl.static_range(1, SPLIT_K):
                    reduced += tl.load(part + split * stride_pk, mask=mask, other=0.0, cache_modifier=".cg")
                _store_tile(
                    reduced, out_ptr, bias_ptr, offs_m, offs_n, M, N, 0, stride_om, stride_on, 0, stride_bn,
                    HAS_BIAS, 1,
                )  # fmt: skip
                # Every split of the tile has counted: the next launch (or replay) finds it zero.
                tl.store(counter, 0)
