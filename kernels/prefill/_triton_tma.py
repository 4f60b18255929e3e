"""SM90 prefill attention: Q/K/V tiles through tensor descriptors (TMA), GQA packing and KV splits.

Same contract and online softmax as the portable kernel (whose jit helpers it shares); what
differs is how data moves and how work is cut:

- Q, K and V tiles (and the output, without a KV split) move through host-side
  ``TensorDescriptor`` objects over the 4-D tensors with their real strides, so the copy engine
  (TMA) fetches whole tiles asynchronously, zero-fills past the end and clips stores, and the
  compiler pipelines the loads without address arithmetic in the loop. Host-side descriptors are
  kernel parameters: no device allocation, no global allocator, CUDA-graph capturable.
- ``PACK_GQA``: the ``GROUP`` query heads sharing one KV head fill one M tile together
  (``BLOCK_M // GROUP`` query positions each, loaded as one ``[1, GROUP, rows, D]`` box), so
  each K/V tile is read once per group instead of once per query head.
- ``SPLIT_KV``: the KV tiles of one M tile are divided among ``SPLIT_KV`` programs when the
  (M tile x head) grid alone cannot fill the GPU; each writes its unnormalised partial output,
  running max and sum to an fp32 workspace, and a small kernel merges them by log-sum-exp.

Descriptors need 16-byte aligned bases, non-inner strides that are multiples of 16 bytes and an
inner stride of 1; the declaration's ``tma_layout_ok`` fact checks that before a call is routed
here. The launch is :func:`.launch.launch_tma`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_portable import _attend_tile, _kv_tile_range, _valid_kv_len


@triton.jit
def _prefill_tma_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    KV_LEN,
    Part_O,
    Part_M,
    Part_L,
    stride_kvl,
    batch,
    q_heads,
    seqlen_q,
    seqlen_k,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PACK_GQA: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KV_LEN: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    NEG_SCALE: tl.constexpr,
):
    HEADS: tl.constexpr = GROUP if PACK_GQA else 1
    ROWS: tl.constexpr = BLOCK_M // HEADS
    # torch.compile may pass Python floats as fp64: keep the softmax in fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    # Causal tiles further down see more keys: start the heaviest first to shorten the tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_hb = tl.program_id(1)
    pid_b = tl.program_id(2) // SPLIT_KV
    pid_s = tl.program_id(2) % SPLIT_KV
    head0 = pid_hb * HEADS
    pid_kvh = head0 // GROUP

    kv = _valid_kv_len(KV_LEN, stride_kvl, pid_b, seqlen_k, HAS_KV_LEN)
    q_shift = kv - seqlen_q
    start_m = pid_m * ROWS
    n_full, n_total = _kv_tile_range(kv, q_shift, start_m, tl.minimum(start_m + ROWS, seqlen_q), BLOCK_N, CAUSAL)
    # This program's share of the tiles: [t_lo, t_mid) unmasked, [t_mid, t_hi) masked.
    per_split = tl.cdiv(n_total, SPLIT_KV)
    t_lo = pid_s * per_split
    t_hi = tl.minimum(t_lo + per_split, n_total)
    t_mid = tl.minimum(tl.maximum(n_full, t_lo), t_hi)

    rows = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    # Row r of a packed tile is query start_m + r % ROWS of head head0 + r // ROWS.
    q_pos = q_shift + start_m + rows % ROWS
    q = q_desc.load([pid_b, head0, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    for t in tl.range(t_lo, t_mid):
        start_n = t * BLOCK_N
        k = k_desc.load([pid_b, pid_kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = v_desc.load([pid_b, pid_kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, tl.trans(k), v, qk_scale, offs_n, q_pos, kv, False, CAUSAL, DOT_IN_FP32, NEG_SCALE
        )
    for t in tl.range(t_mid, t_hi):
        start_n = t * BLOCK_N
        k = k_desc.load([pid_b, pid_kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = v_desc.load([pid_b, pid_kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        # Keys past kv_len may hold anything (a KV cache's unused tail): P is 0 there, V must be too.
        v = tl.where((start_n + offs_n < kv)[:, None], v, 0.0)
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            tl.trans(k),
            v,
            qk_scale,
            start_n + offs_n,
            q_pos,
            kv,
            True,
            CAUSAL,
            DOT_IN_FP32,
            NEG_SCALE,
        )

    if SPLIT_KV == 1:
        # Rows that saw no key have l = 0 and acc = 0: they store zeros.
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_desc.store([pid_b, head0, start_m, 0], acc.to(q.dtype).reshape(1, HEADS, ROWS, HEAD_DIM))
    else:
        q_idx = start_m + rows % ROWS
        head = head0 + rows // ROWS
        part_row = ((pid_s.to(tl.int64) * batch + pid_b) * q_heads + head) * seqlen_q + q_idx
        row_ok = q_idx < seqlen_q
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(Part_O + part_row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(Part_M + part_row, m_i, mask=row_ok)
        tl.store(Part_L + part_row, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    Part_O,
    Part_M,
    Part_L,
    Out,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    batch,
    q_heads,
    seqlen_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT_KV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seqlen_q
    row = (pid_b.to(tl.int64) * q_heads + pid_h) * seqlen_q + offs_m
    split_rows = tl.cast(batch, tl.int64) * q_heads * seqlen_q

    m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(SPLIT_KV):
        m_max = tl.maximum(m_max, tl.load(Part_M + s * split_rows + row, mask=row_ok, other=float("-inf")))
    # Rows no split saw a key for keep -inf: shift by 0 so every weight is exactly 0.
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in tl.static_range(SPLIT_KV):
        weight = tl.exp2(tl.load(Part_M + s * split_rows + row, mask=row_ok, other=float("-inf")) - m_use)
        l_sum += weight * tl.load(Part_L + s * split_rows + row, mask=row_ok, other=0.0)
        part = tl.load(Part_O + (s * split_rows + row)[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None])
        acc += weight[:, None] * part
    acc = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    # 64-bit row offsets: in a [B, L, H, D] view L * H * D may pass 2**31 elements.
    o_ptrs = Out + pid_b.to(tl.int64) * stride_ob + pid_h.to(tl.int64) * stride_oh
    o_ptrs += offs_m.to(tl.int64)[:, None] * stride_om + offs_d.to(tl.int64)[None, :] * stride_od
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
