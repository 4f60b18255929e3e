"""Search space of the ``splitk_decode`` kernel: the split policy, the KV tile and the launch options.

The kernel has one path (any CUDA GPU). Its grid is sized from static facts and each program
decides on the device, from the runtime ``kv_len``, whether its split has work:

- ``TARGET_WAVES``: how many programs per SM the split count aims for,
  ``splits_target = max(1, sm_count * TARGET_WAVES // (batch * kv_heads * row_blocks))``. The
  large targets (8 to 32) split a large batch's long caches too, where two programs an SM would
  leave one split each: smaller splits balance the SMs' shares of unequal lengths, and at equal
  lengths free the SMs of the launch's last wave sooner;
- ``MIN_CHUNK``: the fewest keys a split is given, so short sequences are not shredded into
  splits whose merge costs more than they save;
- ``BLOCK_N``: keys per tile of the inner loop (the chunk is rounded up to a multiple of it);
- ``num_warps`` and ``num_stages``: Triton's launch options (software-pipelining depth);
- ``FUSED_MERGE``: merge the partials inside the split launch (the last split program of a row
  block to finish merges them, found through an arrival counter) instead of in a second launch.
  One launch saves the second kernel's launch gap and its own read of ``kv_len``; the merge then
  runs in one program per row block rather than one per (row, head-dim block), so which wins
  depends on the key;
- ``KV_TMA``: load the K/V tiles through host-side tensor descriptors over the caches (TMA, SM90
  or newer, power-of-two head dims: the box spans the whole head dim) instead of masked pointer
  loads, as the ``varlen_sdpa`` kernel does. A call whose caches a descriptor cannot describe
  (a base or an outer stride not 16-byte aligned) or that ``torch.compile`` traces keeps pointer
  loads, so the option never refuses a call.

The geometry helpers below are shared with the kernel wrapper so that the feasibility rule and
the launch agree on the tile shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .base import (
    HEAD_DIMS,
    SearchSpace,
    TargetLimits,
    attention_smem_bytes,
    choice,
    hopper_or_newer,
    padded_head_dim,
    pointer_attention_reason,
    smem_reason,
)

__all__ = [
    "HEAD_DIMS",
    "LARGE_BATCH_WAVES",
    "MAX_BLOCK_M",
    "SPACE",
    "DecodeConfig",
    "block_m_for",
    "duplicate_reason",
    "feasibility",
    "kv_tma_smem_bytes",
    "max_splits",
    "padded_head_dim",
    "portable_config",
    "row_blocks",
    "splits_target",
]

#: Smallest of the wave targets that split a large batch's caches (see ``TARGET_WAVES``).
LARGE_BATCH_WAVES = 8
#: Most query rows (query heads of one group x new tokens) one program packs into its M tile.
MAX_BLOCK_M = 64
#: Per-thread fp32 registers the accumulator and score tiles may take before the rule calls it a spill.
_MAX_TILE_REGISTERS = 128
#: Tiles the interpreter rule keeps, so tuning at tiny shapes stays quick.
_INTERPRETER_BLOCK_N = (16, 64)
_INTERPRETER_MIN_CHUNK = (64, 128)
_INTERPRETER_TARGET_WAVES = (2, 4)


@dataclass(frozen=True)
class DecodeConfig:
    TARGET_WAVES: int = choice(2, (1, 2, 4, 8, 16, 32))
    MIN_CHUNK: int = choice(128, (64, 128, 256, 512, 1024, 2048))
    BLOCK_N: int = choice(64, (16, 32, 64, 128))
    num_warps: int = choice(4, (2, 4, 8))
    num_stages: int = choice(3, (1, 2, 3, 4))
    FUSED_MERGE: bool = choice(False, (False, True))
    KV_TMA: bool = choice(False, (False, True))


_OPTIONS = {f.name: f.metadata["choices"] for f in dataclasses.fields(DecodeConfig)}
_DEFAULTS = dataclasses.asdict(DecodeConfig())


class _DecodeKeyFields(Protocol):
    """What the rule reads from a key (``tritune.kernels.decode.spec.DecodeKey``)."""

    arch: str
    sm_count: int
    head_dim: int
    gqa_group: int
    lq: int
    bh_bucket: int
    lkv_bucket: int


def block_m_for(rows: int) -> int:
    """Rows of the M tile for ``rows`` query rows per KV head: a power of two in [16, MAX_BLOCK_M]."""
    return min(MAX_BLOCK_M, 1 << (max(rows, 16) - 1).bit_length())


def row_blocks(rows: int) -> int:
    """Programs along M per KV head (1 unless a group packs more than ``MAX_BLOCK_M`` rows)."""
    return -(-rows // block_m_for(rows))


def splits_target(config: DecodeConfig, sm_count: int, batch_kv_heads: int, rows: int) -> int:
    """How many splits per (sequence, KV head) fill ``TARGET_WAVES`` programs per SM."""
    return max(1, sm_count * config.TARGET_WAVES // (batch_kv_heads * row_blocks(rows)))


def max_splits(config: DecodeConfig, sm_count: int, batch_kv_heads: int, rows: int, lmax: int) -> int:
    """Split programs launched per (sequence, KV head): the most any ``kv_len <= lmax`` can use.

    A program's chunk is at least ``MIN_CHUNK`` keys, so no length up to ``lmax`` needs more than
    ``cdiv(lmax, MIN_CHUNK)`` splits, nor more than the target.
    """
    return max(1, min(splits_target(config, sm_count, batch_kv_heads, rows), -(-lmax // config.MIN_CHUNK)))


def kv_tma_smem_bytes(block_m: int, block_n: int, head_dim_pad: int, num_stages: int, num_warps: int) -> int:
    """Shared memory of the split kernel with ``KV_TMA``: :func:`attention_smem_bytes` with TMA loads.

    Triton 3.6's sm_90 builds (2026-12-05) hold one more K/V tile than the pointer loads where the
    MMAs are mma.sync (16- and 32-row M tiles): BLOCK_N 128 with 4 stages at head dim 128 needs
    237,624 bytes, past an H200 block's 232,448, where the pointer loads need 204,800; and only
    barriers more where they are wgmma (64-row M tiles, 4 or 8 warps). The estimate counts a full
    K/V pair more, within one K/V tile and 1 KiB above the builds at head dims 64/128.
    """
    return attention_smem_bytes(block_m, block_n, head_dim_pad, num_warps, num_stages, kv_tma=True)


def _representative(value: int, field: str, same: Callable[[int], bool]) -> int:
    """The one value kept of ``field``'s options that act like ``value`` (the default where it is one)."""
    options = [v for v in _OPTIONS[field] if same(v)]
    default = _DEFAULTS[field]
    return default if default in options else min(options, default=value)


