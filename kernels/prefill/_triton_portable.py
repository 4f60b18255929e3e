"""Portable prefill attention: a FlashAttention-2 style forward pass through plain pointer loads.

One program computes one tile of ``BLOCK_M`` query rows of one (batch, query head). It walks the
KV sequence in tiles of ``BLOCK_N`` keys with an online softmax in fp32 (``exp2``, with the softmax
scale and ``log2(e)`` folded into one multiplier), and only as far as the last tile any of its rows
can see: tiles that ``kv_len`` or the causal bound hide entirely are never loaded. Tiles every row
sees in full run without masks; only the boundary tiles pay for them. GQA maps query head ``h`` to
KV head ``h // GROUP``. Runs on any CUDA GPU Triton supports, and on the interpreter.

The jit helpers here (KV bounds, one online-softmax step) are shared with the TMA path; the launch
is :func:`.launch.launch_portable`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _valid_kv_len(KV_LEN, stride_kvl, pid_b, seqlen_k, HAS_KV_LEN: tl.constexpr):
    """The number of valid keys of batch ``pid_b``, read on the device and clamped to [0, seqlen_k]."""
    if HAS_KV_LEN:
        kv = tl.load(KV_LEN + pid_b * stride_kvl)
        kv = tl.minimum(tl.maximum(kv, 0), seqlen_k)
    else:
        kv = seqlen_k
    return kv


@triton.jit
def _kv_tile_range(kv, q_shift, first_row, end_row, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """KV tiles of query rows [first_row, end_row): [0, n_full) need no mask, [n_full, n_total) do."""
    if CAUSAL:
        # Query row i sits at position q_shift + i and sees keys up to and including it.
        hi = tl.minimum(kv, q_shift + end_row)
        full = tl.minimum(kv, q_shift + first_row + 1)
    else:
        hi = kv
        full = kv
    hi = tl.maximum(hi, 0)
    full = tl.maximum(full, 0)
    return full // BLOCK_N, tl.cdiv(hi, BLOCK_N)


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    kt,
    v,
    qk_scale,
    offs_n,
    q_pos,
    kv,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    NEG_SCALE: tl.constexpr,
):
    """One online-softmax step of a [BLOCK_M, D] query tile over K^T [D, BLOCK_N] and V [BLOCK_N, D].

    The row max of the scaled scores is taken on the raw scores (their min when ``NEG_SCALE``:
    :func:`kernel_scale`) and scaled once per row, so each exponent ``s * qk_scale - m`` is one
    FFMA, not a multiply and a subtract. ``m_i`` stays in scaled units, as the split-KV merge
    expects. The sign is a constexpr, not a select on q: a computed q makes Triton hold the wgmma
    operand in registers, which is slower.
    """
    # The interpreter multiplies bf16 tiles as raw integer bits; GPUs keep the native MMA.
    s = tl.dot(q.to(tl.float32), kt.to(tl.float32)) if DOT_IN_FP32 else tl.dot(q, kt)
    if MASKED:
        valid = offs_n[None, :] < kv
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= q_pos[:, None])
        # Hidden keys must lose the row's extreme: +inf under a min, -inf under a max (both scale to -inf).
        s = tl.where(valid, s, float("inf") if NEG_SCALE else float("-inf"))
    m_new = tl.maximum(m_i, (tl.min(s, 1) if NEG_SCALE else tl.max(s, 1)) * qk_scale)
    if MASKED:
        # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # P is rounded to the input dtype for the second MMA, as on the GPU.
    p = p.to(v.dtype)
    acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc) if DOT_IN_FP32 else tl.dot(p, v, acc)
    return acc, m_new, l_i


@triton.jit
def _load_tile(ptrs, row_ok, col_ok, ROW_MASK: tl.constexpr, COL_MASK: tl.constexpr):
    """A 2-D tile, masked only along the dims that need it (out-of-range elements read as 0)."""
    if ROW_MASK and COL_MASK:
        tile = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    elif ROW_MASK:
        tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif COL_MASK:
        tile = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _prefill_fwd_kernel(
    Q,
    K,
    V,
    Out,
    KV_LEN,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_kvl,
    seqlen_q,
    seqlen_k,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    WIDE_KV_TILES: tl.constexpr,
    NEG_SCALE: tl.constexpr,
):
    # Causal tiles further down see more keys: start the heaviest first to shorten the tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)
    pid_kvh = pid_h // GROUP
    D_MASK: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    # torch.compile may pass Python floats as fp64: keep the softmax in fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)

    kv = _valid_kv_len(KV_LEN, stride_kvl, pid_b, seqlen_k, HAS_KV_LEN)
    q_shift = kv - seqlen_q
    start_m = pid_m * BLOCK_M
    n_full, n_total = _kv_tile_range(kv, q_shift, start_m, tl.minimum(start_m + BLOCK_M, seqlen_q), BLOCK_N, CAUSAL)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < seqlen_q
    q_pos = q_shift + offs_m

    # Q and O offsets in 64 bits: in a [B, L, H, D] view the row stride is H * D, and L * H * D may pass
    # 2**31 elements. They are used once each, outside the KV loop.
    q_ptrs = Q + pid_b.to(tl.int64) * stride_qb + pid_h.to(tl.int64) * stride_qh
    q_ptrs += offs_m.to(tl.int64)[:, None] * stride_qm + offs_d.to(tl.int64)[None, :] * stride_qd
    q = _load_tile(q_ptrs, row_ok, d_ok, True, D_MASK)
    # Scalar 64-bit bases walk the KV sequence; the in-tile offsets stay fixed, in int32 unless one
    # tile spans 2**31 elements (the host sets WIDE_KV_TILES). K is read as K^T [D, BLOCK_N].
    k_base = K + pid_b.to(tl.int64) * stride_kb + pid_kvh.to(tl.int64) * stride_kh
    v_base = V + pid_b.to(tl.int64) * stride_vb + pid_kvh.to(tl.int64) * stride_vh
    if WIDE_KV_TILES:
        tile_n = offs_n.to(tl.int64)
        tile_d = offs_d.to(tl.int64)
        k_step = tl.cast(stride_kn, tl.int64) * BLOCK_N
        v_step = tl.cast(stride_vn, tl.int64) * BLOCK_N
    else:
        tile_n = offs_n
        tile_d = offs_d
        k_step = BLOCK_N * stride_kn
        v_step = BLOCK_N * stride_vn
    kt_offs = tile_d[:, None] * stride_kd + tile_n[None, :] * stride_kn
    v_offs = tile_n[:, None] * stride_vn + tile_d[None, :] * stride_vd

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Tiles every row of this tile sees in full: no masks.
    for _ in tl.range(0, n_full):
        kt = _load_tile(k_base + kt_offs, d_ok, offs_n, D_MASK, False)
        v = _load_tile(v_base + v_offs, offs_n, d_ok, False, D_MASK)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, kt, v, qk_scale, offs_n, q_pos, kv, False, CAUSAL, DOT_IN_FP32, NEG_SCALE
        )
        k_base += k_step
        v_base += v_step
    # Boundary tiles: the causal diagonal and the end of the valid keys.
    for start_n in tl.range(n_full * BLOCK_N, n_total * BLOCK_N, BLOCK_N):
        n_ok = start_n + offs_n < kv
        kt = _load_tile(k_base + kt_offs, d_ok, n_ok, D_MASK, True)
        v = _load_tile(v_base + v_offs, n_ok, d_ok, True, D_MASK)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, kt, v, qk_scale, start_n + offs_n, q_pos, kv, True, CAUSAL, DOT_IN_FP32, NEG_SCALE
        )
        k_base += k_step
        v_base += v_step

    # Rows that saw no key have l = 0 and acc = 0: they store zeros.
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = Out + pid_b.to(tl.int64) * stride_ob + pid_h.to(tl.int64) * stride_oh
    o_ptrs += offs_m.to(tl.int64)[:, None] * stride_om + offs_d.to(tl.int64)[None, :] * stride_od
    if D_MASK:
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
