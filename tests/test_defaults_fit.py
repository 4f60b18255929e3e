"""The portable defaults of the attention families fit the shared memory of every GPU they may run on.

``tune`` refuses to start from a default its space's rule finds infeasible, and such a default
would not compile there: each family fits its default to the GPU its key names (fewer stages,
then smaller tiles), leaving the defaults of the GPUs with room (H200, A100) as they were chosen.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tritune.kernels.decode.kernel import KERNEL as DECODE
from tritune.kernels.decode.kernel import DecodeKey
from tritune.kernels.device import DeviceInfo
from tritune.kernels.fit_default import arch_smem_limit_bytes
from tritune.kernels.prefill.kernel import KERNEL as PREFILL
from tritune.kernels.prefill.kernel import PrefillKey
from tritune.kernels.varlen.kernel import KERNEL as VARLEN
from tritune.kernels.varlen.kernel import VarlenKey
from tritune.search_spaces.splitk_decode import DecodeConfig
from tritune.search_spaces.splitk_decode import portable_config as decode_portable
from tritune.search_spaces.tma_prefill import PortableConfig
from tritune.search_spaces.varlen_sdpa import VarlenConfig
from tritune.search_spaces.varlen_sdpa import portable_config as varlen_portable

FAMILIES = {"prefill": PREFILL, "decode": DECODE, "varlen": VARLEN}

#: One GPU of each architecture the shared-memory table knows (name, capability, SMs).
_NVIDIA = [
    ("Tesla P100", (6, 0), 56),
    ("Tesla P40", (6, 1), 30),
    ("Tesla V100", (7, 0), 80),
    ("Tesla T4", (7, 5), 40),
    ("A100", (8, 0), 108),
    ("RTX 3090", (8, 6), 82),
    ("Jetson AGX Orin", (8, 7), 16),
    ("L40S", (8, 9), 142),
    ("H200", (9, 0), 132),
    ("B200", (10, 0), 148),
    ("RTX 5090", (12, 0), 170),
]
GPUS = {
    f"sm{major}{minor}": DeviceInfo(
        name=f"NVIDIA {name}", vendor="nvidia", capability=(major, minor), sm_count=sms, arch=f"sm{major}{minor}"
    )
    for name, (major, minor), sms in _NVIDIA
}
MI300X = DeviceInfo(name="AMD Instinct MI300X", vendor="amd", capability=(9, 4), sm_count=304, arch="gfx942")
MI355X = DeviceInfo(name="AMD Instinct MI355X", vendor="amd", capability=(9, 5), sm_count=256, arch="gfx950")
GPUS |= {"gfx942": MI300X, "gfx950": MI355X}


@pytest.mark.parametrize("arch", list(GPUS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_is_feasible_at_every_default_key(family, arch):
    kernel, device = FAMILIES[family], GPUS[arch]
    limits = kernel.limits(device)
    keys = kernel.default_keys(device)
    assert keys
    for key in keys:
        config = kernel.default_config(key)
        assert kernel.space.infeasible_reason(config, key, limits) is None, (key, config)


#: The defaults at every default key as chosen on the H200 and A100 (the shipped bundles' speedups
#: are measured against them): fitting must leave them as they are.
_CHOSEN = {
    "prefill": PortableConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "decode": DecodeConfig(TARGET_WAVES=2, MIN_CHUNK=128, BLOCK_N=64, num_warps=4, num_stages=3),
    "varlen": VarlenConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, MAX_SPLITS=16, MIN_CHUNK=512, SHORT_M=16),
}


def _split_large_batch(family: str, key: Any, chosen: Any) -> Any:
    """``chosen`` at wave target 32 for a decode key past two sequence-heads per SM with 16K keys or
    more, where that target splits a cache at all (on 30 SMs it gives 512 sequence-heads one split)."""
    splits = key.sm_count * 32 // key.bh_bucket if family == "decode" else 0
    if splits >= 2 and key.bh_bucket > 2 * key.sm_count and key.lkv_bucket >= 16384:
        return dataclasses.replace(chosen, TARGET_WAVES=32)
    return chosen


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_h200_and_a100_defaults_unchanged(family, arch):
    """Except decode's large batches over long caches (more than two unsplit programs per SM, 16K
    keys or more), whose default splits each cache at the largest wave target (the bundles'
    winners there were measured against the unsplit default; those past the margin still serve)."""
    kernel = FAMILIES[family]
    for key in kernel.default_keys(GPUS[arch]):
        assert kernel.default_config(key) == _split_large_batch(family, key, _CHOSEN[family]), key


def _prefill_chosen(key: PrefillKey) -> PortableConfig:
    """The prefill default before fitting: 64 x 64 tiles, 2 stages; 64 x 32, 1 stage at head dim 256."""
    if key.head_dim > 128:
        return PortableConfig(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
    return PortableConfig()


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_h200_and_a100_defaults_unchanged_beyond_default_keys(arch, head_dim):
    device = GPUS[arch]
    for group in (1, 4, 8, 16):
        prefill = PrefillKey(arch, device.sm_count, "bf16", head_dim, group, group % 2 == 0, 512, 4096)
        assert PREFILL.default_config(prefill) == _prefill_chosen(prefill)
        for lq in (1, 8):
            decode = DecodeKey(arch, device.sm_count, "bf16", head_dim, group, lq, 32, 4096)
            assert DECODE.default_config(decode) == decode_portable(decode, interpreter=False)
        varlen = VarlenKey(arch, device.sm_count, "bf16", head_dim, group, True, False, False, 64, 32, 4096)
        assert VARLEN.default_config(varlen) == varlen_portable(varlen, interpreter=False)


@pytest.mark.parametrize("arch", ["sm75", "sm61", "gfx942"])
def test_small_blocks_drop_stages_first(arch):
    """At head dim 128 a block of 64 KiB (or 48 KiB) takes the chosen tiles with fewer stages;
    head dim 64 fits as chosen."""
    device = GPUS[arch]
    moved = {"prefill": {"num_stages": 1}, "decode": {"num_stages": 2}, "varlen": {"num_stages": 1}}
    for family, kernel in FAMILIES.items():
        for key in kernel.default_keys(device):
            expected = _CHOSEN[family]
            if key.head_dim == 128:
                expected = type(expected)(**{**expected.__dict__, **moved[family]})
            assert kernel.default_config(key) == _split_large_batch(family, key, expected), key


def test_tiles_shrink_where_one_stage_does_not_fit():
    """Prefill at head dim 256 on a 48 KiB block: one stage of 64 x 32 tiles needs 64 KiB, 64 x 16 fits."""
    key = PrefillKey("sm61", 30, "bf16", 256, 8, True, 512, 4096)
    assert PREFILL.default_config(key) == PortableConfig(BLOCK_M=64, BLOCK_N=16, num_warps=4, num_stages=1)
    varlen = VarlenKey("sm61", 30, "bf16", 256, 4, True, False, False, 64, 32, 4096)
    config = VARLEN.default_config(varlen)
    assert config.BLOCK_M < 64 and config.SHORT_M <= config.BLOCK_M
    assert VARLEN.space.infeasible_reason(config, varlen, VARLEN.limits(GPUS["sm61"])) is None


def test_interpreter_and_unknown_archs_keep_their_default():
    key = PrefillKey("cpu-interpreter", 1, "bf16", 128, 2, True, 16, 64)
    assert PREFILL.default_config(key) == PortableConfig(BLOCK_M=32, BLOCK_N=32)
    assert arch_smem_limit_bytes("cpu-interpreter") is None
    assert arch_smem_limit_bytes("tpu") is None


@pytest.mark.parametrize(
    "arch, kib",
    [
        ("sm61", 48),
        ("sm70", 96),
        ("sm75", 64),
        ("sm80", 163),
        ("sm86", 99),
        ("sm90", 227),
        ("sm100", 227),
        ("sm120", 99),
        ("gfx942", 64),
        ("gfx950", 160),
        ("gfx1100", 64),
    ],
)
def test_arch_limit_matches_the_device_limit(arch, kib):
    """The key's arch gives the limit the device's own ``limits`` gives (the default is fitted to the key)."""
    assert arch_smem_limit_bytes(arch) == kib * 1024
    if arch in GPUS:
        assert PREFILL.limits(GPUS[arch]).smem_bytes == kib * 1024


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rocm_limits_are_the_workgroup_lds(family):
    """A ROCm device's capability is no NVIDIA one: MI300X (9.4) gets its 64 KiB of LDS, not Hopper's 227 KiB."""
    kernel = FAMILIES[family]
    assert kernel.limits(MI300X).smem_bytes == 64 * 1024
    assert kernel.limits(MI355X).smem_bytes == 160 * 1024
    assert not kernel.limits(MI300X).interpreter
