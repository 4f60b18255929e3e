"""The Q4_K tuning half's starting configs and serving rules on devices the CPU tier can describe
(no kernel runs): every start is a member of the space, and no path is offered or served on a
device whose instructions it lacks."""

from __future__ import annotations

import pytest

from tritune.kernels import settings
from tritune.kernels.device import DeviceInfo
from tritune.kernels.q4k.kernel import KERNEL, Q4KKey, default_config, key_for
from tritune.kernels.q4k.tuning import TUNING
from tritune.search_spaces.q4k_fp8_gemm import SPACE, GemvConfig

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
