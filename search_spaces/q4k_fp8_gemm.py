"""Search space of ``q4k_fp8_gemm``: the Q4_K weight x activation GEMM, one member space per path.

Seven paths, each its own config type holding only the fields its launch reads (a
:class:`~.base.UnionSpace` on ``path``): the portable kernel, the fp8 kernels (centred, folded
``SCALE_FOLD``, and folded with swapped operands ``SWAP_AB``: the dequantized weight as wgmma's
register A operand), the staged path (the fold kernel's weights, chunk by chunk, into cuBLASLt's
fp8 GEMM), the int8 kernel (folded weights and activations as int8 with one scale per row, int8
tensor-core dots), the GEMV for decode-sized M (integer dot products on the CUDA cores) and the
dequant path for large M (the exact weights in x's dtype, chunk by chunk, into cuBLAS's GEMM)
and the tma path for SM90 (the portable path's weights through a K loop written in Gluon).

The fp8, staged and int8 paths miss ggml's Q4_K accuracy bound (NMSE <= 5e-4) on model-like
activations: they are feasible only at keys with ``fp8=True`` (the ``TRITUNE_Q4K_FP8`` opt-in);
the portable, GEMV, dequant and tma paths meet it. A field keeps
its name and choices on every path that has it, so the sampler's view (the union of the members'
fields) and stored configs mean what they meant. Within the fp8 member a field that leaves the
launch unchanged is pruned as a duplicate (``SWAP_AB`` without ``SCALE_FOLD``), ``BLOCK_M=256``
exists for the swapped kernel only, and the register and shared-memory rules are fitted to what
Triton 3.6 and ptxas make of each kernel for sm_90.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .base import SearchSpace, TargetLimits, UnionSpace, choice, smem_reason

#: Largest M bucket of the decode and short-chunk calls: the staged and dequant paths serve only
#: above it, and up to it the portable default splits K (N=4096 at BLOCK_N=64 is 64 programs,
#: fewer than a large GPU's SMs).
SMALL_M = 64
#: Largest M bucket for which splitting K may pay: up to here two or four 64-row tiles can still
#: leave most SMs idle (N=4096 in 128x128 tiles at M=128 is 32 programs for an H200's 132 SMs).
SPLIT_K_MAX_M = 256
#: Smallest M bucket a GPU call's key takes the fp8 opt-in at: below it the 8-bit paths gain little
#: over the GEMV and split-K tiles, so a call there keeps the accurate key (and its winner) even
#: with ``TRITUNE_Q4K_FP8=1``, and ``tune`` makes no opt-in key there.
OPT_IN_MIN_M = 64
#: Most K values one int8 split may sum exactly in int32: each product is at most 127 * 127.
INT8_MAX_K = (2**31 - 1) // (127 * 127)
#: Registers per thread the folded fp8 kernel may spend on its accumulator plus half its float32
#: weight tile (ptxas keeps about half of that tile live). Fitted to ptxas for sm_90 with Triton 3.6
#: over 51 tiles: above it, 4-warp tiles with BLOCK_K=256 spill; at or below it, none spills more
#: than a few bytes.
FOLD_MAX_REGISTERS = 224
#: Registers per thread the swapped folded kernel (``SWAP_AB``) may spend on its accumulator plus
#: three quarters of its float32 weight tile: it keeps more of that tile live, since each e4m3
#: chunk stays in registers until its wgmma completes. Fitted to ptxas for sm_90 with Triton 3.6
#: over 258 builds (BLOCK_M 16..256, BLOCK_N 64..256, BLOCK_K 32..256, 4 and 8 warps, 1..5
#: stages): with 2 or more stages (all the rule admits) no tile at or below it spills.
SWAP_MAX_REGISTERS = 176
#: Rows per warpgroup on wgmma's M side: in the swapped kernel that side is BLOCK_N.
WGMMA_ROWS = 64
#: wgmma's N side: at most 256, and the tma kernel takes x in tiles of 16 rows or more.
WGMMA_MAX_N = 256
WGMMA_MIN_N = 16
#: Largest M bucket the GEMV path is tried at with its lanes across weight rows. Its integer dot
#: products grow with every row of x, and each row's words are loaded at the products' full shape:
#: two or more rows spill registers and run far slower than the portable kernel.
GEMV_MAX_M = 1
#: Largest M bucket of the one-launch GEMV with its lanes along K (``K_LANES`` and ``FUSE_QUANT``):
#: each row's words are made in registers from x, its code-word loads coalesced, and up to four
#: rows build without spilling for sm_90 at the register rule below. Measured on an H100 at M=2
#: and 4 it beats the portable tiles the bundle served there; at M=8 it loses.
GEMV_K_LANES_MAX_M = 4
#: Product words a thread (rows x BLOCK_N x BLOCK_K / 8 / threads) at one row, and with
#: ``K_LANES`` at several: past these ptxas for sm_90 spills, or fills the registers so that
#: fewer than two programs fit on an SM.
GEMV_WORDS_PER_THREAD = 32
GEMV_K_LANES_WORDS_PER_THREAD = 64
#: x values a GEMV program quantizes per warp with ``FUSE_QUANT`` where one row of x has
#: ``BLOCK_K`` (4 a thread, as in the pre-pass, which makes the sums bit-identical on sm_90).
GEMV_FUSED_VALUES = 128
#: Deepest K tile of the paths that dequantize a tile against one super-block's scales.
SUPER_BLOCK = 256
#: Smallest chunk the staged path uses on a GPU: below it each chunk's GEMM is too narrow to fill
#: the GPU (4096 x 1024 tiles of 128 x 256 are 128 programs for 132 SMs).
MIN_CHUNK_N = 1024
#: Most bytes the dequant path's scratch may hold (a chunk of the weight in x's dtype): the whole
#: 14336 x 4096 Llama-3-8B MLP weight in bf16 (117 MB) fits.
DEQUANT_MAX_SCRATCH_BYTES = 128 * 2**20
#: Elements of its tile each thread of the dequant kernel makes (float32 in registers before the
#: cast): past 64 the tile's codes, scales and weights no longer fit beside each other.
DEQUANT_MAX_PER_THREAD = 64

#: Registers per thread the tma kernel may spend on its accumulator plus its weight tile (each
#: thread dequantizes ``BLOCK_N * BLOCK_K / threads`` weights a step). Fitted to ptxas for sm_90
#: with Triton 3.6 over 49 tiles (every BLOCK_M, BLOCK_N, BLOCK_K and warp count the other rules
#: admit, both orientations): none at or below it spills; the 128x128x128 tile at 4 warps (256)
#: spills, and every tile above it takes all 255 registers. The 256-row tiles (wgmma's widest N)
#: take all 255 under the estimate too, and spill in their epilogue only: up to 288 bytes a thread
#: storing the output with a bias, 1104 storing a split's float32 partials (one store a tile,
#: where the K loop is 16-64 steps). ``tests/test_q4k_tma.py`` rebuilds some.
TMA_MAX_REGISTERS = 224
#: Most accumulator values a thread may hold for the tma path's fused split-K reduce: the 256-row
#: tiles (128 a thread) already take all 255 registers, and the arrival count and the partial
#: sums on top spilled 920 bytes a thread in the sm_90 build (Triton 3.6); 128 x 128 tiles over
#: 8 warps (64) build with 158 and no spill.
TMA_FUSED_MAX_ACC = 64

#: K tiles of the paths whose tile divides a super-block (all but the GEMV).
_K_TILES = (32, 64, 128, 256)
#: The dequant path's chunks, ascending.
_DEQUANT_CHUNKS = (32, 1024, 2048, 4096, 8192, 16384)
#: The staged path's chunks: up to 32768 rows, so that the widest Llama-3-8B projection (28672
#: rows, 112 MiB of e4m3 at K=4096) can be one GEMM, whose eager call pays one ``_scaled_mm``'s
#: host time where 2048-row chunks pay fourteen.
_STAGED_CHUNKS = (32, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class PortableConfig:
    """The portable path: dequantize to x's dtype and bf16/fp16 ``tl.dot`` (any CUDA GPU).

    The defaults are the path's safe middle; the kernel's defaults by M bucket are the spec's.
    """

    path: str = choice("portable", ("portable",))
    BLOCK_M: int = choice(64, (16, 32, 64, 128))
    BLOCK_N: int = choice(64, (32, 64, 128, 256))
    #: K tile; a multiple of the 32-wide sub-block that divides the 256-wide super-block.
    BLOCK_K: int = choice(64, _K_TILES)
    GROUP_M: int = choice(8, (1, 4, 8))
    num_warps: int = choice(4, (2, 4, 8))
    num_stages: int = choice(3, (1, 2, 3, 4, 5))
    #: Programs per output tile along K (float32 partials, then a reduce); small M only.
    SPLIT_K: int = choice(1, (1, 2, 4, 8))


@dataclass(frozen=True)
class Fp8Config:
    """The fp8 path (SM89+): e4m3 activations against exact 4-bit quants, or folded e4m3 weights."""

    path: str = choice("fp8", ("fp8",))
    #: 256 only with SWAP_AB, where it is wgmma's widest N (m64n256).
    BLOCK_M: int = choice(64, (16, 32, 64, 128, 256))
    BLOCK_N: int = choice(64, (32, 64, 128, 256))
    BLOCK_K: int = choice(128, _K_TILES)
    GROUP_M: int = choice(8, (1, 4, 8))
    num_warps: int = choice(4, (2, 4, 8))
    num_stages: int = choice(3, (1, 2, 3, 4, 5))
    SPLIT_K: int = choice(1, (1, 2, 4, 8))
    #: False: one 32-deep dot per sub-block against the exact codes ``q - 8``, scaled into the
    #: accumulator by the sub-block's scale. True: each sub-block's scale and min are folded into
    #: e4m3 weights ``(d*sc*q - dmin*m) * 2**e`` (one power of two per column), so one dot spans the
    #: whole K tile and accumulates in place; the rounded weights cost about 2.5 dB of SQNR (28.5 dB
    #: instead of 31 on Gaussian data).
    SCALE_FOLD: bool = choice(False, (False, True))
    #: With SCALE_FOLD only. True: each program computes a tile of ``out^T``,
    #: ``acc_t[BLOCK_N, BLOCK_M] += w[BLOCK_N, BLOCK_K] @ x^T``, so the weight made in registers is
    #: the MMA's A operand, which Hopper's wgmma reads from registers (no staging through shared
    #: memory, no wait before each MMA: dequantization overlaps the tensor cores), and x^T (K-major,
    #: as e4m3 wgmma needs its B operand) comes from shared memory through the pipelined loads.
    #: BLOCK_N becomes the MMA's M side (64 rows per warpgroup) and BLOCK_M its N side, so small M
    #: gets wgmma too. The same e4m3 weights and scales as SCALE_FOLD, so the same SQNR.
    SWAP_AB: bool = choice(False, (False, True))


@dataclass(frozen=True)
class StagedConfig:
    """The staged path (SM90+, bf16, large M): the folded e4m3 weights made ``CHUNK_N`` rows at a
    time into one reused scratch, each chunk multiplied by cuBLASLt's fp8 GEMM with row and column
    scales. BLOCK_N x BLOCK_K is one dequantization program's tile and ``num_warps`` its warps."""

    path: str = choice("staged", ("staged",))
    BLOCK_N: int = choice(32, (32, 64, 128, 256))
    BLOCK_K: int = choice(256, _K_TILES)
    num_warps: int = choice(4, (2, 4, 8))
    #: Weight rows dequantized per chunk (the scratch holds CHUNK_N x K e4m3 bytes: 8 MiB at
    #: 2048 x 4096); at or above N the whole weight at once (one GEMM), the smallest such choice
    #: only. Small chunks (below ``MIN_CHUNK_N``) are for the interpreter.
    CHUNK_N: int = choice(2048, _STAGED_CHUNKS)
    #: cuBLASLt's fast fp8 accumulation (``use_fast_accum``), checked by the SQNR gate.
    FAST_ACCUM: bool = choice(False, (False, True))


