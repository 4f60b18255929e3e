"""The Q4_K GEMM loop in Gluon, for ``probe_q4k_pipeline.py``: what Triton's pipeliner leaves out.

Built for sm_90 from Triton's own output, the portable kernel copies its code words
asynchronously but runs about eleven CTA barriers a K step and waits for each wgmma before it
dequantizes the next tile. Here one warpgroup holds the whole schedule explicitly:

- x tiles come by TMA through a ring of ``NUM_STAGES`` shared buffers with ready barriers
  (mbarriers: no CTA barrier), issued ``NUM_STAGES - 1`` tiles ahead;
- the next K step's code words, scales and super-scales are loaded into registers while the
  current step is dequantized (a register double buffer);
- the dequantized tile goes to one of two shared buffers, and the wgmma is left in flight
  (``warpgroup_mma_wait(1)``): step ``i``'s tile is written while step ``i - 1``'s wgmma runs.
  One CTA barrier a step remains, between the tile's stores and the wgmma that reads it;
- with ``SWAP`` the product is computed transposed (``W x^T``): the weight rows fill wgmma's
  64-row M side and the few rows of x its N side, which may be as small as 16.

Codes unpack as in the portable kernel (``_codes_as_float``: one AND and one subtraction a code),
per 32-bit word; each word's scale, offset and super-scales are loaded per word, so nothing needs
the ``[N, G, 32]`` broadcast.
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


@gluon.jit
def _word_codes(t):
    """Four codes of the low 16 bits of ``t | 0x4F000000`` as exact floats (bits 0-3, ..., 12-15)."""
    c0 = (t & 0x4B00000F).to(gl.float32, bitcast=True) - 8388608.0
    c1 = (t & 0x490000F0).to(gl.float32, bitcast=True) - 524288.0
    c2 = (t & 0x47000F00).to(gl.float32, bitcast=True) - 32768.0
    c3 = (t & 0x4500F000).to(gl.float32, bitcast=True) - 2048.0
    return c0, c1, c2, c3


@gluon.jit
def _small(x):
    """Integers ``0 <= x < 2**23`` as float32 without a conversion instruction."""
    return (x.to(gl.int32) | 0x4B000000).to(gl.float32, bitcast=True) - 8388608.0


@gluon.jit
def _dequant_words(qw, sc, mn, d, dmin, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, dtype: gl.constexpr):
    """``[BLOCK_N, G, 4]`` code words (four a 32-code group) with ``[BLOCK_N, G]`` 6-bit scales and
    mins and their super-blocks' ``d``/``dmin`` -> the ``[BLOCK_N, BLOCK_K]`` tile ``d*sc*q - dmin*mn``."""
    scale = (d * _small(sc))[:, :, None]
    offset = (dmin * _small(mn))[:, :, None]
    e0, e1, e2, e3 = _word_codes(qw | 0x4F000000)
    e4, e5, e6, e7 = _word_codes((qw >> 16) | 0x4F000000)
    # Element 8w + j of the row is code j of word w: j = 4*j2 + 2*j1 + j0, joined most significant first.
    w0 = (e0 * scale - offset).to(dtype)
    w1 = (e1 * scale - offset).to(dtype)
    w2 = (e2 * scale - offset).to(dtype)
    w3 = (e3 * scale - offset).to(dtype)
    w4 = (e4 * scale - offset).to(dtype)
    w5 = (e5 * scale - offset).to(dtype)
    w6 = (e6 * scale - offset).to(dtype)
    w7 = (e7 * scale - offset).to(dtype)
    even = gl.join(gl.join(w0, w4), gl.join(w2, w6))
    odd = gl.join(gl.join(w1, w5), gl.join(w3, w7))
    return gl.reshape(gl.join(even, odd), [BLOCK_N, BLOCK_K])


@gluon.jit
def _load_words(qs_row, sc_row, mn_row, ss_row, group, word):
    """One K step's code words ``[BLOCK_N, G, 4]`` and, per 32-code group ``[BLOCK_N, G]``, its
    scale, min and super-block ``d``, ``dmin``: each thread loads a group's four words at once."""
    qw = gl.load(qs_row[:, :, None] + (group * 4)[:, :, None] + word)
    sc = gl.load(sc_row + group)
    mn = gl.load(mn_row + group)
    block = group // 8  # 256 codes a super-block
    d = gl.load(ss_row + block * 2).to(gl.float32)
    dmin = gl.load(ss_row + block * 2 + 1).to(gl.float32)
    return qw, sc, mn, d, dmin


