"""The ``q4k_fp8_gemm`` config space, defaults, serving rules and tuning half (no kernel runs here).

One member space per path, each holding only the fields its launch reads; the union's fields and
choices are what the sampler and stored configs have always used. The feasibility rules are
fitted to what Triton 3.6 and ptxas make of each kernel for sm_90 (``test_fold_builds_for_sm90``
builds them with Triton's compiler on the CPU).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tritune.kernels import dispatcher, settings, use_config
from tritune.kernels.device import DeviceInfo, device_info, interpreter_device
from tritune.kernels.dispatcher import DISPATCHER, dispatch_config
from tritune.kernels.q4k.kernel import (
    KERNEL,
    Q4KKey,
    accurate_default,
    accurate_key,
    default_config,
    gemv_default,
    key_for,
    portable_default,
)
from tritune.kernels.q4k.reference import GGML_MAX_NMSE, MIN_SQNR_DB
from tritune.kernels.q4k.tuning import TUNING
from tritune.search_spaces.base import ConfigError, TargetLimits
from tritune.search_spaces.q4k_fp8_gemm import (
    FP8_OPT_IN_REASON,
    SPACE,
    DequantConfig,
    Fp8Config,
    GemvConfig,
    Int8Config,
    PortableConfig,
    StagedConfig,
    TmaConfig,
    smem_bytes,
)

H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
A100 = DeviceInfo(name="NVIDIA A100", vendor="nvidia", capability=(8, 0), sm_count=108, arch="sm80")
L40S = DeviceInfo(name="NVIDIA L40S", vendor="nvidia", capability=(8, 9), sm_count=142, arch="sm89")
LIMITS = TargetLimits()
INTERPRETER = TargetLimits(interpreter=True)


def _key(m: int, n: int = 14336, k: int = 4096, dtype: str = "bfloat16", fp8: bool = True) -> Q4KKey:
    """An H200 key; with the fp8 opt-in unless ``fp8=False`` (most rules here are the fp8 paths')."""
    return Q4KKey(arch="sm90", sm_count=132, dtype=dtype, m_bucket=m, n=n, k=k, fp8=fp8)


def _facts(m: int, n: int, k: int, dtype: str = "bf16") -> tuple[int, int, int, str]:
    return KERNEL.Facts(m, n, k, dtype)  # type: ignore[no-any-return]


# ---- the union of per-path spaces ------------------------------------------------------------


def test_each_path_holds_only_the_fields_its_launch_reads():
    fields = {path: tuple(member.dimensions) for path, member in SPACE.members.items()}
    tiles = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SPLIT_K")
    assert fields == {
        "portable": ("path", *tiles),
        "fp8": ("path", *tiles, "SCALE_FOLD", "SWAP_AB"),
        "staged": ("path", "BLOCK_N", "BLOCK_K", "num_warps", "CHUNK_N", "FAST_ACCUM"),
        "gemv": ("path", "BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K", "FUSE_QUANT", "FUSED_REDUCE", "K_LANES"),
        "int8": ("path", *tiles, "SWAP_AB"),
        "dequant": ("path", "BLOCK_N", "BLOCK_K", "num_warps", "CHUNK_N"),
        "tma": (
            "path",
            *tiles[:3],
            *tiles[4:],
            "SWAP_AB",
            "FUSED_REDUCE",
            "PACKED_DEQUANT",
            "LOADER_WARP",
            "W_REGISTERS",
        ),
    }
    # What the sampler sees: every field with the choices stored configs have always used.
    assert SPACE.dimensions == {
        "path": ("portable", "fp8", "staged", "gemv", "int8", "dequant", "tma"),
        "BLOCK_M": (16, 32, 64, 128, 256, 512),
        "BLOCK_N": (32, 64, 128, 256),
        "BLOCK_K": (32, 64, 128, 256, 512, 1024),
        "GROUP_M": (1, 4, 8),
        "num_warps": (2, 4, 8),
        "num_stages": (1, 2, 3, 4, 5),
        "SPLIT_K": (1, 2, 4, 8),
        "SCALE_FOLD": (False, True),
        "SWAP_AB": (False, True),
        "CHUNK_N": (32, 1024, 2048, 4096, 8192, 16384, 32768),
        "FAST_ACCUM": (False, True),
        "FUSE_QUANT": (False, True),
        "FUSED_REDUCE": (False, True),
        "K_LANES": (False, True),
        "PACKED_DEQUANT": (False, True),
        "LOADER_WARP": (False, True),
        "W_REGISTERS": (False, True),
    }
    # A field keeps its choices on every path that can launch them: 256-row x tiles exist for the
    # swapped fp8 and the tma kernels only, K tiles beyond a super-block for the GEMV only.
    assert SPACE.members["portable"].dimensions["BLOCK_M"] == (16, 32, 64, 128)
    assert SPACE.members["fp8"].dimensions["BLOCK_M"] == (16, 32, 64, 128, 256)
    assert SPACE.members["tma"].dimensions["BLOCK_M"] == (16, 32, 64, 128, 256, 512)
    assert max(SPACE.members["staged"].dimensions["BLOCK_K"]) == 256
    assert max(SPACE.members["gemv"].dimensions["BLOCK_K"]) == 1024
    # The staged path's e4m3 chunk holds a whole 28672-row weight, the dequant path's bf16 one 14336 rows.
    assert SPACE.members["staged"].dimensions["CHUNK_N"] == (32, 1024, 2048, 4096, 8192, 16384, 32768)
    assert SPACE.members["dequant"].dimensions["CHUNK_N"] == (32, 1024, 2048, 4096, 8192, 16384)


def test_pins_and_stored_configs_parse_to_their_paths_defaults():
    assert SPACE.default() == PortableConfig() == KERNEL.pinned_config({})
    assert KERNEL.pinned_config({"path": "fp8"}) == Fp8Config() and Fp8Config().BLOCK_K == 128
    assert KERNEL.pinned_config({"path": "staged"}) == StagedConfig(BLOCK_N=32, BLOCK_K=256, CHUNK_N=2048)
    assert KERNEL.pinned_config({"path": "gemv", "SPLIT_K": 2}) == GemvConfig(SPLIT_K=2)
    folded = KERNEL.pinned_config({"path": "fp8", "SCALE_FOLD": True})
    assert folded == dataclasses.replace(Fp8Config(), SCALE_FOLD=True)
    # A field the pinned path does not read is refused, not silently dropped: without "path" the
    # pin is the portable kernel's, which has no SCALE_FOLD.
    with pytest.raises(ConfigError, match=r"path='portable' has no field\(s\) \['SCALE_FOLD', 'SWAP_AB'\]"):
        KERNEL.pinned_config({"SCALE_FOLD": True, "SWAP_AB": True, "BLOCK_M": 128})
    with pytest.raises(ConfigError, match=r"path='staged' has no field\(s\) \['SPLIT_K'\]"):
        KERNEL.pinned_config({"path": "staged", "SPLIT_K": 2})
    with pytest.raises(ConfigError, match="BLOCK_M=256 is not in the space"):
        KERNEL.pinned_config({"BLOCK_M": 256})
    with pytest.raises(ConfigError, match="BLOCK_K=512 is not in the space"):
        KERNEL.pinned_config({"path": "fp8", "BLOCK_K": 512})
    assert KERNEL.pinned_config({"path": "gemv", "BLOCK_K": 512}).BLOCK_K == 512


def test_the_grid_holds_each_launch_once():
    grid = list(SPACE.grid())
    assert len(grid) == SPACE.size() == len(set(grid))
    assert {c.path for c in grid} == set(SPACE.members)
    assert all(SPACE.parse(SPACE.to_dict(c)) == c for c in grid[::97])
    # The per-path grids, where the old flat product held 2.6 million configs.
    assert SPACE.size() == (
        4 * 4 * 4 * 3 * 3 * 5 * 4 + 5 * 4 * 4 * 3 * 3 * 5 * 4 * 4 + 4 * 4 * 3 * 7 * 2 + 4 * 6 * 3 * 4 * 2 * 2 * 2
        + 5 * 4 * 4 * 3 * 3 * 5 * 4 * 2 + 4 * 4 * 3 * 6 + 6 * 2 * 3 * 2 * 3 * 4 * 2 * 2 * 2 * 2 * 2
    )  # fmt: skip


def test_a_proposal_keeps_its_paths_fields():
    proposal = {name: options[-1] for name, options in SPACE.dimensions.items()}
    staged = SPACE.from_proposal({**proposal, "path": "staged", "BLOCK_K": 128})
    assert staged == StagedConfig(BLOCK_N=256, BLOCK_K=128, num_warps=8, CHUNK_N=32768, FAST_ACCUM=True)
    with pytest.raises(ConfigError, match="CHUNK_N=32768 is not in the space"):
        SPACE.from_proposal({**proposal, "path": "dequant", "BLOCK_K": 256})
    dequant = SPACE.from_proposal({**proposal, "path": "dequant", "BLOCK_K": 256, "CHUNK_N": 16384})
    assert dequant == DequantConfig(BLOCK_N=256, BLOCK_K=256, num_warps=8, CHUNK_N=16384)
    with pytest.raises(ConfigError, match="BLOCK_K=1024 is not in the space"):
        SPACE.from_proposal({**proposal, "path": "staged"})


# ---- portable defaults -----------------------------------------------------------------------

#: (arch, SMs, m_bucket, N, K) -> portable tiles (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages,
#: SPLIT_K), the defaults served since they were chosen on Llama-3-8B shapes (docs/perf/HISTORY.md).
DEFAULTS = {
    ("sm90", 132, 1, 14336, 4096): (16, 64, 256, 1, 4, 3, 1),
    ("sm90", 132, 16, 14336, 4096): (16, 64, 256, 1, 4, 3, 1),
    ("sm90", 132, 32, 14336, 4096): (32, 64, 128, 1, 4, 4, 1),
    ("sm90", 132, 64, 14336, 4096): (64, 64, 128, 1, 4, 4, 1),
    ("sm90", 132, 128, 14336, 4096): (128, 128, 64, 1, 8, 3, 1),
    # 128x128 tiles would make fewer programs than half the SMs: split 64-row tiles instead.
    ("sm90", 132, 128, 4096, 14336): (64, 64, 128, 1, 4, 4, 2),
    # Where no dequant chunk fits the scratch cap (K=131072), the portable rules' tiles are what
    # serves from M=256 off SM90 (on SM90 the tma path up to M=256): split where 128x128 tiles
    # would idle most SMs, else those.
    ("sm90", 132, 256, 4096, 131072): (64, 64, 128, 1, 4, 4, 1),
    ("sm90", 132, 256, 14336, 131072): (128, 128, 64, 8, 8, 3, 1),
    ("sm90", 132, 8192, 4096, 131072): (128, 128, 64, 8, 8, 3, 1),
    ("sm90", 132, 1, 4096, 14336): (16, 64, 256, 1, 4, 3, 4),
    ("sm90", 132, 32, 4096, 14336): (32, 64, 128, 1, 4, 4, 4),
    ("sm90", 132, 64, 4096, 4096): (64, 64, 128, 1, 4, 4, 4),
    ("sm80", 108, 1, 1000, 768): (16, 64, 256, 1, 4, 3, 1),
    ("sm80", 108, 64, 1000, 768): (64, 64, 128, 1, 4, 4, 2),
    ("cpu-interpreter", 1, 16, 64, 256): (16, 32, 64, 1, 4, 1, 1),
    ("cpu-interpreter", 1, 32, 64, 256): (32, 32, 64, 1, 4, 1, 1),
}


@pytest.mark.parametrize("where", sorted(DEFAULTS), ids=lambda w: "-".join(map(str, w)))
def test_portable_defaults_by_m_bucket(where):
    """The portable rules (what serves below M=256 where the tma path does not: off SM90, below
    16 rows, and where no tma tile fits the weight)."""
    arch, sms, m, n, k = where
    config = portable_default(Q4KKey(arch=arch, sm_count=sms, dtype="bfloat16", m_bucket=m, n=n, k=k, fp8=False))
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SPLIT_K")
    assert isinstance(config, PortableConfig)
    assert tuple(getattr(config, name) for name in names) == DEFAULTS[where]


#: (arch, SMs, m_bucket, N, K) -> the GEMV default's (BLOCK_N, BLOCK_K, SPLIT_K). On SM90 at M=1,
#: and at M=4 for N=14336 and for K=14336, these are the tiles the re-tunes on an H100 chose.
GEMV_DEFAULTS = {
    ("sm90", 132, 1, 14336, 4096): (64, 512, 2),
    ("sm90", 132, 1, 4096, 14336): (32, 512, 4),
    ("sm90", 132, 1, 4096, 4096): (64, 512, 8),
    ("sm90", 132, 1, 6144, 4096): (64, 512, 8),
    ("sm90", 132, 1, 28672, 4096): (64, 512, 1),
    ("sm90", 132, 2, 14336, 4096): (64, 512, 2),
    # From M=3 (bucket 4) 256-deep tiles: 512-deep ones of 64 rows would be 128 product words a thread.
    ("sm90", 132, 4, 14336, 4096): (64, 256, 2),
    ("sm90", 132, 4, 4096, 14336): (64, 256, 8),
    ("sm90", 132, 4, 4096, 4096): (64, 256, 8),
    ("sm80", 108, 1, 4096, 4096): (64, 512, 8),
    ("sm61", 20, 1, 4096, 4096): (64, 512, 1),
    # 512 does not divide K: 256-deep tiles. Splitting stops short of 3 programs an SM: the most.
    ("sm90", 132, 1, 4096, 768): (32, 256, 1),
    ("sm90", 132, 1, 512, 4096): (32, 512, 8),
}


@pytest.mark.parametrize("where", sorted(GEMV_DEFAULTS), ids=lambda w: "-".join(map(str, w)))
def test_gemv_default_up_to_four_rows_on_nvidia(where):
    """Up to M=4 on an NVIDIA GPU (dp4a, SM61+) the default is the one-launch GEMV with its lanes
    along K: 4 warps, the split (then the narrower tile) raised until about three programs an SM."""
    arch, sms, m, n, k = where
    key = Q4KKey(arch=arch, sm_count=sms, dtype="bfloat16", m_bucket=m, n=n, k=k, fp8=False)
    config = default_config(key)
    assert isinstance(config, GemvConfig)
    assert GEMV_DEFAULTS[where] == (config.BLOCK_N, config.BLOCK_K, config.SPLIT_K)
    assert config.K_LANES and config.FUSE_QUANT and config.num_warps == 4
    assert (config.SPLIT_K > 1) == config.FUSED_REDUCE
    assert SPACE.infeasible_reason(config, key, TargetLimits(smem_bytes=228 * 1024)) is None


@pytest.mark.parametrize(
    "arch, m, k",
    [("sm90", 8, 4096), ("sm60", 1, 4096), ("sm75", 16, 4096), ("gfx942", 1, 4096), ("cpu-interpreter", 1, 256)],
)
def test_no_gemv_default_past_four_rows_or_without_dp4a(arch, m, k):
    """From M=8, on GPUs without dp4a (before SM61, ROCm) and on the interpreter the default is
    the accurate rule's (the portable tiles at these M)."""
    key = Q4KKey(arch=arch, sm_count=8, dtype="bfloat16", m_bucket=m, n=4096, k=k, fp8=False)
    assert gemv_default(key) is None
    assert default_config(key) == accurate_default(key) == portable_default(key)


#: (rows of x, N, K, opt-in, TORCH_CUDA_ARCH_LIST naming an older GPU too) -> (the default's path,
#: the stand-in's path, a word of the reason): the GEMV needs dp4a (SM61), the staged path SM90.
BUILD_STAND_INS = {
    (1, 4096, 4096, False, "6.0;9.0"): ("gemv", "portable", "dp4a"),
    (2048, 14336, 4096, True, "8.0;9.0"): ("staged", "dequant", "SM90"),
}


@pytest.mark.parametrize(("m", "n", "k", "opt_in", "arch_list"), list(BUILD_STAND_INS))
def test_a_default_the_build_cannot_run_gives_way_to_the_accurate_tiles(monkeypatch, m, n, k, opt_in, arch_list):
    """Where TORCH_CUDA_ARCH_LIST also names a GPU the default's path cannot run on, its stand-in
    is the accurate rule's, not that path again."""
    path, stand_in, reason = BUILD_STAND_INS[(m, n, k, opt_in, arch_list)]
    facts = _facts(m, n, k)
    with settings.override(q4k_fp8=opt_in):
        default = KERNEL.default_config(key_for(H200, facts))
        assert default.path == path
        assert KERNEL.serve_with_reason(default, H200, facts) == (default, None)
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
        served, why = KERNEL.serve_with_reason(default, H200, facts)
        assert served == accurate_default(key_for(H200, facts)) and served.path == stand_in
        assert why is not None and reason in why


#: (arch, m_bucket, N, K) of an opt-in key -> the staged default's CHUNK_N (the whole weight where
#: its e4m3 scratch fits 128 MiB, else the largest chunk at most half of N that does), or None
#: where the accurate default serves under the opt-in too.
STAGED_DEFAULTS = {
    ("sm90", 1024, 4096, 4096): 4096,
    ("sm90", 2048, 14336, 4096): 16384,
    ("sm90", 8192, 28672, 4096): 32768,
    ("sm90", 4096, 6144, 4096): 8192,
    ("sm90", 4096, 4096, 14336): 4096,
    ("sm90", 4096, 16384, 16384): 8192,
    ("sm100", 2048, 4096, 4096): 4096,
    ("sm90", 512, 4096, 4096): None,
    ("sm89", 2048, 4096, 4096): None,
    ("sm80", 2048, 4096, 4096): None,
    ("sm90", 2048, 1024, 4096): 1024,
    ("sm90", 2048, 1000, 4096): None,
}


@pytest.mark.parametrize(("arch", "m", "n", "k"), list(STAGED_DEFAULTS))
def test_the_staged_path_is_the_opt_in_default_from_1024_rows_on_sm90(arch, m, n, k):
    """Under the opt-in from M=1024 on SM90+, the staged path with its largest admitted chunk; its
    accurate twin keeps the accurate rule, and so does an opt-in key below SM90 or M=1024."""
    key = Q4KKey(arch=arch, sm_count=132, dtype="bfloat16", m_bucket=m, n=n, k=k, fp8=True)
    chunk = STAGED_DEFAULTS[(arch, m, n, k)]
    default = KERNEL.default_config(key)
    if chunk is None:
        assert default == accurate_default(key) and default.path != "staged"
    else:
        assert default == StagedConfig(BLOCK_N=128, BLOCK_K=64, num_warps=8, CHUNK_N=chunk)
        assert SPACE.infeasible_reason(default, key, KERNEL.limits(H200)) is None
    assert KERNEL.default_config(dataclasses.replace(key, fp8=False)).path in ("dequant", "tma")
    assert KERNEL.default_config(dataclasses.replace(key, dtype="float16")).path != "staged"


#: (arch, SMs, m_bucket, N, K) -> the dequant default's CHUNK_N: the whole weight where its bf16
#: scratch fits 128 MiB, else the widest chunk that does.
DEQUANT_DEFAULTS = {
    ("sm90", 132, 1024, 4096, 4096): 4096,
    ("sm90", 132, 1024, 6144, 4096): 8192,
    ("sm80", 108, 256, 4096, 4096): 4096,
    ("sm90", 132, 1024, 4096, 14336): 4096,
    ("sm90", 132, 1024, 28672, 4096): 16384,
    ("sm90", 132, 8192, 4096, 4096): 4096,
    ("sm90", 132, 1024, 4096, 65536): 1024,
    ("sm90", 132, 512, 512, 4096): 1024,
    ("sm80", 108, 2048, 14336, 4096): 16384,
    ("sm75", 40, 256, 4096, 4096): 4096,
    ("gfx942", 304, 4096, 14336, 4096): 16384,
}


@pytest.mark.parametrize("where", sorted(DEQUANT_DEFAULTS), ids=lambda w: "-".join(map(str, w)))
def test_dequant_default_from_256_rows(where):
    """From M=256 up (on SM90 where the tma path's wide tiles do not serve: M=512 where they
    would leave most SMs idle, and from M=1024) a GPU key's default dequantizes the weight
    once per call into the vendor GEMM (every GPU runs it, and it meets the accuracy contract),
    32 x 256 tiles of 8 warps."""
    arch, sms, m, n, k = where
    key = Q4KKey(arch=arch, sm_count=sms, dtype="bfloat16", m_bucket=m, n=n, k=k, fp8=False)
    config = default_config(key)
    assert config == DequantConfig(BLOCK_N=32, BLOCK_K=256, num_warps=8, CHUNK_N=DEQUANT_DEFAULTS[where])
    assert SPACE.infeasible_reason(config, key, TargetLimits()) is None
    # One bucket lower the in-loop paths choose (portable, or tma on SM90).
    assert isinstance(default_config(dataclasses.replace(key, m_bucket=128)), PortableConfig | TmaConfig)


def test_gpu_keys_and_feasible_defaults():
    """Every power-of-two M from 1 to 8192 at the five Llama-3-8B linear shapes (fused QKV and
    gate-up included) with accurate keys, and from M=64 up with opt-in keys (the accurate key's
    winner serves smaller opt-in calls)."""
    keys = KERNEL.default_keys(H200)
    shapes = {(4096, 14336), (14336, 4096), (4096, 4096), (4096, 6144), (4096, 28672)}
    powers = {2**i for i in range(14)}
    assert len(keys) == len(set(keys)) == 5 * 14 + 5 * 8
    assert {(k.k, k.n, k.m_bucket) for k in keys if not k.fp8} == {(*s, m) for s in shapes for m in powers}
    assert {(k.k, k.n, k.m_bucket) for k in keys if k.fp8} == {(*s, m) for s in shapes for m in powers if m >= 64}
    assert 512 in {k.m_bucket for k in keys if not k.fp8}
    limits = KERNEL.limits(H200)
    for key in keys:
        # A feasible default is a member of the space's feasible configs: the key can be tuned.
        assert SPACE.infeasible_reason(KERNEL.default_config(key), key, limits) is None, key
    assert key_for(H200, _facts(3, 14336, 4096)) == _key(4, fp8=False)
    assert key_for(H200, _facts(3, 14336, 4096, "fp16")).dtype == "float16"
    with settings.override(q4k_fp8=True):
        # Below OPT_IN_MIN_M rows a GPU call keeps the accurate key: no opt-in neighbour is borrowed.
        assert key_for(H200, _facts(3, 14336, 4096)) == _key(4, fp8=False)
        assert key_for(H200, _facts(63, 14336, 4096)) == _key(64, fp8=True)
        assert key_for(H200, _facts(500, 14336, 4096)) == _key(512, fp8=True)


def test_no_opt_in_key_below_its_smallest_m_on_a_gpu():
    """`tune --m 1 --m 16` must not make opt-in keys whose winners nothing serves."""
    assert not TUNING.valid_key(_key(16, fp8=True))
    assert TUNING.valid_key(_key(16, fp8=False)) and TUNING.valid_key(_key(64, fp8=True))
    a100 = dataclasses.replace(H200, capability=(8, 0), arch="sm80")
    assert {k.m_bucket for k in KERNEL.default_keys(a100) if k.fp8} == {2**i for i in range(6, 14)}
    t4 = dataclasses.replace(H200, capability=(7, 5), arch="sm75")
    assert not any(k.fp8 for k in KERNEL.default_keys(t4))


def test_tuning_keys_aliases_and_validity():
    (key,) = TUNING.default_keys(interpreter_device())
    assert (key.m_bucket, key.n, key.k, key.dtype, key.fp8) == (16, 64, 256, "bfloat16", False)
    field, transform = TUNING.key_aliases["m"]
    assert field == "m_bucket" and [transform(m) for m in (1, 3, 4, 100)] == [1, 4, 4, 128]
    assert TUNING.valid_key(_key(16, fp8=False)) and TUNING.valid_key(_key(128))
    for bad in (_key(16, k=300, fp8=False), _key(16, dtype="float32", fp8=False), _key(3, fp8=False), _key(16, n=0)):
        assert not TUNING.valid_key(bad), bad


# ---- feasibility -----------------------------------------------------------------------------


def test_mma_tile_rules():
    key = _key(4096, n=4096)
    assert "SPLIT_K" in SPACE.infeasible_reason(PortableConfig(SPLIT_K=2), key, LIMITS)
    huge = PortableConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=256, num_warps=8, num_stages=5)
    assert "shared memory" in SPACE.infeasible_reason(huge, key, LIMITS)
    small_blocks = SPACE.infeasible_reason(PortableConfig(BLOCK_N=256), key, INTERPRETER)
    assert small_blocks is not None and "interpreter" in small_blocks
    folded = Fp8Config(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, SCALE_FOLD=True)
    assert SPACE.infeasible_reason(folded, key, LIMITS) is None
    # 128 accumulator registers plus a 128x256 float32 weight tile over 4 warps.
    wide = dataclasses.replace(folded, BLOCK_K=256, num_warps=4)
    assert "weight tile" in SPACE.infeasible_reason(wide, key, LIMITS)
    # The rule is the folded kernel's: the unfolded one keeps its feasible configs.
    assert SPACE.infeasible_reason(dataclasses.replace(wide, SCALE_FOLD=False), key, LIMITS) is None


