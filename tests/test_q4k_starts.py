"""The Q4_K tuning half's starting configs and serving rules on devices the CPU tier can describe
(no kernel runs): every start is a member of the space, and no path is offered or served on a
device whose instructions it lacks."""

from __future__ import annotations

import pytest

from tritune.kernels.device import DeviceInfo
from tritune.kernels.q4k.kernel import Q4KKey
from tritune.kernels.q4k.tuning import TUNING
from tritune.search_spaces.q4k_fp8_gemm import SPACE

H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
A100 = DeviceInfo(name="NVIDIA A100", vendor="nvidia", capability=(8, 0), sm_count=108, arch="sm80")


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
