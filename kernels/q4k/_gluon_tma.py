"""The tma path of ``q4k_fp8_gemm``: the Q4_K GEMM's K loop written in Gluon for SM90.

Triton's pipeliner, on the portable kernel, copies the code words asynchronously but leaves about
eleven CTA barriers a K step and a wait for each wgmma before the next tile is dequantized
(docs/perf/HISTORY.md has the sm_90 build). Here the schedule is explicit:

- x tiles and the weight's code words come by TMA through one ring of ``NUM_STAGES`` shared
  buffers with ready barriers (mbarriers, no CTA barrier), issued ``NUM_STAGES - 1`` steps ahead;
- the scales, mins and super-block ``d``/``dmin`` come by TMA as well, 1024 codes' worth at a time
  into two shared-memory slots (``SCALES_TMA``, where each K split is whole chunks), each step
  reading its own; otherwise each 32-code group's are loaded into registers three steps ahead.
  Loads in flight hold up every step's fence (see the kernel's docstring);
- the dequantized tile (``d*sc*q - dmin*m`` in x's dtype) goes to one of two shared buffers,
  and one wgmma is left in flight (``warpgroup_mma_wait(1)``): step ``i``'s tile is written while
  step ``i - 1``'s wgmma runs. One CTA barrier a step remains, between the tile's stores and the
  wgmma that reads it (two with two warpgroups, see below);
- the tile is dequantized in float32, each weight exact before its one rounding (the portable
  kernel's weights), or with ``PACKED_DEQUANT`` in x's 16-bit dtype, two codes an instruction
  (:func:`_dequant_words_packed`): about half the instructions a weight, which the K loop's time
  follows, for weights whose scale and min were rounded to that dtype first;
- with ``SWAP`` the product is computed transposed (``W x^T``): the weight rows fill wgmma's
  64-row M side and the few rows of x its N side, which may be as small as 16 and as large as 256
  (each weight tile dequantized once for 256 rows of x). Two warpgroups over a 64-row weight tile
  share out the rows of x instead (up to 512: each tile dequantized once for all of them, the
  x tile copied as two TMA boxes);
- a K split writes float32 partials; with ``FUSED_REDUCE`` the last split of each output tile to
  finish (arrival counters) sums them, where otherwise a reduce launch follows.

Gluon does not run on the interpreter, and wgmma exists on SM90 only: :func:`.kernel.serve`
routes this path there alone.
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

from tritune.search_spaces.q4k_fp8_gemm import TMA_SCALE_CHUNK_K, tma_word_lanes, tma_x_warpgroups

#: Warpgroups along x and lanes a code group (the space's rules, as the kernel's constexprs).
x_warpgroups = gluon.constexpr_function(tma_x_warpgroups)
word_lanes = gluon.constexpr_function(tma_word_lanes)


@gluon.jit
def _word_codes(t):
    """Four codes of the low 16 bits of ``t | 0x4F000000`` as exact floats (bits 0-3, ..., 12-15):
    each masked code lands in a float's mantissa, and one subtraction removes the exponent."""
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