def test_staged_rules():
    """The staged path varies its dequantization tile, chunk and accumulation only, at large M,
    bf16 and N, K multiples of 16: at most half the weight a chunk, or the whole weight at once
    (the smallest chunk that holds it, one GEMM) where its e4m3 scratch fits 128 MiB."""
    key = _key(4096)
    staged = StagedConfig(BLOCK_N=32, BLOCK_K=256, CHUNK_N=2048)
    assert SPACE.infeasible_reason(staged, key, LIMITS) is None
    assert SPACE.infeasible_reason(dataclasses.replace(staged, FAST_ACCUM=True), key, LIMITS) is None
    assert "M > 64" in SPACE.infeasible_reason(staged, _key(64), LIMITS)
    assert "half or more" in SPACE.infeasible_reason(staged, _key(4096, n=4096 - 16), LIMITS)
    assert SPACE.infeasible_reason(staged, _key(4096, n=4096), LIMITS) is None
    assert "bfloat16" in SPACE.infeasible_reason(staged, _key(4096, dtype="float16"), LIMITS)
    assert "multiples of 16" in SPACE.infeasible_reason(staged, _key(4096, n=14328), LIMITS)
    assert "below 1024" in SPACE.infeasible_reason(dataclasses.replace(staged, CHUNK_N=32), key, LIMITS)
    assert "BLOCK_K >= 64" in SPACE.infeasible_reason(dataclasses.replace(staged, BLOCK_K=32), key, LIMITS)
    whole = dataclasses.replace(staged, CHUNK_N=4096)
    assert SPACE.infeasible_reason(whole, _key(4096, n=4096), LIMITS) is None
    assert "same launch as CHUNK_N=4096" in SPACE.infeasible_reason(
        dataclasses.replace(staged, CHUNK_N=8192), _key(4096, n=4096), LIMITS
    )
    widest = dataclasses.replace(staged, CHUNK_N=32768)
    assert SPACE.infeasible_reason(widest, _key(4096, n=28672), LIMITS) is None  # 112 MiB of e4m3
    assert "224 MiB scratch" in SPACE.infeasible_reason(widest, _key(4096, n=28672, k=8192), LIMITS)
    # The interpreter tries it at its tiny keys, with its small chunk.
    tiny_key = Q4KKey(arch="cpu-interpreter", sm_count=1, dtype="bfloat16", m_bucket=16, n=64, k=256, fp8=True)
    tiny = dataclasses.replace(staged, BLOCK_K=64, CHUNK_N=32)
    assert SPACE.infeasible_reason(tiny, tiny_key, INTERPRETER) is None
    assert any(c.path == "staged" for c in SPACE.feasible(key, LIMITS))
    assert not any(c.path == "staged" for c in SPACE.feasible(_key(16), LIMITS))


