"""The int8 ``q4k_fp8_gemm`` path: folded weights and activations as int8, int8 tensor-core dots.

Each weight ``w = d*sc*q - dmin*m`` (the fold kernel's values before its e4m3 rounding) is rounded
to int8 against one scale per weight row, ``amax_n / 127``, and each row of x to int8 against
``amax_m / 127``; the dot products accumulate exactly in int32 over all of K, and the two scales
apply once after the loop. Each rounding is uniform over its row's range.

Accuracy against the exactly dequantized fp64 product, measured on the interpreter (2026-12-04,
Gaussian weights * 0.02): with Gaussian x, 37.9-38.8 dB (NMSE 1.3e-4 to 1.6e-4) at N=64, K=1024
and M=1..64, inside ggml's Q4_K bound (NMSE <= 5e-4, 33 dB). But one scale per row of x is set by
the row's largest value: with a few outlier channels (1/64 of them 20x the rest, as in a
transformer's residual stream) 28.5 dB, and with silu(gate) * up (an MLP's down-projection input,
heavy-tailed) 32.8 dB, at M=16, N=64, K=768 (``tests/test_q4k.py``'s realistic activations). So
the rule is: about 38 dB where x's rows are Gaussian, below ggml's bound where they have outliers
or heavy tails, and the path is part of the fp8 opt-in (``TRITUNE_Q4K_FP8``) with its 25 dB floor;
the GEMV's per-32 scales (37.7 and 40.3 dB there) are what stays accurate on such rows.

int32 holds the sum of K products of at most 127 * 127: exact up to K = 133,000.

Two launches: a pre-pass (:func:`_int8_prepass_kernel`) quantizes x's rows and computes each
weight row's scale from its super-blocks' fields alone (``|w| <= max(|15*d*sc - dmin*m|,
|dmin*m|)`` over its sub-blocks: a linear function of the code reaches its largest magnitude at
code 0 or 15, and gguf's quantizer uses both ends of each sub-block's range, so this is the row's
amax in practice); then the GEMM (:func:`_q4k_gemm_int8_kernel`) reads one scale per weight row
instead of scanning its scales again in each program.

``SWAP_AB`` as in the folded fp8 kernel: tiles of ``out^T``, the int8 weight made in registers as
wgmma's A operand, int8 x^T (K-major, as 8-bit wgmma needs its B operand) from shared memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_common import _codes_as_float, _small_as_float, _store_tile, _tile_ids


@triton.jit
def _round_to_int8(v):
    """``v`` (``|v| <= 127.5``) rounded to the nearest integer, ties to even, as int8.

    Adding 1.5 * 2**23 leaves no fraction bits (float32 addition rounds to an integer, ties to
    even) and puts that integer in the low mantissa bits: subtracting the constant's bits
    (0x4B400000) leaves it as an int32, with no float-to-int conversion (quarter rate on Hopper).
    """
    return ((v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000).to(tl.int8)


@triton.jit
def _int8_prepass_kernel(
    x_ptr,
    xq_ptr,
    x_scale_ptr,
    sc_ptr,
    mn_ptr,
    ss_ptr,
    w_scale_ptr,
    M,
    N,
    stride_xm,
    stride_xk,
    stride_sn,
    stride_ssn,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
):
    """Programs ``0 .. M-1``: one row of x each, as int8 with scale ``amax / 127``. The rest:
    ``SCALE_BLOCK_N`` weight rows each, their scales ``amax / 127`` from the super-blocks' fields."""
    pid = tl.program_id(0)
    # The two branches bind different names: Triton unifies a name bound in both, shapes included.
    if pid < M:
        row = pid.to(tl.int64)
        x_row = x_ptr + row * stride_xm
        offs_k = tl.arange(0, BLOCK_K)
        x_amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for i in range(K_TILES):
            x = tl.load(x_row + (i * BLOCK_K + offs_k) * stride_xk).to(tl.float32)
            x_amax = tl.maximum(x_amax, tl.abs(x))
        x_max = tl.max(x_amax, axis=0)
        x_scale = tl.where(x_max > 0, x_max / 127.0, 1.0)
        tl.store(x_scale_ptr + row, x_scale)
        inv = 1.0 / x_scale
        for i in range(K_TILES):
            k0 = i * BLOCK_K
            x = tl.load(x_row + (k0 + offs_k) * stride_xk).to(tl.float32)
            tl.store(xq_ptr + row * K + k0 + offs_k, _round_to_int8(tl.clamp(x * inv, -127.0, 127.0)))
    else:
        # Eight super-blocks (64 sub-blocks) per step; K is a multiple of 256.
        SUPERS: tl.constexpr = K // 256
        CHUNK: tl.constexpr = 8
        offs_n = (pid - M) * SCALE_BLOCK_N + tl.arange(0, SCALE_BLOCK_N)
        rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        offs_s = tl.arange(0, CHUNK)
        offs_g = tl.arange(0, CHUNK * 8)
        w_amax = tl.zeros([SCALE_BLOCK_N], dtype=tl.float32)
        for c in range((SUPERS + CHUNK - 1) // CHUNK):
            sb = c * CHUNK + offs_s
            ss_ptrs = ss_ptr + rows[:, None] * stride_ssn + (sb * 2)[None, :]
            d = tl.load(ss_ptrs, mask=(sb < SUPERS)[None, :], other=0.0).to(tl.float32)  # [BLOCK, CHUNK]
            dmin = tl.load(ss_ptrs + 1, mask=(sb < SUPERS)[None, :], other=0.0).to(tl.float32)
            g = c * CHUNK * 8 + offs_g
            g_ptrs = rows[:, None] * stride_sn + g[None, :]
            sc = _small_as_float(tl.load(sc_ptr + g_ptrs, mask=(g < SUPERS * 8)[None, :], other=0))
            mn = _small_as_float(tl.load(mn_ptr + g_ptrs, mask=(g < SUPERS * 8)[None, :], other=0))
            s = tl.reshape(sc, (SCALE_BLOCK_N, CHUNK, 8)) * d[:, :, None]
            o = tl.reshape(mn, (SCALE_BLOCK_N, CHUNK, 8)) * dmin[:, :, None]
            top = tl.maximum(tl.abs(15.0 * s - o), tl.abs(o))
            w_amax = tl.maximum(w_amax, tl.max(tl.reshape(top, (SCALE_BLOCK_N, CHUNK * 8)), axis=1))
        w_scale = tl.where(w_amax > 0, w_amax / 127.0, 1.0)
        tl.store(w_scale_ptr + offs_n, w_scale, mask=offs_n < N)


@triton.jit
def _int8_weight_tile(q_ptrs, sc_ptrs, mn_ptrs, d_ptrs, inv, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` int8 tile ``round((d*sc*q - dmin*m) * inv)`` of one super-block's
    (``d_ptrs``) K range, from ``[BLOCK_N, BLOCK_K/4]`` pointers to its 16-bit code words (four
    codes a word keep each thread's codes in the 4-wide K runs an 8-bit dot operand holds)."""
    G: tl.constexpr = BLOCK_K // 32
    # The row's inverse scale folded into the sub-block's scale and offset: one FMA per weight.
    d = tl.load(d_ptrs).to(tl.float32) * inv  # [BLOCK_N]
    dmin = tl.load(d_ptrs + 1).to(tl.float32) * inv
    scale = d[:, None] * _small_as_float(tl.load(sc_ptrs))  # [BLOCK_N, G]
    offset = dmin[:, None] * _small_as_float(tl.load(mn_ptrs))
    q = tl.reshape(_codes_as_float(tl.load(q_ptrs), BLOCK_N, BLOCK_K, 4), (BLOCK_N, G, 32))
    w = tl.reshape(q * scale[:, :, None] - offset[:, :, None], (BLOCK_N, BLOCK_K))
    return _round_to_int8(w)


@triton.jit
def _q4k_gemm_int8_kernel(
    xq_ptr,
    x_scale_ptr,
    w_scale_ptr,
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
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """Each program reduces ``K_TILES`` tiles of K (its split): int8 dots of x with the row-scaled
    int8 weights into an int32 accumulator; with ``SWAP_AB`` into a tile of ``out^T``."""
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
    offs_w = tl.arange(0, BLOCK_K // 4)
    offs_g = tl.arange(0, G)
    ss_row = ss_ptr + rows_n * stride_ssn
    w_scale = tl.load(w_scale_ptr + rows_n)  # [BLOCK_N]
    inv = 1.0 / w_scale

    x_ptrs = xq_ptr + rows_m[:, None] * K + (k_start + offs_k)[None, :]
    # The packed codes as 16-bit words of four (K is a multiple of 256: rows and tiles are aligned).
    q_row = (qs_ptr + rows_n[:, None] * stride_qn + k_start // 2).to(tl.pointer_type(tl.uint16))
    q_ptrs = q_row + offs_w[None, :]
    sc_ptrs = sc_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    mn_ptrs = mn_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for i in range(K_TILES):
        # BLOCK_K divides 256, so the whole tile shares one super-block's (d, dmin).
        d_ptrs = ss_row + (k_start + i * BLOCK_K) // 256 * 2
        w = _int8_weight_tile(q_ptrs, sc_ptrs, mn_ptrs, d_ptrs, inv, BLOCK_N, BLOCK_K)
        x = tl.load(x_ptrs)  # [BLOCK_M, BLOCK_K] int8
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.int32)  # [BLOCK_N, BLOCK_M]
        else:
            acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.int32)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 4
        sc_ptrs += G
        mn_ptrs += G

    x_scale = tl.load(x_scale_ptr + rows_m)
    if SWAP_AB:
        out = tl.trans(acc.to(tl.float32) * w_scale[:, None] * x_scale[None, :])
    else:
        out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    _store_tile(
        out, out_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k,
        stride_om, stride_on, stride_ok, stride_bn, HAS_BIAS, SPLIT_K,
    )  # fmt: skip
