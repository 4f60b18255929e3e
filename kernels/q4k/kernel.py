"""``q4k_linear``: a linear layer with a GGUF Q4_K weight, declared as kernel ``q4k_fp8_gemm``.

The declaration (:data:`KERNEL`) gives the call's checks (each error names the argument), the
``tritune::q4k_linear`` op, dispatch by tuning key and the kernel's version; this module adds the
key, the portable defaults by M bucket and the last-moment path eligibility.

Accuracy contract: by default only the paths that meet ggml's Q4_K bound (NMSE <= 5e-4 against
the exactly dequantized product, on model-like activations too: portable, GEMV and dequant) serve.
``TRITUNE_Q4K_FP8=1`` opts in to the faster 8-bit tensor-core paths (fp8, staged, int8: 28.5-39
dB by path and activations); its calls get keys with ``fp8=True``, where those paths are
feasible, and where such a key has no winner of its own the accurate key's winner serves
(:func:`accurate_key`, the declaration's ``fallback_key``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

import torch
import triton

from tritune.search_spaces.base import TargetLimits, nvidia_capability
from tritune.search_spaces.q4k_fp8_gemm import (
    FP8_OPT_IN_REASON,
    GEMV_K_LANES_MAX_M,
    OPT_IN_MIN_M,
    SMALL_M,
    SPACE,
    SPLIT_K_MAX_M,
    WGMMA_ROWS,
    DequantConfig,
    GemvConfig,
    PortableConfig,
    Q4KConfig,
    StagedConfig,
    TmaConfig,
)

from .. import settings as settings_module
from ..declare import Kernel, Obj, Output, Rule, Tensor
from ..device import DeviceInfo, target_supports
from ..fit_default import fit_shared_memory, halve_first
from ..spec import Replaced, TuningKey, pow2_bucket, smem_limit_bytes
from .launch import JIT_KERNELS, launch
from .reference import q4k_linear_reference
from .weight import Q4KWeight

#: A config of a path that works in chunks of weight rows.
_Chunked = TypeVar("_Chunked", StagedConfig, DequantConfig)
#: Key dtype names (stored bundle keys spell them out) of the facts' short dtype names.
_KEY_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
#: The paths below ggml's accuracy bound, served only with the opt-in.
_FP8_PATHS = ("fp8", "staged", "int8")
#: CUDA's cap on a grid's z extent, where the tma path puts its M tiles.
_GRID_Z = 65535
#: M buckets whose untuned default on SM90 is the tma path: from 32 rows to 512 (256-row tiles
#: from 256). Below, the portable split tiles ran faster (M=16); above, the dequant path's one
#: GEMM won (docs/perf/HISTORY.md has the H100 measurements).
TMA_DEFAULT_M = (32, 512)
#: Smallest M bucket whose untuned default is the dequant path where the tma path does not serve
#: (off SM90; on SM90 where :func:`tma_default` gives none, as from M=1024): on an H200 it ran every
#: Llama-3-8B shape 1.4-2.4x faster than the portable tiles at M=256 and 2.0-3.1x at M=512 (the
#: weight's extra bf16 pass costs less there than the in-register dequantization of each M tile).
DEQUANT_DEFAULT_MIN_M = 256
#: Smallest M bucket whose untuned default under the fp8 opt-in (a key with ``fp8=True``) is the
#: staged path, on SM90 or newer: on an H100 the whole weight in one chunk ran 0.97-1.14x bf16
#: cuBLAS at M=1024 and 1.15-1.59x from M=2048 on three Llama-3-8B shapes, where the accurate
#: default (the dequant path) ran 0.74-0.96x (docs/perf/HISTORY.md).
STAGED_DEFAULT_MIN_M = 1024


@dataclass(frozen=True)
class Q4KKey(TuningKey):
    dtype: str
    m_bucket: int
    n: int
    k: int
    #: The fp8 opt-in (``TRITUNE_Q4K_FP8``): True admits the fp8, staged and int8 paths, which
    #: miss ggml's Q4_K accuracy bound; False (a key built without it: the accurate contract)
    #: admits only the paths that meet it. A stored key always names it.
    fp8: bool = False

    BUCKETS: ClassVar[tuple[str, ...]] = ("m_bucket",)
    #: A weight shape nobody tuned (another model's, a fused projection) borrows the nearest tuned
    #: shape's winner rather than the portable default: which path wins follows M far more than N or K.
    NEAR: ClassVar[tuple[str, ...]] = ("n", "k")


def key_for(device: DeviceInfo, facts: Any) -> Q4KKey:
    """The key of a call: its GPU, dtype, M rounded up to a power of two, the weight's N and K,
    and whether the fp8 paths may serve it (``TRITUNE_Q4K_FP8``; on a GPU from ``OPT_IN_MIN_M``
    rows up: a smaller call keeps the accurate key, so no opt-in neighbour is borrowed there)."""
    m_bucket = pow2_bucket(facts.M, minimum=1)
    opt_in = settings_module.settings().q4k_fp8 and (device.is_interpreter or m_bucket >= OPT_IN_MIN_M)
    return Q4KKey(
        arch=device.arch,
        sm_count=device.sm_count,
        dtype=_KEY_DTYPES[facts.dtype],
        m_bucket=m_bucket,
        n=facts.N,
        k=facts.K,
        fp8=opt_in,
    )


def accurate_key(key: Q4KKey) -> Q4KKey | None:
    """The declaration's ``fallback_key``: an opt-in key's accurate twin, whose winner (meeting
    ggml's bound, so valid under the opt-in too) serves where the opt-in key has none."""
    return replace(key, fp8=False) if key.fp8 else None


def default_config(key: Q4KKey) -> PortableConfig | DequantConfig | TmaConfig | GemvConfig | StagedConfig:
    """Untuned defaults by M (chosen on Llama-3-8B shapes, bf16; docs/perf/HISTORY.md).

    On NVIDIA GPUs up to M=4 (:data:`GEMV_K_LANES_MAX_M`): the one-launch GEMV with its lanes
    along K (:func:`gemv_default`), a pass over the exact codes at close to the memory's speed,
    where the portable tiles spend most of their time in dequantizing MMA tiles padded to 16 rows.
    Under the fp8 opt-in from M=1024 on SM90+: the staged path (:func:`staged_default`).
    Otherwise :func:`accurate_default`.
    """
    chosen = gemv_default(key) or staged_default(key)
    return chosen if chosen is not None else accurate_default(key)


def accurate_default(key: Q4KKey) -> PortableConfig | DequantConfig | TmaConfig:
    """The untuned default by M on the paths every GPU runs (chosen on Llama-3-8B shapes, bf16;
    docs/perf/HISTORY.md), where :func:`gemv_default` gives none.

    On SM90 from M=32 to 512 (:data:`TMA_DEFAULT_M`): the tma path (:func:`tma_default`), a K loop
    that keeps its loads and wgmma in flight, dequantizing in x's dtype.
    Elsewhere from M=256 up (:data:`DEQUANT_DEFAULT_MIN_M`): the dequant path, the weight
    dequantized once per call into cuBLAS's GEMM (:func:`dequant_default`), which runs on every
    GPU and meets the accuracy contract with the most margin; where no chunk of it is feasible (N
    of 32 rows or fewer, or K beyond 64K for the scratch cap), the portable rules below
    (:func:`portable_default`).

    Portable rules: up to M=64, 64-wide N tiles split along K until about 1.5 programs per SM (one
    pass over the weight; 256-deep K tiles for decode). Beyond: 128x128x64 tiles, 8 warps, except
    up to M=256 where those tiles make fewer programs than half the SMs: there 64x64 tiles split as
    up to M=64 (measured on an H200: a program's time follows the K it loops over more than its
    tile, so a few 128x128 programs over all of K take several times as long as many split 64-row
    ones). Where a GPU gives a block less shared memory than the H200 they were chosen on
    (Turing's 64 KiB), fewer pipeline stages.
    """
    if key.arch == "sm90" and TMA_DEFAULT_M[0] <= key.m_bucket <= TMA_DEFAULT_M[1]:
        tma = tma_default(key)
        if tma is not None:
            return tma
    if key.arch != "cpu-interpreter" and key.m_bucket >= DEQUANT_DEFAULT_MIN_M:
        dequant = dequant_default(key)
        if dequant is not None:
            return dequant
    return portable_default(key)


def staged_default(key: Q4KKey) -> StagedConfig | None:
    """The staged path's default at an opt-in key (``fp8=True``) from M=1024
    (:data:`STAGED_DEFAULT_MIN_M`) on SM90 or newer: chunks of e4m3 weights into cuBLASLt's
    row-wise scaled fp8 GEMM, made by 128 x 64 tiles of 8 warps (the tiles the H100 measurements
    ran). The fp8 GEMM runs at about twice bf16's rate, which from these sizes pays for writing and
    reading back the weight. The chunk is the largest the space admits, the whole weight where its
    e4m3 scratch fits (one GEMM): each chunk costs an eager call 40-80 us of host time in its two
    launches, and on an H100 the whole weight's GPU time was within 4% of 2048-row chunks' or
    less at four Llama-3-8B shapes (docs/perf/HISTORY.md). ``None`` elsewhere, or where the space
    refuses every chunk (fp16 x, N not a multiple of 16)."""
    capability = nvidia_capability(key.arch)
    if not key.fp8 or key.m_bucket < STAGED_DEFAULT_MIN_M or capability is None or capability < (9, 0):
        return None
    return _widest_chunk(key, "staged", lambda n: StagedConfig(BLOCK_N=128, BLOCK_K=64, num_warps=8, CHUNK_N=n))


def gemv_default(key: Q4KKey) -> GemvConfig | None:
    """The GEMV path's default up to M=4 on an NVIDIA GPU: the one launch (x quantized by each
    program, split partials summed by the last program of a tile) with its lanes along K over 4
    warps, 64 weight rows a program, 512 deep at one and two rows of x and 256 from three (four
    rows' product words of a 512-deep tile would not fit in registers). The split and, where
    splitting stops short, the narrower tile (32 rows) go up until about three programs an SM, else
    the most programs; 256-deep tiles where 512 does not divide K. On an H100 at the five Llama-3-8B
    shapes the re-tunes chose these tiles at every M=1 key and three of five M=4 keys, the others
    a split apart (docs/perf/HISTORY.md). ``None`` off such GPUs, above M=4, or where no such tile
    divides K."""
    # dp4a: NVIDIA SM61+ (not ROCm; the interpreter keeps the portable path's small tiles).
    if (nvidia_capability(key.arch) or (0, 0)) < (6, 1) or key.m_bucket > GEMV_K_LANES_MAX_M:
        return None
    limits = TargetLimits(smem_bytes=smem_limit_bytes((9, 0)))
    for block_k in (512, 256) if key.m_bucket <= 2 else (256,):
        most: tuple[int, GemvConfig] | None = None
        for block_n in (64, 32):
            for split in (1, 2, 4, 8):
                config = GemvConfig(
                    BLOCK_N=block_n,
                    BLOCK_K=block_k,
                    num_warps=4,
                    SPLIT_K=split,
                    FUSE_QUANT=True,
                    FUSED_REDUCE=split > 1,
                    K_LANES=True,
                )
                if SPACE.infeasible_reason(config, key, limits) is not None:
                    continue
                programs = triton.cdiv(key.n, block_n) * split
                if programs >= 3 * key.sm_count:
                    return config
                if most is None or programs > most[0]:
                    most = (programs, config)
        if most is not None:
            return most[1]
    return None


def tma_default(key: Q4KKey) -> TmaConfig | None:
    """The tma path's default at an SM90 key (the best tiles of the H100 measurements in
    docs/perf/HISTORY.md): ``W x^T`` tiles of 64 weight rows by the whole M bucket up to 64 rows, 4 warps, 128
    deep; at M=128 two warpgroups over 128 weight rows; K split (up to 4) until about 1.5
    programs per SM, and up to M=64 a split's partials summed by its last split (``FUSED_REDUCE``:
    on an H100 as fast or faster replayed and one launch fewer eagerly; at M=128 the reduce launch
    replayed faster). From M=256, 256 rows of x (wgmma's widest N) against two warpgroups' 128
    weight rows, 64 deep, split until one program per SM at most (one wave); above M=256, where
    the space admits no split, :func:`_tma_wide_default`. Unsplit 256-row tiles with their copies
    from a loader warp and the weight tile dequantized into wgmma's A registers where the space
    admits them (each K split whole 1024-code chunks): on an H100 the re-tunes picked that twin of
    this tile at all three unsplit M=256 keys, 0.77-0.87x its time. Dequantized in x's
    dtype (``PACKED_DEQUANT``: 2-13% faster on the H100 at every tuned M, about 45 dB against the
    exact product in bf16, 12 dB inside ggml's bound). ``None`` where the space refuses it (N not
    a multiple of the tile)."""
    if key.m_bucket > SPLIT_K_MAX_M:
        return _tma_wide_default(key)
    if key.m_bucket > 128:
        config = TmaConfig(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    elif key.m_bucket > 64:
        config = TmaConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
    else:
        config = TmaConfig(BLOCK_M=max(key.m_bucket, 16), BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    tiles = triton.cdiv(key.n, config.BLOCK_N) * triton.cdiv(key.m_bucket, config.BLOCK_M)
    split = 1
    while split < 4 and (key.k // config.BLOCK_K) % (2 * split) == 0:
        programs = tiles * split
        if config.BLOCK_M == 256:
            # A 256-row program holds its SM's registers alone: one wave at most after doubling.
            if 2 * programs > key.sm_count:
                break
        elif 2 * programs >= 3 * key.sm_count:
            # About 1.5 programs an SM already.
            break
        split *= 2
    config = replace(config, SPLIT_K=split, FUSED_REDUCE=split > 1 and key.m_bucket <= 64, PACKED_DEQUANT=True)
    limits = TargetLimits(smem_bytes=smem_limit_bytes((9, 0)))
    if config.BLOCK_M == 256 and split == 1:
        # Unsplit 256-row tiles: the copies from a loader warp, the weight tile in wgmma's A registers.
        registers = replace(config, SWAP_AB=True, LOADER_WARP=True, W_REGISTERS=True)
        if SPACE.infeasible_reason(registers, key, limits) is None:
            return registers
    return config if SPACE.infeasible_reason(config, key, limits) is None else None


def _tma_wide_default(key: Q4KKey) -> TmaConfig | None:
    """:func:`tma_default` above the split's M: one dequantized 64-row weight tile for the rows of
    x of both warpgroups: 512 of them where those programs cover two thirds of the SMs or more,
    else 256 over 4 stages where those cover 0.9 of them, else none (the dequant path's GEMM wins
    where SMs idle). Against 128 weight rows by 256 of x, the dequantization per product halves
    (the H100 measurements at M=512 in docs/perf/HISTORY.md). The copies from a loader warp where
    the space admits it (each K whole 1024-code chunks): on an H100 the 512-row tile ran 0.97-0.99x
    its plain K loop's time at M=1024 and 4096 on three shapes, and the re-tunes picked a loader
    warp at four of five M=512 keys. Not the weight tile in registers: each warpgroup would
    dequantize the shared tile for itself."""
    tiles = key.n // WGMMA_ROWS
    if key.n % WGMMA_ROWS:
        return None
    if 3 * tiles * triton.cdiv(key.m_bucket, 512) >= 2 * key.sm_count:
        config = TmaConfig(BLOCK_M=512, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, PACKED_DEQUANT=True)
    elif 10 * tiles * triton.cdiv(key.m_bucket, 256) >= 9 * key.sm_count:
        config = TmaConfig(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4, PACKED_DEQUANT=True)
    else:
        return None
    limits = TargetLimits(smem_bytes=smem_limit_bytes((9, 0)))
    loader = replace(config, LOADER_WARP=True)
    if SPACE.infeasible_reason(loader, key, limits) is None:
        return loader
    return config if SPACE.infeasible_reason(config, key, limits) is None else None


def portable_default(key: Q4KKey) -> PortableConfig:
    """The portable path's tiles by the rules of :func:`default_config` (what serves below M=256
    off SM90, and up to M=16 on it),
    fitted to the GPU's shared memory; small tiles on the interpreter."""
    if key.arch == "cpu-interpreter":
        block_m = 16 if key.m_bucket <= 16 else 32
        return PortableConfig(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=1)
    # Fewer stages, then narrower N and K tiles, until the GPU's shared memory holds them.
    return fit_shared_memory(_h200_default(key), key, SPACE, halve_first("BLOCK_K", "BLOCK_N"))


def dequant_default(key: Q4KKey) -> DequantConfig | None:
    """The dequant path's default at a GPU key: the largest chunk the space admits there (the whole
    weight where its scratch fits, one GEMM; else the widest chunk under the scratch cap), 32 x 256
    dequantization tiles of 8 warps (the tiles most of the H200's tuned dequant winners chose; the
    tile matters little next to the GEMM). ``None`` where no chunk fits the scratch cap."""
    return _widest_chunk(key, "dequant", lambda n: DequantConfig(BLOCK_N=32, BLOCK_K=256, num_warps=8, CHUNK_N=n))


def _widest_chunk(key: Q4KKey, path: str, make: Callable[[int], _Chunked]) -> _Chunked | None:
    """``make(chunk)`` with the largest ``CHUNK_N`` of ``path`` that the space admits at ``key``, or
    ``None``. The rule asks nothing of the target's shared memory: these paths' GEMM is the vendor's."""
    limits = TargetLimits()
    for chunk in sorted(SPACE.members[path].dimensions["CHUNK_N"], reverse=True):
        config = make(chunk)
        if SPACE.infeasible_reason(config, key, limits) is None:
            return config
    return None


def _h200_default(key: Q4KKey) -> PortableConfig:
    """The default as chosen on an H200, before :func:`~..fit_default.fit_shared_memory`."""
    big_tiles_idle = 2 * triton.cdiv(key.n, 128) * triton.cdiv(key.m_bucket, 128) < key.sm_count
    if key.m_bucket <= SMALL_M or (key.m_bucket <= SPLIT_K_MAX_M and big_tiles_idle):
        decode = key.m_bucket <= 16
        block_k = 256 if decode else 128
        block_m = 16 if decode else min(key.m_bucket, SMALL_M)
        tiles = triton.cdiv(key.n, 64) * triton.cdiv(key.m_bucket, block_m)
        split = 1
        while split < 8 and 2 * tiles * split < 3 * key.sm_count and (key.k // block_k) % (2 * split) == 0:
            split *= 2
        return PortableConfig(
            BLOCK_M=block_m,
            BLOCK_N=64,
            BLOCK_K=block_k,
            GROUP_M=1,
            num_warps=4,
            num_stages=3 if decode else 4,
            SPLIT_K=split,
        )
    # GROUP_M only reorders programs when more than one M tile exists (the space prunes the
    # duplicate launch otherwise).
    group_m = 8 if key.m_bucket > 128 else 1
    return PortableConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=group_m, num_warps=8, num_stages=3)


def gemv_supported(device: DeviceInfo) -> bool:
    """Whether the GEMV path can run here: its kernels issue PTX ``dp4a`` (NVIDIA SM61+; the
    interpreter emulates it), which no ROCm build has."""
    return device.is_interpreter or target_supports(device, (6, 1))


def _unservable_reason(config: Q4KConfig, device: DeviceInfo, facts: Any) -> str | None:
    """Why ``config``'s path cannot serve this call (``None`` where it can)."""
    if config.path in _FP8_PATHS and not settings_module.settings().q4k_fp8:
        return FP8_OPT_IN_REASON
    if config.path == "fp8" and not (device.is_interpreter or target_supports(device, (8, 9))):
        return f"the fp8 path needs e4m3 tensor cores (SM89+), not {device.arch}"
    if config.path == "int8" and not (device.is_interpreter or target_supports(device, (8, 0))):
        return f"the int8 path needs int8 tensor cores (SM80+), not {device.arch}"
    if config.path == "gemv" and not gemv_supported(device):
        return f"the GEMV path issues PTX dp4a (NVIDIA SM61+), not {device.arch}"
    if isinstance(config, TmaConfig):
        if device.is_interpreter:
            return "the tma path is Gluon, which the interpreter cannot run"
        if device.capability != (9, 0) or not target_supports(device, (9, 0)):
            return f"the tma path runs on SM90 (Hopper) only, not {device.arch}"
        if facts.N % config.BLOCK_N:
            return f"the tma path stores whole weight tiles: BLOCK_N={config.BLOCK_N} does not divide N={facts.N}"
        if -(-facts.M // config.BLOCK_M) > _GRID_Z:
            return f"the tma grid holds at most {_GRID_Z} M tiles of BLOCK_M={config.BLOCK_M} rows, not M={facts.M}"
    if isinstance(config, StagedConfig):
        if not (device.is_interpreter or target_supports(device, (9, 0))):
            return f"the staged path needs row-wise scaled fp8 GEMMs (SM90+), not {device.arch}"
        if facts.dtype != "bf16":
            return f"the staged path's GEMM writes bfloat16 only, not {facts.dtype}"
        if facts.N % 16 or facts.K % 16:
            return f"the staged path's GEMM needs N and K multiples of 16 (N={facts.N}, K={facts.K})"
    return None


def _stand_in(device: DeviceInfo, facts: Any) -> Q4KConfig:
    """What serves a call its config cannot: the key's default, unless that is the GEMV or the
    staged path and this build cannot run it (``TORCH_CUDA_ARCH_LIST`` naming a GPU older than
    SM61, or than SM90 for the staged path's fp8 GEMM): then :func:`accurate_default`."""
    key = key_for(device, facts)
    default = default_config(key)
    if isinstance(default, GemvConfig | StagedConfig) and _unservable_reason(default, device, facts) is not None:
        return accurate_default(key)
    return default


def serve(config: Q4KConfig, device: DeviceInfo, facts: Any) -> Q4KConfig | Replaced:
    """The fp8, staged and int8 paths serve only with the opt-in (``TRITUNE_Q4K_FP8=1``; a stored
    winner of theirs is infeasible at a key without it, so only a pin gets here). The fp8 path
    needs e4m3 tensor cores (SM89+, every built arch) or the interpreter; the staged path needs
    row-wise scaled fp8 GEMMs (SM90+ or the interpreter's CPU ``_scaled_mm``), a bf16 x and N, K
    multiples of 16; the int8 path int8 tensor cores (SM80+) or the interpreter; the GEMV path
    PTX ``dp4a`` (NVIDIA, not ROCm). Otherwise the key's portable default serves, as a
    :class:`~tritune.kernels.spec.Replaced` naming the reason (a pin's one warning quotes it). The
    portable and dequant paths serve on every device.

    A pinned SPLIT_K that does not divide K's tiles is halved until it does; a pinned BLOCK_K that
    does not divide K gives way to the portable default.
    """
    reason = _unservable_reason(config, device, facts)
    if reason is not None:
        return Replaced(_stand_in(device, facts), reason)
    if isinstance(config, StagedConfig | DequantConfig):
        return config
    if facts.K % config.BLOCK_K:
        # A deep GEMV tile (512, 1024) need not divide a K of a few super-blocks.
        why = f"BLOCK_K={config.BLOCK_K} does not divide K={facts.K}"
        return Replaced(_stand_in(device, facts), why)
    tiles = facts.K // config.BLOCK_K
    split = config.SPLIT_K
    while split > 1 and tiles % split:
        split //= 2
    if split == config.SPLIT_K:
        return config
    why = f"SPLIT_K={config.SPLIT_K} does not divide the {tiles} BLOCK_K={config.BLOCK_K} tiles of K={facts.K}"
    return Replaced(replace(config, SPLIT_K=split), why)


KERNEL = Kernel(
    "q4k_fp8_gemm",
    arguments=[
        # Any strides: the launch copies an x whose K stride is not 1.
        Tensor("x", ("*M", "K"), dtypes=(torch.bfloat16, torch.float16)),
        Obj(
            "weight",
            Q4KWeight,
            ("N", "K_weight"),
            parts=("qs", "scales", "mins", "super_scales"),
            split=Q4KWeight.tensors,
            join=Q4KWeight.from_parts,
        ),
        Tensor("bias", ("N",), floating=True, optional=True),
        Output("out", like="x", dims=("*M", "N"), contiguous=True),
    ],
    # Named on x, whose last dim is what a caller gets wrong (the weight's K is fixed by its file).
    rules=[
        Rule(
            "x", lambda K, K_weight: K_weight == K, "expected shape [..., K={K_weight}] to match the weight, got K={K}"
        )
    ],
    facts=("M", "N", "K", "dtype"),
    space=SPACE,
    key_type=Q4KKey,
    key=key_for,
    launch=launch,
    reference=q4k_linear_reference,
    jit_kernels=JIT_KERNELS,
    # Small-M trials are graph-timed (the tuning half's launch_bound), large-M ones eager.
    protocol=1,
    default=default_config,
    serve=serve,
    fallback_key=accurate_key,
    tuning="tritune.kernels.q4k.tuning:TUNING",
    op_name="tritune::q4k_linear",
)


def q4k_linear(
    x: torch.Tensor, weight: Q4KWeight, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W^T + bias`` for a Q4_K weight ``W`` ``[N, K]``; ``x`` is ``[..., K]`` bf16 or fp16.

    The result is ``[..., N]`` in x's dtype, written to ``out`` when given (contiguous, sharing no
    memory with x, bias or the weight). The config (portable, GEMV or dequant path, with
    ``TRITUNE_Q4K_FP8=1`` also fp8, staged or int8, tiles, split-K) comes from the dispatcher for
    this GPU, M bucket, N, K and the opt-in.
    """
    return KERNEL.call(x, weight, bias, out)  # type: ignore[no-any-return]