def test_swap_rules():
    """SWAP_AB exists with SCALE_FOLD only, BLOCK_M=256 with it only, and its tiles follow what
    Triton 3.6 and ptxas make of the swapped kernel for sm_90 (tests/test_sm90_build.py)."""
    key = _key(4096)
    swapped = Fp8Config(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, SCALE_FOLD=True, SWAP_AB=True)
    assert SPACE.infeasible_reason(swapped, key, LIMITS) is None
    # The same launch as SWAP_AB=False: pruned as a duplicate.
    duplicate = dataclasses.replace(swapped, SCALE_FOLD=False, BLOCK_M=128)
    assert "SWAP_AB only changes" in SPACE.infeasible_reason(duplicate, key, LIMITS)
    # BLOCK_M=256 keeps the other kernels' spaces as they were.
    unswapped = dataclasses.replace(swapped, SWAP_AB=False)
    assert "BLOCK_M=256" in SPACE.infeasible_reason(unswapped, key, LIMITS)
    assert SPACE.infeasible_reason(dataclasses.replace(unswapped, BLOCK_M=128), key, LIMITS) is None
    # 64 weight rows per warpgroup: 8 warps need BLOCK_N=128, 2 warps have no warpgroup.
    assert "per warpgroup" in SPACE.infeasible_reason(dataclasses.replace(swapped, BLOCK_N=64), key, LIMITS)
    narrow = dataclasses.replace(swapped, BLOCK_M=128, BLOCK_N=64, num_warps=4)
    assert SPACE.infeasible_reason(narrow, key, LIMITS) is None
    assert "per warpgroup" in SPACE.infeasible_reason(dataclasses.replace(narrow, num_warps=2), key, LIMITS)
    assert "BLOCK_K >= 64" in SPACE.infeasible_reason(dataclasses.replace(swapped, BLOCK_K=32), key, LIMITS)
    assert "num_stages >= 2" in SPACE.infeasible_reason(dataclasses.replace(swapped, num_stages=1), key, LIMITS)
    # A tile the unswapped folded kernel holds without spilling, the swapped one does not.
    wide = Fp8Config(BLOCK_M=64, BLOCK_N=128, BLOCK_K=256, num_warps=4, SCALE_FOLD=True, SWAP_AB=True)
    assert "weight tile" in SPACE.infeasible_reason(wide, key, LIMITS)
    assert SPACE.infeasible_reason(dataclasses.replace(wide, SWAP_AB=False), key, LIMITS) is None
    # The weight tile never passes through shared memory.
    same_tile = dataclasses.replace(swapped, BLOCK_M=128)
    assert smem_bytes(same_tile) < smem_bytes(dataclasses.replace(same_tile, SWAP_AB=False))
    # The interpreter runs the swapped kernel at its small tiles, whatever wgmma would need.
    tiny = Fp8Config(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_stages=1, GROUP_M=1, SCALE_FOLD=True, SWAP_AB=True)
    assert SPACE.infeasible_reason(tiny, _key(16), INTERPRETER) is None
    assert "per warpgroup" in SPACE.infeasible_reason(tiny, _key(16), LIMITS)


