"""The tma path's K loop with a loader warp: every TMA copy issued by a warp of its own.

In the plain kernel (:mod:`._gluon_tma`) the warps that dequantize and issue the wgmma also issue
each step's TMA copies. Triton 3.6's shared-memory barrier analysis cannot tell that one thread
issues them all, so it puts a CTA barrier between the barrier's ``expect`` and each copy, and one
before the next step's wait on it: four barriers a step beside the one the weight tile needs
(the sm_90 build shows them), each holding every warp until the slowest arrives. Here one
**loader** warp (a ``warp_specialize`` worker) issues the copies of x tiles, code words and
scale chunks into the same rings, waiting for a stage or slot to be released first; the other
warps (the default partition) run the plain kernel's K loop with the copies taken out, and
release each stage once the step's wgmma that read it is done, and each scale slot once its
chunk's last step read it. Their barriers inside a worker span its one warp.

Only with the scales by TMA (``SCALES_TMA``, see :mod:`._gluon_tma`): the loader copies whole
chunks of them, and where they come into registers instead the plain kernel runs. The loader
takes few registers (``LOADER_REGS``); the default partition what is left of the register file
(for 8 warps and a 24-register loader, 240 each).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma_wait

from ._gluon_tma import (
    SCALE_CHUNK_K,
    _chunk_scales,
    _dequant_step,
    _epilogue,
    _issue_scales,
    _issue_step,
    _mma_step,
    _zero_acc,
    word_lanes,
)

#: Warps of the loader partition: one issues every TMA copy.
LOADER_WARPS = gl.constexpr(1)
#: Registers a loader thread keeps (it holds coordinates and phases only).
LOADER_REGS = gl.constexpr(24)


@gluon.jit
def _drain(acc):
    """Wait for every wgmma in flight: called in the K loop's last step, not after the loop.

    With the loop followed by a warp-specialized epilogue, ptxas (CUDA 12.8, sm_90a) schedules the
    epilogue's first reads of the accumulator (its bf16 conversions) above a drain placed after
    the loop, so the last step's wgmma was still writing registers they read; a drain inside the
    loop body keeps them below it (``tests/test_q4k_tma.py`` checks the builds' SASS)."""
    return warpgroup_mma_wait(0, deps=(acc,))


@gluon.jit
def _loader(
    x_desc, q_desc, sc_desc, mn_desc, ss_desc, x_smem, q_smem, sc_smem, mn_smem, ss_smem,
    ready, empty, scales_ready, scales_empty, row_m, row_n, k_start,
    BLOCK_K: gl.constexpr, K_TILES: gl.constexpr,
):  # fmt: skip
    """Each scale chunk into its slot once the chunk two before has been read, and each K step's
    x tile and code words into its stage once the step ``NUM_STAGES`` before has been used."""
    NUM_STAGES: gl.constexpr = x_smem.shape[0]
    CHUNK_STEPS: gl.constexpr = SCALE_CHUNK_K // BLOCK_K
    for c in range(K_TILES // CHUNK_STEPS):
        # A fresh barrier counts as having completed the phase before its first: the first passes go through.
        mbarrier.wait(scales_empty.index(c % 2), ((c // 2) & 1) ^ 1)
        _issue_scales(sc_desc, mn_desc, ss_desc, sc_smem, mn_smem, ss_smem, scales_ready, c, row_n, k_start)
        for j in range(CHUNK_STEPS):
            i = c * CHUNK_STEPS + j
            mbarrier.wait(empty.index(i % NUM_STAGES), ((i // NUM_STAGES) & 1) ^ 1)
            _issue_step(x_desc, q_desc, x_smem, q_smem, ready, i, row_m, row_n, k_start, BLOCK_K)


@gluon.jit
def _consumer(
    x_smem, q_smem, w_smem, sc_smem, mn_smem, ss_smem, ready, empty, scales_ready, scales_empty,
    bias_ptr, out_ptr, part_ptr, counters_ptr, row_m, row_n, pid_k, M,
    stride_om, stride_on, stride_pk, stride_pm, stride_bn,
    HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    K_TILES: gl.constexpr, SWAP: gl.constexpr, SPLIT_K: gl.constexpr, FUSED_REDUCE: gl.constexpr,
    PACKED_DEQUANT: gl.constexpr,
):  # fmt: skip
    """The plain kernel's K loop with its scales by TMA, the copies left to the loader; then the epilogue."""
    warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = w_smem.dtype
    NUM_STAGES: gl.constexpr = x_smem.shape[0]
    G: gl.constexpr = BLOCK_K // 32
    # The plain kernel's layouts (see its body): code words [BLOCK_N, G, 4] and as the TMA wrote them.
    WORD_LANES: gl.constexpr = word_lanes(BLOCK_N, BLOCK_K, warps)
    lanes_g: gl.constexpr = G if G < 32 // WORD_LANES else 32 // WORD_LANES
    words_layout: gl.constexpr = gl.BlockedLayout(
        [1, G // lanes_g, 4 // WORD_LANES],
        [32 // (lanes_g * WORD_LANES), lanes_g, WORD_LANES],
        [warps, 1, 1],
        [2, 1, 0],
    )
    flat_layout: gl.constexpr = gl.BlockedLayout(
        [1, 4 // WORD_LANES * (G // lanes_g)],
        [32 // (lanes_g * WORD_LANES), lanes_g * WORD_LANES],
        [warps, 1],
        [1, 0],
    )
    groups_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
    CHUNK_STEPS: gl.constexpr = SCALE_CHUNK_K // BLOCK_K

    acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP)
    for c in range(K_TILES // CHUNK_STEPS):
        slot = c % 2
        mbarrier.wait(scales_ready.index(slot), (c // 2) & 1)
        for j in gl.static_range(CHUNK_STEPS):
            i = c * CHUNK_STEPS + j
            sc, mn, d, dmin = _chunk_scales(sc_smem, mn_smem, ss_smem, slot, j, groups_layout, BLOCK_K)
            w_buf = _dequant_step(
                i, q_smem, w_smem, ready, sc, mn, d, dmin, flat_layout, words_layout, BLOCK_N, BLOCK_K,
                PACKED_DEQUANT, dtype,
            )  # fmt: skip
            if j == CHUNK_STEPS - 1:
                # Every warp read the chunk's last scales before the barrier the step just passed.
                mbarrier.arrive(scales_empty.index(slot))
            acc = _mma_step(w_buf, x_smem.index(i % NUM_STAGES), acc, SWAP)
            if j == CHUNK_STEPS - 1:  # noqa: SIM102 (a compile-time test, then a run-time one)
                if c == K_TILES // CHUNK_STEPS - 1:
                    acc = _drain(acc)
            # Step i - 1's wgmma is done (in both warpgroups once past the barrier) and its code
            # words were read before its own barrier: its stage is free for the loader.
            if warps > 4:
                gl.thread_barrier()
            if i > 0:
                mbarrier.arrive(empty.index((i - 1) % NUM_STAGES))
    _epilogue(
        acc, bias_ptr, out_ptr, part_ptr, counters_ptr, row_m, row_n, pid_k, M,
        stride_om, stride_on, stride_pk, stride_pm, stride_bn,
        HAS_BIAS, BLOCK_M, BLOCK_N, SWAP, SPLIT_K, FUSED_REDUCE,
    )  # fmt: skip


@gluon.jit
def scale_slots(sc_desc, mn_desc, ss_desc, BLOCK_N: gl.constexpr):
    """Two slots of a scale chunk for ``BLOCK_N`` weight rows: scales, mins, super-block (d, dmin)."""
    sc_smem = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, SCALE_CHUNK_K // 32], sc_desc.layout)
    mn_smem = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, SCALE_CHUNK_K // 32], mn_desc.layout)
    ss_smem = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, SCALE_CHUNK_K // 128], ss_desc.layout)
    return sc_smem, mn_smem, ss_smem


@gluon.jit
def split_barriers(NUM_STAGES: gl.constexpr):
    """The barriers between a loader and the warps it feeds, initialized and fenced: each ring
    stage's filled (``ready``) and emptied (``empty``), each scale slot's filled and emptied."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    scales_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    scales_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for s in gl.static_range(2):
        mbarrier.init(scales_ready.index(s), count=1)
        mbarrier.init(scales_empty.index(s), count=1)
    fence_async_shared()
    return ready, empty, scales_ready, scales_empty


@gluon.jit
def _q4k_gemm_tma_loader_kernel(
    x_desc, q_desc, sc_desc, mn_desc, ss_desc, sc_ptr, mn_ptr, ss_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr,
    M, stride_sn, stride_ssn, stride_om, stride_on, stride_pk, stride_pm, stride_bn,
    HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    K_TILES: gl.constexpr, NUM_STAGES: gl.constexpr, SWAP: gl.constexpr, SPLIT_K: gl.constexpr,
    FUSED_REDUCE: gl.constexpr, PACKED_DEQUANT: gl.constexpr, SCALES_TMA: gl.constexpr,
):  # fmt: skip
    """:func:`._gluon_tma._q4k_gemm_tma_kernel` with its copies issued by a loader warp: the same
    grid and arguments (``sc_ptr``, ``mn_ptr``, ``ss_ptr`` and their strides unread), and
    ``SCALES_TMA`` always set (the launch's check)."""
    gl.static_assert(SCALES_TMA, "the loader warp copies the scales by TMA")
    dtype: gl.constexpr = x_desc.dtype
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    k_start = pid_k * (K_TILES * BLOCK_K)
    row_m = pid_m * BLOCK_M
    row_n = pid_n * BLOCK_N

    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
    x_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, BLOCK_N, BLOCK_K // 8], q_desc.layout)
    w_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_K], w_layout)
    sc_smem, mn_smem, ss_smem = scale_slots(sc_desc, mn_desc, ss_desc, BLOCK_N)
    ready, empty, scales_ready, scales_empty = split_barriers(NUM_STAGES)

    # fmt: off
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    x_smem, q_smem, w_smem, sc_smem, mn_smem, ss_smem, ready, empty, scales_ready, scales_empty,
                    bias_ptr, out_ptr, part_ptr, counters_ptr, row_m, row_n, pid_k, M,
                    stride_om, stride_on, stride_pk, stride_pm, stride_bn,
                    HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, SWAP, SPLIT_K, FUSED_REDUCE, PACKED_DEQUANT,
                ),
            ),
            (
                _loader,
                (
                    x_desc, q_desc, sc_desc, mn_desc, ss_desc, x_smem, q_smem, sc_smem, mn_smem, ss_smem,
                    ready, empty, scales_ready, scales_empty, row_m, row_n, k_start, BLOCK_K, K_TILES,
                ),
            ),
        ],
        [LOADER_WARPS],
        [LOADER_REGS],
    )
    # fmt: on
