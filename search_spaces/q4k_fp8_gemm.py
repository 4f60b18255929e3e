"""Search space of ``q4k_fp8_gemm``: the Q4_K weight x activation GEMM, portable and fp8 paths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .base import SearchSpace, TargetLimits, choice

#: Largest M bucket for which splitting K may pay: up to here a few M tiles cannot fill the GPU
#: (on an H200, N=4096 at BLOCK_N=64 is 64 programs for 132 SMs).
SMALL_M = 64
#: Registers per thread the folded fp8 kernel may spend on its accumulator plus half its float32
#: weight tile (ptxas keeps about half of that tile live). Fitted to ptxas for sm_90 with Triton 3.6
#: over 51 tiles: above it, 4-warp tiles with BLOCK_K=256 spill; at or below it, none spills more
#: than a few bytes.
FOLD_MAX_REGISTERS = 224


@dataclass(frozen=True)
class Q4KConfig:
    """One launch of the Q4_K GEMM. The defaults are the portable path's safe middle."""

    #: "portable": dequantize to x's dtype and bf16/fp16 ``tl.dot`` (any CUDA GPU);
    #: "fp8": e4m3 activations against exact 4-bit quants, or folded e4m3 weights (SM89+).
    path: str = choice("portable", ("portable", "fp8"))
    BLOCK_M: int = choice(64, (16, 32, 64, 128))
    BLOCK_N: int = choice(64, (32, 64, 128, 256))
    #: K tile; a multiple of the 32-wide sub-block that divides the 256-wide super-block.
    BLOCK_K: int = choice(64, (32, 64, 128, 256))
    GROUP_M: int = choice(8, (1, 4, 8))
    num_warps: int = choice(4, (2, 4, 8))
    num_stages: int = choice(3, (1, 2, 3, 4, 5))
    #: Programs per output tile along K (float32 partials, then a reduce); small M only.
    SPLIT_K: int = choice(1, (1, 2, 4, 8))
    #: fp8 path only. False: one 32-deep dot per sub-block against the exact codes ``q - 8``,
    #: scaled into the accumulator by the sub-block's scale. True: each sub-block's scale and min
    #: are folded into e4m3 weights ``(d*sc*q - dmin*m) * 2**e`` (one power of two per column), so
    #: one dot spans the whole K tile and accumulates in place; the rounded weights cost about
    #: 2.5 dB of SQNR (28.5 dB instead of 31 on Gaussian data).
    SCALE_FOLD: bool = choice(False, (False, True))


class Q4KShape(Protocol):
    """The key fields feasibility looks at (the key type lives with the kernel)."""

    @property
    def m_bucket(self) -> int: ...

    @property
    def n(self) -> int: ...

    @property
    def k(self) -> int: ...


def smem_bytes(config: Q4KConfig) -> int:
    """Shared memory a launch is expected to need: pipelined loads plus the staged dot operand."""
    bm, bn, bk = config.BLOCK_M, config.BLOCK_N, config.BLOCK_K
    if config.path == "fp8" and config.SCALE_FOLD:
        # As Triton 3.6 lays it out for wgmma on sm_90 (exact or 2 KiB over on the tiles compiled;
        # mma.sync tiles below 64 rows need less): x's e4m3 tile in every stage, the packed quants
        # and codes in all but one, and the folded e4m3 weight tile staged once.
        stages = config.num_stages
        return stages * bm * bk + (stages - 1) * (bn * bk // 2 + 2 * bn * (bk // 32)) + bn * bk
    if config.path == "fp8":
        # Per 32-wide slice: e4m3 x, packed quants and one byte of scale per column.
        per_stage = bk * (bm + bn // 2) + 3 * bn * (bk // 32)
        staged = bn * 32
    else:
        per_stage = bk * (2 * bm + bn // 2) + 2 * bn * (bk // 32) + 4 * bn * max(bk // 256, 1)
        staged = 2 * bn * bk
    return max(config.num_stages - 1, 1) * per_stage + staged


def feasibility(config: Q4KConfig, key: Q4KShape, limits: TargetLimits) -> str | None:
    """Why ``config`` cannot (or should not) run for ``key``; ``None`` if it may."""
    small = key.m_bucket <= SMALL_M
    if config.SCALE_FOLD and config.path != "fp8":
        return "SCALE_FOLD only changes the fp8 path (the same launch as SCALE_FOLD=False)"
    if config.SPLIT_K > 1 and not small:
        return f"SPLIT_K={config.SPLIT_K} only for M <= {SMALL_M} (m_bucket={key.m_bucket})"
    if (key.k // config.BLOCK_K) % config.SPLIT_K:
        return f"SPLIT_K={config.SPLIT_K} does not divide the {key.k // config.BLOCK_K} BLOCK_K={config.BLOCK_K} tiles"
    if max(key.m_bucket, 16) < config.BLOCK_M:
        return f"BLOCK_M={config.BLOCK_M} exceeds m_bucket={key.m_bucket}"
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
    if config.path == "fp8" and config.SCALE_FOLD:
        # The float32 weight tile is dequantized next to the accumulator before its e4m3 cast.
        regs = (config.BLOCK_M + config.BLOCK_K // 2) * config.BLOCK_N // (32 * config.num_warps)
        if regs > FOLD_MAX_REGISTERS:
            return (
                f"the {config.BLOCK_M}x{config.BLOCK_N} accumulator and the {config.BLOCK_N}x{config.BLOCK_K} "
                f"float32 weight tile spill ({regs} registers per thread by the estimate, > {FOLD_MAX_REGISTERS})"
            )
    need = smem_bytes(config)
    if need > limits.smem_bytes:
        return f"needs about {need} bytes of shared memory, the target has {limits.smem_bytes}"
    return None


SPACE: SearchSpace[Q4KConfig, Q4KShape] = SearchSpace("q4k_fp8_gemm", Q4KConfig, feasibility=feasibility)