@dataclass(frozen=True)
class DequantConfig:
    """The dequant path (any CUDA GPU, large M): ``CHUNK_N`` weight rows at a time dequantized
    exactly and rounded to x's dtype into one reused scratch, each chunk multiplied by cuBLAS's
    GEMM into its columns of ``out``; the weights the portable kernel multiplies, so its accuracy.
    BLOCK_N x BLOCK_K is one dequantization program's tile and ``num_warps`` its warps."""

    path: str = choice("dequant", ("dequant",))
    BLOCK_N: int = choice(32, (32, 64, 128, 256))
    BLOCK_K: int = choice(256, _K_TILES)
    num_warps: int = choice(4, (2, 4, 8))
    #: Weight rows dequantized per chunk; at or above N the whole weight at once (one GEMM), the
    #: smallest such choice only. 16384 (the dequant path's alone) holds a 14336-row weight whole.
    #: Small chunks (below ``MIN_CHUNK_N``) are for the interpreter.
    CHUNK_N: int = choice(16384, _DEQUANT_CHUNKS)


@dataclass(frozen=True)
class Int8Config:
    """The int8 path (SM80+ int8 tensor cores; wgmma on SM90): the folded weights ``d*sc*q - dmin*m``
    (the fold kernel's values, before its e4m3 rounding) as int8 with one scale per weight row,
    against x as int8 with one scale per row; ``tl.dot`` accumulates int32 over the whole K loop
    and both scales apply once after it. 37-39 dB on Gaussian activations, but one scale per row
    of x leaves few levels to the other values of a row with outlier channels or heavy tails
    (28.5 and 32.8 dB): below ggml's Q4_K bound on model-like activations, so part of the fp8
    opt-in (see :mod:`tritune.kernels.q4k._triton_int8`)."""

    path: str = choice("int8", ("int8",))
    #: 256 only with SWAP_AB, where it is wgmma's widest N (m64n256).
    BLOCK_M: int = choice(64, (16, 32, 64, 128, 256))
    BLOCK_N: int = choice(128, (32, 64, 128, 256))
    BLOCK_K: int = choice(64, _K_TILES)
    GROUP_M: int = choice(8, (1, 4, 8))
    num_warps: int = choice(4, (2, 4, 8))
    num_stages: int = choice(3, (1, 2, 3, 4, 5))
    SPLIT_K: int = choice(1, (1, 2, 4, 8))
    #: As the folded fp8 kernel's: tiles of ``out^T``, the register-made int8 weight as wgmma's A
    #: operand (from registers), x^T (K-major, as int8 wgmma needs its B operand) from shared memory.
    SWAP_AB: bool = choice(False, (False, True))


