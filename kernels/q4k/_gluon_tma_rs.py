"""The tma path's K loop with the weight tile in registers: wgmma's A operand never in shared memory.

The plain kernel (:mod:`._gluon_tma`) stores each dequantized weight tile to shared memory, fences
it, passes a CTA barrier and has wgmma read it back (once per warpgroup). With the 512 x 64 tile
that is 8 KB stored and 16 KB read a step beside the 64 KB of x the TMA writes and wgmma reads:
at the tensor-core rate cuBLAS keeps, shared memory could not serve it all. Here each warpgroup
dequantizes the tile straight into wgmma's register layout for A (``DotOperandLayout``), so the
stores, their fence and the barrier leave; where two warpgroups share one weight tile (each its own
rows of x), both dequantize it.

wgmma's A layout gives a thread, for each row it holds and each 8-code word of that row, the two
neighbouring codes ``2p`` and ``2p + 1`` with ``p`` its lane modulo 4. So the code words are read
from shared memory in a layout of ``[BLOCK_N, BLOCK_K / 8, 4]`` (row, word, pair: the pair over
those two lane bits, each word read by the four lanes that share it), each lane takes its pair out
of the word with one byte permute (:data:`_PAIR_ASM_BF16`), and the two halves joined and reshaped
to ``[BLOCK_N, BLOCK_K]`` are A's layout exactly (:func:`pair_layout` builds it; the conversion is
then free). The weights are :func:`._gluon_tma._dequant_words_packed`'s, bit for bit.

With ``LOADER`` (the config's ``LOADER_WARP``) the copies come from a loader warp, as in
:mod:`._gluon_tma_loader` (whose loader this reuses); without, these warps issue them the plain
kernel's way. Always with the scales by TMA, the weights dequantized in x's 16-bit dtype
(``PACKED_DEQUANT``), swapped.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._gluon_tma import (
    SCALE_CHUNK_K,
    _chunk_scales,
    _epilogue,
    _issue_scales,
    _issue_step,
    _pair,
    _small,
    _zero_acc,
    x_warpgroups,
)
from ._gluon_tma_loader import LOADER_REGS, LOADER_WARPS, _drain, _loader, scale_slots, split_barriers


@gluon.constexpr_function
def pair_layout(block_n: int, block_k: int, warps: int, split: int, word_dims: int) -> gl.DistributedLinearLayout:
    """The layout of ``[BLOCK_N, BLOCK_K / 8, 4]`` (row, word, pair) whose two halves, joined as a
    last dimension and reshaped to ``[BLOCK_N, BLOCK_K]`` (code ``8 * word + 2 * pair + half``),
    are wgmma's A layout for the swapped accumulator (:func:`._gluon_tma._zero_acc`) of ``warps``
    warps, ``split`` warpgroups of them along the rows of x (:func:`._gluon_tma.x_warpgroups`).

    ``word_dims`` 1 gives it as written; 2 splits the word dimension into (group, word of the
    group), ``[BLOCK_N, BLOCK_K / 32, 4, 4]``, the form the per-group scales broadcast over."""
    row_warps = warps // split
    words = block_k // 8
    # wgmma's A: 16 rows a warp; a tile taller than the warps' rows holds the rest in registers.
    rows_held = 16 * row_warps

    def at(row: int, word: int, pair: int) -> list[int]:
        if word_dims == 1:
            return [row, word, pair]
        return [row, word // 4, word % 4, pair]

    # A's registers: the half (the join's, first), row + 8, the words, then rows past the warps'.
    reg = [at(8, 0, 0)] + [at(0, 1 << b, 0) for b in range(words.bit_length() - 1)]
    reg += [at(rows_held << b, 0, 0) for b in range((block_n // rows_held).bit_length() - 1)]
    lanes = [at(0, 0, 1), at(0, 0, 2), at(1, 0, 0), at(2, 0, 0), at(4, 0, 0)]
    warp = [at(16 << b, 0, 0) for b in range(row_warps.bit_length() - 1)] + [at(0, 0, 0)] * (split.bit_length() - 1)
    shape = [block_n, words, 4] if word_dims == 1 else [block_n, block_k // 32, 4, 4]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lanes, warp_bases=warp, block_bases=[], shape=shape)


#: One lane's two codes of a word as a 16-bit pair, scaled: byte ``p`` of the word (codes ``2p``,
#: ``2p + 1``) and of the word shifted by a nibble into the two halves (the byte permute's
#: selector ``0x0400 + 0x0101 p`` is an input), then :mod:`._gluon_tma`'s packed dequantization of
#: that register: one ``lop3`` under the magic exponent, one subtraction, one fused multiply-add.
_PAIR_ASM_TEMPLATE = """
{
.reg .b32 v, t, m;
mov.b32 m, MAGIC;
shr.u32 v, $2, 4;
prmt.b32 t, $2, v, $3;
lop3.b32 t, t, 0x000F000F, m, 0xEA;
sub.rn.TYPE t, t, m;
fma.rn.TYPE t, t, $4, $5;
mov.b32 {$0, $1}, t;
}
"""
_PAIR_ASM_BF16 = gl.constexpr(_PAIR_ASM_TEMPLATE.replace("MAGIC", "0x43004300").replace("TYPE", "bf16x2"))
_PAIR_ASM_F16 = gl.constexpr(_PAIR_ASM_TEMPLATE.replace("MAGIC", "0x64006400").replace("TYPE", "f16x2"))


@gluon.jit
def _words_wide(t, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, word_layout: gl.constexpr):
    """``[BLOCK_N, BLOCK_K / 32]`` per-group values as ``[BLOCK_N, BLOCK_K / 8]``, each word its group's."""
    G: gl.constexpr = BLOCK_K // 32
    group_words = gl.full([1, 1, 4], 0, gl.int32, layout=t.type.layout.parent)
    wide, _ = gl.broadcast(gl.expand_dims(t, 2), group_words)
    return gl.convert_layout(gl.reshape(wide, [BLOCK_N, G * 4]), word_layout)