def test_gemv_rules():
    """One row of x on a GPU (two or more spill), K tiles up to 1024 that divide K and its split."""
    gemv = GemvConfig(BLOCK_N=32, BLOCK_K=256, SPLIT_K=2)
    assert SPACE.infeasible_reason(gemv, _key(1), LIMITS) is None
    assert "M <= 1" in SPACE.infeasible_reason(gemv, _key(2), LIMITS)
    assert "does not divide" in SPACE.infeasible_reason(dataclasses.replace(gemv, SPLIT_K=8), _key(1, k=768), LIMITS)
    assert "exceed 32" in SPACE.infeasible_reason(GemvConfig(BLOCK_N=256, BLOCK_K=1024), _key(1), LIMITS)
    assert "leave threads" in SPACE.infeasible_reason(GemvConfig(BLOCK_N=32, BLOCK_K=32, num_warps=8), _key(1), LIMITS)
    # The interpreter's tiny keys take it at any M.
    assert SPACE.infeasible_reason(GemvConfig(BLOCK_N=32), _key(16, n=64, k=256), INTERPRETER) is None


def test_gemv_one_launch_rules():
    """FUSED_REDUCE only where there is a split to reduce (else the same launch); FUSE_QUANT only
    where each thread quantizes 4 values of a sub-block, as the pre-pass's do (the same sums)."""
    fused = GemvConfig(BLOCK_N=32, BLOCK_K=256, SPLIT_K=4, FUSE_QUANT=True, FUSED_REDUCE=True)
    assert SPACE.infeasible_reason(fused, _key(1), LIMITS) is None
    alone = dataclasses.replace(fused, SPLIT_K=1)
    assert "SPLIT_K > 1" in SPACE.infeasible_reason(alone, _key(1), LIMITS)
    assert "SPLIT_K > 1" in SPACE.infeasible_reason(alone, _key(16, n=64, k=256), INTERPRETER)
    assert SPACE.infeasible_reason(dataclasses.replace(alone, FUSED_REDUCE=False), _key(1), LIMITS) is None
    deep = GemvConfig(BLOCK_N=32, BLOCK_K=1024, SPLIT_K=2, FUSE_QUANT=True)
    assert "BLOCK_K <= 128 * num_warps" in SPACE.infeasible_reason(deep, _key(1), LIMITS)
    assert SPACE.infeasible_reason(dataclasses.replace(deep, num_warps=8), _key(1), LIMITS) is None
    assert SPACE.infeasible_reason(dataclasses.replace(deep, FUSE_QUANT=False), _key(1), LIMITS) is None
    # Stored configs without the fields (bundles written before them) are today's launches.
    assert KERNEL.pinned_config({"path": "gemv", "SPLIT_K": 4}) == GemvConfig(SPLIT_K=4)
    assert GemvConfig().FUSE_QUANT is False and GemvConfig().FUSED_REDUCE is False
    assert GemvConfig().K_LANES is False


