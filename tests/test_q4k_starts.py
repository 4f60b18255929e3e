"""The Q4_K tuning half's starting configs and serving rules on devices the CPU tier can describe
(no kernel runs): every start is a member of the space, and no path is offered or served on a
device whose instructions it lacks."""

from __future__ import annotations

import pytest

from tritune.kernels import settings
from tritune.kernels.device import DeviceInfo
from tritune.kernels.q4k.kernel import KERNEL, Q4KKey, default_config, key_for
from tritune.kernels.q4k.tuning import TUNING, _each_path_first
from tritune.search_spaces.q4k_fp8_gemm import SPACE, DequantConfig, GemvConfig, StagedConfig, TmaConfig

H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
A100 = DeviceInfo(name="NVIDIA A100", vendor="nvidia", capability=(8, 0), sm_count=108, arch="sm80")
#: As :func:`tritune.kernels.device.device_info` describes an MI300X under ROCm (HIP reports 9.4).
MI300X = DeviceInfo(name="AMD Instinct MI300X", vendor="amd", capability=(9, 4), sm_count=304, arch="gfx942")


@pytest.mark.parametrize("device", [H200, A100], ids=["sm90", "sm80"])
@pytest.mark.parametrize("fp8", [False, True], ids=["accurate", "opt-in"])
@pytest.mark.parametrize("n", [32768, 57344, 128256])
def test_every_start_at_a_large_n_is_a_member_of_the_space(device, fp8, n):
    """Each path's starts take their choices from the path's own member space: the staged chunks
    are not the dequant path's (whose 16384 the staged path does not offer)."""
    for m in (1, 8, 64, 1024, 8192):
        key = Q4KKey(arch=device.arch, sm_count=device.sm_count, dtype="bfloat16", m_bucket=m, n=n, k=4096, fp8=fp8)
        for config in TUNING.starting_configs(key, device):
            assert SPACE.contains(config), (m, config)
            assert SPACE.parse(SPACE.to_dict(config)) == config


@pytest.mark.parametrize("m", [128, 256, 2048, 8192])
def test_each_competing_path_is_started_before_a_second_tile_of_any(m):
    """At large M the opt-in key's first starts are one of each path (dequant, tma where it starts,
    fp8, int8, staged): a tune of a few trials measures the staged path, which wins at M >= 2048
    under the opt-in, instead of three dequant chunks and a run of tma tiles before it. Each path's
    own starts keep their order."""
    key = Q4KKey(arch="sm90", sm_count=132, dtype="bfloat16", m_bucket=m, n=4096, k=14336, fp8=True)
    starts = TUNING.starting_configs(key, H200)
    paths = list(dict.fromkeys(c.path for c in starts))
    assert {"dequant", "fp8", "int8", "staged"} <= set(paths)
    assert [c.path for c in starts[: len(paths)]] == paths


def test_moving_each_path_first_keeps_every_start_and_each_path_order():
    """The reorder is a stable partition: the first of each path in path order, then the rest as they came."""
    d1, d2 = DequantConfig(CHUNK_N=16384), DequantConfig(CHUNK_N=8192)
    s1, s2 = StagedConfig(CHUNK_N=4096), StagedConfig(CHUNK_N=2048)
    tma = TmaConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128)
    assert _each_path_first([d1, d2, tma, s1, s2]) == [d1, tma, s1, d2, s2]
    assert _each_path_first([d1]) == [d1] and _each_path_first([]) == []


def test_below_large_m_the_gemv_starts_keep_the_lead():
    """Up to ``SMALL_M`` the order is the rules' own: at M=1 every GEMV tile before the first tma tile."""
    key = Q4KKey(arch="sm90", sm_count=132, dtype="bfloat16", m_bucket=1, n=4096, k=4096, fp8=False)
    paths = [c.path for c in TUNING.starting_configs(key, H200)]
    assert paths[0] == "gemv" and "tma" in paths
    assert paths.index("tma") == paths.count("gemv")


# ---- the GEMV path's dp4a: NVIDIA only ---------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True], ids=["accurate", "opt-in"])
def test_no_gemv_start_on_rocm(fp8):
    """The GEMV kernels issue PTX dp4a, which no ROCm build has: a ROCm tune does not start there
    (as it does not start the fp8, staged or int8 paths); an NVIDIA GPU still does."""
    for m in (1, 2, 4, 8):
        key = Q4KKey(arch=MI300X.arch, sm_count=MI300X.sm_count, dtype="bfloat16", m_bucket=m, n=4096, k=4096, fp8=fp8)
        starts = TUNING.starting_configs(key, MI300X)
        assert not [c for c in starts if c.path in ("gemv", "fp8", "staged", "int8")], (m, starts)
    nvidia = Q4KKey(arch="sm90", sm_count=132, dtype="bfloat16", m_bucket=1, n=4096, k=4096, fp8=fp8)
    assert any(c.path == "gemv" for c in TUNING.starting_configs(nvidia, H200))


@pytest.mark.parametrize("fp8", [False, True], ids=["accurate", "opt-in"])
def test_a_gemv_config_does_not_serve_on_rocm(fp8):
    """A pinned or stored GEMV config gives way to the portable default on ROCm, naming dp4a."""
    facts = KERNEL.Facts(1, 4096, 4096, "bf16")
    gemv = GemvConfig(BLOCK_N=32, BLOCK_K=256, num_warps=4)
    with settings.override(q4k_fp8=fp8):
        served, why = KERNEL.serve_with_reason(gemv, MI300X, tuple(facts))
        assert served == default_config(key_for(MI300X, facts)) and served.path == "portable"
        assert why is not None and "dp4a" in why and "gfx942" in why
        assert KERNEL.serveable(gemv, H200, tuple(facts)) == gemv
        assert KERNEL.serveable(gemv, A100, tuple(facts)) == gemv