@gluon.jit
def _dequant_a(words, sel, sc, mn, d, dmin, a_layout: gl.constexpr, word_layout: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, dtype: gl.constexpr):  # fmt: skip
    """Code words ``[BLOCK_N, BLOCK_K / 8]`` (``word_layout``) and their groups' scales and mins
    ``[BLOCK_N, G]`` with the super-block ``d``/``dmin`` -> the tile ``[BLOCK_N, BLOCK_K]`` in
    ``a_layout``, the weights of :func:`._gluon_tma._dequant_words_packed`."""
    scale = _words_wide(_pair(d * _small(sc), dtype), BLOCK_N, BLOCK_K, word_layout)
    offset = _words_wide(_pair(-(dmin * _small(mn)), dtype), BLOCK_N, BLOCK_K, word_layout)
    # [BLOCK_N, BLOCK_K / 8, 1] each, broadcast over the pairs against the selector's [1, 1, 4].
    w3 = gl.expand_dims(words, 2)
    s3 = gl.expand_dims(scale, 2)
    o3 = gl.expand_dims(offset, 2)
    if dtype == gl.bfloat16:
        lo, hi = gl.inline_asm_elementwise(
            _PAIR_ASM_BF16, "=h,=h,r,r,r,r", [w3, sel, s3, o3], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True,
            pack=1,
        )  # fmt: skip
    else:
        lo, hi = gl.inline_asm_elementwise(
            _PAIR_ASM_F16, "=h,=h,r,r,r,r", [w3, sel, s3, o3], dtype=(gl.float16, gl.float16), is_pure=True, pack=1
        )  # fmt: skip
    return gl.convert_layout(gl.reshape(gl.join(lo, hi), [BLOCK_N, BLOCK_K]), a_layout)