@gluon.jit
def _ready_barriers(NUM_STAGES: gl.constexpr):
    """One mbarrier per ring stage, initialised for one arrival (the TMA's byte count)."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()
    return ready


@gluon.jit
def _mma_step(w_buf, x_buf, acc, SWAP: gl.constexpr):
    """Issue this K step's wgmma (``x W^T``, or ``W x^T`` with ``SWAP``) and wait until only it is in flight."""
    if SWAP:
        tok = warpgroup_mma(w_buf, x_buf.permute((1, 0)), acc, is_async=True)
    else:
        tok = warpgroup_mma(x_buf, w_buf.permute((1, 0)), acc, is_async=True)
    acc, _, _ = warpgroup_mma_wait(1, deps=(tok, x_buf, w_buf))
    return acc


@gluon.jit
def _zero_acc(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SWAP: gl.constexpr):
    """The float32 accumulator in wgmma's layout: ``[BLOCK_M, BLOCK_N]``, or ``[BLOCK_N, BLOCK_M]`` with ``SWAP``."""
    warps: gl.constexpr = gl.num_warps()
    if SWAP:
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=layout)
    else:
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=layout)
    return acc


@gluon.jit
def _store_acc(
    acc, out_ptr, row_m, row_n, pid_k, M, stride_om, stride_ok,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SWAP: gl.constexpr,
):  # fmt: skip
    """Store the accumulator's valid rows of x into split ``pid_k`` of the float32 partials."""
    layout: gl.constexpr = acc.type.layout
    if SWAP:
        offs_n = row_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        offs_m = row_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
        ptrs = out_ptr + pid_k * stride_ok + offs_m[None, :].to(gl.int64) * stride_om + offs_n[:, None]
        gl.store(ptrs, acc, mask=(offs_m < M)[None, :])
    else:
        offs_m = row_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_n = row_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        ptrs = out_ptr + pid_k * stride_ok + offs_m[:, None].to(gl.int64) * stride_om + offs_n[None, :]
        gl.store(ptrs, acc, mask=(offs_m < M)[:, None])