def test_gemv_takes_up_to_four_rows_only_as_one_launch_along_k():
    """Two to four rows of x: the one-launch GEMV with its lanes along K only, at up to 64 product
    words a thread; one row keeps every GEMV form at 32; eight rows none."""
    along_k = GemvConfig(BLOCK_N=64, BLOCK_K=256, SPLIT_K=8, FUSE_QUANT=True, FUSED_REDUCE=True, K_LANES=True)
    for m in (2, 4):
        assert SPACE.infeasible_reason(along_k, _key(m), LIMITS) is None, m
        for other in (dataclasses.replace(along_k, K_LANES=False), dataclasses.replace(along_k, FUSE_QUANT=False)):
            assert "without K_LANES and FUSE_QUANT" in SPACE.infeasible_reason(other, _key(m), LIMITS), (m, other)
        starts = [c for c in KERNEL.starting_configs(_key(m), H200) if isinstance(c, GemvConfig)]
        assert starts and all(c.K_LANES and c.FUSE_QUANT for c in starts), (m, starts)
    assert "M <= 4" in SPACE.infeasible_reason(along_k, _key(8), LIMITS)
    # 4 rows x 64 x 512 / 8 words over 128 threads: 128 product words a thread.
    deep = dataclasses.replace(along_k, BLOCK_K=512)
    assert "128 product words a thread" in SPACE.infeasible_reason(deep, _key(4), LIMITS)
    assert SPACE.infeasible_reason(deep, _key(2), LIMITS) is None
    # One row: 128 x 512 / 8 words over 128 threads is 64, past the one-row rule.
    wide = dataclasses.replace(along_k, BLOCK_N=128, BLOCK_K=512, SPLIT_K=1, FUSED_REDUCE=False)
    assert "exceed 32" in SPACE.infeasible_reason(wide, _key(1), LIMITS)


