"""The tma path of ``q4k_fp8_gemm``: who it serves, its space's rules, its host code, its sm_90 build, its numerics.

CPU tier: the space member's feasibility rules, the gating of :func:`~tritune.kernels.q4k.kernel.serve`
(which calls the Gluon kernel may serve, which fall back and why), the SM90 defaults and starting
configs, the launch's grid and arguments recorded on meta tensors, the descriptors, the layout
checks, the opaque op's schema, and an sm_90 build of the kernel at its defaults and the widest
tiles the register rule admits (no spills but the 256-row tiles' epilogue, wgmma and TMA present,
the shared memory the rule estimates), in a subprocess without ``TRITON_INTERPRET`` (Gluon has no
interpreter).

GPU tier (``gpu`` marker, SM90 only): the kernel against the float32 reference of the exactly
dequantized weight (ggml's NMSE bound and the path's SQNR floor) at awkward M, both orientations,
splits, bias, fp16, an unaligned x and a NaN-poisoned output; CUDA-graph replay and
``torch.compile`` through the opaque op.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import sm90_build
import torch

from tritune.kernels import use_config
from tritune.kernels._launch import unchecked_gluon_descriptor
from tritune.kernels.device import DeviceInfo, interpreter_device
from tritune.kernels.q4k import launch_tma
from tritune.kernels.q4k.kernel import KERNEL, TMA_DEFAULT_M, Q4KKey, default_config, q4k_linear, tma_default
from tritune.kernels.q4k.reference import check_path, nmse, packed_dequantized, q4k_linear_reference, sqnr_db
from tritune.kernels.q4k.tuning import TUNING
from tritune.kernels.q4k.weight import Q4KWeight
from tritune.kernels.spec import Replaced, pow2_bucket
from tritune.search_spaces.base import TargetLimits
from tritune.search_spaces.q4k_fp8_gemm import (
    SPACE,
    TMA_LOADER_STATE_BYTES,
    TMA_MAX_REGISTERS,
    DequantConfig,
    GemvConfig,
    PortableConfig,
    TmaConfig,
    tma_scales_by_tma,
    tma_smem_bytes,
    tma_word_lanes,
    tma_x_warpgroups,
)

H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
A100 = DeviceInfo(name="NVIDIA A100", vendor="nvidia", capability=(8, 0), sm_count=108, arch="sm80")
B200 = DeviceInfo(name="NVIDIA B200", vendor="nvidia", capability=(10, 0), sm_count=148, arch="sm100")
H200_LIMITS = KERNEL.limits(H200)
HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
BF16, FP16 = torch.bfloat16, torch.float16


def _key(m_bucket: int = 64, n: int = 14336, k: int = 4096, arch: str = "sm90", fp8: bool = False) -> Q4KKey:
    return Q4KKey(arch=arch, sm_count=132, dtype="bfloat16", m_bucket=m_bucket, n=n, k=k, fp8=fp8)


def _facts(m: int = 64, n: int = 14336, k: int = 4096) -> Any:
    """A bf16 call's facts on meta tensors (nothing allocated)."""
    x, parts, _, out = sm90_build.meta_q4k_call(m, n, k)
    return KERNEL.facts(x, Q4KWeight(*parts), None, out=out)


# ---- the space ------------------------------------------------------------------------------


def test_tma_member_is_part_of_the_space():
    config = SPACE.parse({"path": "tma", "BLOCK_M": 16, "SPLIT_K": 4})
    assert isinstance(config, TmaConfig) and config.SWAP_AB and config.BLOCK_N == 64
    assert SPACE.infeasible_reason(config, _key(16, n=4096, k=14336), H200_LIMITS) is None


@pytest.mark.parametrize(
    ("config", "key", "limits", "words"),
    [
        (TmaConfig(), _key(), TargetLimits(interpreter=True), "interpreter"),
        (TmaConfig(), _key(arch="sm80"), H200_LIMITS, "SM90"),
        (TmaConfig(), _key(arch="sm100"), H200_LIMITS, "SM90"),
        (TmaConfig(BLOCK_N=128), _key(n=4160), H200_LIMITS, "does not divide N=4160"),
        (TmaConfig(BLOCK_M=64), _key(m_bucket=32), H200_LIMITS, "exceeds m_bucket=32"),
        (TmaConfig(SPLIT_K=2), _key(m_bucket=512), H200_LIMITS, "only for M <= 256"),
        (TmaConfig(SPLIT_K=8, BLOCK_K=256), _key(k=1024), H200_LIMITS, "does not divide the 4"),
        (TmaConfig(BLOCK_M=32, SWAP_AB=False), _key(), H200_LIMITS, "BLOCK_M=32"),
        (TmaConfig(BLOCK_M=64, num_warps=8, SWAP_AB=False), _key(), H200_LIMITS, "BLOCK_M=64"),
        (TmaConfig(BLOCK_M=512, BLOCK_K=64), _key(512), H200_LIMITS, "512 rows of x"),
        (TmaConfig(BLOCK_M=16, num_warps=8), _key(16), H200_LIMITS, "8 rows of x"),
        (TmaConfig(BLOCK_M=512, BLOCK_K=64, num_warps=8, SWAP_AB=False), _key(512), H200_LIMITS, "swapped"),
        (TmaConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128), _key(m_bucket=128), H200_LIMITS, "spill"),
        (TmaConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=256, num_warps=8), _key(m_bucket=128), H200_LIMITS, "KiB"),
        (TmaConfig(FUSED_REDUCE=True), _key(), H200_LIMITS, "SPLIT_K > 1"),
        (TmaConfig(BLOCK_M=256, BLOCK_K=64, SWAP_AB=False), _key(256), H200_LIMITS, "only for the swapped kernel"),
        (TmaConfig(BLOCK_M=256, BLOCK_K=64, SPLIT_K=2, FUSED_REDUCE=True), _key(256), H200_LIMITS, "spills"),
        # K=14336 in four splits is not whole chunks of 1024: no scales by TMA for the loader.
        (TmaConfig(SPLIT_K=4, LOADER_WARP=True), _key(k=14336), H200_LIMITS, "LOADER_WARP needs the scales by TMA"),
        (TmaConfig(SPLIT_K=4, W_REGISTERS=True, PACKED_DEQUANT=True), _key(k=14336), H200_LIMITS, "W_REGISTERS"),
        (TmaConfig(W_REGISTERS=True), _key(), H200_LIMITS, "needs SWAP_AB and PACKED_DEQUANT"),
        (TmaConfig(BLOCK_M=64, SWAP_AB=False, W_REGISTERS=True, PACKED_DEQUANT=True), _key(), H200_LIMITS, "SWAP_AB"),
    ],
)
def test_tma_feasibility_names_what_is_wrong(config, key, limits, words):
    reason = SPACE.infeasible_reason(config, key, limits)
    assert reason is not None and words in reason, reason