@gluon.jit
def gluon_q4k_kernel(
    x_desc, qs_ptr, sc_ptr, mn_ptr, ss_ptr, out_ptr, M, N,
    stride_qn, stride_sn, stride_ssn, stride_om, stride_ok,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, K_TILES: gl.constexpr,
    NUM_STAGES: gl.constexpr, SWAP: gl.constexpr,
):  # fmt: skip
    """``out[pid_k, M, N] = x[:, split] @ dequant(W)[:, split]^T`` in float32, one (N, split, M) tile a program."""
    warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = x_desc.dtype
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    k_start = pid_k * (K_TILES * BLOCK_K)

    # Code words as [BLOCK_N, G, 4]: a thread holds one 32-code group's four words (one 16-byte
    # load), the groups of a row over neighbouring lanes, rows over the rest and the warps.
    G: gl.constexpr = BLOCK_K // 32
    lanes_g: gl.constexpr = G if G < 32 else 32
    words_layout: gl.constexpr = gl.BlockedLayout(
        [1, G // lanes_g, 4], [32 // lanes_g, lanes_g, 1], [warps, 1, 1], [2, 1, 0]
    )
    groups_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
    rows_n = (pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, groups_layout))).to(gl.int64)
    group = gl.arange(0, G, layout=gl.SliceLayout(0, groups_layout))[None, :] + (k_start // 32)
    word = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, words_layout)))[None, None, :]
    qs_row = (qs_ptr + rows_n[:, None] * stride_qn).to(gl.pointer_type(gl.int32))
    sc_row = sc_ptr + rows_n[:, None] * stride_sn
    mn_row = mn_ptr + rows_n[:, None] * stride_sn
    ss_row = ss_ptr + rows_n[:, None] * stride_ssn

    acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP)

    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
    x_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_K], w_layout)
    ready = _ready_barriers(NUM_STAGES)

    # x tiles 0 .. NUM_STAGES - 2 in flight before the loop.
    for s in gl.static_range(NUM_STAGES - 1):
        if s < K_TILES:
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
            at = [pid_m * BLOCK_M, k_start + s * BLOCK_K]
            tma.async_copy_global_to_shared(x_desc, at, ready.index(s), x_smem.index(s))
    qw, sc, mn, d, dmin = _load_words(qs_row, sc_row, mn_row, ss_row, group, word)
    for i in range(K_TILES):
        stage = i % NUM_STAGES
        w_buf = w_smem.index(i % 2)
        # Step i - 2's wgmma read this buffer; the wait(1) of step i - 1 saw it done.
        w_buf.store(_dequant_words(qw, sc, mn, d, dmin, BLOCK_N, BLOCK_K, dtype))
        fence_async_shared()
        gl.thread_barrier()
        if i + 1 < K_TILES:
            qw, sc, mn, d, dmin = _load_words(qs_row, sc_row, mn_row, ss_row, group + (i + 1) * G, word)
        x_buf = x_smem.index(stage)
        mbarrier.wait(ready.index(stage), (i // NUM_STAGES) & 1)
        # Leaves step i's wgmma running: step i - 1's is done, so its x stage takes tile i - 1 + NUM_STAGES
        # (at i = 0 the last stage, which no tile has used yet).
        acc = _mma_step(w_buf, x_buf, acc, SWAP)
        nxt = i - 1 + NUM_STAGES
        if nxt < K_TILES:
            back = nxt % NUM_STAGES
            mbarrier.expect(ready.index(back), x_desc.block_type.nbytes)
            at = [pid_m * BLOCK_M, k_start + nxt * BLOCK_K]
            tma.async_copy_global_to_shared(x_desc, at, ready.index(back), x_smem.index(back))
    acc = warpgroup_mma_wait(0, deps=(acc,))
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(s))

    _store_acc(acc, out_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, pid_k, M, stride_om, stride_ok, BLOCK_M, BLOCK_N, SWAP)


@gluon.jit
def _load_scales(sc_row, mn_row, ss_row, group):
    """Per 32-code group ``[BLOCK_N, G]``: its 6-bit scale and min, and its super-block's ``d``, ``dmin``."""
    block = group // 8  # 256 codes a super-block
    d = gl.load(ss_row + block * 2).to(gl.float32)
    dmin = gl.load(ss_row + block * 2 + 1).to(gl.float32)
    return gl.load(sc_row + group), gl.load(mn_row + group), d, dmin


@gluon.jit
def _issue_tile(
    x_desc, q_desc, x_smem, q_smem, ready, tile, row_m, row_n, k_start, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr
):
    """TMA copies of K step ``tile``'s x tile and code words into ring stage ``tile % NUM_STAGES``."""
    stage = tile % NUM_STAGES
    bar = ready.index(stage)
    mbarrier.expect(bar, x_desc.block_type.nbytes + q_desc.block_type.nbytes)
    k = k_start + tile * BLOCK_K
    tma.async_copy_global_to_shared(x_desc, [row_m, k], bar, x_smem.index(stage))
    tma.async_copy_global_to_shared(q_desc, [row_n, k // 8], bar, q_smem.index(stage))


@gluon.jit
def gluon_q4k_tma_kernel(
    x_desc, q_desc, sc_ptr, mn_ptr, ss_ptr, out_ptr, M, N,
    stride_sn, stride_ssn, stride_om, stride_ok,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, K_TILES: gl.constexpr,
    NUM_STAGES: gl.constexpr, SWAP: gl.constexpr,
):  # fmt: skip
    """:func:`gluon_q4k_kernel` with the code words in the TMA ring beside x (``NUM_STAGES - 1``
    steps ahead) and the scales loaded into registers three steps ahead: no load a step waits on
    was issued by the step before it."""
    warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = x_desc.dtype
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    k_start = pid_k * (K_TILES * BLOCK_K)
    row_m = pid_m * BLOCK_M
    row_n = pid_n * BLOCK_N

    G: gl.constexpr = BLOCK_K // 32
    lanes_g: gl.constexpr = G if G < 32 else 32
    words_layout: gl.constexpr = gl.BlockedLayout(
        [1, G // lanes_g, 4], [32 // lanes_g, lanes_g, 1], [warps, 1, 1], [2, 1, 0]
    )
    flat_layout: gl.constexpr = gl.BlockedLayout([1, 4 * (G // lanes_g)], [32 // lanes_g, lanes_g], [warps, 1], [1, 0])
    groups_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
    rows_n = (row_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, groups_layout))).to(gl.int64)
    group = gl.arange(0, G, layout=gl.SliceLayout(0, groups_layout))[None, :] + (k_start // 32)
    sc_row = sc_ptr + rows_n[:, None] * stride_sn
    mn_row = mn_ptr + rows_n[:, None] * stride_sn
    ss_row = ss_ptr + rows_n[:, None] * stride_ssn

    acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP)

    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
    x_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, BLOCK_N, BLOCK_K // 8], q_desc.layout)
    w_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_K], w_layout)
    ready = _ready_barriers(NUM_STAGES)

    for s in gl.static_range(NUM_STAGES - 1):
        if s < K_TILES:
            _issue_tile(x_desc, q_desc, x_smem, q_smem, ready, s, row_m, row_n, k_start, BLOCK_K, NUM_STAGES)
    # Scales of steps 0, 1, 2 (a step past the end reads its last step again: valid memory, unused).
    sc0, mn0, d0, dmin0 = _load_scales(sc_row, mn_row, ss_row, group)
    sc1, mn1, d1, dmin1 = _load_scales(sc_row, mn_row, ss_row, group + gl.minimum(1, K_TILES - 1) * G)
    sc2, mn2, d2, dmin2 = _load_scales(sc_row, mn_row, ss_row, group + gl.minimum(2, K_TILES - 1) * G)
    for i in range(K_TILES):
        stage = i % NUM_STAGES
        mbarrier.wait(ready.index(stage), (i // NUM_STAGES) & 1)
        qw = gl.reshape(q_smem.index(stage).load(flat_layout), [BLOCK_N, G, 4])
        qw = gl.convert_layout(qw, words_layout)
        w_buf = w_smem.index(i % 2)
        w_buf.store(_dequant_words(qw, sc0, mn0, d0, dmin0, BLOCK_N, BLOCK_K, dtype))
        fence_async_shared()
        gl.thread_barrier()
        sc0, mn0, d0, dmin0 = sc1, mn1, d1, dmin1
        sc1, mn1, d1, dmin1 = sc2, mn2, d2, dmin2
        sc2, mn2, d2, dmin2 = _load_scales(sc_row, mn_row, ss_row, group + gl.minimum(i + 3, K_TILES - 1) * G)
        x_buf = x_smem.index(stage)
        # Step i - 1's wgmma is done: its stage (x and codes, read into registers before the
        # barrier above) takes tile i - 1 + NUM_STAGES.
        acc = _mma_step(w_buf, x_buf, acc, SWAP)
        nxt = i - 1 + NUM_STAGES
        if nxt < K_TILES:
            _issue_tile(x_desc, q_desc, x_smem, q_smem, ready, nxt, row_m, row_n, k_start, BLOCK_K, NUM_STAGES)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(s))

    _store_acc(acc, out_ptr, row_m, row_n, pid_k, M, stride_om, stride_ok, BLOCK_M, BLOCK_N, SWAP)


def run_gluon(x, w, cfg: dict, part, out):
    """Launch :func:`gluon_q4k_kernel` (``cfg["CODES_TMA"]``: :func:`gluon_q4k_tma_kernel`) for
    ``x @ dequant(w)^T`` into ``out`` (float32) through ``part``."""
    import torch
    import triton
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m, k = x.shape
    n = w.shape[0]
    split = cfg["SPLIT_K"]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16))
    grid = (n // bn, split, triton.cdiv(m, bm))
    sizes = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_TILES=k // bk // split, NUM_STAGES=cfg["num_stages"])
    if cfg.get("CODES_TMA"):
        words = w.qs.view(torch.int32)
        q_layout = gl.NVMMASharedLayout.get_default_for([bn, bk // 8], gl.int32)
        q_desc = TensorDescriptor.from_tensor(words, [bn, bk // 8], q_layout)
        gluon_q4k_tma_kernel[grid](
            x_desc, q_desc, w.scales, w.mins, w.super_scales, part, m, n,
            w.scales.stride(0), w.super_scales.stride(0), part.stride(1), part.stride(0),
            **sizes, SWAP=cfg["SWAP"], num_warps=cfg["num_warps"],
        )  # fmt: skip
    else:
        gluon_q4k_kernel[grid](
            x_desc, w.qs, w.scales, w.mins, w.super_scales, part, m, n,
            w.qs.stride(0), w.scales.stride(0), w.super_scales.stride(0), part.stride(1), part.stride(0),
            **sizes, SWAP=cfg["SWAP"], num_warps=cfg["num_warps"],
        )  # fmt: skip
    torch.sum(part, dim=0, out=out)
    return out