def test_the_tuner_can_choose_every_fp8_kernel():
    """SCALE_FOLD and SWAP_AB are dimensions: feasible at decode and prefill sizes, never a default."""
    limits = KERNEL.limits(H200)
    for m in (1, 16, 4096):
        key = _key(m)
        # The fp8 path is never a default: an accurate path is (the GEMV up to M=4, then portable,
        # tma on SM90 from M=32 to 512, then the dequant path), or under the opt-in from M=1024 the
        # staged path.
        expected = "gemv" if m <= 4 else "portable" if m < 32 else "tma" if m <= 256 else "staged"
        assert KERNEL.default_config(key).path == expected
        assert KERNEL.default_config(_key(m, fp8=False)).path == expected.replace("staged", "dequant")
        fp8 = [c for c in SPACE.feasible(key, limits) if isinstance(c, Fp8Config)]
        assert any(c.SCALE_FOLD and c.BLOCK_K == 256 for c in fp8), m
        assert any(c.SWAP_AB for c in fp8) and all(c.SCALE_FOLD for c in fp8 if c.SWAP_AB), m
        assert all(c.SWAP_AB for c in fp8 if c.BLOCK_M == 256)
    # BLOCK_M=256 (wgmma's widest N in the swapped kernel) where M fills it.
    assert any(c.BLOCK_M == 256 for c in fp8)


# ---- serving ---------------------------------------------------------------------------------


@pytest.fixture
def fp8_opt_in():
    with settings.override(q4k_fp8=True):
        yield


def test_serve_falls_back_where_a_path_cannot_run(fp8_opt_in):
    fp8 = KERNEL.pinned_config({"path": "fp8"})
    folded = KERNEL.pinned_config({"path": "fp8", "SCALE_FOLD": True})
    facts = _facts(16, 4096, 4096)
    assert KERNEL.serveable(fp8, A100, facts) == KERNEL.default_config(key_for(A100, facts))
    assert KERNEL.serveable(folded, A100, facts) == KERNEL.serveable(fp8, A100, facts)
    assert KERNEL.serveable(folded, H200, facts) == folded
    assert KERNEL.serveable(fp8, H200, facts) == fp8
    assert KERNEL.serveable(fp8, interpreter_device(), facts) == fp8
    staged = KERNEL.pinned_config({"path": "staged"})
    assert SPACE.infeasible_reason(staged, key_for(H200, _facts(4096, 14336, 4096)), KERNEL.limits(H200)) is None
    assert KERNEL.serveable(staged, H200, facts) == staged
    assert KERNEL.serveable(staged, interpreter_device(), facts) == staged
    # Row-wise scaled fp8 GEMMs: SM90+, bf16 out, N and K multiples of 16; else the portable default.
    for device, call in ((L40S, facts), (H200, _facts(16, 4096, 4096, "fp16")), (H200, _facts(16, 4088, 4096))):
        assert KERNEL.serveable(staged, device, call).path == "portable", (device.arch, call)
    # A split that does not divide K's tiles is narrowed rather than refused at launch.
    odd = KERNEL.serveable(PortableConfig(BLOCK_K=256, SPLIT_K=8), H200, _facts(1, 4096, 768))
    assert odd == PortableConfig(BLOCK_K=256, SPLIT_K=1)
    assert KERNEL.serveable(GemvConfig(BLOCK_K=256, SPLIT_K=4), H200, _facts(1, 4096, 512)).SPLIT_K == 2
    # int8 tensor cores: SM80+ (and the interpreter); before, the portable default.
    int8 = Int8Config(BLOCK_M=16, BLOCK_N=32, GROUP_M=1)
    assert KERNEL.serveable(int8, A100, facts) == int8
    assert KERNEL.serveable(int8, interpreter_device(), facts) == int8
    turing = DeviceInfo(name="NVIDIA T4", vendor="nvidia", capability=(7, 5), sm_count=40, arch="sm75")
    assert KERNEL.serveable(int8, turing, facts).path == "portable"


def test_without_the_opt_in_8_bit_pins_do_not_serve(caplog, monkeypatch):
    """A pinned fp8, staged or int8 config without TRITUNE_Q4K_FP8 is replaced by the portable
    default, with one warning line that names the setting (the dispatcher's, quoting the reason
    ``serve`` gives); the accurate paths serve as pinned."""
    facts = _facts(4096, 14336, 4096)
    default = KERNEL.default_config(key_for(H200, facts))
    pins = [
        {"path": "fp8"},
        {"path": "fp8", "SCALE_FOLD": True, "SWAP_AB": True},
        {"path": "staged"},
        {"path": "int8", "SWAP_AB": True},
    ]
    # Dispatch as on an H200 (the pin is served without reading any winner).
    monkeypatch.setattr("tritune.kernels.pins._rewritten_pins", set())
    monkeypatch.setattr(dispatcher, "device_info", lambda where: H200)
    with caplog.at_level("WARNING", logger="tritune"):
        for pin in pins:
            config = KERNEL.pinned_config(pin)
            assert KERNEL.serveable(config, H200, facts) == default, pin
            assert KERNEL.serve_with_reason(config, H200, facts) == (default, FP8_OPT_IN_REASON), pin
            DISPATCHER.clear()
            with use_config(KERNEL.name, pin):
                for _ in range(2):
                    assert dispatch_config(KERNEL.name, "cuda", 0, facts) == default, pin
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == len(pins), warnings
    for pin, message in zip(pins, warnings, strict=True):
        assert message.startswith(f"q4k_fp8_gemm: pinned config {KERNEL.pinned_config(pin)} cannot serve"), message
        assert f"({FP8_OPT_IN_REASON})" in message and "TRITUNE_Q4K_FP8=1" in message, message
    for accurate in (GemvConfig(), PortableConfig(BLOCK_M=128), DequantConfig()):
        assert KERNEL.serve_with_reason(accurate, H200, facts) == (accurate, None)