#: :func:`_dequant_words_packed`'s PTX per x dtype (``MAGIC``, ``TYPE``). Each 32-bit register
#: takes two neighbouring codes, one a 16-bit half: a byte permute puts byte ``p`` of the word
#: (codes ``2p``, ``2p + 1``) in the low half and byte ``p`` of the word shifted by a nibble in the
#: high half, and one ``lop3`` keeps each half's low nibble under an exponent that makes the
#: nibble the value's low mantissa bits (``0x4300`` is 128.0 in bfloat16, ``0x6400`` 1024.0 in
#: float16): ``magic | code`` is exactly ``magic + code``. One subtraction leaves the codes and one
#: fused multiply-add scales them, rounding once.
_PACKED_ASM_TEMPLATE = """
{
.reg .b32 v, t0, t1, t2, t3, m;
mov.b32 m, MAGIC;
shr.u32 v, $8, 4;
prmt.b32 t0, $8, v, 0x0400;
prmt.b32 t1, $8, v, 0x0501;
prmt.b32 t2, $8, v, 0x0602;
prmt.b32 t3, $8, v, 0x0703;
lop3.b32 t0, t0, 0x000F000F, m, 0xEA;
lop3.b32 t1, t1, 0x000F000F, m, 0xEA;
lop3.b32 t2, t2, 0x000F000F, m, 0xEA;
lop3.b32 t3, t3, 0x000F000F, m, 0xEA;
sub.rn.TYPE t0, t0, m;
sub.rn.TYPE t1, t1, m;
sub.rn.TYPE t2, t2, m;
sub.rn.TYPE t3, t3, m;
fma.rn.TYPE t0, t0, $9, $10;
fma.rn.TYPE t1, t1, $9, $10;
fma.rn.TYPE t2, t2, $9, $10;
fma.rn.TYPE t3, t3, $9, $10;
mov.b32 {$0, $1}, t0;
mov.b32 {$2, $3}, t1;
mov.b32 {$4, $5}, t2;
mov.b32 {$6, $7}, t3;
}
"""
_PACKED_ASM_BF16 = gl.constexpr(_PACKED_ASM_TEMPLATE.replace("MAGIC", "0x43004300").replace("TYPE", "bf16x2"))
_PACKED_ASM_F16 = gl.constexpr(_PACKED_ASM_TEMPLATE.replace("MAGIC", "0x64006400").replace("TYPE", "f16x2"))


@gluon.jit
def _pair(v, dtype: gl.constexpr):
    """float32 ``v`` rounded to ``dtype`` (16 bits), twice in one int32: a packed operand."""
    bits = v.to(dtype).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return bits | (bits << 16)


@gluon.jit
def _dequant_words_packed(qw, sc, mn, d, dmin, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, dtype: gl.constexpr):
    """:func:`_dequant_words` in ``dtype`` arithmetic, two codes an instruction: the scale
    ``d*sc`` and the min ``dmin*mn`` rounded to ``dtype``, each weight rounded once by a fused
    multiply-add (:func:`~.reference.packed_dequantized` computes the same weights). In bfloat16
    that is about 45 dB against the exact product where exact weights give 52: the scale's
    rounding moves every weight of its group alike."""
    scale = _pair(d * _small(sc), dtype)[:, :, None]
    offset = _pair(-(dmin * _small(mn)), dtype)[:, :, None]
    if dtype == gl.bfloat16:
        w0, w1, w2, w3, w4, w5, w6, w7 = gl.inline_asm_elementwise(
            _PACKED_ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [qw, scale, offset],
            dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16,
                   gl.bfloat16),
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        w0, w1, w2, w3, w4, w5, w6, w7 = gl.inline_asm_elementwise(
            _PACKED_ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [qw, scale, offset],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16),
            is_pure=True, pack=1,
        )  # fmt: skip
    # Element 8w + j of the row is code j of word w: j = 4*j2 + 2*j1 + j0, joined most significant first.
    even = gl.join(gl.join(w0, w4), gl.join(w2, w6))
    odd = gl.join(gl.join(w1, w5), gl.join(w3, w7))
    return gl.reshape(gl.join(even, odd), [BLOCK_N, BLOCK_K])


@gluon.jit
def _load_scales(sc_row, mn_row, ss_row, group):
    """Per 32-code group ``[BLOCK_N, G]``: its 6-bit scale and min, and its super-block's ``d``, ``dmin``."""
    block = group // 8  # 256 codes a super-block
    d = gl.load(ss_row + block * 2).to(gl.float32)
    dmin = gl.load(ss_row + block * 2 + 1).to(gl.float32)
    return gl.load(sc_row + group), gl.load(mn_row + group), d, dmin


