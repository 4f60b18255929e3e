"""Triton kernels of split-K decode attention: a split kernel and a log-sum-exp merge kernel.

Both kernels derive the split plan of a sequence from its runtime length the same way:

    chunk      = round_up(max(min_chunk, cdiv(kv_len, splits_target)), BLOCK_N)
    num_splits = cdiv(kv_len, chunk)

The grid is sized for the longest possible ``kv_len`` (the cache length), so one launch (and one
captured CUDA graph) serves any lengths: split programs past ``num_splits`` return at once, and the
merge reads only the ``num_splits`` partials that were written. A sequence that needs one split
(or none: ``kv_len == 0``) is finished by split program 0 directly into the output, and the
merge skips it. Scores are kept in the log2 domain (``qk_scale`` folds in log2(e)).

With ``FUSED_MERGE`` there is no merge launch: each split program, once its partial is written,
counts itself on its row block's arrival counter, and the program that arrives last merges the
row block's partials (through the same :func:`_merge_row` as the merge kernel) and puts the
counter back to 0, so that the next launch or graph replay starts from zero.

With ``KV_TMA`` the split kernel loads its K/V tiles through host-side tensor descriptors (TMA on
SM90) instead of masked pointer loads; the pointer path's code is the same either way.
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


@triton.jit
def _merge_row(
    WS, O_ROW, ws_row0, d0, num_splits, lse_offset,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Merge the ``num_splits`` partials of one query row, columns ``d0 + [0, BLOCK_D)``, into ``O_ROW``.

    ``ws_row0``: the workspace row of split 0; split ``s`` of the same query row is ``s * ROWS`` rows on.
    """
    offs_s = tl.arange(0, SPLIT_BLOCK)
    offs_d = d0 + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # Online log-sum-exp over the partials, SPLIT_BLOCK at a time: each partial is already
    # normalised, weighted by 2^(lse - running max), so nothing overflows whatever the scores.
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        split = s0 + offs_s
        split_ok = split < num_splits
        ws_row = ws_row0 + split * ROWS
        # Through L2 (.cg), never L1: in a fused launch other programs wrote these during this launch.
        lse = tl.load(WS + lse_offset + ws_row, mask=split_ok, other=float("-inf"), cache_modifier=".cg")
        part_ptrs = WS + ws_row[:, None] * HEAD_DIM + offs_d[None, :]
        part = tl.load(part_ptrs, mask=split_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.math.exp2(lse - m_safe)
        alpha = tl.math.exp2(m_run - m_safe)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)  # [BLOCK_D]
        l_run = l_run * alpha + tl.sum(w, 0)
        m_run = m_new
    o = acc / tl.where(l_run > 0.0, l_run, 1.0)
    tl.store(O_ROW + offs_d, o.to(O_ROW.dtype.element_ty), mask=d_ok)


# fmt: off
@triton.jit
def _decode_split_kernel(
    Q, K, V, KV_LEN, O, WS, COUNTERS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_kvl,
    num_kv_heads, lmax, qk_scale, splits_target, min_chunk, num_splits_max, lse_offset,
    K_DESC, V_DESC,
    GROUP: tl.constexpr,
    LQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    MERGE_BLOCK_D: tl.constexpr,
    KV_TMA: tl.constexpr,
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
        if KV_TMA:
            # Boxes [1, 1, BLOCK_N, D] of the [B, Hkv, Lmax, D] caches (D_PAD == HEAD_DIM). Rows past
            # the cache arrive as zeros, rows past this split's end as what the cache holds there
            # (another split's keys, or anything past kv_len, NaN included). K's are dropped by the
            # score mask below (tl.where replaces a NaN score too); V's are zeroed, since P's zero
            # weight times a NaN or inf value would still poison the sum.
            k = K_DESC.load([pid_b, pid_h, n0, 0]).reshape(BLOCK_N, D_PAD)
            v = V_DESC.load([pid_b, pid_h, n0, 0]).reshape(BLOCK_N, D_PAD)
            v = tl.where((cols < end)[:, None], v, 0.0)
        else:
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
        if FUSED_MERGE:
            # Publish, then count. bar.sync orders every thread's stores above before the atomic,
            # which one thread runs (Triton's scalar atomic), and its release at gpu scope makes them
            # all visible GPU-wide before the count moves: the shape of CUDA's own grid sync.
            tl.debug_barrier()
            counter = COUNTERS + (b64 * num_kv_heads + pid_h) * ROW_BLOCKS + pid_m
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            # Every arrival is acq_rel, so they form a chain: the program that reads num_splits - 1
            # has acquired the release of each earlier one. Triton hands the atomic's result to all
            # threads through shared memory behind a bar.sync, so every thread's reads of the
            # partials come after that acquire; they go to L2 (.cg), where the stores went, never
            # to a stale L1 line.
            if arrived == num_splits - 1:
                row0 = ((b64 * num_kv_heads + pid_h) * num_splits_max) * ROWS
                o_b = O + b64 * stride_ob
                for i in range(0, tl.minimum(BLOCK_M, ROWS - pid_m * BLOCK_M)):
                    r = pid_m * BLOCK_M + i
                    o_row = o_b + (pid_h * GROUP + r // LQ).to(tl.int64) * stride_oh + (r % LQ).to(tl.int64) * stride_om
                    for d0 in range(0, HEAD_DIM, MERGE_BLOCK_D):
                        _merge_row(WS, o_row, row0 + r, d0, num_splits, lse_offset, ROWS=ROWS, HEAD_DIM=HEAD_DIM,
                                   SPLIT_BLOCK=SPLIT_BLOCK, BLOCK_D=MERGE_BLOCK_D)  # fmt: skip
                # All num_splits programs have counted, so nothing else touches the counter in this
                # launch; the next launch (or graph replay) on the stream finds it zero.
                tl.store(counter, 0)


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
    row0 = ((pid_b.to(tl.int64) * num_kv_heads + pid_h) * num_splits_max) * ROWS + pid_r
    o_row = O + pid_b.to(tl.int64) * stride_ob + (pid_h * GROUP + pid_r // LQ).to(tl.int64) * stride_oh
    o_row = o_row + (pid_r % LQ).to(tl.int64) * stride_om
    _merge_row(WS, o_row, row0, (pid_rd % D_BLOCKS) * BLOCK_D, num_splits, lse_offset, ROWS=ROWS, HEAD_DIM=HEAD_DIM,
               SPLIT_BLOCK=SPLIT_BLOCK, BLOCK_D=BLOCK_D)  # fmt: skip