def test_a_narrowed_split_says_why():
    """serve's other rewrite of a pin, a SPLIT_K that does not divide K's tiles, names its reason too."""
    config = PortableConfig(BLOCK_K=256, SPLIT_K=8)
    served, why = KERNEL.serve_with_reason(config, H200, _facts(1, 4096, 768))
    assert served == PortableConfig(BLOCK_K=256, SPLIT_K=1)
    assert why == "SPLIT_K=8 does not divide the 3 BLOCK_K=256 tiles of K=768"


def test_int8_refuses_a_split_whose_int32_sums_could_overflow():
    limits = KERNEL.limits(H200)
    key = dataclasses.replace(_key(4096), k=256 * 600)  # 153600 K values
    assert "overflow" in SPACE.infeasible_reason(Int8Config(SPLIT_K=1), key, limits)
    assert "overflow" not in (SPACE.infeasible_reason(Int8Config(SPLIT_K=2), key, limits) or "")


def test_a_pinned_gemv_tile_deeper_than_k_divides_gives_way_with_its_reason():
    config = GemvConfig(BLOCK_N=32, BLOCK_K=512, num_warps=4, SPLIT_K=1)
    served, why = KERNEL.serve_with_reason(config, H200, _facts(1, 4096, 768))
    assert why == "BLOCK_K=512 does not divide K=768"
    assert served == default_config(key_for(H200, _facts(1, 4096, 768)))


def test_8_bit_paths_are_infeasible_at_accurate_keys():
    """At a key without the opt-in the tuner never tries the fp8, staged and int8 paths and the
    dispatcher never admits a stored winner of theirs; the accurate paths keep their configs."""
    limits = KERNEL.limits(H200)
    for m in (1, 16, 512, 4096):
        accurate, opt_in = _key(m, fp8=False), _key(m, fp8=True)
        paths = {c.path for c in SPACE.feasible(accurate, limits)}
        # The accurate dequant path beyond SMALL_M (its dense weight costs more than it saves below).
        # The tma path at every M of an SM90 key (the tuner starts from its tiles up to M=256 only).
        expected = {1: {"portable", "gemv", "tma"}, 16: {"portable", "tma"}}.get(m, {"portable", "dequant", "tma"})
        assert paths == expected, m
        opt_in_feasible = set(SPACE.feasible(opt_in, limits))
        assert set(SPACE.feasible(accurate, limits)) <= opt_in_feasible
        assert {"fp8", "int8"} <= {c.path for c in opt_in_feasible}
    for config in (Fp8Config(), StagedConfig(), Int8Config()):
        assert "TRITUNE_Q4K_FP8=1" in SPACE.infeasible_reason(config, _key(4096, fp8=False), limits)


def test_the_opt_in_key_falls_back_to_the_accurate_key():
    assert accurate_key(_key(512, fp8=True)) == _key(512, fp8=False)
    assert accurate_key(_key(512, fp8=False)) is None
    assert KERNEL.fallback_key(_key(64, fp8=True)) == _key(64, fp8=False)


def test_int8_rules():
    """The folded kernel's tile rules: BLOCK_M=256 with SWAP_AB only, 64 weight rows per warpgroup
    when swapped, the register estimate of the float32 weight tile; any M, dtype and N."""
    key = _key(4096)
    swapped = Int8Config(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, SWAP_AB=True)
    assert SPACE.infeasible_reason(swapped, key, LIMITS) is None
    assert "BLOCK_M=256" in SPACE.infeasible_reason(dataclasses.replace(swapped, SWAP_AB=False), key, LIMITS)
    assert "per warpgroup" in SPACE.infeasible_reason(dataclasses.replace(swapped, BLOCK_N=64), key, LIMITS)
    assert "num_stages >= 2" in SPACE.infeasible_reason(dataclasses.replace(swapped, num_stages=1), key, LIMITS)
    wide = Int8Config(BLOCK_M=64, BLOCK_N=128, BLOCK_K=256, num_warps=4, SWAP_AB=True)
    assert "weight tile" in SPACE.infeasible_reason(wide, key, LIMITS)
    assert (
        SPACE.infeasible_reason(Int8Config(BLOCK_M=128, BLOCK_N=128, num_warps=8), _key(4096, dtype="float16"), LIMITS)
        is None
    )
    assert "SPLIT_K" in SPACE.infeasible_reason(Int8Config(SPLIT_K=2), key, LIMITS)
    # The same shared memory as the folded fp8 tile of the same shape.
    assert smem_bytes(swapped) == smem_bytes(
        Fp8Config(**{**dataclasses.asdict(swapped), "path": "fp8", "SCALE_FOLD": True})
    )


def test_check_holds_each_path_to_its_floor():
    expected = torch.randn(4, 8)
    problem = TUNING.make_problem(TUNING.default_keys(interpreter_device())[0], torch.device("cpu"), seed=1)
    assert "NaN" in KERNEL.check(torch.full_like(expected, float("nan")), expected, problem)
    noisy = expected + 0.2 * torch.randn(4, 8)
    assert "SQNR" in KERNEL.check(noisy, expected, problem)
    assert MIN_SQNR_DB["fp8"] < MIN_SQNR_DB["gemv"] < MIN_SQNR_DB["portable"]
    # The accurate paths answer to ggml's NMSE bound too: 35 dB passes it, 32 dB does not.
    signal = torch.randn(64, 64, dtype=torch.float64)
    noise = torch.randn(64, 64, dtype=torch.float64)
    noise *= (signal.square().sum() / noise.square().sum()).sqrt()
    for path in ("portable", "gemv"):
        assert MIN_SQNR_DB[path] >= -10 * math.log10(GGML_MAX_NMSE) - 0.02
    assert KERNEL.check(signal + noise * 10 ** (-35 / 20), signal, problem, GemvConfig()) is None
    too_noisy = KERNEL.check(signal + noise * 10 ** (-32 / 20), signal, problem, GemvConfig())
    assert too_noisy is not None and "33 dB" in too_noisy
    for opt_in in (Fp8Config(), Int8Config(), StagedConfig()):
        assert KERNEL.check(signal + noise * 10 ** (-32 / 20), signal, problem, opt_in) is None


# ---- the tuner's starting configs ------------------------------------------------------------


