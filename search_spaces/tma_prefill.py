"""Search space of the ``tma_prefill`` kernel family: one member space per path.

Three paths, each its own config type holding only the fields its launch reads (a
:class:`~.base.UnionSpace` on ``path``). The portable path (plain pointer loads, any CUDA GPU)
tunes ``BLOCK_M``, ``BLOCK_N``, ``num_warps`` and ``num_stages``. The TMA path (tensor
descriptors, SM90+) tunes the same plus ``PACK_GQA`` (the query heads of one GQA group share an M
tile, so each K/V tile is read once per group) and ``SPLIT_KV`` (the KV range is split across
programs and merged by log-sum-exp). The ws path (the warp-specialized Gluon kernel, SM90 only)
tunes ``BLOCK_M`` (two consumer warpgroups of ``BLOCK_M // 2`` rows), ``BLOCK_N``, ``num_stages``
(the K/V ring's depth) and the registers ``warp_specialize`` gives each consumer
(``CONSUMER_REGS``) and the producer (``PRODUCER_REGS``); its warps are fixed by the kernel (one
consumer warpgroup, ``CONSUMER_WARPS``), so it has no ``num_warps``. A field keeps its name and
choices on every path that has it, so stored configs of one path mean what they meant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .base import (
    HEAD_DIMS,
    SearchSpace,
    TargetLimits,
    UnionSpace,
    choice,
    hopper_or_newer,
    padded_head_dim,
    register_reason,
    smem_reason,
    tile_smem_bytes,
)

__all__ = [
    "HEAD_DIMS",
    "SPACE",
    "TMA_HEAD_DIMS",
    "TUNED_QUERY_HEADS",
    "WS_HEAD_DIMS",
    "PortableConfig",
    "PrefillConfig",
    "TmaConfig",
    "WsConfig",
    "grid_programs",
    "pack_gqa_applies",
    "padded_head_dim",
    "portable_feasibility",
    "tma_feasibility",
    "ws_feasibility",
]

#: Head dims the TMA path serves (its tiles span the whole head dim, no padding).
TMA_HEAD_DIMS = (64, 128, 256)
#: Query heads of the problems the tuner times on a GPU (the occupancy rule for SPLIT_KV assumes it).
TUNED_QUERY_HEADS = 16
#: Per-thread fp32 registers the accumulator and score tiles may take before the rule calls it a spill.
_MAX_TILE_REGISTERS = 192
#: Largest tiles the interpreter rule keeps, so tuning at tiny shapes stays quick.
_INTERPRETER_MAX_BLOCK = 32
#: Head dims the ws path serves (one wgmma N extent for O; 256 would not leave the registers).
WS_HEAD_DIMS = (64, 128)
#: Registers per thread of the three warpgroups of a ws program as Triton 3.6 hands them out:
#: it starts each warp at 65536 / 12 warps / 32 threads = 168 (rounded to 8) and gives the
#: default partition (consumer 0) what the workers leave, ``3 * 168 - CONSUMER_REGS - PRODUCER_REGS``.
#: Both consumers get ``CONSUMER_REGS`` when the three add up to this.
_WS_REGISTER_SUM = 3 * 168
#: Registers a ws consumer keeps besides its tiles (addresses, row statistics, loop state): at
#: 128 x 128 tiles and head dim 128 ptxas uses 184 of 232 for tiles of 64 + 64 + 2 x 32.
_WS_CONSUMER_OVERHEAD = 32
#: Fewest producer registers at head dim 128: zeroing V's rows past kv_len (8 rows of 128 at a
#: time, one warp) spills at 24 with ptxas for sm_90 (Triton 3.6), not at 40.
_WS_PRODUCER_REGS_D128 = 40

_BLOCKS = (16, 32, 64, 128)


@dataclass(frozen=True)
class PortableConfig:
    """The portable path: pointer loads with any strides, any CUDA GPU (and the interpreter)."""

    path: str = choice("portable", ("portable",))
    BLOCK_M: int = choice(64, _BLOCKS)
    BLOCK_N: int = choice(64, _BLOCKS)
    num_warps: int = choice(4, (4, 8))
    num_stages: int = choice(2, (1, 2, 3, 4))


@dataclass(frozen=True)
class TmaConfig:
    """The TMA path (SM90+, causal): host tensor descriptors over the 4-D tensors."""

    path: str = choice("tma", ("tma",))
    BLOCK_M: int = choice(64, _BLOCKS)
    BLOCK_N: int = choice(64, _BLOCKS)
    num_warps: int = choice(4, (4, 8))
    num_stages: int = choice(2, (1, 2, 3, 4))
    #: One GQA group's query heads share the M tile (``BLOCK_M // group`` rows each).
    PACK_GQA: bool = choice(False, (False, True))
    #: Programs per M tile along the KV range, merged by log-sum-exp in a second launch.
    SPLIT_KV: int = choice(1, (1, 2, 4, 8))


@dataclass(frozen=True)
class WsConfig:
    """The ws path (SM90 only): a producer warp and two consumer warpgroups (Gluon).

    The defaults are the path's start at head dim 128 (``ws_default`` in the kernel's module).
    """

    path: str = choice("ws", ("ws",))
    BLOCK_M: int = choice(128, _BLOCKS)
    BLOCK_N: int = choice(128, _BLOCKS)
    #: Depth of the K/V ring the producer fills.
    num_stages: int = choice(2, (1, 2, 3, 4))
    #: Registers ``setmaxnreg`` gives each consumer warpgroup and the producer warp.
    CONSUMER_REGS: int = choice(232, (224, 232, 240))
    PRODUCER_REGS: int = choice(40, (24, 40, 56))


#: A config of any path.
PrefillConfig = PortableConfig | TmaConfig | WsConfig


class _PrefillKeyFields(Protocol):
    """What the rules read from a key (``tritune.kernels.prefill.spec.PrefillKey``)."""

    arch: str
    sm_count: int
    head_dim: int
    gqa_group: int
    causal: bool
    lq_bucket: int
    lkv_bucket: int


def pack_gqa_applies(config: TmaConfig, group: int) -> bool:
    """Whether packing ``group`` query heads into one M tile is possible for this config."""
    return group > 1 and group & (group - 1) == 0 and group <= config.BLOCK_M


def grid_programs(config: TmaConfig, group: int, seqlen_q: int, q_heads: int, batch: int = 1) -> int:
    """Programs of the TMA kernel before any KV split: (M tiles) x (head tiles) x batch."""
    heads_per_tile = group if config.PACK_GQA else 1
    return -(-seqlen_q // (config.BLOCK_M // heads_per_tile)) * (q_heads // heads_per_tile) * batch


def _tile_reason(
    config: PortableConfig | TmaConfig, key: _PrefillKeyFields, limits: TargetLimits, *, tma: bool
) -> str | None:
    """The tile, warp and stage rules the portable and TMA paths share (the interpreter's, else a GPU's)."""
    if limits.interpreter:
        if config.BLOCK_M > _INTERPRETER_MAX_BLOCK or config.BLOCK_N > _INTERPRETER_MAX_BLOCK:
            return f"the interpreter keeps tiles of at most {_INTERPRETER_MAX_BLOCK} (quick tuning at tiny shapes)"
        if config.num_warps != 4 or config.num_stages != 2:
            return "num_warps and num_stages mean nothing to the interpreter"
        return None

    d = padded_head_dim(key.head_dim)
    if d == 256 and config.BLOCK_N > 64:
        return "head dim 256 takes BLOCK_N <= 64"
    if config.num_warps == 8 and config.BLOCK_M < 64:
        return "8 warps need BLOCK_M >= 64"
    if tma and config.BLOCK_M < 64:
        return "the tma path wants BLOCK_M >= 64 (one warpgroup MMA per 64 rows)"
    registers = register_reason(config.BLOCK_M, config.BLOCK_N, d, config.num_warps, _MAX_TILE_REGISTERS)
    if registers is not None:
        return registers
    # Q, then K and V once per pipeline stage, plus the descriptor path's barriers: what Triton 3.6
    # allocates on SM90 for both paths (P stays in registers).
    smem = tile_smem_bytes(
        (config.BLOCK_M, d, 2),
        (2 * max(config.num_stages, 1) * config.BLOCK_N, d, 2),
        (1, 1024 if tma else 0, 1),
    )
    return smem_reason(smem, limits)


def portable_feasibility(config: PortableConfig, key: _PrefillKeyFields, limits: TargetLimits) -> str | None:
    """The portable path's rule: tiles, warps and stages that fit (small tiles on the interpreter)."""
    return _tile_reason(config, key, limits, tma=False)


