"""Search space of the ``varlen_sdpa`` kernel: tiles, launch options and the on-device split policy.

One program computes one M tile: ``BLOCK_M`` query rows, which are the query heads of one GQA
group for ``BLOCK_M // group`` consecutive tokens of one segment, so each K/V tile is read once
per group. The grid is sized from static facts; each program reads the step's ``seq_info`` and
works out on the device which tile (and which KV split of it) is its own.

The split policy (split-K over the keys, merged by log-sum-exp):

- ``TARGET_WAVES``: the work budget is ``sm_count * TARGET_WAVES // kv_heads`` programs per KV head;
- the step's total key work ``C`` (tiles x keys each tile may see) sets the chunk
  ``max(MIN_CHUNK, cdiv(C, budget))``, so a step that already fills the GPU is not split while a
  decode-heavy step over long caches is;
- ``MAX_SPLITS``: the most splits one tile takes (1 switches split-K off);
- ``MIN_CHUNK``: the fewest keys a split is given.

Two choices shape the tiles themselves:

- ``SHORT_M``: rows of the M tile for a segment whose new tokens all fit in it (a decode token,
  a short draft block). One launch serves decode tokens and prefill chunks together, and a
  prefill-sized tile spends its MMAs on empty rows for a decode, while a decode-sized tile is far
  slower for a prefill chunk. Each program picks its tile from its own segment's ``q_len`` on the
  device. ``SHORT_M >= BLOCK_M`` is one tile for all.
- ``KV_TMA``: load K/V tiles through host-side tensor descriptors over the stores (SM90+, flat
  stores; a ring's tiles may wrap past the last row, so ring keys keep pointer loads), as the
  ``tma_prefill`` kernel does.

The geometry helpers below are shared with the launch so that feasibility and launch agree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from .base import (
    HEAD_DIMS,
    SearchSpace,
    TargetLimits,
    choice,
    hopper_or_newer,
    padded_head_dim,
    pointer_attention_reason,
)

__all__ = [
    "HEAD_DIMS",
    "SPACE",
    "VarlenConfig",
    "block_m_for",
    "duplicate_reason",
    "feasibility",
    "padded_head_dim",
    "portable_config",
    "short_block_m",
    "split_budget",
    "tokens_per_tile",
]

#: Per-thread fp32 registers the accumulator and score tiles may take before the rule calls it a spill.
_MAX_TILE_REGISTERS = 192
#: Largest tiles the interpreter keeps, so tuning at tiny shapes stays quick.
_INTERPRETER_MAX_BLOCK = 32
#: Split chunks the GPU rule keeps: shorter ones cost more to merge than they save.
_GPU_MIN_CHUNK = 128


@dataclass(frozen=True)
class VarlenConfig:
    BLOCK_M: int = choice(64, (16, 32, 64, 128))
    BLOCK_N: int = choice(64, (16, 32, 64, 128))
    num_warps: int = choice(4, (2, 4, 8))
    num_stages: int = choice(2, (1, 2, 3, 4))
    MAX_SPLITS: int = choice(16, (1, 4, 16, 64))
    MIN_CHUNK: int = choice(512, (16, 32, 64, 128, 256, 512, 1024, 2048))
    TARGET_WAVES: int = choice(2, (1, 2, 4))
    SHORT_M: int = choice(16, (16, 32, 64, 128))
    KV_TMA: bool = choice(False, (False, True))


_DEFAULTS = dataclasses.asdict(VarlenConfig())


class _VarlenKeyFields(Protocol):
    """What the rule reads from a key (``tritune.kernels.varlen.spec.VarlenKey``)."""

    arch: str
    sm_count: int
    head_dim: int
    gqa_group: int
    ring: bool
    t_bucket: int
    rows_bucket: int


def block_m_for(block_m: int, group: int) -> int:
    """Rows of the M tile: ``BLOCK_M``, raised to the power of two that holds one whole GQA group."""
    return max(block_m, 1 << (max(group, 1) - 1).bit_length())


def short_block_m(config: VarlenConfig, group: int) -> int:
    """Rows of the short segments' M tile: ``SHORT_M`` raised to a whole group, at most the main tile's rows."""
    return min(block_m_for(config.SHORT_M, group), block_m_for(config.BLOCK_M, group))


def tokens_per_tile(block_m: int, group: int) -> int:
    """Tokens of one segment one M tile covers (each brings ``group`` query rows)."""
    return block_m_for(block_m, group) // max(group, 1)


def split_budget(config: VarlenConfig, sm_count: int, kv_heads: int) -> int:
    """Programs per KV head the split policy aims for (the chunk is sized so that the work fills them)."""
    return max(1, sm_count * config.TARGET_WAVES // max(kv_heads, 1))


def duplicate_reason(config: VarlenConfig, key: _VarlenKeyFields) -> str | None:
    """Why ``config`` launches what another config of the space launches at ``key``, if it does."""
    g = 1 << (max(key.gqa_group, 1) - 1).bit_length()
    if min(g, 128) > config.BLOCK_M:
        return f"BLOCK_M={config.BLOCK_M} is raised to the group's {g} rows"
    if min(g, 128) > config.SHORT_M:
        return f"SHORT_M={config.SHORT_M} is raised to the group's {g} rows"
    if config.SHORT_M > config.BLOCK_M:
        return f"SHORT_M={config.SHORT_M} above BLOCK_M={config.BLOCK_M} is one tile for all, as SHORT_M=BLOCK_M"
    moot = {"MIN_CHUNK": config.MIN_CHUNK, "TARGET_WAVES": config.TARGET_WAVES}
    if config.MAX_SPLITS == 1 and any(_DEFAULTS[name] != value for name, value in moot.items()):
        return "MIN_CHUNK and TARGET_WAVES are moot with MAX_SPLITS=1"
    if config.MIN_CHUNK < config.BLOCK_N:
        return "MIN_CHUNK below BLOCK_N rounds up to BLOCK_N"
    return None


def feasibility(config: VarlenConfig, key: _VarlenKeyFields, limits: TargetLimits) -> str | None:
    """Why ``config`` cannot (or should not) run for ``key`` on this target, or ``None``."""
    duplicate = duplicate_reason(config, key)
    if duplicate is not None:
        return duplicate
    if config.KV_TMA:
        if key.ring:
            return "KV_TMA needs a flat store (a ring's tiles may wrap past its last row)"
        if padded_head_dim(key.head_dim) != key.head_dim:
            return f"KV_TMA needs a power-of-two head dim, not {key.head_dim}"
        if not limits.interpreter and not hopper_or_newer(key.arch):
            return f"KV_TMA needs SM90 or newer, not {key.arch}"
    if limits.interpreter:
        if config.BLOCK_M > _INTERPRETER_MAX_BLOCK or config.BLOCK_N > _INTERPRETER_MAX_BLOCK:
            return f"the interpreter keeps tiles of at most {_INTERPRETER_MAX_BLOCK} (quick tuning at tiny shapes)"
        if config.num_warps != _DEFAULTS["num_warps"] or config.num_stages != _DEFAULTS["num_stages"]:
            return "num_warps and num_stages mean nothing to the interpreter"
        if config.MIN_CHUNK > 128 or config.MAX_SPLITS > 16:
            return "the interpreter keeps split policies that act at tiny shapes"
        return None

    if config.MIN_CHUNK < _GPU_MIN_CHUNK:
        return f"chunks under {_GPU_MIN_CHUNK} keys cost more to merge than they save"
    d = padded_head_dim(key.head_dim)
    block_m = block_m_for(config.BLOCK_M, key.gqa_group)
    if d == 256 and config.BLOCK_N > 64:
        return "head dim 256 takes BLOCK_N <= 64"
    if config.num_warps == 8 and block_m < 64:
        return "8 warps need BLOCK_M >= 64"
    return pointer_attention_reason(
        block_m,
        config.BLOCK_N,
        d,
        config.num_warps,
        config.num_stages,
        limits,
        max_registers=_MAX_TILE_REGISTERS,
        kv_tma=config.KV_TMA,
    )


#: Shared memory the portable default's base tiles fit (Volta and newer offer a block 96 KiB or more);
#: kernels/fit_default.py fits them further to a GPU that offers less (Turing, Pascal, AMD LDS).
_PORTABLE_LIMITS = TargetLimits(smem_bytes=96 * 1024)
#: The portable default, then smaller tiles for the keys (head dim 256, wide groups) where it does not fit.
_PORTABLE_STEPS: tuple[dict[str, Any], ...] = (
    {},
    {"BLOCK_N": 32},
    {"BLOCK_N": 32, "num_warps": 8},
    {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
    {"BLOCK_M": 128, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1},
)
_INTERPRETER_DEFAULT = VarlenConfig(BLOCK_M=16, BLOCK_N=16, MIN_CHUNK=64)


def portable_config(key: _VarlenKeyFields, *, interpreter: bool) -> VarlenConfig:
    """The default config for ``key``: the dataclass defaults where they fit any CUDA GPU, else smaller tiles."""
    # The short tile holds at least one whole group (the space's canonical SHORT_M for wide groups).
    short = min(block_m_for(VarlenConfig().SHORT_M, key.gqa_group), 128)
    if interpreter:
        config = _INTERPRETER_DEFAULT
        group_rows = block_m_for(config.BLOCK_M, key.gqa_group)
        if group_rows > config.BLOCK_M:
            config = dataclasses.replace(config, BLOCK_M=min(group_rows, 128))
        return dataclasses.replace(config, SHORT_M=min(short, config.BLOCK_M))
    config = VarlenConfig()
    for changes in _PORTABLE_STEPS:
        config = dataclasses.replace(VarlenConfig(), **changes)
        config = dataclasses.replace(config, SHORT_M=min(short, config.BLOCK_M))
        if feasibility(config, key, _PORTABLE_LIMITS) is None:
            break
    return config


SPACE: SearchSpace[VarlenConfig, _VarlenKeyFields] = SearchSpace("varlen_sdpa", VarlenConfig, feasibility=feasibility)
