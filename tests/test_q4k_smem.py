"""The Q4_K portable defaults against each GPU's shared memory per block (no kernel runs).

The defaults were chosen on an H200 (227 KiB); Turing (SM75) gives a block at most 64 KiB (CUDA
C++ Programming Guide, compute capability 7.x: Turing's shared memory capacity is 32 or 64 KiB),
so a default that compiles on an H200 must drop pipeline stages there (and narrow its tiles on
Pascal's 48 KiB and an AMD workgroup's 64 KiB of LDS, where stages alone do not fit).
"""

from __future__ import annotations

import pytest

from tritune.kernels.device import DeviceInfo
from tritune.kernels.q4k.kernel import (
    DEQUANT_DEFAULT_MIN_M,
    KERNEL,
    STAGED_DEFAULT_MIN_M,
    TMA_DEFAULT_M,
    _h200_default,
    dequant_default,
    gemv_default,
    staged_default,
    tma_default,
)
from tritune.kernels.spec import smem_limit_bytes
from tritune.search_spaces.q4k_fp8_gemm import SPACE

T4 = DeviceInfo(name="NVIDIA T4", vendor="nvidia", capability=(7, 5), sm_count=40, arch="sm75")
GPUS = [
    T4,
    DeviceInfo(name="Tesla V100-SXM2-32GB", vendor="nvidia", capability=(7, 0), sm_count=80, arch="sm70"),
    DeviceInfo(name="NVIDIA A100", vendor="nvidia", capability=(8, 0), sm_count=108, arch="sm80"),
    DeviceInfo(name="NVIDIA GeForce RTX 3090", vendor="nvidia", capability=(8, 6), sm_count=82, arch="sm86"),
    DeviceInfo(name="NVIDIA L40S", vendor="nvidia", capability=(8, 9), sm_count=142, arch="sm89"),
    DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90"),
    DeviceInfo(name="NVIDIA GeForce RTX 5090", vendor="nvidia", capability=(12, 0), sm_count=170, arch="sm120"),
    DeviceInfo(name="Tesla P40", vendor="nvidia", capability=(6, 1), sm_count=30, arch="sm61"),
    DeviceInfo(name="AMD Instinct MI300X", vendor="amd", capability=(9, 4), sm_count=304, arch="gfx942"),
]


def test_turing_gives_a_block_64_kib():
    assert smem_limit_bytes((7, 5)) == 64 * 1024


@pytest.mark.parametrize("device", GPUS, ids=[d.arch for d in GPUS])
def test_the_portable_default_of_every_default_key_is_feasible(device):
    """Every default key's portable default fits the GPU's shared memory (and every other rule)."""
    limits = KERNEL.limits(device)
    for key in KERNEL.default_keys(device):
        default = KERNEL.default_config(key)
        assert SPACE.infeasible_reason(default, key, limits) is None, (key, default)


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_the_defaults_of_the_large_parts_are_not_refitted(arch):
    """The shipped speedups are measured against these defaults: fitting must leave them alone
    (up to M=4 the GEMV path, which keeps no tiles in shared memory; under the opt-in from M=1024
    on SM90 the staged path, whose GEMM is cuBLASLt's; on SM90 from M=32 to 512 the tma path, whose
    tiles are chosen for SM90's shared memory; elsewhere from M=256 up the dequant path, which has
    no shared-memory tiles to fit)."""
    device = next(d for d in GPUS if d.arch == arch)
    for key in KERNEL.default_keys(device):
        dequant = dequant_default(key) if key.m_bucket >= DEQUANT_DEFAULT_MIN_M else None
        tma = tma_default(key) if arch == "sm90" and TMA_DEFAULT_M[0] <= key.m_bucket <= TMA_DEFAULT_M[1] else None
        gemv, staged = gemv_default(key), staged_default(key)
        assert (staged is not None) == (arch == "sm90" and key.fp8 and key.m_bucket >= STAGED_DEFAULT_MIN_M), key
        assert KERNEL.default_config(key) == (gemv or staged or tma or dequant or _h200_default(key)), key