def tma_feasibility(config: TmaConfig, key: _PrefillKeyFields, limits: TargetLimits) -> str | None:
    """The TMA path's rule: causal keys at its head dims on SM90+, a packing and a KV split that
    pay, then the tiles the portable path's rules admit with the descriptor path's barriers."""
    if not key.causal:
        return "the tma path serves causal attention only"
    if key.head_dim not in TMA_HEAD_DIMS:
        return f"the tma path covers head dims {TMA_HEAD_DIMS}, not {key.head_dim}"
    if not limits.interpreter and not hopper_or_newer(key.arch):
        return f"the tma path needs SM90 or newer, not {key.arch}"
    if config.PACK_GQA and not pack_gqa_applies(config, key.gqa_group):
        return f"PACK_GQA needs a power-of-two group in 2..BLOCK_M, not {key.gqa_group}"
    if config.SPLIT_KV > 1:
        if key.lkv_bucket < config.SPLIT_KV * 2 * config.BLOCK_N:
            return "SPLIT_KV leaves fewer than two KV tiles per split"
        programs = grid_programs(config, key.gqa_group, key.lq_bucket, TUNED_QUERY_HEADS)
        if not limits.interpreter and programs >= 2 * key.sm_count:
            return f"{programs} programs already fill {key.sm_count} SMs twice: no KV split needed"
    return _tile_reason(config, key, limits, tma=True)


