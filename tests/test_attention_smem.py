"""The shared-memory rules of the attention kernels that load K/V by pointers or by TMA descriptors
(``splitk_decode``, ``varlen_sdpa``: :func:`tritune.search_spaces.base.pointer_attention_reason`,
:func:`tritune.search_spaces.splitk_decode.kv_tma_smem_bytes`).

Their estimates are fitted to Triton 3.6's sm_90 builds (``tests/test_decode_sm90.py`` and
``tests/test_sm90_build.py`` check them against builds); here, without building, that the fitted
rules still admit every winner the shipped H200 bundle holds for these kernels, and that the
estimate bounds the build figures it was fitted to.
"""

from __future__ import annotations

import pytest

from tritune.configs_db.bundles import shipped_records
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import smem_limit_bytes
from tritune.kernels.winners import Rejection, admit
from tritune.search_spaces.base import TargetLimits, attention_smem_bytes, pointer_attention_reason

H200 = DeviceInfo("NVIDIA H200", "nvidia", (9, 0), 132, "sm90")
H200_LIMITS = TargetLimits(smem_bytes=smem_limit_bytes(H200.capability))
#: The kernels whose feasibility uses the pointer/TMA attention rules, and their winners in the bundle.
ATTENTION_WINNERS = {"splitk_decode": 60, "varlen_sdpa": 8}


def test_shipped_attention_winners_stay_feasible_on_an_h200():
    """Every decode and varlen winner of the shipped H200 bundle is admitted on an H200 (parsed,
    feasible at its key): the fitted shared-memory rules refuse none of them."""
    records, rejections = shipped_records(H200.slug)
    assert rejections == []
    counts = dict.fromkeys(ATTENTION_WINNERS, 0)
    refused = []
    for record in records:
        if record.kernel not in ATTENTION_WINNERS:
            continue
        counts[record.kernel] += 1
        outcome = admit(record, H200)
        if isinstance(outcome, Rejection):
            refused.append((record.kernel, record.key, record.config, outcome.reason))
    assert counts == ATTENTION_WINNERS
    assert not refused, refused


#: Triton 3.6's sm_90 builds (``metadata.shared``, 2026-12-05, ``tests/sm90_build.py``):
#: (block_m, block_n, head_dim, num_warps, num_stages, kv_tma, bytes). The decode and varlen kernels
#: build the same pointer-load figures; their TMA builds differ (decode's holds Q + P + 2s - 1 K/V
#: tiles with mma.sync, varlen's Q + 2s), and the estimate bounds both.
BUILDS = [
    # mma.sync (16/32-row M tiles): Q + P + 2 (s - 1) K/V tiles, one tile at one stage
    (16, 128, 128, 4, 1, False, 40960),
    (16, 128, 128, 4, 4, False, 204800),
    (32, 128, 128, 4, 4, False, 212992),
    (16, 16, 64, 4, 2, False, 6656),
    # wgmma (64/128-row M tiles, 4+ warps): Q + 2 s K/V tiles
    (64, 64, 128, 4, 3, False, 114688),
    (64, 128, 128, 4, 3, False, 212992),
    (64, 128, 128, 8, 4, False, 278528),
    (128, 128, 128, 8, 3, False, 229376),
    (128, 128, 128, 8, 4, False, 294912),
    # the fp32 accumulator, converted through shared memory, at small tiles
    (64, 16, 64, 4, 1, False, 16384),
    # TMA loads: decode with mma.sync (16-row tiles)
    (16, 128, 128, 4, 3, True, 172064),
    (16, 128, 128, 4, 4, True, 237624),
    # TMA loads: varlen with mma.sync, and with wgmma
    (16, 128, 128, 4, 3, True, 200736),
    (16, 128, 128, 4, 4, True, 266304),
    (64, 128, 64, 4, 4, True, 140288),
    (128, 128, 128, 8, 3, True, 230400),
    (128, 128, 128, 8, 4, True, 295936),
]


@pytest.mark.parametrize(("block_m", "block_n", "head_dim", "num_warps", "num_stages", "kv_tma", "built"), BUILDS)
def test_estimate_bounds_the_build(block_m, block_n, head_dim, num_warps, num_stages, kv_tma, built):
    """The estimate is at least what the build allocates, within one K/V tile, P and 1 KiB of it,
    and refuses it on an H200 exactly when the build needs more than an H200 block has."""
    estimate = attention_smem_bytes(block_m, block_n, head_dim, num_warps, num_stages, kv_tma=kv_tma)
    assert built <= estimate <= built + block_n * head_dim * 2 + block_m * block_n * 2 + 1024
    reason = pointer_attention_reason(
        block_m, block_n, head_dim, num_warps, num_stages, H200_LIMITS, max_registers=1 << 20, kv_tma=kv_tma
    )
    assert (reason is not None) == (built > H200_LIMITS.smem_bytes), reason