def test_tma_fused_reduce_and_widest_tiles_are_admitted():
    """The fused reduce up to 64 accumulator values a thread; 256 rows of x (wgmma's widest N side)
    a warpgroup, 512 where two warpgroups share one 64-row weight tile."""
    fused = TmaConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, SPLIT_K=2, FUSED_REDUCE=True)
    assert SPACE.infeasible_reason(fused, _key(128), H200_LIMITS) is None
    widest = TmaConfig(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, SPLIT_K=2)
    assert SPACE.infeasible_reason(widest, _key(256), H200_LIMITS) is None
    shared = TmaConfig(BLOCK_M=512, BLOCK_N=64, BLOCK_K=64, num_warps=8)
    assert SPACE.infeasible_reason(shared, _key(512), H200_LIMITS) is None
    # The same tile is refused one M bucket lower (an x tile taller than the bucket).
    assert "exceeds m_bucket=256" in SPACE.infeasible_reason(shared, _key(256), H200_LIMITS)


@pytest.mark.parametrize(("block_n", "num_warps", "expected"), [(64, 4, 1), (128, 4, 1), (64, 8, 2), (128, 8, 1)])
def test_tma_warpgroups_share_out_x_where_the_weight_tile_is_narrow(block_n, num_warps, expected):
    assert tma_x_warpgroups(block_n, num_warps) == expected


def test_tma_dequantization_leaves_no_thread_idle():
    """Every tile of the space: the weight tile's 32-code groups, each shared by its word lanes,
    cover every thread, and a lane takes whole words (four a group)."""
    member = SPACE.members["tma"].dimensions
    for block_n in member["BLOCK_N"]:
        for block_k in member["BLOCK_K"]:
            for warps in member["num_warps"]:
                lanes = tma_word_lanes(block_n, block_k, warps)
                assert 4 % lanes == 0
                assert block_n * block_k // 32 * lanes >= 32 * warps, (block_n, block_k, warps)
                assert lanes == 1 or block_n * block_k // 32 < 32 * warps


def test_tma_shared_memory_estimate_counts_every_buffer():
    config = TmaConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_stages=3)
    # Three stages of an x tile (64 x 128 bf16) and its code words (64 x 64 bytes) with a barrier
    # each, and two 64 x 128 bf16 weight buffers.
    assert tma_smem_bytes(config) == 3 * (64 * 128 * 2 + 64 * 64 + 8) + 2 * 64 * 128 * 2
    # With the scales by TMA: two slots of a chunk (1024 codes: 32 scale and 32 min bytes and 16
    # bytes of super-block scales a row) with a barrier each.
    assert tma_smem_bytes(config, scale_chunks=True) == tma_smem_bytes(config) + 2 * (64 * 80 + 8)
    # The loader warp's kernel: a second barrier a stage and slot, each array of them 16-byte
    # aligned (three stages: 24 bytes, so 32), and Triton's warp-specialization state.
    loader = dataclasses.replace(config, LOADER_WARP=True)
    buffers = 3 * (64 * 128 * 2 + 64 * 64) + 2 * 64 * 128 * 2 + 2 * 64 * 80
    assert tma_smem_bytes(loader, scale_chunks=True) == buffers + 2 * 32 + 2 * 16 + TMA_LOADER_STATE_BYTES
    # The weight tile in registers: no weight buffers (with or without the loader warp).
    registers = dataclasses.replace(config, W_REGISTERS=True, PACKED_DEQUANT=True)
    assert tma_smem_bytes(registers, scale_chunks=True) == buffers - 2 * 64 * 128 * 2 + 2 * 32 + 2 * 16
    both = dataclasses.replace(registers, LOADER_WARP=True)
    assert tma_smem_bytes(both, scale_chunks=True) == tma_smem_bytes(registers, True) + TMA_LOADER_STATE_BYTES
    # Without the scales by TMA they run the plain kernel, and take its shared memory.
    assert tma_smem_bytes(both) == tma_smem_bytes(config)


