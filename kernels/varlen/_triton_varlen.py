"""Triton kernels of varlen attention over a batched KV store: the tile kernel and the split merge.

Every program reads the step's ``seq_info`` table ([S, 4]: q_start, q_len, col, kv_end) and
derives the same schedule from it on the device, so one launch (and one captured CUDA graph)
serves any mix of segments:

- segment ``s`` has ``tiles_s = cdiv(q_len_s, TQ)`` M tiles (``TQ`` tokens x the GQA group each);
- ``cost_s`` bounds the keys any of its tiles sees (the ring, the window and the causal
  diagonal all narrow it), and the step's work is ``C = sum(tiles_s * cost_s)``;
- the chunk ``max(min_chunk, cdiv(C, budget))`` (at least ``cdiv(cost_s, max_splits)``, rounded up to
  ``BLOCK_N``) gives segment ``s`` ``splits_s`` work items per tile;
- work items are numbered segment by segment, tile by tile, split by split: program ``pid`` finds
  its own with a prefix sum over the segments.

The grid holds ``sum(tiles) + budget`` work programs at most (the chunk keeps the split work within
the budget), then ``cdiv(T, ZERO_TOKENS)`` programs that write zeros to the query rows no segment
covers. A tile whose keys need one split writes the output directly; otherwise each split writes a
normalised partial and its log2-sum-exp, and the merge kernel combines them. Scores are kept in
the log2 domain (``qk_scale`` folds in log2(e)).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pick(values, offs_s, seg):
    """Entry ``seg`` of a per-segment vector, as a scalar."""
    return tl.sum(tl.where(offs_s == seg, values, 0), 0)


@triton.jit
def _schedule(
    SEQ,
    stride_ss,
    stride_sf,
    num_segs,
    num_tokens,
    kv_rows,
    num_cols,
    window,
    budget,
    min_chunk,
    max_splits,
    S_PAD: tl.constexpr,
    TQ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    RING: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Per-segment vectors of the step's schedule, the same in every program of both kernels."""
    offs_s = tl.arange(0, S_PAD)
    s_ok = offs_s < num_segs
    row = SEQ + offs_s * stride_ss
    q_start = tl.load(row, mask=s_ok, other=0)
    q_len = tl.load(row + stride_sf, mask=s_ok, other=0)
    col = tl.load(row + 2 * stride_sf, mask=s_ok, other=0)
    kv_end = tl.load(row + 3 * stride_sf, mask=s_ok, other=0)
    # Entries that would leave the tensors are dropped or clamped (validate_seq_info names them).
    usable = s_ok & (q_start >= 0) & (q_start < num_tokens) & (col >= 0) & (col < num_cols)
    q_len = tl.where(usable, tl.minimum(tl.maximum(q_len, 0), num_tokens - q_start), 0)
    kv_end = tl.maximum(kv_end, 0)
    if RING:
        ring_lo = tl.maximum(kv_end - kv_rows, 0)
    else:
        kv_end = tl.minimum(kv_end, kv_rows)
        ring_lo = tl.zeros_like(kv_end)
    tiles = (q_len + TQ - 1) // TQ
    if SPLIT:
        cost = kv_end - ring_lo
        if WINDOWED:
            # Causal: a tile's tokens span TQ positions; otherwise a token sees to kv_end.
            if CAUSAL:
                cost = tl.minimum(cost, TQ + window - 1)
            else:
                cost = tl.minimum(cost, q_len + window - 1)
        total = tl.sum(tiles.to(tl.int64) * cost, 0)
        chunk = tl.maximum((total + budget - 1) // budget, min_chunk)
        chunk = tl.minimum(chunk, 1 << 30).to(tl.int32)
        chunk = tl.maximum(chunk, (cost + max_splits - 1) // max_splits)
        chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        splits = tl.maximum((cost + chunk - 1) // chunk, 1)
    else:
        chunk = tl.full([S_PAD], 1 << 30, tl.int32)
        splits = tl.full([S_PAD], 1, tl.int32)
    return offs_s, q_start, q_len, col, kv_end, ring_lo, tiles, chunk, splits


@triton.jit
def _tile_keys(q_len, kv_end, ring_lo, window, t0, TQ: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr):
    """Keys of the tile of tokens [t0, t0 + TQ): its rows see within [lo, hi), and all see [full_lo, full_hi)."""
    pos_first = kv_end - q_len + t0
    pos_last = pos_first + tl.minimum(q_len - t0, TQ) - 1
    lo = ring_lo
    full_lo = ring_lo
    if WINDOWED:
        lo = tl.maximum(lo, pos_first - window + 1)
        full_lo = tl.maximum(full_lo, pos_last - window + 1)
    if CAUSAL:
        hi = tl.minimum(kv_end, pos_last + 1)
        full_hi = tl.minimum(kv_end, pos_first + 1)
    else:
        hi = kv_end
        full_hi = kv_end
    return lo, hi, full_lo, full_hi


@triton.jit
def _kv_tile(base, desc, col, pid_h, n0, offs_n, offs_d, stride_r, kv_rows, key_ok, d_ok, MASKED: tl.constexpr,
             D_MASK: tl.constexpr, RING: tl.constexpr, KV_TMA: tl.constexpr):  # fmt: skip
    """Keys at positions [n0, n0 + BLOCK_N) of one store column: [BLOCK_N, D_PAD] (masked ones read 0).

    With ``KV_TMA`` the tile comes through ``desc`` (a ``[BLOCK_N, 1, 1, D]`` box over the flat
    store): rows past the store arrive as zeros, rows past the sequence as whatever the store holds,
    so masked tiles zero them here.
    """
    if KV_TMA:
        BLOCK_N: tl.constexpr = offs_n.shape[0]
        D_PAD: tl.constexpr = offs_d.shape[0]
        tile = desc.load([n0, col, pid_h, 0]).reshape(BLOCK_N, D_PAD)
        if MASKED:
            tile = tl.where(key_ok[:, None], tile, 0.0)
        return tile
    pos = n0 + offs_n
    row = pos % kv_rows if RING else pos
    ptrs = base + (row.to(tl.int64) * stride_r)[:, None] + offs_d[None, :]
    if MASKED and D_MASK:
        tile = tl.load(ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    elif MASKED:
        tile = tl.load(ptrs, mask=key_ok[:, None], other=0.0)
    elif D_MASK:
        tile = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _attend(acc, m_i, l_i, q, k, v, qk_scale, visible, MASKED: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """One online-softmax step of the [BLOCK_M, D_PAD] query tile over one [BLOCK_N, D_PAD] K/V tile."""
    if DOT_IN_FP32:
        # The interpreter multiplies bf16 tiles wrongly (Triton 3.6); fp32 is exact for bf16/fp16 data.
        s = tl.dot(q, tl.trans(k.to(tl.float32)))
    else:
        s = tl.dot(q, tl.trans(k))
    # fp32 whatever type a caller's float takes (inductor passes a float64 scalar).
    s = (s * qk_scale).to(tl.float32)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift it by 0 so its weights stay exactly 0.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to the store's dtype for the second MMA, on the interpreter as on the GPU.
    p = p.to(v.dtype)
    if DOT_IN_FP32:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32))
    else:
        acc = tl.dot(p, v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _zero_uncovered(Out, stride_ot, stride_oh, pid_z, pid_h, num_tokens, q_start, q_len,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    ZERO_TOKENS: tl.constexpr):  # fmt: skip
    """Zeros for the query rows of tokens [pid_z * ZERO_TOKENS, ...) that no segment covers."""
    tok = pid_z * ZERO_TOKENS + tl.arange(0, ZERO_TOKENS)
    inside = (tok[:, None] >= q_start[None, :]) & (tok[:, None] < (q_start + q_len)[None, :])
    covered = tl.max(inside.to(tl.int32), 1) > 0
    todo = (tok < num_tokens) & ~covered
    offs_d = tl.arange(0, D_PAD)
    mask = todo[:, None] & (offs_d < HEAD_DIM)[None, :]
    zeros = tl.zeros([ZERO_TOKENS, D_PAD], dtype=Out.dtype.element_ty)
    ptrs = Out + tok.to(tl.int64)[:, None] * stride_ot + offs_d[None, :]
    for g in range(GROUP):
        tl.store(ptrs + (pid_h * GROUP + g).to(tl.int64) * stride_oh, zeros, mask=mask)


@triton.jit
def _attend_segment_tile(
    Q, Out, WS, k_base, v_base, k_desc, v_desc,
    stride_qt, stride_qh, stride_kr, stride_vr, stride_ot, stride_oh,
    s_q_start, s_q_len, s_col, s_kv_end, s_ring_lo, pid_h, t0, lo, hi, full_lo, full_hi, span_lo, span_hi,
    window, kv_rows, num_kv_heads, qk_scale, used, ws_slot, lse_offset,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TQ: tl.constexpr,
    WS_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    RING: tl.constexpr,
    KV_TMA: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):  # fmt: skip
    """One work item: the ``BLOCK_M``-row tile of tokens [t0, t0 + TQ) of a segment over keys
    [span_lo, span_hi), written to ``Out`` (one split) or as a partial in workspace slot ``ws_slot``
    (partials are ``WS_M`` rows apart, the main tile's rows, whichever tile wrote them)."""
    D_MASK: tl.constexpr = HEAD_DIM != D_PAD
    # Row r of the M tile is query head (r % GROUP) of the group at token t0 + r // GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    tok = t0 + offs_m // GROUP
    head = pid_h * GROUP + offs_m % GROUP
    row_ok = (offs_m < TQ * GROUP) & (tok < s_q_len)
    # Row offsets in 64 bits: a view of a [Hq, T, D] buffer puts heads T * D elements apart.
    q_rows = (s_q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # Each row's own key range: its causal bound, its window, and what the ring still holds.
    pos = s_kv_end - s_q_len + tok
    if CAUSAL:
        row_hi = tl.minimum(s_kv_end, pos + 1)
    else:
        row_hi = tl.zeros_like(pos) + s_kv_end
    if WINDOWED:
        row_lo = tl.maximum(s_ring_lo, pos - window + 1)
    else:
        row_lo = tl.zeros_like(pos) + s_ring_lo

    # Tiles start at span_lo + k * BLOCK_N; those inside [full_lo, full_hi) need no mask.
    a = tl.minimum(tl.maximum(full_lo, span_lo), span_hi)
    a = tl.minimum(span_lo + (a - span_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, span_hi)
    b = tl.minimum(tl.maximum(full_hi, a), span_hi)
    b = a + (b - a) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for n0 in tl.range(span_lo, a, BLOCK_N):
        p = n0 + offs_n
        key_ok = (p >= lo) & (p < hi)
        k = _kv_tile(k_base, k_desc, s_col, pid_h, n0, offs_n, offs_d, stride_kr, kv_rows, key_ok, d_ok, True,
                     D_MASK, RING, KV_TMA)
        v = _kv_tile(v_base, v_desc, s_col, pid_h, n0, offs_n, offs_d, stride_vr, kv_rows, key_ok, d_ok, True,
                     D_MASK, RING, KV_TMA)
        visible = (p[None, :] >= row_lo[:, None]) & (p[None, :] < row_hi[:, None])
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k, v, qk_scale, visible, True, DOT_IN_FP32)
    for n0 in tl.range(a, b, BLOCK_N):
        k = _kv_tile(k_base, k_desc, s_col, pid_h, n0, offs_n, offs_d, stride_kr, kv_rows, offs_n, d_ok, False,
                     D_MASK, RING, KV_TMA)
        v = _kv_tile(v_base, v_desc, s_col, pid_h, n0, offs_n, offs_d, stride_vr, kv_rows, offs_n, d_ok, False,
                     D_MASK, RING, KV_TMA)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k, v, qk_scale, offs_n, False, DOT_IN_FP32)
    for n0 in tl.range(b, span_hi, BLOCK_N):
        p = n0 + offs_n
        key_ok = (p >= lo) & (p < hi)
        k = _kv_tile(k_base, k_desc, s_col, pid_h, n0, offs_n, offs_d, stride_kr, kv_rows, key_ok, d_ok, True,
                     D_MASK, RING, KV_TMA)
        v = _kv_tile(v_base, v_desc, s_col, pid_h, n0, offs_n, offs_d, stride_vr, kv_rows, key_ok, d_ok, True,
                     D_MASK, RING, KV_TMA)
        visible = (p[None, :] >= row_lo[:, None]) & (p[None, :] < row_hi[:, None])
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k, v, qk_scale, visible, True, DOT_IN_FP32)

    # Rows that saw no key have l = 0 and acc = 0: they store zeros.
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    tile_ok = row_ok[:, None] & d_ok[None, :]
    if used <= 1:
        o_rows = (s_q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(Out + o_rows[:, None] + offs_d[None, :], o.to(Out.dtype.element_ty), mask=tile_ok)
    else:
        ws_row = (ws_slot.to(tl.int64) * num_kv_heads + pid_h) * WS_M + offs_m
        tl.store(WS + ws_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=tile_ok)
        lse = tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(WS + lse_offset + ws_row, lse, mask=row_ok)


@triton.jit
def _varlen_fwd_kernel(
    Q, K, V, K_DESC, V_DESC, Out, SEQ, WS,
    stride_qt, stride_qh,
    stride_kr, stride_kc, stride_kh,
    stride_vr, stride_vc, stride_vh,
    stride_ot, stride_oh,
    stride_ss, stride_sf,
    num_segs, num_tokens, kv_rows, num_cols, num_kv_heads, window, qk_scale,
    budget, min_chunk, max_splits, work_slots, lse_offset,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SHORT_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    S_PAD: tl.constexpr,
    ZERO_TOKENS: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    RING: tl.constexpr,
    SPLIT: tl.constexpr,
    KV_TMA: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):  # fmt: skip
    TQ: tl.constexpr = BLOCK_M // GROUP
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_s, q_start, q_len, col, kv_end, ring_lo, tiles, chunk, splits = _schedule(
        SEQ, stride_ss, stride_sf, num_segs, num_tokens, kv_rows, num_cols, window, budget, min_chunk, max_splits,
        S_PAD, TQ, BLOCK_N, CAUSAL, WINDOWED, RING, SPLIT,
    )  # fmt: skip
    if pid >= work_slots:
        _zero_uncovered(Out, stride_ot, stride_oh, pid - work_slots, pid_h, num_tokens, q_start, q_len,
                        GROUP, HEAD_DIM, D_PAD, ZERO_TOKENS)  # fmt: skip
        return

    work = tiles * splits
    work_end = tl.cumsum(work, 0)
    if pid >= tl.sum(work, 0):
        return
    seg = tl.sum((work_end <= pid).to(tl.int32), 0)
    s_work = _pick(work, offs_s, seg)
    s_splits = _pick(splits, offs_s, seg)
    local = pid - (_pick(work_end, offs_s, seg) - s_work)
    tile = local // s_splits
    split = local % s_splits
    s_q_start = _pick(q_start, offs_s, seg)
    s_q_len = _pick(q_len, offs_s, seg)
    s_col = _pick(col, offs_s, seg)
    s_kv_end = _pick(kv_end, offs_s, seg)
    s_ring_lo = _pick(ring_lo, offs_s, seg)
    s_chunk = _pick(chunk, offs_s, seg)

    t0 = tile * TQ
    lo, hi, full_lo, full_hi = _tile_keys(s_q_len, s_kv_end, s_ring_lo, window, t0, TQ, CAUSAL, WINDOWED)
    # Defined on every path: the compiler (unlike the interpreter) needs them where the store below reads them.
    used = 1
    ws_slot = 0
    if SPLIT:
        used = (tl.maximum(hi - lo, 0) + s_chunk - 1) // s_chunk
        # Split 0 always runs: a tile that sees no key still writes its zeros.
        if split >= tl.maximum(used, 1):
            return
        span_lo = lo + split * s_chunk
        span_hi = tl.minimum(span_lo + s_chunk, hi)
        # Partials of split tiles are packed: earlier split segments' work items, then this tile's splits.
        split_work = tl.where(splits > 1, work, 0)
        ws_slot = _pick(tl.cumsum(split_work, 0) - split_work, offs_s, seg) + tile * s_splits + split
    else:
        span_lo = lo
        span_hi = hi
    span_hi = tl.maximum(span_hi, span_lo)

    k_base = K + s_col.to(tl.int64) * stride_kc + pid_h.to(tl.int64) * stride_kh
    v_base = V + s_col.to(tl.int64) * stride_vc + pid_h.to(tl.int64) * stride_vh
    # A segment whose new tokens all fit in the short tile (a decode token, a short draft) runs in
    # it: the main tile would spend its MMAs on empty rows. It has one tile (t0 = 0) either way.
    short = False
    if SHORT_M < BLOCK_M:
        short = s_q_len <= SHORT_M // GROUP
    if short:
        _attend_segment_tile(
            Q, Out, WS, k_base, v_base, K_DESC, V_DESC,
            stride_qt, stride_qh, stride_kr, stride_vr, stride_ot, stride_oh,
            s_q_start, s_q_len, s_col, s_kv_end, s_ring_lo, pid_h, t0, lo, hi, full_lo, full_hi, span_lo, span_hi,
            window, kv_rows, num_kv_heads, qk_scale, used, ws_slot, lse_offset,
            GROUP, HEAD_DIM, D_PAD, SHORT_M, SHORT_M // GROUP, BLOCK_M, BLOCK_N, CAUSAL, WINDOWED, RING, KV_TMA,
            DOT_IN_FP32,
        )
    else:
        _attend_segment_tile(
            Q, Out, WS, k_base, v_base, K_DESC, V_DESC,
            stride_qt, stride_qh, stride_kr, stride_vr, stride_ot, stride_oh,
            s_q_start, s_q_len, s_col, s_kv_end, s_ring_lo, pid_h, t0, lo, hi, full_lo, full_hi, span_lo, span_hi,
            window, kv_rows, num_kv_heads, qk_scale, used, ws_slot, lse_offset,
            GROUP, HEAD_DIM, D_PAD, BLOCK_M, TQ, BLOCK_M, BLOCK_N, CAUSAL, WINDOWED, RING, KV_TMA, DOT_IN_FP32,
        )  # fmt: skip


@triton.jit
def _varlen_merge_kernel(
    Out, SEQ, WS,
    stride_ot, stride_oh,
    stride_ss, stride_sf,
    num_segs, num_tokens, kv_rows, num_cols, num_kv_heads, window,
    budget, min_chunk, max_splits, lse_offset,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    S_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    RING: tl.constexpr,
):  # fmt: skip
    TQ: tl.constexpr = BLOCK_M // GROUP
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_d = tl.program_id(2)
    offs_s, q_start, q_len, _col, kv_end, ring_lo, tiles, chunk, splits = _schedule(
        SEQ, stride_ss, stride_sf, num_segs, num_tokens, kv_rows, num_cols, window, budget, min_chunk, max_splits,
        S_PAD, TQ, BLOCK_N, CAUSAL, WINDOWED, RING, True,
    )  # fmt: skip
    # One program per tile of a split segment: the packed partials follow the same order.
    split_tiles = tl.where(splits > 1, tiles, 0)
    split_tiles_end = tl.cumsum(split_tiles, 0)
    if pid >= tl.sum(split_tiles, 0):
        return
    seg = tl.sum((split_tiles_end <= pid).to(tl.int32), 0)
    tile = pid - (_pick(split_tiles_end, offs_s, seg) - _pick(split_tiles, offs_s, seg))
    s_splits = _pick(splits, offs_s, seg)
    s_q_start = _pick(q_start, offs_s, seg)
    s_q_len = _pick(q_len, offs_s, seg)
    s_chunk = _pick(chunk, offs_s, seg)
    t0 = tile * TQ
    lo, hi, _full_lo, _full_hi = _tile_keys(
        s_q_len, _pick(kv_end, offs_s, seg), _pick(ring_lo, offs_s, seg), window, t0, TQ, CAUSAL, WINDOWED
    )
    used = (tl.maximum(hi - lo, 0) + s_chunk - 1) // s_chunk
    if used <= 1:
        return

    split_work = tl.where(splits > 1, tiles * splits, 0)
    ws_first = _pick(tl.cumsum(split_work, 0) - split_work, offs_s, seg) + tile * s_splits
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tok = t0 + offs_m // GROUP
    head = pid_h * GROUP + offs_m % GROUP
    row_ok = (offs_m < TQ * GROUP) & (tok < s_q_len)

    # Online log-sum-exp over the partials: each is already normalised, weighted by 2^(lse - running
    # max), so nothing overflows whatever the scores.
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(0, used):
        ws_row = ((ws_first + split).to(tl.int64) * num_kv_heads + pid_h) * BLOCK_M + offs_m
        lse = tl.load(WS + lse_offset + ws_row, mask=row_ok, other=float("-inf"))
        part = tl.load(WS + ws_row[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                       other=0.0)  # fmt: skip
        m_new = tl.maximum(m_run, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.math.exp2(lse - m_safe)
        alpha = tl.math.exp2(m_run - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * part
        l_run = l_run * alpha + w
        m_run = m_new
    o = acc / tl.where(l_run > 0.0, l_run, 1.0)[:, None]
    o_rows = (s_q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(Out + o_rows[:, None] + offs_d[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