@gluon.jit
def _issue_step(x_desc, q_desc, x_smem, q_smem, ready, step, row_m, row_n, k_start, BLOCK_K: gl.constexpr):
    """TMA copies of K step ``step``'s x tile and code words into ring stage ``step % NUM_STAGES``."""
    stage = step % x_smem.shape[0]
    bar = ready.index(stage)
    # A TMA box spans at most 256 rows: a wider x tile comes in several boxes.
    BOX_M: gl.constexpr = x_desc.block_type.shape[0]
    BOXES: gl.constexpr = x_smem.shape[1] // BOX_M
    mbarrier.expect(bar, BOXES * x_desc.block_type.nbytes + q_desc.block_type.nbytes)
    k = k_start + step * BLOCK_K
    x_buf = x_smem.index(stage)
    for box in gl.static_range(BOXES):
        tma.async_copy_global_to_shared(x_desc, [row_m + box * BOX_M, k], bar, x_buf.slice(box * BOX_M, BOX_M))
    # The codes are int32 words, eight a word: K column k is word column k / 8.
    tma.async_copy_global_to_shared(q_desc, [row_n, k // 8], bar, q_smem.index(stage))


@gluon.jit
def _zero_acc(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SWAP: gl.constexpr):
    """The float32 accumulator in wgmma's layout: ``[BLOCK_M, BLOCK_N]``, or ``[BLOCK_N, BLOCK_M]`` with ``SWAP``.

    Swapped, the warpgroups share out the weight rows 64 each; where the weight tile has fewer
    rows than that, they share out the rows of x instead (:func:`x_warpgroups`), each warpgroup
    multiplying the same dequantized tile by its own part of x."""
    warps: gl.constexpr = gl.num_warps()
    if SWAP:
        split: gl.constexpr = x_warpgroups(BLOCK_N, warps)
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps // split, split], instr_shape=[16, BLOCK_M // split, 16]
        )
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=layout)
    else:
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=layout)
    return acc


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
def _tile_ptrs(
    layout: gl.constexpr, base, row_m, row_n, M, stride_m, stride_n,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SWAP: gl.constexpr,
):  # fmt: skip
    """Pointers into an ``[M, N]`` matrix at ``base`` for the accumulator's elements (``layout``,
    transposed with ``SWAP``), the mask of rows below ``M``, and the N offsets (for the bias)."""
    if SWAP:
        offs_n = row_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        offs_m = row_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
        ptrs = base + offs_m[None, :].to(gl.int64) * stride_m + offs_n[:, None] * stride_n
        mask = (offs_m < M)[None, :]
    else:
        offs_m = row_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_n = row_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        ptrs = base + offs_m[:, None].to(gl.int64) * stride_m + offs_n[None, :] * stride_n
        mask = (offs_m < M)[:, None]
    return ptrs, mask, offs_n


@gluon.jit
def _store_out(
    acc, bias_ptr, out_ptr, row_m, row_n, M, stride_om, stride_on, stride_bn,
    HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SWAP: gl.constexpr,
):  # fmt: skip
    """Store float32 ``acc`` (plus the bias, if any) to ``out``'s rows below ``M``, in out's dtype."""
    layout: gl.constexpr = acc.type.layout
    ptrs, mask, offs_n = _tile_ptrs(layout, out_ptr, row_m, row_n, M, stride_om, stride_on, BLOCK_M, BLOCK_N, SWAP)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + offs_n * stride_bn).to(gl.float32)
        acc = acc + bias[:, None] if SWAP else acc + bias[None, :]
    gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _epilogue(
    acc, bias_ptr, out_ptr, part_ptr, counters_ptr, row_m, row_n, pid_k, M,
    stride_om, stride_on, stride_pk, stride_pm, stride_bn,
    HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SWAP: gl.constexpr,
    SPLIT_K: gl.constexpr, FUSED_REDUCE: gl.constexpr,
):  # fmt: skip
    """Without a split: ``out`` (plus the bias). With one: this split's float32 partial into
    ``part`` ``[SPLIT_K, M, N]``; with ``FUSED_REDUCE`` the tile's last split to finish then sums
    the partials in split order (so the result does not depend on which finishes last) into
    ``out``, where otherwise a reduce launch follows."""
    if SPLIT_K == 1:
        _store_out(acc, bias_ptr, out_ptr, row_m, row_n, M, stride_om, stride_on, stride_bn, HAS_BIAS, BLOCK_M,
                   BLOCK_N, SWAP)  # fmt: skip
    else:
        layout: gl.constexpr = acc.type.layout
        part, mask, _ = _tile_ptrs(layout, part_ptr, row_m, row_n, M, stride_pm, 1, BLOCK_M, BLOCK_N, SWAP)
        gl.store(part + pid_k * stride_pk, acc, mask=mask)
        if FUSED_REDUCE:
            # Publish, then count (as the GEMV's fused reduce): the CTA barrier orders every
            # thread's stores before the one atomic, whose release at gpu scope makes them
            # visible GPU-wide before the count moves.
            gl.thread_barrier()
            counter = counters_ptr + gl.program_id(2) * gl.num_programs(0) + gl.program_id(0)
            arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                _sum_partials(
                    part_ptr, bias_ptr, out_ptr, row_m, row_n, M, stride_om, stride_on, stride_pk, stride_pm,
                    stride_bn, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K,
                )  # fmt: skip
                # Every split has counted: the next launch (or graph replay) finds the counter at 0.
                gl.store(counter, 0)