@pytest.mark.parametrize(
    ("k", "split", "expected"),
    [(4096, 1, True), (4096, 4, True), (4096, 8, False), (14336, 2, True), (14336, 4, False), (2560, 1, False)],
)
def test_scales_come_by_tma_where_each_split_holds_whole_chunks(k, split, expected):
    config = TmaConfig(BLOCK_K=128 if k // split >= 1024 else 64, SPLIT_K=split)
    assert tma_scales_by_tma(config, k) == expected
    _, parts, _, _ = sm90_build.meta_q4k_call(16, 4096, k)
    assert launch_tma.scales_by_tma_ok(config, parts, k) == expected


def test_scales_by_tma_need_contiguous_scale_tensors():
    _, parts, _, _ = sm90_build.meta_q4k_call(16, 4096, 4096)
    config = TmaConfig()
    wide = torch.empty((4096, 256), dtype=torch.uint8, device="meta")[:, :128]
    assert launch_tma.scales_by_tma_ok(config, parts, 4096)
    assert not launch_tma.scales_by_tma_ok(config, (parts[0], wide, parts[2], parts[3]), 4096)


# ---- serving ----------------------------------------------------------------------------------


def test_tma_serves_on_sm90_and_falls_back_elsewhere():
    config = TmaConfig(BLOCK_M=16, SPLIT_K=4)
    facts = _facts(m=16, n=4096, k=14336)
    assert KERNEL.serve_with_reason(config, H200, facts)[0] == config
    for device, words in ((A100, "SM90"), (B200, "SM90"), (interpreter_device(), "interpreter")):
        served, reason = KERNEL.serve_with_reason(config, device, facts)
        assert served.path != "tma" and words in reason, (device.arch, reason)


def test_tma_serve_checks_the_call_shape():
    """A borrowed winner (another N or K) that does not fit the call gives way, with the reason."""
    served, reason = KERNEL.serve_with_reason(TmaConfig(BLOCK_N=128), H200, _facts(n=4160))
    assert not isinstance(served, TmaConfig) or served.BLOCK_N != 128
    assert "does not divide N=4160" in reason
    served, reason = KERNEL.serve_with_reason(TmaConfig(BLOCK_K=256, SPLIT_K=8), H200, _facts(m=16, k=1024))
    assert served == TmaConfig(BLOCK_K=256, SPLIT_K=4) and "SPLIT_K=8" in reason


def test_tma_serve_checks_the_grid():
    """M tiles go on the grid's z axis (at most 65535): a call with more gives way, with the reason."""
    config = TmaConfig(BLOCK_M=16)
    assert KERNEL.serve_with_reason(config, H200, _facts(m=16 * 65535, n=4096))[0] == config
    served, reason = KERNEL.serve_with_reason(config, H200, _facts(m=16 * 65535 + 1, n=4096))
    assert served != config and "65535 M tiles" in reason


def test_serve_hook_returns_a_replacement_for_other_devices():
    from tritune.kernels.q4k.kernel import serve

    result = serve(TmaConfig(), A100, _facts())
    assert isinstance(result, Replaced) and "SM90" in result.reason


@pytest.mark.parametrize("m_bucket", [32, 64, 128, 256, 512])
@pytest.mark.parametrize(("k", "n"), [(4096, 14336), (14336, 4096), (4096, 4096)])
def test_sm90_default_is_the_tma_path_from_32_to_512_rows(m_bucket, k, n):
    key = _key(m_bucket, n=n, k=k)
    config = default_config(key)
    assert isinstance(config, TmaConfig) and config == tma_default(key)
    assert SPACE.infeasible_reason(config, key, H200_LIMITS) is None
    assert TMA_DEFAULT_M[0] <= m_bucket <= TMA_DEFAULT_M[1]
    if m_bucket == 512:
        # One 64-row weight tile for both warpgroups: 512 rows of x where 224 programs (N=14336)
        # fill the SMs, 256 where 512 rows would leave them half idle (N=4096: 64 programs).
        assert (config.BLOCK_N, config.num_warps, config.SPLIT_K) == (64, 8, 1)
        assert (512 if n == 14336 else 256) == config.BLOCK_M


@pytest.mark.parametrize(
    ("n", "expected"),
    [(28672, 512), (14336, 512), (6144, 512), (5632, 512), (5568, 256), (4096, 256), (3712, None), (512, None)],
)
def test_wide_tma_default_follows_the_programs_per_sm(n, expected):
    """At M=512 the 512-row tiles where their N/64 programs cover two thirds of 132 SMs (88), the
    256-row ones where twice as many cover 0.9 of them (119), else the dequant path."""
    key = _key(512, n=n, k=4096)
    default = tma_default(key)
    assert (default.BLOCK_M if default else None) == expected
    if expected is None:
        assert isinstance(default_config(key), DequantConfig)
    else:
        assert default.LOADER_WARP and not default.W_REGISTERS


def test_wide_tma_default_keeps_the_plain_k_loop_where_the_scales_cannot_come_by_tma():
    """K=4352 is not whole 1024-code chunks: no loader warp, the plain 512-row tile."""
    key = _key(512, n=14336, k=4352)
    default = tma_default(key)
    assert default.BLOCK_M == 512 and not default.LOADER_WARP
    assert SPACE.infeasible_reason(default, key, H200_LIMITS) is None


@pytest.mark.parametrize(
    ("k", "n", "registers"),
    [(4096, 14336, True), (14336, 28672, True), (4352, 14336, False), (4096, 4096, False), (14336, 4096, False)],
    ids=["unsplit", "unsplit-k14336", "k-not-whole-chunks", "split-4096", "split-14336"],
)
def test_unsplit_256_row_default_takes_the_loader_warp_and_register_a(k, n, registers):
    """At M=256 the unsplit 256 x 128 tile comes with its loader warp and register-A K loop where
    each K is whole 1024-code chunks (the scales by TMA); split or otherwise, the plain K loop."""
    key = _key(256, n=n, k=k)
    config = tma_default(key)
    assert (config.BLOCK_M, config.BLOCK_N) == (256, 128)
    assert (config.SPLIT_K == 1) == (n != 4096)
    assert config.LOADER_WARP is registers and config.W_REGISTERS is registers
    assert SPACE.infeasible_reason(config, key, H200_LIMITS) is None


@pytest.mark.parametrize(
    "key",
    [_key(8), _key(16), _key(1024), _key(64, arch="sm80"), _key(64, arch="sm100"), _key(64, n=4128), _key(32, n=96)],
    ids=["m8", "m16", "m1024", "sm80", "sm100", "n4128", "n96"],
)
def test_default_is_not_the_tma_path_elsewhere(key):
    assert not isinstance(default_config(key), TmaConfig)


def test_tma_starting_configs_are_feasible_and_only_where_they_may_win():
    for m_bucket in (1, 16, 64, 128, 256, 512):
        key = _key(m_bucket, n=4096, k=14336)
        starts = [c for c in TUNING.starting_configs(key, H200) if isinstance(c, TmaConfig)]
        assert starts, m_bucket
        assert starts[0] == tma_default(key) or tma_default(key) is None
        assert len(set(starts)) == len(starts)
        # 256-row tiles from M=256, and only there.
        assert any(c.BLOCK_M == 256 for c in starts) == (m_bucket >= 256), m_bucket
        default = tma_default(key)
        # The default's split is tried with both reduces where the space admits the fused one.
        both = default.SPLIT_K > 1 and default.BLOCK_M < 256
        for fused in (False, True):
            tried = dataclasses.replace(default, FUSED_REDUCE=fused) in starts
            assert tried == (both or fused == default.FUSED_REDUCE), (m_bucket, fused)
        # The default sums a split's partials in the GEMM up to M=64.
        assert default.FUSED_REDUCE is (default.SPLIT_K > 1 and m_bucket <= 64), default
        # It dequantizes in x's dtype, and is tried with the exact float32 weights too.
        assert default.PACKED_DEQUANT and dataclasses.replace(default, PACKED_DEQUANT=False) in starts
    # From M=256 each wide tile is also tried with the loader warp and its weight tile in registers
    # (the shared-tile default with the loader warp alone), and the default with the plain K loop.
    for m_bucket in (128, 256, 1024):
        starts = [c for c in TUNING.starting_configs(_key(m_bucket), H200) if isinstance(c, TmaConfig)]
        tile = lambda c: (c.BLOCK_M, c.BLOCK_N, c.BLOCK_K, c.num_warps, c.SPLIT_K)  # noqa: E731
        default = tma_default(_key(m_bucket))
        split = [c for c in starts if c.LOADER_WARP or c.W_REGISTERS]
        assert all(c.LOADER_WARP and c.BLOCK_M >= 256 for c in split), m_bucket
        # Register-A, save the shared tile's default and the default's float32 twin.
        assert all(c.W_REGISTERS or c.BLOCK_N == 64 or tile(c) == tile(default) for c in split), m_bucket
        assert bool(split) == (m_bucket >= 256), m_bucket
        plain = dataclasses.replace(default, LOADER_WARP=False, W_REGISTERS=False)
        assert plain in starts, m_bucket
        wide = {tile(c) for c in starts if c.BLOCK_M >= 256 and not c.LOADER_WARP}
        assert wide <= {tile(c) for c in split}, m_bucket
    # Up to M=1024 (the shared weight tile's 512 rows of x among them), none above.
    assert any(c.BLOCK_M == 512 for c in TUNING.starting_configs(_key(1024), H200) if isinstance(c, TmaConfig))
    assert not any(isinstance(c, TmaConfig) for c in TUNING.starting_configs(_key(2048), H200))
    assert not any(isinstance(c, TmaConfig) for c in TUNING.starting_configs(_key(64, arch="sm80"), A100))


def test_a_stored_winner_is_followed_by_its_twin_with_the_newer_choice():
    exact = TmaConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, SPLIT_K=1)
    packed = dataclasses.replace(exact, PACKED_DEQUANT=True)
    loader = dataclasses.replace(exact, LOADER_WARP=True)
    assert TUNING.winner_variants(exact, _key(128), H200) == [packed, loader]
    # A swapped, packed winner is also tried with the loader warp and its weight tile in registers.
    both = dataclasses.replace(packed, LOADER_WARP=True, W_REGISTERS=True)
    assert TUNING.winner_variants(packed, _key(128), H200) == [
        exact,
        dataclasses.replace(packed, LOADER_WARP=True),
        both,
    ]
    assert TUNING.winner_variants(both, _key(128), H200) == [
        dataclasses.replace(both, PACKED_DEQUANT=False),
        dataclasses.replace(both, LOADER_WARP=False),
    ]
    assert TUNING.winner_variants(PortableConfig(), _key(128), H200) == []
    gemv = GemvConfig(BLOCK_N=32, BLOCK_K=512, FUSE_QUANT=True)
    assert TUNING.winner_variants(gemv, _key(1), H200) == [dataclasses.replace(gemv, K_LANES=True)]