def ws_feasibility(config: WsConfig, key: _PrefillKeyFields, limits: TargetLimits) -> str | None:
    """The ws path's rule: SM90, its head dims, its fixed partition shape, registers and shared memory.

    Fitted to what ptxas makes of the kernel for sm_90 with Triton 3.6 (2026-12-04, 18 builds
    over head dims 64/128, ``BLOCK_N`` 64/128, 2-4 stages and the three register splits): no
    config the rule keeps spills, and its shared memory is the Q tiles plus ``num_stages`` K and
    V tiles plus under 1 KB of barriers (head dim 128 at 128 x 128 tiles: 164208 bytes at two
    stages, 229808 at three, over 295000 at four).
    """
    if limits.interpreter:
        return "the ws path is Gluon for sm_90a: the interpreter cannot run it"
    if key.arch != "sm90":
        return f"the ws path needs SM90 (wgmma, setmaxnreg), not {key.arch}"
    if key.head_dim not in WS_HEAD_DIMS:
        return f"the ws path covers head dims {WS_HEAD_DIMS}, not {key.head_dim}"
    if config.BLOCK_M != 128:
        return "the ws path takes BLOCK_M = 128 (two consumer warpgroups of 64 rows)"
    if config.BLOCK_N < 64:
        return "the ws path wants BLOCK_N >= 64 (a narrower tile starves the wgmma)"
    if config.num_stages < 2:
        # With one stage the next tile's load waits for the current tile's MMAs: nothing overlaps.
        return "the ws path overlaps the next K/V tile's load with the current MMAs: num_stages >= 2"
    if 2 * config.CONSUMER_REGS + config.PRODUCER_REGS != _WS_REGISTER_SUM:
        return (
            f"2 x CONSUMER_REGS + PRODUCER_REGS must be {_WS_REGISTER_SUM} (both consumers then get "
            f"CONSUMER_REGS), not {2 * config.CONSUMER_REGS + config.PRODUCER_REGS}"
        )
    if key.head_dim > 64 and config.PRODUCER_REGS < _WS_PRODUCER_REGS_D128:
        return f"the producer spills with fewer than {_WS_PRODUCER_REGS_D128} registers at head dim {key.head_dim}"
    # Per thread of a consumer: S (fp32) and O (fp32) over 128 threads, and two P tiles (bf16, packed).
    tiles = (config.BLOCK_N + key.head_dim) // 2 + config.BLOCK_N // 2
    if tiles + _WS_CONSUMER_OVERHEAD > config.CONSUMER_REGS:
        return f"{tiles} tile registers per consumer thread leave too few of {config.CONSUMER_REGS}"
    smem = tile_smem_bytes(
        (config.BLOCK_M, key.head_dim, 2),
        (2 * config.num_stages * config.BLOCK_N, key.head_dim, 2),
        (1, 1024, 1),
    )
    return smem_reason(smem, limits)


SPACE: UnionSpace[_PrefillKeyFields] = UnionSpace(
    "tma_prefill",
    "path",
    [
        SearchSpace("tma_prefill", PortableConfig, feasibility=portable_feasibility),
        SearchSpace("tma_prefill", TmaConfig, feasibility=tma_feasibility),
        SearchSpace("tma_prefill", WsConfig, feasibility=ws_feasibility),
    ],
)
