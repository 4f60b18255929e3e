"""Triton kernels of split-K decode attention: a split kernel and a log-sum-exp merge kernel.

Both kernels derive the split plan of a sequence from its runtime length the same way:

    chunk      = round_up(max(min_chunk, cdiv(kv_len, splits_target)), BLOCK_N)
    num_splits = cdiv(kv_len, chunk)

The grid is sized for the longest possible ``kv_len`` (the cache length), so one launch (and one
captured CUDA graph) serves any lengths: split programs past ``num_splits`` return at once, and the
merge reads only the ``num_splits`` partials that were written. A sequence that needs one split
(or none: ``kv_len == 0``) is finished by split program 0 directly into the output, and the
merge skips it. Scores are kept in the log2 domain (``qk_scale`` folds in log2(e)).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _split_plan(KV_LEN, stride_kvl, pid_b, lmax, splits_target, min_chunk, BLOCK_N: tl.constexpr):
    # A length past the cache is clamped so that no key outside the buffer is ever read.
    kv_len = tl.load(KV_LEN + pid_b * stride_kvl)
    kv_len = tl.minimum(tl.maximum(kv_len, 0), lmax)
    chunk = tl.maximum(min_chunk, tl.cdiv(kv_len, splits_target))
    chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
    return kv_len, chunk, tl.cdiv(kv_len, chunk)


# fmt: off
@triton.jit
def _decode_split_kernel(
    Q, K, V, KV_LEN, O, WS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_kvl,
    num_kv_heads, lmax, qk_scale, splits_target, min_chunk, num_splits_max, lse_offset,
    GROUP: tl.constexpr,
    LQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # fmt: on
    ROWS: tl.constexpr = GROUP * LQ
    ROW_BLOCKS: tl.constexpr = (ROWS + BLOCK_M - 1) // BLOCK_M
    pid_s = tl.program_id(0)
    pid_hm = tl.program_id(1)
    pid_b = tl.program_id(2)
    pid_h = pid_hm // ROW_BLOCKS
    pid_m = pid_hm % ROW_BLOCKS

    # Row r of the M tile is query head (r // LQ) of the group at new token (r % LQ).
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    row_ok = offs_m < ROWS
    d_ok = offs_d < HEAD_DIM
    token = offs_m % LQ
    q_head = pid_h * GROUP + offs_m // LQ
    b64 = pid_b.to(tl.int64)
    h64 = pid_h.to(tl.int64)
    # Row offsets in 64 bits: a head or token stride of a view into a large buffer can pass 2**31 elements.
    q_head64 = q_head.to(tl.int64)
    token64 = token.to(tl.int64)
    # Issued before kv_len is known, so that the two loads' latencies overlap.
    q_ptrs = Q + b64 * stride_qb + (q_head64 * stride_qh + token64 * stride_qm)[:, None] + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        # The interpreter multiplies bf16 tiles wrongly (Triton 3.6); fp32 is exact for bf16/fp16 data.
        q = q.to(tl.float32)

    kv_len, chunk, num_splits = _split_plan(KV_LEN, stride_kvl, pid_b, lmax, splits_target, min_chunk, BLOCK_N)
    # Program 0 always runs: with no key at all it writes the zeros of an empty sequence.
    if pid_s >= tl.maximum(num_splits, 1):
        return
    start = pid_s * chunk
    end = tl.minimum(start + chunk, kv_len)
    # Causal among the new tokens: token i sits at kv_len - LQ + i and sees keys up to there.
    limit = tl.minimum(kv_len - (LQ - 1) + token, end)

    # Scalar 64-bit bases advanced per tile, int32 offsets within a tile: fewer registers than pointer tiles.
    start64 = start.to(tl.int64)
    k_base = K + b64 * stride_kb + h64 * stride_kh + start64 * stride_kn
    v_base = V + b64 * stride_vb + h64 * stride_vh + start64 * stride_vn
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :]
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        # Keys past kv_len are never loaded, so whatever the cache holds there cannot leak in.
        kv_mask = (cols < end)[:, None] & d_ok[None, :]
        k = tl.load(k_base + k_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        v = tl.load(v_base + v_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        # fp32 whatever type a caller's float takes (inductor passes a float64 scalar).
        s = (tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32)  # [BLOCK_M, BLOCK_N]
        s = tl.where(cols[None, :] < limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift it by 0 so its weights stay exactly 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # P is rounded to the cache dtype for the second MMA, on the interpreter as on the GPU.
        p = p.to(v.dtype)
        if DOT_IN_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
        k_base += BLOCK_N * stride_kn
        v_base += BLOCK_N * stride_vn

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    tile_ok = row_ok[:, None] & d_ok[None, :]
    if num_splits <= 1:
        o_ptrs = O + b64 * stride_ob + (q_head64 * stride_oh + token64 * stride_om)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=tile_ok)
    else:
        ws_row = ((b64 * num_kv_heads + pid_h) * num_splits_max + pid_s) * ROWS + offs_m
        tl.store(WS + ws_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=tile_ok)
        lse = tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(WS + lse_offset + ws_row, lse, mask=row_ok)


# fmt: off
@triton.jit
def _decode_merge_kernel(
    KV_LEN, O, WS,
    stride_ob, stride_oh, stride_om,
    stride_kvl,
    num_kv_heads, lmax, splits_target, min_chunk, num_splits_max, lse_offset,
    GROUP: tl.constexpr,
    LQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # fmt: on
    ROWS: tl.constexpr = GROUP * LQ
    # One program per (query row, BLOCK_D columns): many splits are merged wide rather than in a long loop.
    D_BLOCKS: tl.constexpr = (HEAD_DIM + BLOCK_D - 1) // BLOCK_D
    pid_rd = tl.program_id(0)
    pid_r = pid_rd // D_BLOCKS
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)
    _kv_len, _chunk, num_splits = _split_plan(KV_LEN, stride_kvl, pid_b, lmax, splits_target, min_chunk, BLOCK_N)
    if num_splits <= 1:
        return

    offs_s = tl.arange(0, SPLIT_BLOCK)
    offs_d = (pid_rd % D_BLOCKS) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row0 = ((pid_b.to(tl.int64) * num_kv_heads + pid_h) * num_splits_max) * ROWS + pid_r

    # Online log-sum-exp over the partials, SPLIT_BLOCK at a time: each partial is already
    # normalised, weighted by 2^(lse - running max), so nothing overflows whatever the scores.
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        split = s0 + offs_s
        split_ok = split < num_splits
        ws_row = row0 + split * ROWS
        lse = tl.load(WS + lse_offset + ws_row, mask=split_ok, other=float("-inf"))
        part_ptrs = WS + ws_row[:, None] * HEAD_DIM + offs_d[None, :]
        part = tl.load(part_ptrs, mask=split_ok[:, None] & d_ok[None, :], other=0.0)  # [SPLIT_BLOCK, BLOCK_D]
        m_new = tl.maximum(m_run, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.math.exp2(lse - m_safe)
        alpha = tl.math.exp2(m_run - m_safe)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        l_run = l_run * alpha + tl.sum(w, 0)
        m_run = m_new

    o = acc / tl.where(l_run > 0.0, l_run, 1.0)
    o_ptrs = O + pid_b.to(tl.int64) * stride_ob + (pid_h * GROUP + pid_r // LQ).to(tl.int64) * stride_oh
    o_ptrs = o_ptrs + (pid_r % LQ).to(tl.int64) * stride_om + offs_d
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=d_ok)