def test_starting_configs_follow_the_rules_the_space_admits():
    """On an H200: one row of x starts from GEMV tiles split toward four programs per SM; every
    opt-in key from swapped folded fp8 tiles (16-row x tiles at small M, 256 and 128 rows at large
    M); large M from int8 tiles (swapped 256 and 128 rows, one plain 128x128) and the two largest
    staged chunks the key admits (the whole weight, then at most half of it). Accurate keys get
    none of these 8-bit tensor-core starts. Large M on any GPU, accurate or not, starts from the
    three largest dequant chunks the key admits, the whole weight first. Before Hopper only the
    GEMV tiles and dequant chunks remain; the interpreter gets none."""
    limits = KERNEL.limits(H200)
    keys = [k for k in KERNEL.default_keys(H200) if k.m_bucket in (1, 16, 64, 512, 4096)]
    keys += [dataclasses.replace(k, fp8=True) for k in keys if k.m_bucket < 64]
    for key in keys:
        starts = KERNEL.starting_configs(key, H200)
        assert len(starts) == len(set(starts)), key
        for config in starts:
            assert SPACE.infeasible_reason(config, key, limits) is None, (key, config)
            assert (isinstance(config, Fp8Config) and config.SWAP_AB) or config.path in (
                "staged", "gemv", "int8", "dequant", "tma"
            )  # fmt: skip
            assert config.path != "tma" or key.m_bucket <= 512, (key, config)
        fold = [c for c in starts if isinstance(c, Fp8Config)]
        if key.fp8:
            assert max(c.BLOCK_M for c in fold) == {1: 16, 16: 16, 64: 64, 512: 256, 4096: 256}[key.m_bucket]
        else:
            assert {c.path for c in starts} <= {"gemv", "dequant", "tma"}, key
        int8 = [c for c in starts if isinstance(c, Int8Config)]
        assert {(c.BLOCK_M, c.SWAP_AB) for c in int8} == (
            {(256, True), (128, True), (128, False)} if key.m_bucket > 64 and key.fp8 else set()
        )
        staged = sorted(c.CHUNK_N for c in starts if isinstance(c, StagedConfig))
        # The whole weight (one GEMM), then the largest chunk of at most half the weight rows.
        large = key.m_bucket > 64 and key.fp8
        chunks = {28672: [8192, 32768], 14336: [4096, 16384], 6144: [2048, 8192], 4096: [2048, 4096]}
        expected = chunks[key.n] if large else []
        assert staged == expected, key
        dequant = [c.CHUNK_N for c in starts if isinstance(c, DequantConfig)]
        # The whole weight (117 MB in bf16 at both MLP shapes) first, then the next two chunks;
        # fused gate-up (235 MB) starts from the largest chunk, 128 MiB.
        whole = {
            28672: [16384, 8192, 4096],
            14336: [16384, 8192, 4096],
            6144: [8192, 4096, 2048],
            4096: [4096, 2048, 1024],
        }[key.n]
        assert dequant == (whole if key.m_bucket > 64 else []), key
        gemv = [c for c in starts if isinstance(c, GemvConfig)]
        assert bool(gemv) == (key.m_bucket <= 4), key
        for config in gemv:
            programs = -(-key.n // config.BLOCK_N) * config.SPLIT_K
            assert programs <= 4 * H200.sm_count or config.SPLIT_K == 1, config
        if gemv:
            # One launch first (fused quantization, and the fused reduce where split) with the
            # lanes along K, then without, then the same tiles as two or three launches; each
            # tile has its twins.
            along_k = [c for c in gemv if c.K_LANES]
            one_launch = [c for c in gemv if c.FUSE_QUANT and (c.FUSED_REDUCE or c.SPLIT_K == 1) and not c.K_LANES]
            assert along_k and gemv[: len(along_k)] == along_k, key
            assert gemv[len(along_k) : len(along_k) + len(one_launch)] == one_launch, key
            assert [dataclasses.replace(c, K_LANES=False) for c in along_k] == one_launch, key
            unfused = {c for c in gemv if not c.FUSE_QUANT and not c.FUSED_REDUCE}
            assert len(along_k) + len(one_launch) + len(unfused) == len(gemv), key
            assert {dataclasses.replace(c, FUSE_QUANT=False, FUSED_REDUCE=False) for c in one_launch} <= unfused
            assert {c.BLOCK_K for c in one_launch} == {256, 512}, key
    decode = KERNEL.starting_configs(key_for(L40S, _facts(1, 14336, 4096)), L40S)
    assert decode and {c.path for c in decode} == {"gemv"}
    assert decode[0].FUSE_QUANT and decode[0].K_LANES, decode[0]
    prefill = KERNEL.starting_configs(key_for(L40S, _facts(4096, 14336, 4096)), L40S)
    assert [(c.path, c.CHUNK_N) for c in prefill] == [("dequant", 16384), ("dequant", 8192), ("dequant", 4096)]
    cpu = device_info("cpu")
    assert KERNEL.starting_configs(KERNEL.default_keys(cpu)[0], cpu) == []


# ---- what Triton's compiler makes of the folded kernel -----------------------------------------


def test_fold_builds_for_sm90(tmp_path):
    """Triton's compiler, unlike the interpreter, sees the real kernel: built for sm_90 here (no GPU
    needed), feasible tiles use e4m3 wgmma from 64 rows, spill nothing and fit the smem estimate.

    Without SWAP_AB the folded kernel takes its weight tile (wgmma's A) from shared memory and waits
    for each wgmma; with it, from registers, keeping wgmma groups in flight while it dequantizes
    the next chunk, at every BLOCK_M down to 16, with x's tiles arriving by cp.async.
    """
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception as exc:
        pytest.skip(f"Triton's CUDA backend cannot build here: {exc}")
    if not os.access(ptxas, os.X_OK):
        pytest.skip(f"Triton's ptxas is not executable here: {ptxas}")
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP_AB): prefill tiles and decode tiles.
    configs = [
        (128, 128, 128, 8, 3, False),
        (64, 256, 64, 8, 4, False),
        (16, 64, 256, 4, 3, False),
        (256, 128, 64, 8, 4, True),
        (128, 256, 64, 8, 3, True),
        (16, 128, 256, 8, 3, True),
        (16, 64, 256, 4, 4, True),
    ]
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    script = Path(__file__).with_name("sm90_build.py")
    run = subprocess.run(
        [sys.executable, str(script), json.dumps(configs)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    built = [json.loads(line) for line in run.stdout.splitlines()]
    for (bm, bn, bk, warps, stages, swap), result in zip(configs, built, strict=True):
        assert result["swap"] is swap, result
        key = _key(4096 if bm >= 64 else 16)
        config = Fp8Config(
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8 if bm >= 64 else 1, num_warps=warps, num_stages=stages,
            SCALE_FOLD=True, SWAP_AB=swap,
        )  # fmt: skip
        assert SPACE.infeasible_reason(config, key, KERNEL.limits(H200)) is None, config
        assert result["spill_bytes"] == 0, result
        assert result["shared"] <= smem_bytes(config), result
        if swap:
            # wgmma's M side is BLOCK_N (64 rows per warpgroup, each warpgroup its own rows), its N
            # side all of BLOCK_M: wgmma at every tile, 16 rows too.
            assert result["mma"] == [f"wgmma.mma_async.sync.aligned.m64n{bm}k32.f32.e4m3.e4m3"], result
            assert result["wgmma_a"] == ["registers"], result
            assert result["wgmma_in_flight"] == bk // 32 - 1, result
            assert result["cp_async"] > 0 and result["tma"] == 0, result
        elif bm >= 64:
            assert [m for m in result["mma"] if m.endswith(".f32.e4m3.e4m3")], result
            assert result["wgmma_a"] == ["shared"] and result["wgmma_in_flight"] == 0, result