# ---- host code --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("split", "bias", "fused", "packed"),
    [(1, False, False, False), (1, True, False, True), (4, True, False, True), (4, True, True, False)],
)
def test_launch_grid_and_arguments(split, bias, fused, packed):
    """One Gluon launch over (N tiles, splits, M tiles); with a split, float32 partials and the
    reduce (which adds the bias) after it, or with ``FUSED_REDUCE`` the arrival counters instead.
    Three M tiles (M=65), so one counter per N tile would not do."""
    m, n, k = 65, 4096, 14336
    x, parts, bias_t, out = sm90_build.meta_q4k_call(m, n, k, bias)
    config = TmaConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, FUSED_REDUCE=fused, PACKED_DEQUANT=packed)
    with sm90_build.record_launches() as recorder:
        launch_tma.launch_tma(config, x, parts, bias_t, out)
    names = [launch.kernel.fn.__name__ for launch in recorder.launches]
    assert names == ["_q4k_gemm_tma_kernel"] + (["_splitk_reduce_kernel"] if split > 1 and not fused else [])
    gluon = recorder.launches[0]
    assert tuple(gluon.grid) == (n // 64, split, 3)
    assert gluon.kwargs["K_TILES"] == k // 128 // split
    # The kernel adds the bias where it writes the output: without a split or with the fused reduce.
    assert gluon.kwargs["HAS_BIAS"] == (bias and (split == 1 or fused)) and gluon.kwargs["SPLIT_K"] == split
    assert gluon.kwargs["FUSED_REDUCE"] == fused and gluon.kwargs["PACKED_DEQUANT"] == packed
    x_desc, q_desc = gluon.args[:2]
    assert x_desc.base is x and x_desc.block_shape == [32, 128]
    assert q_desc.base.dtype == torch.int32 and list(q_desc.base.shape) == [n, k // 8]
    assert q_desc.block_shape == [64, 16]
    # K=14336 per split is 14 chunks of scales (by TMA); split in 4 it is not a whole chunk.
    assert gluon.kwargs["SCALES_TMA"] == (split == 1)
    sc_desc, mn_desc, ss_desc = gluon.args[2:5]
    if split == 1:
        assert sc_desc.base is parts[1] and mn_desc.base is parts[2] and sc_desc.block_shape == [64, 32]
        assert list(ss_desc.base.shape) == [n, k // 128] and ss_desc.block_shape == [64, 8]
    target, part, counters = gluon.args[9:12]
    assert target is out
    assert part is out if split == 1 else (part.dtype == torch.float32 and part.shape == (split, m, n))
    # One counter per output tile (N tiles x M tiles) where the reduce is fused.
    assert counters is out if not fused else (counters.dtype == torch.int32 and counters.numel() >= n // 64 * 3)


@pytest.mark.parametrize(
    ("fields", "k", "kernel", "loader"),
    [
        ({"LOADER_WARP": True}, 4096, "_q4k_gemm_tma_loader_kernel", None),
        ({"W_REGISTERS": True}, 4096, "_q4k_gemm_tma_rs_kernel", False),
        ({"W_REGISTERS": True, "LOADER_WARP": True}, 4096, "_q4k_gemm_tma_rs_kernel", True),
        # K=4352 is no whole chunk of scales: they come into registers, and the plain kernel runs.
        ({"W_REGISTERS": True, "LOADER_WARP": True}, 4352, "_q4k_gemm_tma_kernel", None),
        ({}, 4096, "_q4k_gemm_tma_kernel", None),
    ],
)
def test_launch_runs_the_k_loop_the_config_names(fields, k, kernel, loader):
    """``LOADER_WARP`` and ``W_REGISTERS`` pick the Gluon kernel (same grid and arguments) where the
    scales come by TMA; the register-A kernel gets the loader warp as a constexpr."""
    x, parts, bias_t, out = sm90_build.meta_q4k_call(300, 4096, k, True)
    config = TmaConfig(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64, num_warps=8, PACKED_DEQUANT=True, **fields)
    with sm90_build.record_launches() as recorder:
        launch_tma.launch_tma(config, x, parts, bias_t, out)
    (gluon,) = recorder.launches
    assert gluon.kernel.fn.__name__ == kernel
    assert gluon.kwargs.get("LOADER") == loader
    assert gluon.kwargs["SCALES_TMA"] == (k % 1024 == 0) and tuple(gluon.grid) == (4096 // 64, 1, 2)


def test_direct_bodies_launch_and_tracers_get_the_opaque_op(monkeypatch):
    """In a direct op body (wrap_triton off) the path launches the Gluon kernel itself; under a
    tracer it calls ``tritune::q4k_linear_tma`` (which tracing sees as one call) instead."""
    from torch._library.triton import set_wrap_triton_enabled

    x, parts, bias, out = sm90_build.meta_q4k_call(16, 4096, 4096, bias=True)
    config = TmaConfig(BLOCK_M=16, SPLIT_K=2)
    with sm90_build.record_launches() as recorder, set_wrap_triton_enabled(False):
        launch_tma.dispatch_tma(config, x, parts, bias, out)
    names = [launch.kernel.fn.__name__ for launch in recorder.launches]
    assert names == ["_q4k_gemm_tma_kernel", "_splitk_reduce_kernel"]
    called = []
    monkeypatch.setattr(launch_tma, "_TMA_OP", lambda *args, **fields: called.append(fields))
    with sm90_build.record_launches() as recorder:
        launch_tma.dispatch_tma(config, x, parts, bias, out)
    assert not recorder.launches
    assert called == [{name: getattr(config, name) for name in launch_tma._OP_FIELDS}]


def test_descriptors_match_the_checked_constructor():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    x_layout, q_layout = launch_tma._layouts(BF16, 16, 64, 128)
    assert launch_tma._layouts(BF16, 16, 64, 128)[0] is x_layout
    qs = torch.zeros((64, 512), dtype=torch.uint8).view(torch.int32)
    for t, box, layout in ((torch.empty(20, 1024, dtype=BF16), [16, 128], x_layout), (qs, [64, 16], q_layout)):
        fast = unchecked_gluon_descriptor(t, box, layout)
        checked = TensorDescriptor(t, list(t.shape), list(t.stride()), box, layout)
        assert fast.base is checked.base
        for name in ("shape", "strides", "block_shape", "layout", "padding"):
            assert getattr(fast, name) == getattr(checked, name), name


def test_layout_checks():
    storage = torch.empty(4 * 1032 + 8, dtype=BF16)
    assert launch_tma.x_layout_ok(storage[: 4 * 1024].view(4, 1024))
    assert not launch_tma.x_layout_ok(storage[1 : 1 + 4 * 1024].view(4, 1024)), "base off 16 bytes"
    assert not launch_tma.x_layout_ok(storage[: 4 * 1030].view(4, 1030)[:, :1024]), "row stride of 2060 bytes"
    assert not launch_tma.x_layout_ok(storage[: 2 * 1024].view(1024, 2).t()), "inner stride 2"
    codes = torch.zeros((8, 256), dtype=torch.uint8)
    assert launch_tma.codes_layout_ok(codes)
    assert not launch_tma.codes_layout_ok(torch.zeros(8 * 256 + 1, dtype=torch.uint8)[1:].view(8, 256))


def test_opaque_op_carries_every_field():
    schema = str(launch_tma._TMA_OP._schema)
    for name in SPACE.members["tma"].dimensions:
        assert (name in schema) == (name != "path"), name
    fields = (("BLOCK_M", 32), ("BLOCK_N", 128), ("BLOCK_K", 64), ("num_warps", 8), ("num_stages", 2))
    flags = (("SPLIT_K", 2), ("SWAP_AB", False), ("FUSED_REDUCE", True), ("PACKED_DEQUANT", True))
    loop = (("LOADER_WARP", True), ("W_REGISTERS", False))
    config = launch_tma._op_config((*fields, *flags, *loop))
    assert config == TmaConfig(
        BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=2, SPLIT_K=2, SWAP_AB=False, FUSED_REDUCE=True,
        PACKED_DEQUANT=True, LOADER_WARP=True,
    )  # fmt: skip


def test_portable_stand_in_keeps_the_tiles_up_to_its_largest_m_tile():
    config = TmaConfig(BLOCK_M=32, BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=2, SPLIT_K=4)
    stand_in = launch_tma.portable_stand_in(config)
    assert isinstance(stand_in, PortableConfig)
    assert (stand_in.BLOCK_M, stand_in.BLOCK_N, stand_in.BLOCK_K, stand_in.SPLIT_K) == (32, 128, 256, 4)
    # The portable kernel's M tiles stop at 128 rows.
    wide = launch_tma.portable_stand_in(TmaConfig(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64))
    assert (wide.BLOCK_M, wide.BLOCK_N, wide.BLOCK_K) == (128, 64, 64)


# ---- the sm_90 build ------------------------------------------------------------------------

#: The defaults at M 16, 64, 128 and 256 (split and not), and the widest tiles the register rule admits.
_BUILDS = [
    dataclasses.asdict(tma_default(_key(16, n=4096, k=14336))),
    dataclasses.asdict(tma_default(_key(64))),
    dataclasses.asdict(tma_default(_key(128))),
    dataclasses.asdict(tma_default(_key(256, n=4096, k=4096))),
    # Unsplit 256-row tiles, packed: the default at M=256 and 512 on 14336-row weights.
    dataclasses.asdict(tma_default(_key(256))),
    # The widest tiles, dequantized in float32 (the defaults dequantize in x's dtype).
    dataclasses.asdict(TmaConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=2)),
    dataclasses.asdict(TmaConfig(BLOCK_M=128, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=2, SWAP_AB=False)),
    # wgmma's widest N side: 256 rows of x against each warpgroup's 64 weight rows.
    dataclasses.asdict(TmaConfig(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
    # The split's reduce in the GEMM (arrival counters), and the largest accumulator it is admitted with.
    dataclasses.asdict(TmaConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_stages=3, SPLIT_K=4, FUSED_REDUCE=True)),
    dataclasses.asdict(
        TmaConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, SPLIT_K=2, FUSED_REDUCE=True)
    ),
    # The K loops of the loader warp and of the weight tile in registers, on one and two warpgroups.
    *(
        dataclasses.asdict(TmaConfig(**tile, PACKED_DEQUANT=True, LOADER_WARP=lw, W_REGISTERS=rs))
        for tile, lw, rs in [
            ({"BLOCK_M": 512, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8}, True, True),
            ({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8}, True, False),
            ({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "SPLIT_K": 2}, False, True),
            (
                {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "SPLIT_K": 2, "FUSED_REDUCE": True},
                True,
                True,
            ),
        ]
    ),
]
#: Spill bytes a thread the epilogue of tiles with 256 rows of x or more may take (see
#: ``TMA_MAX_REGISTERS``), by the K loop's registers (255, or 240 beside a loader warp) and the
#: split: storing the output with a bias, and storing a split's float32 partials. On every such
#: build with the scales by TMA, each spill instruction lies after the last wgmma.
_EPILOGUE_SPILLS = {(False, False): 384, (False, True): 1104, (True, False): 1024, (True, True): 1104}


@pytest.fixture(scope="module")
def tma_builds(tmp_path_factory):
    """The kernel at :data:`_BUILDS`, built for sm_90 with ptxas' report (one subprocess)."""
    reason = sm90_build.build_reason()
    if reason is not None:
        pytest.skip(reason)
    cases = [
        {"k": 4096, "n": 14336, "m": 128, "config": {k: v for k, v in c.items() if k != "path"}, "bias": True}
        for c in _BUILDS
    ]
    return sm90_build.run_script(["--q4k-tma", json.dumps(cases)], str(tmp_path_factory.mktemp("sm90-q4k-tma")))


def test_tma_builds_for_sm90_spill_only_in_the_widest_tiles_epilogue(tma_builds):
    """Every build compiles to a cubin for sm_90a: no spills but the 256-row tiles' epilogue (a
    bounded few bytes a thread), wgmma and TMA loads in the loop, exactly the shared memory
    :func:`tma_smem_bytes` estimates, and no read of the accumulator before the last wgmma's
    drain (:func:`sm90_build.reads_before_drain`). The loader warp's kernels run a warpgroup more
    (Triton pads the one loader warp to a warpgroup for the register reallocation)."""
    assert len(tma_builds) == len(_BUILDS)
    for build in tma_builds:
        config = TmaConfig(**build["case"]["config"])
        (launch,) = build["launches"]
        where = f"{config}: {launch}"
        assert launch["reads_before_drain"] == 0, where
        expected = launch_tma.tma_kernel_for(config, scales_by_tma=True)[0].fn.__name__
        assert launch["kernel"] == expected, where
        assert launch["num_warps"] == config.num_warps + (4 if config.LOADER_WARP else 0), where
        assert (config.BLOCK_M + config.BLOCK_K) * config.BLOCK_N // (32 * config.num_warps) <= TMA_MAX_REGISTERS
        wide = config.BLOCK_M >= 256
        spills = _EPILOGUE_SPILLS[config.LOADER_WARP or config.BLOCK_M > 256, config.SPLIT_K > 1] if wide else 0
        assert launch["spill_bytes"] <= spills, where
        chunks = tma_scales_by_tma(config, build["case"]["k"])
        assert launch["shared"] == tma_smem_bytes(config, chunks) <= H200_LIMITS.smem_bytes, where
        assert launch["sass"]["HGMMA"] > 0 and launch["sass"]["UTMALDG"] > 0, where


# ---- GPU tier ---------------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not HAS_SM90, reason="the tma path runs on SM90 only")


def _problem(m: int, n: int, k: int, dtype: torch.dtype = BF16, bias: bool = False, seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = Q4KWeight.quantize(torch.randn((n, k), generator=generator, device="cuda") * 0.02)
    x = torch.randn((m, k), generator=generator, device="cuda").to(dtype)
    b = torch.randn((n,), generator=generator, device="cuda").to(dtype) if bias else None
    return x, weight, b


def _assert_accurate(out: torch.Tensor, x, weight, bias, where: str) -> None:
    assert not torch.isnan(out).any(), f"{where}: some outputs were never written"
    expected = q4k_linear_reference(x, weight, bias)
    assert check_path(out.float(), expected, "tma") is None, f"{where}: NMSE {nmse(out.float(), expected):.2e}"
    # Every row of x (M tiles and the masked tail) stays close on its own.
    rows = ((out.float() - expected).square().sum(1) / expected.square().sum(1)).max().item()
    assert rows < 4e-4, f"{where}: worst row NMSE {rows:.2e}"


_GPU_CONFIGS = [
    TmaConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, SPLIT_K=1),
    TmaConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, SPLIT_K=4),
    TmaConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=2, SPLIT_K=2, SWAP_AB=False),
    TmaConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, SPLIT_K=2),
    TmaConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, SPLIT_K=1, SWAP_AB=False),
    TmaConfig(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, SPLIT_K=2),
    TmaConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, SPLIT_K=4, FUSED_REDUCE=True),
    TmaConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, SPLIT_K=2, FUSED_REDUCE=True),
    TmaConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, SPLIT_K=2, PACKED_DEQUANT=True),
    TmaConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=2, SWAP_AB=False, PACKED_DEQUANT=True),
    TmaConfig(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, SPLIT_K=2, PACKED_DEQUANT=True),
    # One 64-row weight tile for both warpgroups' rows of x: 2 x 128, and 2 x 256 in two TMA boxes.
    TmaConfig(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4, SPLIT_K=2),
    TmaConfig(BLOCK_M=512, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, PACKED_DEQUANT=True),
    TmaConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=3),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("config", _GPU_CONFIGS, ids=lambda c: f"{c.BLOCK_M}x{c.BLOCK_N}x{c.BLOCK_K}w{c.num_warps}"
                         f"s{c.SPLIT_K}{'swap' if c.SWAP_AB else ''}{'fused' if c.FUSED_REDUCE else ''}"
                         f"{'packed' if c.PACKED_DEQUANT else ''}")  # fmt: skip
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64, 100, 128, 257, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_tma_matches_reference_gpu(config, m, bias):
    n, k = 4096, 2048
    x, weight, b = _problem(m, n, k, bias=bias, seed=m)
    out = torch.full((m, n), float("nan"), dtype=BF16, device="cuda")
    launch_tma.run_tma(config, x, weight.tensors(), b, out)
    _assert_accurate(out, x, weight, b, f"{config}, m={m}")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "config",
    [
        TmaConfig(BLOCK_M=512, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, PACKED_DEQUANT=True),
        TmaConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, SPLIT_K=2, FUSED_REDUCE=True),
        TmaConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=2, SWAP_AB=False, PACKED_DEQUANT=True),
    ],
    ids=["512x64", "64x128-split2", "64x64x256-noswap"],
)
def test_scales_by_tma_compute_what_scales_in_registers_do_gpu(config):
    """The scales copied by TMA in chunks and read from shared memory give the very weights the
    registers' loads give: the outputs are equal bit for bit (K=6144: six chunks, three a split
    where it splits in two, so both slots serve and each is refilled)."""
    m, n, k = 300, 4096, 6144
    x, weight, b = _problem(m, n, k, bias=True, seed=7)
    assert launch_tma.scales_by_tma_ok(config, weight.tensors(), k)
    outs = []
    for by_tma in (True, False):
        out = torch.full((m, n), float("nan"), dtype=BF16, device="cuda")
        launch_tma.launch_tma(config, x, weight.tensors(), b, out, scales_tma=by_tma)
        outs.append(out)
    _assert_accurate(outs[0], x, weight, b, f"{config} with the scales by TMA")
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("swap", [True, False])
def test_tma_packed_dequant_computes_its_reference_weights_gpu(dtype, swap):
    """``PACKED_DEQUANT`` multiplies by exactly :func:`packed_dequantized`'s weights: against their
    product its output differs by the float32 accumulation and the output's rounding alone (a code
    out of place, or a scale rounded otherwise, would show as tens of dB)."""
    m, n, k = 70, 4096, 2048
    x, weight, _ = _problem(m, n, k, dtype=dtype, seed=7)
    config = TmaConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, SWAP_AB=swap, PACKED_DEQUANT=True)
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    launch_tma.run_tma(config, x, weight.tensors(), None, out)
    expected = x.double() @ packed_dequantized(weight, dtype).double().t()
    # The output's own rounding to ``dtype`` sets the ceiling.
    ceiling = sqnr_db(expected.to(dtype), expected)
    assert sqnr_db(out, expected) > ceiling - 3.0, (sqnr_db(out, expected), ceiling)
    # And against the exact weights: the accuracy the space's docs state (bf16 about 45 dB, fp16 63).
    exact = sqnr_db(out, q4k_linear_reference(x, weight))
    assert exact > (43.0 if dtype == BF16 else 60.0), exact


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("split", [2, 4, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_tma_fused_reduce_equals_the_reduce_launch_gpu(split, bias):
    """The last split sums the partials in split order, as the reduce launch does: the same bits,
    call after call (the counters are back at zero after each)."""
    x, weight, b = _problem(77, 4096, 4096, bias=bias, seed=split)
    config = TmaConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, SPLIT_K=split)
    expected = torch.full((77, 4096), float("nan"), dtype=BF16, device="cuda")
    launch_tma.run_tma(config, x, weight.tensors(), b, expected)
    for call in range(3):
        out = torch.full_like(expected, float("nan"))
        launch_tma.run_tma(dataclasses.replace(config, FUSED_REDUCE=True), x, weight.tensors(), b, out)
        assert torch.equal(out, expected), f"call {call}: {(out.float() - expected.float()).abs().max()}"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("k", "n", "m"),
    [
        (4096, 14336, 32),
        (14336, 4096, 64),
        (4096, 4096, 128),
        (4096, 6144, 33),
        (4096, 4096, 200),
        (4096, 14336, 500),
        (4096, 14336, 256),
        (4096, 4096, 300),
    ],
)
def test_tma_default_through_the_op_gpu(k, n, m):
    """The SM90 default (the tma path) through ``q4k_linear`` at the Llama shapes, fp16 and an unaligned x too."""
    x, weight, _ = _problem(m, n, k, seed=k + m)
    out = torch.full((m, n), float("nan"), dtype=BF16, device="cuda")
    assert q4k_linear(x, weight, out=out) is out
    _assert_accurate(out, x, weight, None, f"default {k}x{n} m={m}")
    wide = torch.randn((m, k + 1), device="cuda").to(FP16)
    unaligned = wide[:, 1:]
    with use_config("q4k_fp8_gemm", dataclasses.asdict(tma_default(_key(pow2_bucket(m, 1), n=n, k=k)))):
        result = q4k_linear(unaligned, weight)
    _assert_accurate(result, unaligned, weight, None, f"unaligned fp16 {k}x{n} m={m}")