@gluon.jit
def _sum_partials(
    part_ptr, bias_ptr, out_ptr, row_m, row_n, M, stride_om, stride_on, stride_pk, stride_pm, stride_bn,
    HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT_K: gl.constexpr,
):  # fmt: skip
    """The last split's sum of the tile's float32 partials, in split order, into ``out`` (plus the
    bias). A few rows at a time in a plain layout of four consecutive N values a thread: the
    accumulator's registers are free at this point, and its layout's pointers over the whole tile would
    not fit beside them. Every earlier split's release is acquired; reads go to L2 (``.cg``),
    where the partials were written, never to a stale L1 line."""
    warps: gl.constexpr = gl.num_warps()
    lanes_n: gl.constexpr = BLOCK_N // 4 if BLOCK_N // 4 < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // lanes_n, lanes_n], [warps, 1], [1, 0])
    ROWS: gl.constexpr = (32 // lanes_n) * warps
    # Whole passes only: a pass past the tile would sum and store the next M tile's rows.
    gl.static_assert(BLOCK_M % ROWS == 0, "the M tile must hold whole passes of the reduce layout")
    offs_n = row_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    if HAS_BIAS:
        bias = gl.load(bias_ptr + offs_n * stride_bn).to(gl.float32)
    for first in range(0, BLOCK_M, ROWS):
        offs_m = row_m + first + rows
        mask = (offs_m < M)[:, None]
        part = part_ptr + offs_m[:, None].to(gl.int64) * stride_pm + offs_n[None, :]
        total = gl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        for split in gl.static_range(1, SPLIT_K):
            total += gl.load(part + split * stride_pk, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total = total + bias[None, :]
        ptrs = out_ptr + offs_m[:, None].to(gl.int64) * stride_om + offs_n[None, :] * stride_on
        gl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


#: K a chunk of scales covers when they come by TMA (``SCALES_TMA``): the narrowest boxes the TMA
#: copies are 16 bytes of a row, and 1024 codes have 32 sub-block scales (bytes) and 4 super-blocks'
#: ``(d, dmin)`` (16 bytes of float16). The space's constant, as the kernel's.
SCALE_CHUNK_K = gl.constexpr(TMA_SCALE_CHUNK_K)


@gluon.jit
def _issue_scales(sc_desc, mn_desc, ss_desc, sc_smem, mn_smem, ss_smem, bars, chunk, row_n, k_start):
    """TMA copies of scale chunk ``chunk`` (K from ``k_start + chunk * SCALE_CHUNK_K``) into slot
    ``chunk % 2``, whose barrier is the one after the ring's in ``bars``."""
    slot = chunk % 2
    bar = bars.index(bars.shape[0] - 2 + slot)
    mbarrier.expect(bar, sc_desc.block_type.nbytes + mn_desc.block_type.nbytes + ss_desc.block_type.nbytes)
    k = k_start + chunk * SCALE_CHUNK_K
    tma.async_copy_global_to_shared(sc_desc, [row_n, k // 32], bar, sc_smem.index(slot))
    tma.async_copy_global_to_shared(mn_desc, [row_n, k // 32], bar, mn_smem.index(slot))
    # (d, dmin) of each 256-code super-block, two float16 a super-block: column k / 128.
    tma.async_copy_global_to_shared(ss_desc, [row_n, k // 128], bar, ss_smem.index(slot))


@gluon.jit
def _chunk_scales(sc_smem, mn_smem, ss_smem, slot, j: gl.constexpr, layout: gl.constexpr, BLOCK_K: gl.constexpr):
    """Step ``j`` of a scale chunk's slot: ``[BLOCK_N, G]`` scales and mins, ``[BLOCK_N, 1]`` d and dmin."""
    G: gl.constexpr = BLOCK_K // 32
    block: gl.constexpr = j * BLOCK_K // 256
    sc = sc_smem.index(slot).slice(j * G, G, dim=1).load(layout)
    mn = mn_smem.index(slot).slice(j * G, G, dim=1).load(layout)
    d = ss_smem.index(slot).slice(2 * block, 1, dim=1).load(layout).to(gl.float32)
    dmin = ss_smem.index(slot).slice(2 * block + 1, 1, dim=1).load(layout).to(gl.float32)
    return sc, mn, d, dmin


@gluon.jit
def _dequant_step(
    i, q_smem, w_smem, ready, sc, mn, d, dmin, flat_layout: gl.constexpr, words_layout: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, PACKED_DEQUANT: gl.constexpr, dtype: gl.constexpr,
):  # fmt: skip
    """Wait for step ``i``'s stage, dequantize its code words into weight buffer ``i % 2``, and
    make the tile visible to wgmma (the stores fenced, then a CTA barrier); the buffer."""
    NUM_STAGES: gl.constexpr = q_smem.shape[0]
    G: gl.constexpr = BLOCK_K // 32
    stage = i % NUM_STAGES
    mbarrier.wait(ready.index(stage), (i // NUM_STAGES) & 1)
    qw = gl.reshape(q_smem.index(stage).load(flat_layout), [BLOCK_N, G, 4])
    qw = gl.convert_layout(qw, words_layout)
    # Step i - 2's wgmma read this buffer; the wait of step i - 1 saw it done.
    w_buf = w_smem.index(i % 2)
    if PACKED_DEQUANT:
        w_buf.store(_dequant_words_packed(qw, sc, mn, d, dmin, BLOCK_N, BLOCK_K, dtype))
    else:
        w_buf.store(_dequant_words(qw, sc, mn, d, dmin, BLOCK_N, BLOCK_K, dtype))
    fence_async_shared()
    gl.thread_barrier()
    return w_buf


@gluon.jit
def _mma_and_refill(
    i, w_buf, acc, x_desc, q_desc, x_smem, q_smem, ready, row_m, row_n, k_start,
    BLOCK_K: gl.constexpr, K_TILES: gl.constexpr, SWAP: gl.constexpr,
):  # fmt: skip
    """Step ``i``'s wgmma (step ``i - 1``'s then done), and the TMA copies of step ``i - 1 + NUM_STAGES``
    into the stage step ``i - 1`` left."""
    NUM_STAGES: gl.constexpr = x_smem.shape[0]
    acc = _mma_step(w_buf, x_smem.index(i % NUM_STAGES), acc, SWAP)
    if gl.num_warps() > 4:
        # Two warpgroups: each waited for its own wgmma of step i - 1 only, and the other's may
        # still read the stage (and the weight buffer) that are written next.
        gl.thread_barrier()
    # Step i - 1's wgmma is done and its code words were read before the barrier above: its
    # stage takes step i - 1 + NUM_STAGES.
    nxt = i - 1 + NUM_STAGES
    if nxt < K_TILES:
        _issue_step(x_desc, q_desc, x_smem, q_smem, ready, nxt, row_m, row_n, k_start, BLOCK_K)
    return acc


@gluon.jit
def _q4k_gemm_tma_kernel(
    x_desc, q_desc, sc_desc, mn_desc, ss_desc, sc_ptr, mn_ptr, ss_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr,
    M, stride_sn, stride_ssn, stride_om, stride_on, stride_pk, stride_pm, stride_bn,
    HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    K_TILES: gl.constexpr, NUM_STAGES: gl.constexpr, SWAP: gl.constexpr, SPLIT_K: gl.constexpr,
    FUSED_REDUCE: gl.constexpr, PACKED_DEQUANT: gl.constexpr, SCALES_TMA: gl.constexpr,
):  # fmt: skip
    """``out = x @ dequant(W)^T (+ bias)``, one (N tile, K split, M tile) a program, the program ids
    in that order; a split's partial goes to ``part[pid_k]`` (see :func:`_epilogue`). N is a
    multiple of ``BLOCK_N`` and each split ``K_TILES`` steps of ``BLOCK_K`` (the launch's checks);
    rows of x past ``M`` read as zeros (the TMA's padding) and are not stored.

    With ``SCALES_TMA`` (each split's K a multiple of :data:`SCALE_CHUNK_K`, the scale tensors'
    rows 16-byte aligned: the launch's checks) the scales come by TMA too, a chunk of
    ``SCALE_CHUNK_K`` codes at a time into two slots, and each step reads them from shared memory.
    Loaded into registers instead, each step's fence waits for the loads still in flight (it
    orders every earlier memory access), and under the x tiles' traffic a scale load outlasts a step.
    The K loop then runs a chunk's steps unrolled, so each reads its scales at a fixed offset."""
    warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = x_desc.dtype
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    k_start = pid_k * (K_TILES * BLOCK_K)
    row_m = pid_m * BLOCK_M
    row_n = pid_n * BLOCK_N

    # Code words as [BLOCK_N, G, 4]: a thread holds one 32-code group's four words (or its share), the groups of
    # a row over neighbouring lanes, rows over the other lanes and the warps.
    G: gl.constexpr = BLOCK_K // 32
    # A tile with fewer groups than threads shares each group's words out over WORD_LANES lanes.
    WORD_LANES: gl.constexpr = word_lanes(BLOCK_N, BLOCK_K, warps)
    lanes_g: gl.constexpr = G if G < 32 // WORD_LANES else 32 // WORD_LANES
    words_layout: gl.constexpr = gl.BlockedLayout(
        [1, G // lanes_g, 4 // WORD_LANES], [32 // (lanes_g * WORD_LANES), lanes_g, WORD_LANES], [warps, 1, 1],
        [2, 1, 0],
    )
    # The same words as the [BLOCK_N, BLOCK_K / 8] tile the TMA wrote, a group's words of a thread consecutive.
    flat_layout: gl.constexpr = gl.BlockedLayout(
        [1, 4 // WORD_LANES * (G // lanes_g)], [32 // (lanes_g * WORD_LANES), lanes_g * WORD_LANES], [warps, 1],
        [1, 0],
    )
    groups_layout: gl.constexpr = gl.SliceLayout(2, words_layout)

    acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP)

    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
    x_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, BLOCK_N, BLOCK_K // 8], q_desc.layout)
    w_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_K], w_layout)
    if SCALES_TMA:
        CHUNK_STEPS: gl.constexpr = SCALE_CHUNK_K // BLOCK_K
        CHUNKS: gl.constexpr = K_TILES // CHUNK_STEPS
        sc_smem = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, SCALE_CHUNK_K // 32], sc_desc.layout)
        mn_smem = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, SCALE_CHUNK_K // 32], mn_desc.layout)
        ss_smem = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, SCALE_CHUNK_K // 128], ss_desc.layout)
    # One array of barriers: the ring's, then the scale slots' (no padding between two arrays).
    BARRIERS: gl.constexpr = NUM_STAGES + 2 if SCALES_TMA else NUM_STAGES
    ready = gl.allocate_shared_memory(gl.int64, [BARRIERS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(BARRIERS):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()

    for s in gl.static_range(NUM_STAGES - 1):
        if s < K_TILES:
            _issue_step(x_desc, q_desc, x_smem, q_smem, ready, s, row_m, row_n, k_start, BLOCK_K)
    if SCALES_TMA:
        for c in gl.static_range(2):
            if c < CHUNKS:
                _issue_scales(sc_desc, mn_desc, ss_desc, sc_smem, mn_smem, ss_smem, ready, c, row_n, k_start)
        for c in range(CHUNKS):
            slot = c % 2
            mbarrier.wait(ready.index(NUM_STAGES + slot), (c // 2) & 1)
            for j in gl.static_range(CHUNK_STEPS):
                i = c * CHUNK_STEPS + j
                sc, mn, d, dmin = _chunk_scales(sc_smem, mn_smem, ss_smem, slot, j, groups_layout, BLOCK_K)
                w_buf = _dequant_step(
                    i, q_smem, w_smem, ready, sc, mn, d, dmin, flat_layout, words_layout, BLOCK_N, BLOCK_K,
                    PACKED_DEQUANT, dtype,
                )  # fmt: skip
                # A compile-time test (the chunk's last step), then a run-time one: kept apart.
                if j == CHUNK_STEPS - 1:  # noqa: SIM102
                    # Every thread read this chunk's last scales before the barrier just passed.
                    if c + 2 < CHUNKS:
                        _issue_scales(
                            sc_desc, mn_desc, ss_desc, sc_smem, mn_smem, ss_smem, ready, c + 2, row_n, k_start
                        )  # fmt: skip
                acc = _mma_and_refill(
                    i, w_buf, acc, x_desc, q_desc, x_smem, q_smem, ready, row_m, row_n, k_start, BLOCK_K, K_TILES,
                    SWAP,
                )  # fmt: skip
    else:
        rows_n = (row_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, groups_layout))).to(gl.int64)
        group = gl.arange(0, G, layout=gl.SliceLayout(0, groups_layout))[None, :] + (k_start // 32)
        sc_row = sc_ptr + rows_n[:, None] * stride_sn
        mn_row = mn_ptr + rows_n[:, None] * stride_sn
        ss_row = ss_ptr + rows_n[:, None] * stride_ssn
        # Scales of steps 0, 1, 2 (a step past the end reads the last step again: valid memory, unused).
        sc0, mn0, d0, dmin0 = _load_scales(sc_row, mn_row, ss_row, group)
        sc1, mn1, d1, dmin1 = _load_scales(sc_row, mn_row, ss_row, group + gl.minimum(1, K_TILES - 1) * G)
        sc2, mn2, d2, dmin2 = _load_scales(sc_row, mn_row, ss_row, group + gl.minimum(2, K_TILES - 1) * G)
        for i in range(K_TILES):
            w_buf = _dequant_step(
                i, q_smem, w_smem, ready, sc0, mn0, d0, dmin0, flat_layout, words_layout, BLOCK_N, BLOCK_K,
                PACKED_DEQUANT, dtype,
            )  # fmt: skip
            sc0, mn0, d0, dmin0 = sc1, mn1, d1, dmin1
            sc1, mn1, d1, dmin1 = sc2, mn2, d2, dmin2
            sc2, mn2, d2, dmin2 = _load_scales(
                sc_row, mn_row, ss_row, group + gl.minimum(i + 3, K_TILES - 1) * G
            )  # fmt: skip
            acc = _mma_and_refill(
                i, w_buf, acc, x_desc, q_desc, x_smem, q_smem, ready, row_m, row_n, k_start, BLOCK_K, K_TILES, SWAP
            )  # fmt: skip
    acc = warpgroup_mma_wait(0, deps=(acc,))
    for s in gl.static_range(BARRIERS):
        mbarrier.invalidate(ready.index(s))

    _epilogue(
        acc, bias_ptr, out_ptr, part_ptr, counters_ptr, row_m, row_n, pid_k, M,
        stride_om, stride_on, stride_pk, stride_pm, stride_bn,
        HAS_BIAS, BLOCK_M, BLOCK_N, SWAP, SPLIT_K, FUSED_REDUCE,
    )  # fmt: skip