@dataclass(frozen=True)
class GemvConfig:
    """The GEMV path: decode-sized M (one row; up to ``GEMV_K_LANES_MAX_M`` as one launch with
    ``K_LANES``) on the CUDA cores, int8 x (one scale per 32 values) against the exact codes with
    ``dp4a``, no MMA (any CUDA GPU).

    Its loads are issued one iteration ahead by the kernel itself (no dot: Triton's pipeliner
    leaves them alone), so it has no ``num_stages``. With ``FUSE_QUANT`` and ``FUSED_REDUCE`` a
    call is one launch, where otherwise it is two or three (each costs tens of microseconds of
    host time in an eager decode step); the results are bit-identical either way.
    """

    path: str = choice("gemv", ("gemv",))
    BLOCK_N: int = choice(64, (32, 64, 128, 256))
    #: 512 and 1024 too: a deeper tile keeps more bytes in flight per SM.
    BLOCK_K: int = choice(64, (*_K_TILES, 512, 1024))
    num_warps: int = choice(4, (2, 4, 8))
    SPLIT_K: int = choice(1, (1, 2, 4, 8))
    #: The GEMV kernel quantizes the x values of its K range itself (every program, each
    #: iteration), instead of a pre-pass launch writing them for it.
    FUSE_QUANT: bool = choice(False, (False, True))
    #: With ``SPLIT_K > 1``: the last program of each output tile to finish sums the tile's
    #: partials (arrival counters), instead of a reduce launch.
    FUSED_REDUCE: bool = choice(False, (False, True))
    #: True: a warp's lanes run along K, each reading 16 consecutive bytes of codes of one weight
    #: row (a warp reads whole rows' K tiles) and each super-block's (d, dmin) as one word; False:
    #: they run across BLOCK_N rows, 16 bytes of each, and gather d and dmin per sub-block. True
    #: runs the one-launch kernel (with the pre-pass and the reduce where the other fields ask).
    K_LANES: bool = choice(False, (False, True))


