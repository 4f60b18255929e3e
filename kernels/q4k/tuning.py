"""The tuning half of ``q4k_fp8_gemm``: problems, the accuracy gate, default keys and seed rules.

Imported by the tuner only (the declaration names it as ``tuning=``), never by serving code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import triton

from tritune.search_spaces.q4k_fp8_gemm import (
    GEMV_K_LANES_MAX_M,
    GEMV_MAX_M,
    OPT_IN_MIN_M,
    SMALL_M,
    SPACE,
    WGMMA_ROWS,
    DequantConfig,
    Fp8Config,
    GemvConfig,
    Int8Config,
    Q4KConfig,
    StagedConfig,
    TmaConfig,
)

from ..declare import KernelTuning
from ..device import DeviceInfo, target_supports
from ..spec import Problem, pow2_bucket
from .kernel import KERNEL, Q4KKey, gemv_supported, tma_default
from .reference import check_against_portable, check_path
from .weight import Q4KWeight

#: (K, N) of the Llama-3-8B linears: MLP up or gate, down, the q or o projection, and the fused
#: projections serving engines run (Q, K and V in one; gate and up in one).
_GPU_SHAPES = ((4096, 14336), (14336, 4096), (4096, 4096), (4096, 6144), (4096, 28672))
#: Every power of two a call's M rounds up to, from decode (1) to long prefill chunks (8192).
_GPU_M_BUCKETS = tuple(2**i for i in range(14))
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
#: Dequant chunks measured first at a large-M key (the largest the key admits).
_DEQUANT_STARTS = 3
#: Largest M bucket the tma path's starting tiles are measured at: above it each M tile
#: dequantizes the weight again and the dequant path's one GEMM wins (docs/perf/HISTORY.md).
_TMA_MAX_START_M = 1024
#: Rows of x the reference is computed at (see :meth:`Q4KTuning.check_problem`).
_CHECK_ROWS = 256


def _each_path_first(starts: list[Q4KConfig]) -> list[Q4KConfig]:
    """``starts`` with the first start of each path moved to the front, in the paths' order.

    At large M several paths compete (dequant, tma, and under the opt-in fp8, int8 and staged),
    and a short tune measures only the first few seeds: one of each path comes before a second
    of any, so that no path's best tile is left unmeasured behind another path's variations.
    """
    firsts: dict[str, Q4KConfig] = {}
    for config in starts:
        firsts.setdefault(config.path, config)
    lead = list(firsts.values())
    return lead + [c for c in starts if c not in lead]


def _with_loader_and_registers(shapes: list[TmaConfig]) -> list[TmaConfig]:
    """Each tma shape followed by its twin with the loader warp and the weight tile in registers."""
    return [
        variant
        for shape in shapes
        for variant in (shape, dataclasses.replace(shape, LOADER_WARP=True, W_REGISTERS=True))
    ]


class Q4KTuning(KernelTuning):
    """Llama-3-8B shapes over M buckets on a GPU, one tiny key on the interpreter."""

    key_aliases: ClassVar[dict[str, tuple[str, Callable[[int], int]]]] = {
        "m": ("m_bucket", lambda m: pow2_bucket(m, 1)),
    }

    def make_problem(self, key: Q4KKey, device: torch.device, seed: int) -> Problem:
        generator = torch.Generator(device=device).manual_seed(seed)
        m = key.m_bucket
        w = torch.randn((key.n, key.k), generator=generator, device=device) * 0.02
        weight = Q4KWeight.quantize(w)
        x = torch.randn((m, key.k), generator=generator, device=device).to(_DTYPES[key.dtype])
        x_bytes = x.numel() * x.element_size()
        return Problem(
            args=(x, weight),
            flops=2.0 * m * key.n * key.k,
            bytes_moved=float(weight.nbytes + x_bytes + m * key.n * x.element_size()),
            flush_l2=True,
            launch_bound=m <= SMALL_M,
        )

    def check_problem(self, key: Q4KKey, device: torch.device, seed: int) -> Problem:
        """The key's problem with M capped at 256 rows: the fp32 reference of an 8192-row product
        costs seconds per key, and the tuner still cross-checks the full size against the
        portable output."""
        return self.make_problem(dataclasses.replace(key, m_bucket=min(key.m_bucket, _CHECK_ROWS)), device, seed)

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        """SQNR against the exact-weight reference at the floor of the config's path.

        Without a config the loosest floor (fp8) applies.
        """
        return check_path(out, expected, config.path if config is not None else "fp8")

    def check_full(self, out: torch.Tensor, portable: torch.Tensor, config: Any) -> str | None:
        """At the timed size (M past the check's 256 rows): ``out`` against the portable output.

        The portable path is within about 4e-5 of the exact product, so an accurate path must stay
        within ggml's bound of it too and a lossy one within 1 dB of its own floor: a tile bug that
        shows only past 256 rows cannot pass as noise under the generic 5%-of-max|out| check.
        """
        return check_against_portable(out, portable, config.path)

    def default_keys(self, device: DeviceInfo) -> list[Q4KKey]:
        """GPU: the Llama-3-8B MLP and attention shapes, bf16, at every power-of-two M bucket with
        accurate keys (``fp8=False``) and from M=64 up with opt-in keys (``fp8=True``; smaller M
        falls back to the accurate key's winner); interpreter: one tiny accurate key."""
        if device.is_interpreter:
            shapes: tuple[tuple[int, int], ...] = ((256, 64),)
            buckets: tuple[int, ...] = (16,)
            opt_in_from = 2**31
        else:
            shapes, buckets, opt_in_from = _GPU_SHAPES, _GPU_M_BUCKETS, OPT_IN_MIN_M
            if not target_supports(device, (8, 0)):
                # No 8-bit tensor-core path runs below SM80 (int8 MMA; fp8 needs SM89).
                opt_in_from = 2**31
        return [
            Q4KKey(arch=device.arch, sm_count=device.sm_count, dtype="bfloat16", m_bucket=mb, n=n, k=k, fp8=fp8)
            for fp8 in (False, True)
            for (k, n) in shapes
            for mb in buckets
            if not fp8 or mb >= opt_in_from
        ]

    def valid_key(self, key: Q4KKey) -> bool:
        """A served dtype, a weight Q4_K can hold (K a multiple of 256), a power-of-two M bucket, and
        on a GPU no opt-in key below ``OPT_IN_MIN_M`` (calls there keep the accurate key)."""
        m = key.m_bucket
        small_opt_in = key.fp8 and m < OPT_IN_MIN_M and key.arch != "cpu-interpreter"
        shape_ok = key.k > 0 and key.k % 256 == 0 and key.n > 0 and m > 0 and m & (m - 1) == 0
        return key.dtype in _DTYPES and shape_ok and not small_opt_in

    def winner_variants(self, config: Any, key: Q4KKey, device: DeviceInfo) -> list[Any]:
        """A stored tma winner is followed by its twin with the other dequantization
        (``PACKED_DEQUANT``) and by its K loop with the other copy issue (``LOADER_WARP``) and
        with the loader warp and the weight tile in registers (``W_REGISTERS``, where it is
        swapped and packed); a GEMV winner by its twin with the other lane order (``K_LANES``):
        choices the first winners never had, so that a short re-tune seeded from the winners
        measures them (the infeasible ones are dropped)."""
        if isinstance(config, TmaConfig):
            variants = [
                dataclasses.replace(config, PACKED_DEQUANT=not config.PACKED_DEQUANT),
                dataclasses.replace(config, LOADER_WARP=not config.LOADER_WARP),
            ]
            if config.SWAP_AB and config.PACKED_DEQUANT and not (config.LOADER_WARP and config.W_REGISTERS):
                variants.append(dataclasses.replace(config, LOADER_WARP=True, W_REGISTERS=True))
            return variants
        if isinstance(config, GemvConfig):
            return [dataclasses.replace(config, K_LANES=not config.K_LANES)]
        return []

    def starting_configs(self, key: Q4KKey, device: DeviceInfo) -> list[Q4KConfig]:
        """Rules for where the good tiles lie, measured first (the admitted ones only):

        - one row of x, on an NVIDIA GPU (PTX ``dp4a``): GEMV tiles of the narrowest and next
          row counts at each K depth from one super-block up, each split along K until about
          four programs per SM; first each as one launch (``FUSE_QUANT``, and ``FUSED_REDUCE``
          where split) with the lanes along K (``K_LANES``), then as one launch without, then as
          two or three; at two to four rows, the one launch with the lanes along K only, and
          each also split eight ways;
        - at large M, on any GPU: dequant chunks, the three largest the key admits, the largest
          (the whole weight where it fits the scratch cap) first: one GEMM of the whole N is
          what cuBLAS runs fastest, smaller chunks may keep the dense chunk in L2 for the GEMM;
        - on SM90 up to M=1024, tma tiles: the key's default first, then ``W x^T`` tiles of 64
          weight rows (and from M=64 of 128 rows over two warpgroups) by the M bucket, split
          along K toward about two programs per SM, and the default with 4 stages (the best
          tiles of the 2026-12-06 H100 measurements); from M=256 also 256 rows of x, and one
          64-row weight tile for two warpgroups' rows of x (256, from M=512 also 512);
        - on SM90+ (wgmma), swapped folded fp8 tiles, which compile to register-A wgmma with the
          dequantization overlapping the MMA (sm_90 ptxas builds, ``tests/sm90_build.py``): one
          warpgroup per 64 weight rows (wgmma's M side); at small M 16-row x tiles with
          super-block-deep K tiles split along K toward about one program per SM, and one M tile
          of the whole bucket; at large M x tiles as wide as wgmma's N side allows (256 rows);
        - at large M, staged chunks: the two largest the key admits, the whole weight first where
          its scratch fits (large chunks amortise each GEMM's launch and host time; the
          dequantization tile matters little, so the path's own);
        - at large M on SM90+, int8 tiles as the swapped fp8 ones (the same loop with int8
          operands, register-A wgmma) and one unswapped 128x128 tile.

        The fp8, staged and int8 starts are dropped at accurate keys (``fp8=False``), where the
        space makes them infeasible. Above ``SMALL_M`` the first start of each path leads
        (:func:`_each_path_first`).
        """
        if device.is_interpreter:
            return []
        starts: list[Q4KConfig] = list(self._gemv_starts(key, device))
        if key.m_bucket > SMALL_M:
            chunks = sorted(SPACE.members["dequant"].dimensions["CHUNK_N"], reverse=True)
            starts += [DequantConfig(CHUNK_N=chunk) for chunk in chunks]
        if device.capability == (9, 0) and target_supports(device, (9, 0)):
            starts += self._tma_starts(key, device)
        if target_supports(device, (9, 0)):
            starts += self._swapped_starts(key, device)
            if key.m_bucket > SMALL_M:
                starts += self._int8_starts(key)
        limits = KERNEL.limits(device)
        if target_supports(device, (9, 0)) and key.m_bucket > SMALL_M:
            # The staged member's own chunks (the union's CHUNK_N also holds the dequant path's):
            # the two largest the key admits, the whole weight first where it fits.
            chunks = sorted(SPACE.members["staged"].dimensions["CHUNK_N"], reverse=True)
            staged = [StagedConfig(CHUNK_N=c) for c in chunks]
            starts += [c for c in staged if SPACE.infeasible_reason(c, key, limits) is None][:2]
        feasible = [c for c in starts if SPACE.infeasible_reason(c, key, limits) is None]
        dequant = [c for c in feasible if isinstance(c, DequantConfig)]
        starts = [c for c in feasible if not isinstance(c, DequantConfig) or c in dequant[:_DEQUANT_STARTS]]
        return _each_path_first(starts) if key.m_bucket > SMALL_M else starts

    @staticmethod
    def _gemv_starts(key: Q4KKey, device: DeviceInfo) -> list[GemvConfig]:
        if key.m_bucket > GEMV_K_LANES_MAX_M or not gemv_supported(device):
            return []
        starts = []
        for block_k in (256, 512, 1024):
            for block_n in (32, 64):
                tiles = triton.cdiv(key.n, block_n)
                split = 1
                while split < 8 and tiles * split * 2 <= 4 * device.sm_count and (key.k // block_k) % (2 * split) == 0:
                    split *= 2
                starts.append(GemvConfig(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, SPLIT_K=split))
        # The same tiles in one launch first (where the space admits them: FUSE_QUANT needs
        # BLOCK_K <= 128 * num_warps): an eager decode step pays each launch's host time; and
        # before those, with the lanes along K (whole row slices a load instruction).
        fused = [dataclasses.replace(c, FUSE_QUANT=True, FUSED_REDUCE=c.SPLIT_K > 1) for c in starts]
        along_k = [dataclasses.replace(c, K_LANES=True) for c in fused]
        if key.m_bucket > GEMV_MAX_M:
            # Several rows: only the one launch with its lanes along K (the space's rule), and
            # a deeper split, where the rows' products leave fewer programs per SM.
            deeper = [dataclasses.replace(c, SPLIT_K=8, FUSED_REDUCE=True) for c in along_k if c.SPLIT_K < 8]
            return along_k + [c for c in deeper if c not in along_k]
        return along_k + fused + starts

    @staticmethod
    def _tma_starts(key: Q4KKey, device: DeviceInfo) -> list[TmaConfig]:
        if key.m_bucket > _TMA_MAX_START_M:
            return []
        block_m = min(max(key.m_bucket, 16), 128)
        one_group = TmaConfig(BLOCK_M=block_m, BLOCK_N=WGMMA_ROWS, BLOCK_K=128, num_warps=4, PACKED_DEQUANT=True)
        shapes = [one_group]
        if key.m_bucket >= 64:
            shapes.append(dataclasses.replace(one_group, BLOCK_N=2 * WGMMA_ROWS, num_warps=8))
        if key.m_bucket >= 256:
            # wgmma's widest N side: 256 rows of x per weight tile, dequantized half as often; and
            # one 64-row weight tile for two warpgroups' rows of x (256, or 512 where M fills them).
            widest = TmaConfig(
                BLOCK_M=256, BLOCK_N=WGMMA_ROWS, BLOCK_K=64, num_warps=4, num_stages=4, PACKED_DEQUANT=True
            )
            wide = [widest, dataclasses.replace(widest, BLOCK_N=2 * WGMMA_ROWS, num_warps=8, num_stages=3)]
            shared = [dataclasses.replace(widest, num_warps=8)]
            if key.m_bucket >= 512:
                # The widest the space holds, 512 rows, first of all there: the one tma tile a
                # short large-M tune measures (each path's first start leads).
                shared.insert(0, dataclasses.replace(shared[0], BLOCK_M=512, num_stages=3))
            # Each also with its copies from a loader warp and its weight tile in registers.
            wide, shared = (_with_loader_and_registers(group) for group in (wide, shared))
            shapes = shared + shapes + wide if key.m_bucket >= 512 else shapes + wide + shared
        default = tma_default(key)
        # The default, with a stage more, with the other reduce where it splits (below),
        # dequantized in float32 (the exact weights; not in registers, which need x's dtype), and
        # with the plain K loop where it takes the loader warp or register-A.
        starts = [] if default is None else [default, dataclasses.replace(default, num_stages=4)]
        if default is not None:
            starts.append(dataclasses.replace(default, PACKED_DEQUANT=not default.PACKED_DEQUANT, W_REGISTERS=False))
            if default.LOADER_WARP or default.W_REGISTERS:
                starts.append(dataclasses.replace(default, LOADER_WARP=False, W_REGISTERS=False))
        if default is not None and default.SPLIT_K > 1:
            # The default's split with the other reduce: by its last split or by a launch of its
            # own (where the space admits it: not with 256-row tiles; infeasible starts are
            # dropped below).
            starts.insert(1, dataclasses.replace(default, FUSED_REDUCE=not default.FUSED_REDUCE))
        for shape in shapes:
            tiles = triton.cdiv(key.n, shape.BLOCK_N) * triton.cdiv(key.m_bucket, shape.BLOCK_M)
            starts += [
                dataclasses.replace(shape, SPLIT_K=split)
                for split in (1, 2, 4, 8)
                if split == 1 or tiles * split <= 2 * device.sm_count
            ]
        return list(dict.fromkeys(starts))

    @staticmethod
    def _int8_starts(key: Q4KKey) -> list[Int8Config]:
        # 256 (then 128) rows of x against two warpgroups of 64 weight rows, grouped where several
        # M tiles share a weight tile; then the plain 128x128 tile with the weight in shared memory.
        swapped = Int8Config(BLOCK_N=2 * WGMMA_ROWS, BLOCK_K=64, num_warps=8, num_stages=3, SWAP_AB=True)
        starts = [
            dataclasses.replace(swapped, BLOCK_M=block_m, GROUP_M=8 if key.m_bucket > block_m else 1)
            for block_m in (256, 128)
        ]
        plain = Int8Config(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
        return [*starts, dataclasses.replace(plain, GROUP_M=8 if key.m_bucket > 128 else 1)]

    @staticmethod
    def _swapped_starts(key: Q4KKey, device: DeviceInfo) -> list[Fp8Config]:
        swapped = Fp8Config(SCALE_FOLD=True, SWAP_AB=True, GROUP_M=1)
        if key.m_bucket > SMALL_M:
            # Two warpgroups of 64 weight rows against 256 (then 128) rows of x, in grouped tile
            # order where several M tiles share a weight tile.
            wide = dataclasses.replace(swapped, BLOCK_N=2 * WGMMA_ROWS, BLOCK_K=64, num_warps=8)
            return [
                dataclasses.replace(wide, BLOCK_M=block_m, GROUP_M=8 if key.m_bucket > block_m else 1)
                for block_m in (256, 128)
            ]
        small = dataclasses.replace(swapped, BLOCK_M=16, BLOCK_N=WGMMA_ROWS, BLOCK_K=256, num_stages=4)
        tiles = triton.cdiv(key.n, WGMMA_ROWS)
        starts = [
            dataclasses.replace(small, SPLIT_K=split)
            for split in (1, 2, 4, 8)
            if split == 1 or tiles * split <= 2 * device.sm_count
        ]
        if key.m_bucket > 16:
            # One M tile of the whole bucket: each weight tile dequantized once for all its rows.
            whole = dataclasses.replace(swapped, BLOCK_M=key.m_bucket, BLOCK_N=2 * WGMMA_ROWS, BLOCK_K=128)
            starts += [dataclasses.replace(whole, SPLIT_K=split) for split in (2, 4, 8)]
        return starts

    def peer(self, key: Q4KKey, problem: Problem) -> Any:
        """``torch.nn.functional.linear(x, w)`` with ``w`` the weight dequantized to x's dtype (bf16 cuBLAS).

        What a user without a Q4_K kernel does: dequantize the weight once, at load, and run the
        dense GEMM; the dequantization is done here, before timing. A ``Peer`` (kernels.spec).
        """
        from ..spec import Peer

        x, weight = problem.args[0], problem.args[1]
        bias = problem.args[2] if len(problem.args) > 2 else problem.kwargs.get("bias")
        dense = weight.dequantize().to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
        return Peer("F.linear, dequantized weight", lambda: torch.nn.functional.linear(x, dense, bias))


TUNING = Q4KTuning()