@gluon.jit
def _consumer_rs(
    x_desc, q_desc, sc_desc, mn_desc, ss_desc, x_smem, q_smem, sc_smem, mn_smem, ss_smem,
    ready, empty, scales_ready, scales_empty, bias_ptr, out_ptr, part_ptr, counters_ptr,
    row_m, row_n, pid_k, k_start, M, stride_om, stride_on, stride_pk, stride_pm, stride_bn,
    HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    K_TILES: gl.constexpr, SPLIT_K: gl.constexpr, FUSED_REDUCE: gl.constexpr, LOADER: gl.constexpr,
):  # fmt: skip
    """Each step's tile dequantized into registers and multiplied by x from shared memory, one
    wgmma in flight; then the epilogue. With ``LOADER`` the stages and scale slots are released
    to the loader warp; without, these warps issue the copies themselves, the plain kernel's way
    (``NUM_STAGES - 1`` steps and two scale chunks ahead)."""
    warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = x_smem.dtype
    NUM_STAGES: gl.constexpr = x_smem.shape[0]
    CHUNK_STEPS: gl.constexpr = SCALE_CHUNK_K // BLOCK_K
    CHUNKS: gl.constexpr = K_TILES // CHUNK_STEPS
    split: gl.constexpr = x_warpgroups(BLOCK_N, warps)
    pairs_layout: gl.constexpr = pair_layout(BLOCK_N, BLOCK_K, warps, split, 1)
    word_layout: gl.constexpr = gl.SliceLayout(2, pairs_layout)
    # Per-group values [BLOCK_N, G], which _words_wide widens through [BLOCK_N, G, 4] (the group's words).
    scales_layout: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, pair_layout(BLOCK_N, BLOCK_K, warps, split, 2)))

    acc = _zero_acc(BLOCK_M, BLOCK_N, True)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    # Each lane's byte-permute selector: its pair p of every word (see _PAIR_ASM_TEMPLATE).
    pair = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, pairs_layout)))
    sel = gl.expand_dims(gl.expand_dims(0x0400 + 0x0101 * pair, 0), 0)
    if not LOADER:
        for s in gl.static_range(NUM_STAGES - 1):
            if s < K_TILES:
                _issue_step(x_desc, q_desc, x_smem, q_smem, ready, s, row_m, row_n, k_start, BLOCK_K)
        for s in gl.static_range(2):
            if s < CHUNKS:
                _issue_scales(sc_desc, mn_desc, ss_desc, sc_smem, mn_smem, ss_smem, scales_ready, s, row_n, k_start)
    for c in range(CHUNKS):
        slot = c % 2
        mbarrier.wait(scales_ready.index(slot), (c // 2) & 1)
        for j in gl.static_range(CHUNK_STEPS):
            i = c * CHUNK_STEPS + j
            stage = i % NUM_STAGES
            sc, mn, d, dmin = _chunk_scales(sc_smem, mn_smem, ss_smem, slot, j, scales_layout, BLOCK_K)
            mbarrier.wait(ready.index(stage), (i // NUM_STAGES) & 1)
            words = q_smem.index(stage).load(word_layout)
            a = _dequant_a(words, sel, sc, mn, d, dmin, a_layout, word_layout, BLOCK_N, BLOCK_K, dtype)
            x_buf = x_smem.index(stage)
            tok = warpgroup_mma(a, x_buf.permute((1, 0)), acc, is_async=True)
            acc, _, _ = warpgroup_mma_wait(1, deps=(tok, x_buf, a))
            if j == CHUNK_STEPS - 1:  # noqa: SIM102 (a compile-time test, then a run-time one)
                if c == CHUNKS - 1:
                    acc = _drain(acc)
            # Past the barrier every warp has read step i - 1's code words and this chunk's scales,
            # and every warpgroup's wgmma of step i - 1 is done: its stage may be refilled.
            gl.thread_barrier()
            if LOADER:
                if j == CHUNK_STEPS - 1:
                    mbarrier.arrive(scales_empty.index(slot))
                if i > 0:
                    mbarrier.arrive(empty.index((i - 1) % NUM_STAGES))
            else:
                if j == CHUNK_STEPS - 1:  # noqa: SIM102 (a compile-time test, then a run-time one)
                    if c + 2 < CHUNKS:
                        _issue_scales(
                            sc_desc, mn_desc, ss_desc, sc_smem, mn_smem, ss_smem, scales_ready, c + 2, row_n, k_start
                        )  # fmt: skip
                nxt = i - 1 + NUM_STAGES
                if nxt < K_TILES:
                    _issue_step(x_desc, q_desc, x_smem, q_smem, ready, nxt, row_m, row_n, k_start, BLOCK_K)
    _epilogue(
        acc, bias_ptr, out_ptr, part_ptr, counters_ptr, row_m, row_n, pid_k, M,
        stride_om, stride_on, stride_pk, stride_pm, stride_bn,
        HAS_BIAS, BLOCK_M, BLOCK_N, True, SPLIT_K, FUSED_REDUCE,
    )  # fmt: skip


@gluon.jit
def _q4k_gemm_tma_rs_kernel(
    x_desc, q_desc, sc_desc, mn_desc, ss_desc, sc_ptr, mn_ptr, ss_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr,
    M, stride_sn, stride_ssn, stride_om, stride_on, stride_pk, stride_pm, stride_bn,
    HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    K_TILES: gl.constexpr, NUM_STAGES: gl.constexpr, SWAP: gl.constexpr, SPLIT_K: gl.constexpr,
    FUSED_REDUCE: gl.constexpr, PACKED_DEQUANT: gl.constexpr, SCALES_TMA: gl.constexpr, LOADER: gl.constexpr,
):  # fmt: skip
    """:func:`._gluon_tma._q4k_gemm_tma_kernel`'s grid and arguments with the weight tile in
    registers, and with ``LOADER`` the copies from a loader warp; swapped, packed and with the
    scales by TMA only (the launch's check)."""
    gl.static_assert(SCALES_TMA and SWAP and PACKED_DEQUANT, "swapped, packed, with the scales by TMA")
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    k_start = pid_k * (K_TILES * BLOCK_K)
    row_m = pid_m * BLOCK_M
    row_n = pid_n * BLOCK_N

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, BLOCK_N, BLOCK_K // 8], q_desc.layout)
    sc_smem, mn_smem, ss_smem = scale_slots(sc_desc, mn_desc, ss_desc, BLOCK_N)
    ready, empty, scales_ready, scales_empty = split_barriers(NUM_STAGES)

    # fmt: off
    if LOADER:
        gl.warp_specialize(
            [
                (
                    _consumer_rs,
                    (
                        x_desc, q_desc, sc_desc, mn_desc, ss_desc, x_smem, q_smem, sc_smem, mn_smem, ss_smem,
                        ready, empty, scales_ready, scales_empty, bias_ptr, out_ptr, part_ptr, counters_ptr,
                        row_m, row_n, pid_k, k_start, M, stride_om, stride_on, stride_pk, stride_pm, stride_bn,
                        HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, SPLIT_K, FUSED_REDUCE, LOADER,
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
    else:
        _consumer_rs(
            x_desc, q_desc, sc_desc, mn_desc, ss_desc, x_smem, q_smem, sc_smem, mn_smem, ss_smem,
            ready, empty, scales_ready, scales_empty, bias_ptr, out_ptr, part_ptr, counters_ptr,
            row_m, row_n, pid_k, k_start, M, stride_om, stride_on, stride_pk, stride_pm, stride_bn,
            HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, SPLIT_K, FUSED_REDUCE, LOADER,
        )
    # fmt: on