@dataclass(frozen=True)
class TmaConfig:
    """The tma path (SM90 only): the portable path's exact weights and bf16/fp16 wgmma, its K loop
    written in Gluon (:mod:`tritune.kernels.q4k._gluon_tma`): x tiles and code words by TMA through
    a ring of ``num_stages`` buffers, the scales by TMA in chunks (or loaded three steps ahead), the dequantized tile
    double-buffered in shared memory with one wgmma in flight. Accurate, so it serves without the
    opt-in; for small and mid M, where the portable loop waits on its loads and barriers."""

    path: str = choice("tma", ("tma",))
    BLOCK_M: int = choice(64, (16, 32, 64, 128, 256, 512))
    BLOCK_N: int = choice(64, (64, 128))
    BLOCK_K: int = choice(128, (64, 128, 256))
    num_warps: int = choice(4, (4, 8))
    num_stages: int = choice(3, (2, 3, 4))
    SPLIT_K: int = choice(1, (1, 2, 4, 8))
    #: True: each program computes a tile of ``out^T`` (``W x^T``), the weight rows on wgmma's
    #: 64-row M side and the rows of x on its N side, which may be as narrow as 16; False: ``x W^T``,
    #: which needs 64 rows of x per warpgroup.
    SWAP_AB: bool = choice(True, (False, True))
    #: With ``SPLIT_K > 1``: the last split of each output tile to finish sums the float32
    #: partials (arrival counters) instead of a reduce launch after the GEMM.
    FUSED_REDUCE: bool = choice(False, (False, True))
    #: True: dequantize in x's 16-bit dtype, two codes an instruction, the scale and min rounded
    #: to it and each weight rounded once (about 45 dB against the exact product in bfloat16, 63
    #: in float16); False: in float32, each weight exact before its one rounding (52 dB, 70 dB).
    PACKED_DEQUANT: bool = choice(False, (False, True))
    #: True: one warp of its own (``warp_specialize``, few registers) issues every TMA copy, the
    #: others only wait for stages and release them; their steps then pass two or three CTA
    #: barriers instead of six. Needs the scales by TMA (:func:`tma_scales_by_tma`).
    LOADER_WARP: bool = choice(False, (False, True))
    #: True: each warpgroup dequantizes the weight tile straight into wgmma's A registers: no
    #: weight tile in shared memory, no store, fence or barrier for it. Swapped, packed
    #: (``SWAP_AB``, ``PACKED_DEQUANT``) and with the scales by TMA only; the same weights bit for bit.
    W_REGISTERS: bool = choice(False, (False, True))


#: A config of any path.
Q4KConfig = PortableConfig | Fp8Config | StagedConfig | GemvConfig | Int8Config | DequantConfig | TmaConfig


