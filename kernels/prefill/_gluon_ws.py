"""SM90 prefill attention, warp-specialized in Gluon: a TMA producer and two ping-ponged consumers.

Same contract and online softmax (exp2, scale folded into one multiplier, bottom-right causal
alignment, device ``kv_len``, zeros for rows that see no key) as the portable and TMA kernels;
what differs is who does what inside one program (CTA), the FlashAttention-3 schedule for Hopper:

- one **producer** warp (its own partition, few registers) moves tiles with TMA: both consumers'
  Q tiles once, then K and V tiles of ``BLOCK_N`` keys through a ring of ``NUM_STAGES`` buffers,
  each with a ready barrier (TMA byte count) and an empty barrier both consumers arrive on (K's
  once both QK^T are done, V's once both PV are: K refills while PV still reads V);
- two **consumer** warpgroups (the default partition and one worker, ``BLOCK_M // 2`` query rows
  each, the same K/V tiles) run the MMAs (async ``warpgroup_mma``) and the softmax. They take
  turns issuing their MMAs (two barriers passed back and forth: ping-pong), so one warpgroup's
  softmax runs while the other's MMAs occupy the tensor cores;
- within a consumer, iteration ``j`` issues ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` back to
  back, waits for ``S_j`` only, and computes ``P_j`` while the PV MMA is still running; ``O`` is
  rescaled once that MMA is done;
- ``warp_specialize``'s register counts move registers from the producer (``PRODUCER_REGS``) to
  the consumers (``CONSUMER_REGS``; Triton gives the default partition what is left, equal to the
  worker's when ``2 * CONSUMER_REGS + PRODUCER_REGS == 504``: see the search space's rule);
- longest-first tile order: the grid is (query head, batch, M tile) with the M tiles last to
  first, so the tiles that see the most keys start before any lighter one (causal balance).

Keys past ``kv_len`` but inside the tensor (a KV cache's unused tail) may hold anything: P is 0
there, and the producer zeroes those rows of the last V tile in shared memory before the consumers
see it (0 x NaN would still be NaN in the MMA). Q, K, V and the output move through host-side
4-D tensor descriptors over the real strides, as on the TMA path (:func:`.launch.launch_ws`).
Gluon does not run on the interpreter: :func:`.kernel.serve` routes this path to SM90 only.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

#: Warps of the producer partition: one issues every TMA copy.
PRODUCER_WARPS = gl.constexpr(1)
#: Warps of each consumer partition: one warpgroup, what a wgmma takes.
CONSUMER_WARPS = gl.constexpr(4)


@gluon.constexpr_function
def _rows_layout(head_dim: int) -> gl.BlockedLayout:
    """A one-warp layout over 8 rows of a ``[*, head_dim]`` tile, 8 contiguous elements a thread."""
    cols = head_dim // 8
    return gl.BlockedLayout([1, 8], [32 // cols, cols], [1, 1], [1, 0])


@gluon.jit
def _valid_kv_len(KV_LEN, stride_kvl, pid_b, seqlen_k, HAS_KV_LEN: gl.constexpr):
    """The valid keys of batch ``pid_b``, read on the device and clamped to [0, seqlen_k]."""
    if HAS_KV_LEN:
        kv = gl.load(KV_LEN + pid_b * stride_kvl)
        kv = gl.minimum(gl.maximum(kv, 0), seqlen_k)
    else:
        kv = seqlen_k
    return kv


@gluon.jit
def _zero_tail_rows(tile, first_zero, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Zero rows ``first_zero..BLOCK_N`` of a shared ``[BLOCK_N, HEAD_DIM]`` tile (one warp)."""
    layout: gl.constexpr = _rows_layout(HEAD_DIM)
    row = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
    for chunk in gl.static_range(BLOCK_N // 8):
        if chunk * 8 + 8 > first_zero:
            part = tile.slice(chunk * 8, 8, dim=0)
            values = part.load(layout)
            keep = (chunk * 8 + row < first_zero)[:, None]
            part.store(gl.where(keep, values, gl.zeros_like(values)))


@gluon.jit
def _producer(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    q_bar,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    v_raw,
    pid_b,
    pid_h,
    kv_head,
    start_m,
    kv,
    seqlen_k,
    n_total,
    ROWS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """The TMA partition: both Q tiles, then K and V tile by tile into the ring's free stages."""
    box_q: gl.constexpr = [1, 1, ROWS, HEAD_DIM]
    box_kv: gl.constexpr = [1, 1, BLOCK_N, HEAD_DIM]
    for c in gl.static_range(2):
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        dst = q_smem.index(c)._reinterpret(q_desc.dtype, box_q, q_desc.layout)
        tma.async_copy_global_to_shared(q_desc, [pid_b, pid_h, start_m + c * ROWS, 0], q_bar.index(c), dst)
    for t in range(n_total):
        stage = t % NUM_STAGES
        # A fresh barrier counts as having completed the phase before its first, so the ring's
        # first pass goes through.
        free_phase = ((t // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(stage), free_phase)
        start_n = t * BLOCK_N
        k_dst = k_smem.index(stage)._reinterpret(k_desc.dtype, box_kv, k_desc.layout)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [pid_b, kv_head, start_n, 0], k_ready.index(stage), k_dst)
        # K is released as soon as both QK^T are done, V only after both PV: separate rings.
        mbarrier.wait(v_empty.index(stage), free_phase)
        v_tile = v_smem.index(stage)
        v_dst = v_tile._reinterpret(v_desc.dtype, box_kv, v_desc.layout)
        if (start_n + BLOCK_N > kv) & (kv < seqlen_k):
            # The last tile of a KV cache's valid prefix: rows past kv_len hold stale values.
            # Only one tile per program gets here, so its barrier completes phase 0 only.
            mbarrier.expect(v_raw.index(0), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [pid_b, kv_head, start_n, 0], v_raw.index(0), v_dst)
            mbarrier.wait(v_raw.index(0), 0)
            _zero_tail_rows(v_tile, kv - start_n, BLOCK_N, HEAD_DIM)
            # The consumers' wgmma reads through the async proxy: publish the generic-proxy writes.
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(v_ready.index(stage))
        else:
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [pid_b, kv_head, start_n, 0], v_ready.index(stage), v_dst)


@gluon.jit
def _softmax_step(
    s,
    m_i,
    l_i,
    qk_scale,
    tile,
    n_full,
    offs_n,
    q_pos,
    kv,
    p_layout: gl.constexpr,
    dtype: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
    NEG_SCALE: gl.constexpr,
):
    """One online-softmax step on scores ``s``: ``(P as wgmma's A operand, alpha, m, l)``.

    As in the portable kernel: the row extreme is taken on raw scores and scaled once per row,
    hidden keys lose it (+inf under a min, -inf under a max), and a row that has seen no key yet
    is shifted by 0 so exp2 gives 0, not NaN. Only tiles from ``n_full`` on are masked.
    """
    if tile >= n_full:
        cols = tile * BLOCK_N + offs_n
        valid = cols[None, :] < kv
        if CAUSAL:
            valid = valid & (cols[None, :] <= q_pos[:, None])
        s = gl.where(valid, s, float("inf") if NEG_SCALE else float("-inf"))
    extreme = gl.min(s, 1) if NEG_SCALE else gl.max(s, 1)
    m_new = gl.maximum(m_i, extreme * qk_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(dtype), p_layout), alpha, m_new, l_i


@gluon.jit
def _consumer(
    c: gl.constexpr,
    o_desc,
    q_smem,
    k_smem,
    v_smem,
    q_bar,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    turn,
    pid_b,
    pid_h,
    start_m,
    q_shift,
    kv,
    n_full,
    n_total,
    qk_scale,
    ROWS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    NEG_SCALE: gl.constexpr,
):
    """Consumer ``c``: rows ``start_m + c * ROWS ..`` of the program's tile, every K/V tile."""
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    other: gl.constexpr = 1 - c

    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    q_pos = q_shift + start_m + c * ROWS + rows
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    p = gl.zeros([ROWS, BLOCK_N], dtype, layout=p_layout)

    q = q_smem.index(c)
    mbarrier.wait(q_bar.index(c), 0)
    if n_total > 0:
        # Tile 0: its QK^T on this consumer's turn, then the softmax (nothing to overlap yet).
        mbarrier.wait(turn.index(c), 0)
        mbarrier.wait(k_ready.index(0), 0)
        k0 = k_smem.index(0)
        s_tok = warpgroup_mma(q, k0.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.arrive(turn.index(other))
        s, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q, k0))
        mbarrier.arrive(k_empty.index(0))
        p, alpha, m_i, l_i = _softmax_step(
            s, m_i, l_i, qk_scale, 0, n_full, offs_n, q_pos, kv, p_layout, dtype, BLOCK_N, CAUSAL, NEG_SCALE
        )
        for j in range(1, n_total):
            stage = j % NUM_STAGES
            prev = (j - 1) % NUM_STAGES
            k_j = k_smem.index(stage)
            v_prev = v_smem.index(prev)
            mbarrier.wait(turn.index(c), j & 1)
            mbarrier.wait(k_ready.index(stage), (j // NUM_STAGES) & 1)
            s_tok = warpgroup_mma(q, k_j.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_STAGES) & 1)
            o_tok = warpgroup_mma(p, v_prev, acc, is_async=True)
            mbarrier.arrive(turn.index(other))
            # Groups complete in order: this waits for S_j and leaves P_{j-1} V_{j-1} running.
            s, _, _ = warpgroup_mma_wait(1, deps=(s_tok, q, k_j))
            mbarrier.arrive(k_empty.index(stage))
            p_next, alpha, m_i, l_i = _softmax_step(
                s, m_i, l_i, qk_scale, j, n_full, offs_n, q_pos, kv, p_layout, dtype, BLOCK_N, CAUSAL, NEG_SCALE
            )
            acc, _, _ = warpgroup_mma_wait(0, deps=(o_tok, p, v_prev))
            mbarrier.arrive(v_empty.index(prev))
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p = p_next
        last = (n_total - 1) % NUM_STAGES
        v_last = v_smem.index(last)
        mbarrier.wait(turn.index(c), n_total & 1)
        mbarrier.wait(v_ready.index(last), ((n_total - 1) // NUM_STAGES) & 1)
        o_tok = warpgroup_mma(p, v_last, acc, is_async=True)
        mbarrier.arrive(turn.index(other))
        acc, _, _ = warpgroup_mma_wait(0, deps=(o_tok, p, v_last))
        mbarrier.arrive(v_empty.index(last))

    # Rows that saw no key have l = 0 and acc = 0: they store zeros.
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    acc = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
    # Q's buffer is free once the last QK^T is done: it stages the output for the TMA store.
    q.store(acc.to(dtype))
    fence_async_shared()
    box_o: gl.constexpr = [1, 1, ROWS, HEAD_DIM]
    tma.async_copy_shared_to_global(
        o_desc, [pid_b, pid_h, start_m + c * ROWS, 0], q._reinterpret(dtype, box_o, o_desc.layout)
    )
    tma.store_wait(0)


@gluon.jit
def _prefill_ws_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    KV_LEN,
    stride_kvl,
    seqlen_q,
    seqlen_k,
    qk_scale,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_KV_LEN: gl.constexpr,
    NEG_SCALE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    ROWS: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_desc.dtype
    # torch.compile may pass Python floats as fp64: keep the softmax in fp32.
    qk_scale = qk_scale.to(gl.float32)
    # Longest first: the grid's slowest axis walks the M tiles last to first, so every (head,
    # batch) starts its causal tile that sees the most keys before any lighter one (the GPU
    # dispatches x fastest). Neighbouring programs are the query heads of one KV head: shared K/V in L2.
    pid_h = gl.program_id(0)
    pid_b = gl.program_id(1)
    pid_m = gl.num_programs(2) - 1 - gl.program_id(2)
    kv_head = pid_h // GROUP

    kv = _valid_kv_len(KV_LEN, stride_kvl, pid_b, seqlen_k, HAS_KV_LEN)
    q_shift = kv - seqlen_q
    start_m = pid_m * BLOCK_M
    end_m = gl.minimum(start_m + BLOCK_M, seqlen_q)
    # Both consumers walk the program's tiles: [0, n_full) unmasked, [n_full, n_total) masked.
    if CAUSAL:
        hi = gl.minimum(kv, q_shift + end_m)
        full = gl.minimum(kv, q_shift + start_m + 1)
    else:
        hi = kv
        full = kv
    n_full = gl.maximum(full, 0) // BLOCK_N
    n_total = gl.cdiv(gl.maximum(hi, 0), BLOCK_N)

    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_raw = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    mbarrier.init(v_raw.index(0), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # Both consumers release a stage.
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    # Consumer 0 takes the first turn.
    mbarrier.arrive(turn.index(0))
    fence_async_shared()

    # Consumer 0 is the default partition (this program's 4 warps), consumer 1 and the producer
    # are workers; the register counts are the workers' (see the module doc).
    # fmt: off
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    0, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                    pid_b, pid_h, start_m, q_shift, kv, n_full, n_total, qk_scale,
                    ROWS, BLOCK_N, HEAD_DIM, NUM_STAGES, CAUSAL, NEG_SCALE,
                ),
            ),
            (
                _consumer,
                (
                    1, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                    pid_b, pid_h, start_m, q_shift, kv, n_full, n_total, qk_scale,
                    ROWS, BLOCK_N, HEAD_DIM, NUM_STAGES, CAUSAL, NEG_SCALE,
                ),
            ),
            (
                _producer,
                (
                    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, v_raw,
                    pid_b, pid_h, kv_head, start_m, kv, seqlen_k, n_total,
                    ROWS, BLOCK_N, HEAD_DIM, NUM_STAGES,
                ),
            ),
        ],
        [CONSUMER_WARPS, PRODUCER_WARPS],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on