def duplicate_reason(config: DecodeConfig, key: _DecodeKeyFields) -> str | None:
    """Why ``config`` launches exactly what another config of the space launches at ``key``, if it does.

    Split policies collapse: wave targets that give the same split count (a large target, from
    :data:`LARGE_BATCH_WAVES`, also one whose split count only passes what ``MIN_CHUNK`` lets a
    cache of the key's length take), a ``MIN_CHUNK`` that can
    never matter (one split target) or that always means one split (not below the cache length).
    Of each such set only the default's value, or else the smallest, stays in the space.
    ``FUSED_MERGE`` is moot where no length up to the cache's can take more than one split.
    """
    rows = key.gqa_group * key.lq
    waves, chunk = config.TARGET_WAVES, config.MIN_CHUNK

    def target(w: int) -> int:
        return splits_target(dataclasses.replace(config, TARGET_WAVES=w), key.sm_count, key.bh_bucket, rows)

    now = target(waves)
    kept = _representative(waves, "TARGET_WAVES", lambda w: target(w) == now)
    if waves != kept:
        return f"TARGET_WAVES={waves} gives the same {now} split target as TARGET_WAVES={kept}"
    if waves >= LARGE_BATCH_WAVES:
        # A cache of up to lkv_bucket keys never takes more splits than chunks of MIN_CHUNK keys,
        # so targets at or past that launch alike (every split gets MIN_CHUNK keys). The large
        # targets are for splitting large batches: one that splits no more than a smaller target
        # is that target's duplicate (the small targets keep the rule above alone).
        cap = -(-key.lkv_bucket // chunk)
        same = [w for w in _OPTIONS["TARGET_WAVES"] if w < waves and min(target(w), cap) == min(now, cap)]
        if same:
            return f"TARGET_WAVES={waves} gives the same {min(now, cap)} splits as TARGET_WAVES={same[0]}"
    if now == 1 and chunk != _DEFAULTS["MIN_CHUNK"]:
        return "MIN_CHUNK is moot with a split target of 1"
    if chunk >= key.lkv_bucket:
        kept = _representative(chunk, "MIN_CHUNK", lambda c: c >= key.lkv_bucket)
        if chunk != kept:
            return f"MIN_CHUNK={chunk} means one split for any cache up to {key.lkv_bucket}, as {kept} does"
    if chunk < config.BLOCK_N:
        return "MIN_CHUNK below BLOCK_N rounds up to BLOCK_N (a duplicate of MIN_CHUNK == BLOCK_N)"
    if config.FUSED_MERGE and max_splits(config, key.sm_count, key.bh_bucket, rows, key.lkv_bucket) == 1:
        return "FUSED_MERGE is moot with one split per sequence (there is nothing to merge)"
    return None


def feasibility(config: DecodeConfig, key: _DecodeKeyFields, limits: TargetLimits) -> str | None:
    """Why ``config`` cannot (or should not) run for ``key`` on this target, or ``None``."""
    duplicate = duplicate_reason(config, key)
    if duplicate is not None:
        return duplicate
    if config.KV_TMA:
        if padded_head_dim(key.head_dim) != key.head_dim:
            return f"KV_TMA needs a power-of-two head dim, not {key.head_dim}"
        # The interpreter runs host-side descriptors on the CPU.
        if not limits.interpreter and not hopper_or_newer(key.arch):
            return f"KV_TMA needs SM90 or newer, not {key.arch}"

    if limits.interpreter:
        if (
            config.BLOCK_N not in _INTERPRETER_BLOCK_N
            or config.MIN_CHUNK not in _INTERPRETER_MIN_CHUNK
            or config.TARGET_WAVES not in _INTERPRETER_TARGET_WAVES
        ):
            return "the interpreter keeps a few small tiles and split policies (quick tuning at tiny shapes)"
        if config.num_warps != _DEFAULTS["num_warps"] or config.num_stages != _DEFAULTS["num_stages"]:
            return "num_warps and num_stages mean nothing to the interpreter"
        return None

    block_m, d = block_m_for(key.gqa_group * key.lq), padded_head_dim(key.head_dim)
    reason = pointer_attention_reason(
        block_m, config.BLOCK_N, d, config.num_warps, config.num_stages, limits, max_registers=_MAX_TILE_REGISTERS
    )
    if reason is None and config.KV_TMA:
        reason = smem_reason(kv_tma_smem_bytes(block_m, config.BLOCK_N, d, config.num_stages, config.num_warps), limits)
    return reason


#: Shared memory the portable default's base tiles fit (Volta and newer offer a block 96 KiB or more);
#: kernels/fit_default.py fits them further to a GPU that offers less (Turing, Pascal, AMD LDS).
_PORTABLE_LIMITS = TargetLimits(smem_bytes=96 * 1024)
#: The portable default, then smaller tiles for the keys (head dim 256, packed groups) where it does not fit.
#: Any-valued: the overrides go to dataclasses.replace, whose fields mix ints with the bool FUSED_MERGE.
_PORTABLE_STEPS: tuple[dict[str, Any], ...] = (
    {},
    {"BLOCK_N": 32},
    {"BLOCK_N": 32, "num_warps": 8},
    {"BLOCK_N": 16, "num_warps": 8},
    {"BLOCK_N": 16, "num_warps": 8, "num_stages": 1},
)


def portable_config(key: _DecodeKeyFields, *, interpreter: bool) -> DecodeConfig:
    """The default config for ``key``: the dataclass defaults where they fit any CUDA GPU, else smaller tiles."""
    limits = TargetLimits(interpreter=True) if interpreter else _PORTABLE_LIMITS
    config = DecodeConfig()
    for changes in _PORTABLE_STEPS:
        config = dataclasses.replace(DecodeConfig(), **changes)
        if feasibility(config, key, limits) is None:
            break
    return config


SPACE: SearchSpace[DecodeConfig, _DecodeKeyFields] = SearchSpace("splitk_decode", DecodeConfig, feasibility=feasibility)