class Q4KShape(Protocol):
    """The key fields feasibility looks at (the key type lives with the kernel)."""

    @property
    def arch(self) -> str: ...

    @property
    def m_bucket(self) -> int: ...

    @property
    def n(self) -> int: ...

    @property
    def k(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def fp8(self) -> bool: ...


#: Why the fp8, staged and int8 paths cannot serve a key without the opt-in.
FP8_OPT_IN_REASON = (
    "the fp8, staged and int8 paths miss ggml's Q4_K accuracy bound (NMSE <= 5e-4) on model-like "
    "activations; they serve only with TRITUNE_Q4K_FP8=1 (keys with fp8=True)"
)


def smem_bytes(config: PortableConfig | Fp8Config | Int8Config) -> int:
    """Shared memory a launch is expected to need: pipelined loads plus the staged dot operand.

    The int8 kernel loads and stages what the folded fp8 kernel does (one byte per x and per
    weight element, the same packed codes and scales), so it shares that kernel's estimates.
    """
    bm, bn, bk = config.BLOCK_M, config.BLOCK_N, config.BLOCK_K
    stages = config.num_stages
    folded = isinstance(config, Int8Config) or (isinstance(config, Fp8Config) and config.SCALE_FOLD)
    if folded and not isinstance(config, PortableConfig) and config.SWAP_AB:
        # As Triton 3.6 lays it out for wgmma on sm_90 (never under, at most 6 KiB over on the
        # admitted tiles compiled): x's e4m3 tile in every stage, the packed quants, codes and
        # (d, dmin) in all but one. The weight never passes through shared memory.
        return stages * bm * bk + (stages - 1) * (bn * bk // 2 + 2 * bn * (bk // 32) + 4 * bn)
    if folded:
        # As Triton 3.6 lays it out for wgmma on sm_90 (exact or 2 KiB over on the tiles compiled;
        # mma.sync tiles below 64 rows need less): x's e4m3 tile in every stage, the packed quants
        # and codes in all but one, and the folded e4m3 weight tile staged once.
        return stages * bm * bk + (stages - 1) * (bn * bk // 2 + 2 * bn * (bk // 32)) + bn * bk
    if isinstance(config, Fp8Config):
        # Per 32-wide slice: e4m3 x, packed quants and one byte of scale per column.
        per_stage = bk * (bm + bn // 2) + 3 * bn * (bk // 32)
        staged = bn * 32
    else:
        per_stage = bk * (2 * bm + bn // 2) + 2 * bn * (bk // 32) + 4 * bn * max(bk // 256, 1)
        staged = 2 * bn * bk
    return max(stages - 1, 1) * per_stage + staged


def _split_and_rows_reason(config: PortableConfig | Fp8Config | Int8Config | TmaConfig, key: Q4KShape) -> str | None:
    """Split-K only for small M and in whole K tiles; an x tile no taller than the key's M bucket."""
    if config.SPLIT_K > 1 and key.m_bucket > SPLIT_K_MAX_M:
        return f"SPLIT_K={config.SPLIT_K} only for M <= {SPLIT_K_MAX_M} (m_bucket={key.m_bucket})"
    if (key.k // config.BLOCK_K) % config.SPLIT_K:
        return f"SPLIT_K={config.SPLIT_K} does not divide the {key.k // config.BLOCK_K} BLOCK_K={config.BLOCK_K} tiles"
    if max(key.m_bucket, 16) < config.BLOCK_M:
        return f"BLOCK_M={config.BLOCK_M} exceeds m_bucket={key.m_bucket}"
    return None


def _mma_tile_reason(
    config: PortableConfig | Fp8Config | Int8Config, key: Q4KShape, limits: TargetLimits
) -> str | None:
    """The rules the MMA paths share: split-K and tiles against the key, the accumulator's
    registers, and (on a GPU) threads the tile leaves idle; on the interpreter, small blocks."""
    reason = _split_and_rows_reason(config, key)
    if reason is not None:
        return reason
    if config.GROUP_M > 1 and key.m_bucket <= config.BLOCK_M:
        return "GROUP_M > 1 is the same launch as GROUP_M=1 when one M tile covers every row"
    acc_regs = config.BLOCK_M * config.BLOCK_N // (32 * config.num_warps)
    if acc_regs > 128:
        return f"the {config.BLOCK_M}x{config.BLOCK_N} accumulator needs {acc_regs} registers per thread"
    if limits.interpreter:
        if config.BLOCK_M > 32 or config.BLOCK_N > 64 or config.BLOCK_K > 128:
            return "the interpreter only runs small blocks (BLOCK_M <= 32, BLOCK_N <= 64, BLOCK_K <= 128)"
        return None
    if config.num_warps * 32 * 4 > config.BLOCK_M * config.BLOCK_N:
        return f"{config.num_warps} warps for a {config.BLOCK_M}x{config.BLOCK_N} tile leave threads idle"
    return None


def portable_feasibility(config: PortableConfig, key: Q4KShape, limits: TargetLimits) -> str | None:
    """Why a portable ``config`` cannot (or should not) run for ``key``; ``None`` if it may."""
    reason = _mma_tile_reason(config, key, limits)
    if reason is not None or limits.interpreter:
        return reason
    return smem_reason(smem_bytes(config), limits)


def fp8_feasibility(config: Fp8Config, key: Q4KShape, limits: TargetLimits) -> str | None:
    """Why an fp8 ``config`` cannot (or should not) run for ``key``; ``None`` if it may."""
    if not key.fp8:
        return FP8_OPT_IN_REASON
    if config.SWAP_AB and not config.SCALE_FOLD:
        return "SWAP_AB only changes the folded fp8 path (the same launch as SWAP_AB=False)"
    if config.BLOCK_M == 256 and not config.SWAP_AB:
        return "BLOCK_M=256 only for the swapped kernel (SWAP_AB), where it is wgmma's N side"
    return _folded_reason(config, key, limits, folded=config.SCALE_FOLD)


def int8_feasibility(config: Int8Config, key: Q4KShape, limits: TargetLimits) -> str | None:
    """Why an int8 ``config`` cannot (or should not) run for ``key``; ``None`` if it may.

    The kernel is the folded fp8 kernel's loop with int8 operands and an int32 accumulator (the
    same bytes per operand, the same registers per accumulator element): the folded kernel's
    register and shared-memory rules apply (``tests/test_sm90_build.py`` builds its starting
    tiles for sm_90).
    """
    if not key.fp8:
        return FP8_OPT_IN_REASON
    if key.k // config.SPLIT_K > INT8_MAX_K:
        return f"int32 sums of {key.k // config.SPLIT_K} int8 products per split can overflow (at most {INT8_MAX_K})"
    if config.BLOCK_M == 256 and not config.SWAP_AB:
        return "BLOCK_M=256 only for the swapped kernel (SWAP_AB), where it is wgmma's N side"
    return _folded_reason(config, key, limits, folded=True)


def _folded_reason(config: Fp8Config | Int8Config, key: Q4KShape, limits: TargetLimits, *, folded: bool) -> str | None:
    """The tile rules of the kernels that dequantize a float32 weight tile and round it to 8 bits."""
    reason = _mma_tile_reason(config, key, limits)
    if reason is not None or limits.interpreter:
        return reason
    # Each warpgroup (4 warps) of the swapped kernel takes WGMMA_ROWS weight rows as wgmma's M side;
    # with fewer, Triton falls back to mma.sync (2 warps) or two warpgroups dequantize the same
    # rows (8 warps, BLOCK_N=64).
    warpgroups = config.num_warps // 4
    if config.SWAP_AB and (warpgroups == 0 or WGMMA_ROWS * warpgroups > config.BLOCK_N):
        return (
            f"the swapped kernel needs {WGMMA_ROWS} weight rows (BLOCK_N) per warpgroup: "
            f"BLOCK_N={config.BLOCK_N} with {config.num_warps} warps"
        )
    if config.SWAP_AB and config.num_stages == 1:
        # One buffer for x: each wgmma must finish before the next tile's load overwrites it.
        return "the swapped kernel overlaps its wgmma with the next tile only with num_stages >= 2"
    if config.SWAP_AB and config.BLOCK_K < 64:
        # Triton 3.6 dequantizes a 32-wide tile in a layout of its own, then passes it through
        # shared memory and waits for each wgmma: what swapping the operands is meant to avoid.
        return "the swapped kernel keeps its weight tile in registers only with BLOCK_K >= 64"
    if folded:
        # The float32 weight tile is dequantized next to the accumulator before its 8-bit cast.
        live_k = 3 * config.BLOCK_K // 4 if config.SWAP_AB else config.BLOCK_K // 2
        regs = (config.BLOCK_M + live_k) * config.BLOCK_N // (32 * config.num_warps)
        limit = SWAP_MAX_REGISTERS if config.SWAP_AB else FOLD_MAX_REGISTERS
        if regs > limit:
            return (
                f"the {config.BLOCK_M}x{config.BLOCK_N} accumulator and the {config.BLOCK_N}x{config.BLOCK_K} "
                f"float32 weight tile spill ({regs} registers per thread by the estimate, > {limit})"
            )
    return smem_reason(smem_bytes(config), limits)


def staged_feasibility(config: StagedConfig, key: Q4KShape, limits: TargetLimits) -> str | None:
    """Why a staged ``config`` cannot (or should not) run for ``key``; ``None`` if it may.

    Small M is left to the in-loop kernels: writing and re-reading every weight costs more than
    dequantizing it once per M tile when there are few M tiles.
    """
    if not key.fp8:
        return FP8_OPT_IN_REASON
    if key.dtype != "bfloat16":
        return f"the staged path's GEMM writes bfloat16 only (row-wise scaled fp8), not {key.dtype}"
    chunk, whole = config.CHUNK_N, next((c for c in _STAGED_CHUNKS if c >= key.n), None)
    if whole is not None and chunk > whole:
        return f"CHUNK_N={chunk} is the same launch as CHUNK_N={whole} (the whole N={key.n} rows at once)"
    if chunk < key.n < 2 * chunk:
        return f"CHUNK_N={chunk} would stage half or more of the N={key.n} weight rows, but not all, at once"
    if min(chunk, key.n) * key.k > DEQUANT_MAX_SCRATCH_BYTES:
        return (
            f"CHUNK_N={chunk} at K={key.k} needs a {min(chunk, key.n) * key.k / 2**20:.0f} MiB scratch "
            f"(at most {DEQUANT_MAX_SCRATCH_BYTES // 2**20} MiB)"
        )
    if key.n % 16 or key.k % 16:
        return "cuBLASLt's fp8 GEMM needs N and K multiples of 16"
    if limits.interpreter:
        # The CPU tune tries the path at its tiny keys, whatever their M.
        if config.BLOCK_N > 64 or config.BLOCK_K > 128:
            return "the interpreter only runs small blocks (BLOCK_N <= 64, BLOCK_K <= 128)"
        return None
    if key.m_bucket <= SMALL_M:
        return f"the staged path is for M > {SMALL_M} (m_bucket={key.m_bucket})"
    if config.CHUNK_N < MIN_CHUNK_N:
        return f"CHUNK_N={config.CHUNK_N} is below {MIN_CHUNK_N}, too narrow a GEMM for a GPU"
    if config.BLOCK_K < 64:
        return "the staged dequantization writes 64 or more bytes of each row per program (BLOCK_K >= 64)"
    if config.num_warps * 32 * 4 > config.BLOCK_N * config.BLOCK_K:
        return f"{config.num_warps} warps for a {config.BLOCK_N}x{config.BLOCK_K} tile leave threads idle"
    return None


def dequant_feasibility(config: DequantConfig, key: Q4KShape, limits: TargetLimits) -> str | None:
    """Why a dequant ``config`` cannot (or should not) run for ``key``; ``None`` if it may.

    Accurate, so feasible with the opt-in and without it. Small M is left to the in-loop kernels
    on a GPU: at Llama-3-8B's MLP shape the dense bf16 weight written and read back is 235 MB
    (about 50 us at an H200's 4.8 TB/s), where the portable and GEMV paths read the 34 MB Q4_K
    weight once.
    """
    chunk, whole = config.CHUNK_N, next((c for c in _DEQUANT_CHUNKS if c >= key.n), None)
    if whole is not None and chunk > whole:
        return f"CHUNK_N={chunk} is the same launch as CHUNK_N={whole} (the whole N={key.n} rows at once)"
    if limits.interpreter:
        # The CPU tune tries the path at its tiny keys, whatever their M.
        if config.BLOCK_N > 64 or config.BLOCK_K > 128:
            return "the interpreter only runs small blocks (BLOCK_N <= 64, BLOCK_K <= 128)"
        return None
    if key.m_bucket <= SMALL_M:
        return f"the dequant path is for M > {SMALL_M} (m_bucket={key.m_bucket})"
    if chunk < MIN_CHUNK_N:
        return f"CHUNK_N={chunk} is below {MIN_CHUNK_N}, too narrow a GEMM for a GPU"
    scratch = min(chunk, key.n) * key.k * 2
    if scratch > DEQUANT_MAX_SCRATCH_BYTES:
        return (
            f"CHUNK_N={chunk} at K={key.k} needs a {scratch / 2**20:.0f} MiB scratch "
            f"(at most {DEQUANT_MAX_SCRATCH_BYTES // 2**20} MiB)"
        )
    threads, tile = 32 * config.num_warps, config.BLOCK_N * config.BLOCK_K
    if threads * 8 > tile:
        return f"{config.num_warps} warps for a {config.BLOCK_N}x{config.BLOCK_K} tile leave threads without 8 weights"
    if tile > DEQUANT_MAX_PER_THREAD * threads:
        return (
            f"a {config.BLOCK_N}x{config.BLOCK_K} tile is more than {DEQUANT_MAX_PER_THREAD} weights for each of "
            f"{threads} threads"
        )
    return None


def gemv_feasibility(config: GemvConfig, key: Q4KShape, limits: TargetLimits) -> str | None:
    """Why a GEMV ``config`` cannot (or should not) run for ``key``; ``None`` if it may.

    Each program multiplies a ``[BLOCK_N, BLOCK_K]`` weight tile with all of x's rows (up to 8);
    its K tile, warps and split are what vary.
    """
    if key.k % config.BLOCK_K or (key.k // config.BLOCK_K) % config.SPLIT_K:
        return f"SPLIT_K={config.SPLIT_K} does not divide K={key.k} into BLOCK_K={config.BLOCK_K} tiles evenly"
    if config.FUSED_REDUCE and config.SPLIT_K == 1:
        return "FUSED_REDUCE only changes a launch with SPLIT_K > 1 (the same launch as FUSED_REDUCE=False)"
    if limits.interpreter:
        if config.BLOCK_N > 64 or config.BLOCK_K > 128:
            return "the interpreter only runs small blocks (BLOCK_N <= 64, BLOCK_K <= 128)"
        return None
    several_rows = config.K_LANES and config.FUSE_QUANT
    max_m = GEMV_K_LANES_MAX_M if several_rows else GEMV_MAX_M
    if key.m_bucket > max_m:
        if key.m_bucket <= GEMV_K_LANES_MAX_M:
            return f"the GEMV path is for M <= {GEMV_MAX_M} (m_bucket={key.m_bucket}) without K_LANES and FUSE_QUANT"
        return f"the GEMV path is for M <= {GEMV_K_LANES_MAX_M} (m_bucket={key.m_bucket})"
    if config.FUSE_QUANT and config.BLOCK_K // config.num_warps > GEMV_FUSED_VALUES:
        # Deeper, each thread would hold more values of a sub-block than the pre-pass's threads do,
        # and the float sums of a sub-block would be added in another order (other last bits).
        return (
            f"FUSE_QUANT quantizes BLOCK_K={config.BLOCK_K} x values at 4 a thread only with "
            f"BLOCK_K <= {GEMV_FUSED_VALUES} * num_warps (num_warps={config.num_warps})"
        )
    words = config.BLOCK_N * config.BLOCK_K // 8  # 32-bit words of codes per tile
    if words < 4 * 32 * config.num_warps:
        return f"{config.num_warps} warps for {words} words of codes leave threads without a sub-block"
    # Each product word of every row stays live with its code and x words.
    rows = min(key.m_bucket, max_m)
    per_thread = rows * words // (32 * config.num_warps)
    limit = GEMV_K_LANES_WORDS_PER_THREAD if rows > 1 else GEMV_WORDS_PER_THREAD
    if per_thread > limit:
        return f"{per_thread} product words a thread (rows x BLOCK_N x BLOCK_K / 8 / threads) exceed {limit}"
    return None


#: K of one chunk of scales the tma kernel copies by TMA: 32 scale bytes and 16 bytes of super-block
#: scales a weight row, the narrowest boxes that make whole 16-byte rows.
TMA_SCALE_CHUNK_K = 1024


def tma_scales_by_tma(config: TmaConfig, k: int) -> bool:
    """Whether the tma kernel copies the scales by TMA at this K: each split's K whole chunks of
    :data:`TMA_SCALE_CHUNK_K` (the launch also needs the scale tensors' rows 16-byte aligned,
    which K then makes them)."""
    return (k // config.SPLIT_K) % TMA_SCALE_CHUNK_K == 0


#: Shared memory Triton 3.6 adds to a kernel with a ``warp_specialize`` loader warp, beside its
#: buffers and barriers: the worker partitions' state word and what the partitions exchange (the
#: sm_90 builds of every loader-warp tile tested measure the same 228 bytes).
TMA_LOADER_STATE_BYTES = 228


def _barrier_array_bytes(count: int) -> int:
    """An array of ``count`` mbarriers (8 bytes each), as the allocator places it (16-byte multiples)."""
    return -(-8 * count // 16) * 16


def tma_smem_bytes(config: TmaConfig, scale_chunks: bool = False) -> int:
    """Shared memory of a tma launch: per ring stage an x tile (2 bytes an element) and its code
    words (half a byte a weight), the two dequantized weight buffers (none with ``W_REGISTERS``),
    and a barrier per stage; with ``scale_chunks`` (:func:`tma_scales_by_tma`) two slots of a
    scale chunk with a barrier each.

    The kernels of ``LOADER_WARP`` and ``W_REGISTERS`` (with the scales by TMA) keep four barrier
    arrays, the stages' and the slots' filled and emptied, and with the loader warp
    :data:`TMA_LOADER_STATE_BYTES` more; the plain kernel one array of all its barriers."""
    bm, bn, bk, stages = config.BLOCK_M, config.BLOCK_N, config.BLOCK_K, config.num_stages
    total = stages * (2 * bm * bk + bn * bk // 2)
    slot_bytes = 2 * bn * (2 * TMA_SCALE_CHUNK_K // 32 + 2 * TMA_SCALE_CHUNK_K // 128)
    if scale_chunks and (config.LOADER_WARP or config.W_REGISTERS):
        total += slot_bytes + 2 * _barrier_array_bytes(stages) + 2 * _barrier_array_bytes(2)
        if not config.W_REGISTERS:
            total += 2 * 2 * bn * bk
        if config.LOADER_WARP:
            total += TMA_LOADER_STATE_BYTES
        return total
    total += 2 * 2 * bn * bk + 8 * stages
    if scale_chunks:
        total += slot_bytes + 8 * 2
    return total


def tma_x_warpgroups(block_n: int, num_warps: int) -> int:
    """Warpgroups of the swapped tma kernel along the rows of x: each warpgroup takes 64 weight
    rows (wgmma's M side) and those the weight tile leaves over share out x instead, each
    multiplying the same dequantized tile by its own rows of x."""
    return max(1, num_warps // 4 // (block_n // WGMMA_ROWS))


def tma_word_lanes(block_n: int, block_k: int, num_warps: int) -> int:
    """Lanes of the tma kernel sharing one 32-code group's four code words as it dequantizes: one
    while the weight tile has a group for every thread, else as many as leave no thread idle (at
    most four, a word each)."""
    groups = block_n * block_k // 32
    threads = 32 * num_warps
    return 1 if groups >= threads else min(4, threads // groups)


def _tma_k_loop_reason(config: TmaConfig, key: Q4KShape) -> str | None:
    """Why the loader warp or the weight tile in registers cannot run at ``key``; ``None`` if they may."""
    if not (config.LOADER_WARP or config.W_REGISTERS):
        return None
    field = "W_REGISTERS" if config.W_REGISTERS else "LOADER_WARP"
    if not tma_scales_by_tma(config, key.k):
        return (
            f"{field} needs the scales by TMA: K={key.k} over SPLIT_K={config.SPLIT_K} is not whole "
            f"chunks of {TMA_SCALE_CHUNK_K}"
        )
    if config.W_REGISTERS and not (config.SWAP_AB and config.PACKED_DEQUANT):
        return "W_REGISTERS needs SWAP_AB and PACKED_DEQUANT (wgmma's A is the weight tile, in x's dtype)"
    return None


def tma_feasibility(config: TmaConfig, key: Q4KShape, limits: TargetLimits) -> str | None:
    """Why a tma ``config`` cannot (or should not) run for ``key``; ``None`` if it may.

    The register rule is fitted to what ptxas makes of the kernel for sm_90 with Triton 3.6 (see
    :data:`TMA_MAX_REGISTERS`); the shared memory is :func:`tma_smem_bytes`.
    """
    if limits.interpreter:
        return "the tma path is Gluon for sm_90a: the interpreter cannot run it"
    if key.arch != "sm90":
        return f"the tma path needs SM90 (wgmma, TMA), not {key.arch}"
    if key.n % config.BLOCK_N:
        return f"BLOCK_N={config.BLOCK_N} does not divide N={key.n} (the tma path stores whole weight tiles)"
    reason = _split_and_rows_reason(config, key)
    if reason is not None:
        return reason
    if config.BLOCK_M >= 256 and not config.SWAP_AB:
        return f"BLOCK_M={config.BLOCK_M} only for the swapped kernel (SWAP_AB), where it is wgmma's N side"
    if config.FUSED_REDUCE and config.SPLIT_K == 1:
        return "FUSED_REDUCE only changes a launch with SPLIT_K > 1 (the same launch as FUSED_REDUCE=False)"
    if config.FUSED_REDUCE and config.BLOCK_M * config.BLOCK_N // (32 * config.num_warps) > TMA_FUSED_MAX_ACC:
        return (
            f"FUSED_REDUCE with a {config.BLOCK_M}x{config.BLOCK_N} accumulator over {config.num_warps} warps "
            f"(more than {TMA_FUSED_MAX_ACC} values a thread) spills"
        )
    warpgroups = config.num_warps // 4
    if config.SWAP_AB:
        x_rows = config.BLOCK_M // tma_x_warpgroups(config.BLOCK_N, config.num_warps)
        if x_rows > WGMMA_MAX_N:
            return (
                f"BLOCK_M={config.BLOCK_M} over {config.num_warps} warps gives a warpgroup {x_rows} rows of x "
                f"(wgmma's N side, at most {WGMMA_MAX_N})"
            )
        if x_rows < WGMMA_MIN_N:
            return (
                f"BLOCK_M={config.BLOCK_M} over {config.num_warps} warps gives a warpgroup {x_rows} rows of x "
                f"(fewer than {WGMMA_MIN_N})"
            )
    elif WGMMA_ROWS * warpgroups > config.BLOCK_M:
        return f"wgmma's M side (BLOCK_M={config.BLOCK_M}) needs {WGMMA_ROWS} rows for each of {warpgroups} warpgroups"
    reason = _tma_k_loop_reason(config, key)
    if reason is not None:
        return reason
    regs = (config.BLOCK_M + config.BLOCK_K) * config.BLOCK_N // (32 * config.num_warps)
    if regs > TMA_MAX_REGISTERS:
        return (
            f"the {config.BLOCK_M}x{config.BLOCK_N} accumulator and the {config.BLOCK_N}x{config.BLOCK_K} "
            f"weight tile spill ({regs} registers per thread by the estimate, > {TMA_MAX_REGISTERS})"
        )
    return smem_reason(tma_smem_bytes(config, tma_scales_by_tma(config, key.k)), limits)


SPACE: UnionSpace[Q4KShape] = UnionSpace(
    "q4k_fp8_gemm",
    "path",
    [
        SearchSpace("q4k_fp8_gemm", PortableConfig, feasibility=portable_feasibility),
        SearchSpace("q4k_fp8_gemm", Fp8Config, feasibility=fp8_feasibility),
        SearchSpace("q4k_fp8_gemm", StagedConfig, feasibility=staged_feasibility),
        SearchSpace("q4k_fp8_gemm", GemvConfig, feasibility=gemv_feasibility),
        SearchSpace("q4k_fp8_gemm", Int8Config, feasibility=int8_feasibility),
        SearchSpace("q4k_fp8_gemm", DequantConfig, feasibility=dequant_feasibility),
        SearchSpace("q4k_fp8_gemm", TmaConfig, feasibility=tma_feasibility),
    ],
)