def _replays_with_new_x(x: torch.Tensor, weight: Q4KWeight, bias: torch.Tensor | None) -> None:
    """One call captured in a CUDA graph (after an eager warm-up), replayed three times with new
    x into a NaN-poisoned output, each replay checked."""
    out = torch.empty((x.shape[0], weight.qs.shape[0]), device="cuda", dtype=x.dtype)
    q4k_linear(x, weight, bias, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q4k_linear(x, weight, bias, out=out)
    for replay in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_accurate(out, x, weight, bias, f"graph replay {replay} with new x")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("fused", [False, True], ids=["reduce-launch", "fused-reduce"])
def test_tma_graph_replay_and_compile_gpu(fused):
    """Replays with new x (the fused reduce's counters back at zero after each), and the op under
    ``torch.compile``."""
    x, weight, bias = _problem(48, 4096, 4096, bias=True)
    config = dataclasses.asdict(TmaConfig(BLOCK_M=64, SPLIT_K=4, FUSED_REDUCE=fused))
    with use_config("q4k_fp8_gemm", config):
        _replays_with_new_x(x, weight, bias)
        compiled = torch.compile(lambda a: q4k_linear(a, weight, bias), fullgraph=True)
        _assert_accurate(compiled(x), x, weight, bias, "torch.compile")


_K_LOOP_TILES = [
    TmaConfig(BLOCK_M=512, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, PACKED_DEQUANT=True),
    TmaConfig(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, PACKED_DEQUANT=True),
    TmaConfig(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, PACKED_DEQUANT=True),
    TmaConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, PACKED_DEQUANT=True, SPLIT_K=2),
    TmaConfig(
        BLOCK_M=128,
        BLOCK_N=128,
        BLOCK_K=128,
        num_warps=8,
        num_stages=3,
        PACKED_DEQUANT=True,
        SPLIT_K=2,
        FUSED_REDUCE=True,
    ),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("tile", _K_LOOP_TILES, ids=lambda c: f"{c.BLOCK_M}x{c.BLOCK_N}x{c.BLOCK_K}w{c.num_warps}")
@pytest.mark.parametrize(("loader", "registers"), [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize(("m", "k"), [(300, 4096), (1024, 6144)])
def test_tma_k_loops_compute_the_plain_kernels_outputs_gpu(tile, loader, registers, m, k):
    """The loader warp's and the register-A K loops give the plain kernel's outputs bit for bit
    (the same weights, the same wgmma order), over many programs and K steps, with a bias."""
    x, weight, bias = _problem(m, 4096, k, bias=True, seed=m + k)
    outs = []
    for config in (tile, dataclasses.replace(tile, LOADER_WARP=loader, W_REGISTERS=registers)):
        out = torch.full((m, 4096), float("nan"), device="cuda", dtype=BF16)
        launch_tma.launch_tma(config, x, weight.tensors(), bias, out)
        outs.append(out)
    torch.cuda.synchronize()
    _assert_accurate(outs[1], x, weight, bias, "variant")
    assert torch.equal(outs[0], outs[1]), f"{int((outs[0] != outs[1]).sum())} outputs differ from the plain kernel's"


@pytest.mark.gpu
@needs_sm90
def test_tma_register_a_k_loop_replays_in_a_graph_gpu():
    """The loader warp with the weight tile in registers, captured and replayed with new x."""
    x, weight, bias = _problem(512, 4096, 4096, bias=True)
    config = dataclasses.replace(_K_LOOP_TILES[0], LOADER_WARP=True, W_REGISTERS=True)
    with use_config("q4k_fp8_gemm", dataclasses.asdict(config)):
        _replays_with_new_x(x, weight, bias)


#: The end of a K loop and the start of its epilogue as ``nvdisasm -c`` prints them (from an
#: sm_90 build of the loader-warp kernel whose conversions ptxas placed above the final drain).
_HOISTED_SASS = """
        /*9930*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*9940*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*9950*/                   BAR.SYNC.DEFER_BLOCKING 0x0, 0x100 ;
        /*9970*/               @P1 BRA `(.L_x_31) ;
        /*99b0*/                   F2FP.BF16.F32.PACK_AB R151, R151, R150 ;
        /*9ec0*/                   F2FP.BF16.F32.PACK_AB R2, R25, R24 ;
        /*9ed0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*9ee0*/                   STG.E.U16 desc[UR4][R2.64], R5 ;
"""


def test_the_drain_check_sees_accumulator_reads_above_the_drain():
    """:func:`sm90_build.reads_before_drain` counts the conversions between the last wgmma and the
    drain, and none once the drain comes first (as in a build that drains in the loop)."""
    assert sm90_build.reads_before_drain(_HOISTED_SASS) == 2
    lines = _HOISTED_SASS.splitlines()
    drained = "\n".join([*lines[:3], lines[7], *lines[3:7], *lines[8:]])
    assert sm90_build.reads_before_drain(drained) == 0
    assert sm90_build.reads_before_drain("") == 0
