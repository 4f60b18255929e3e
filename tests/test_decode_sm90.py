"""The split-K decode kernel built for sm_90 by Triton's compiler and ptxas (no GPU needed).

Two facts the CPU tier cannot see on the interpreter:

- the pointer-load path (``KV_TMA=False``) builds the very SASS that the shipped H200 bundle's
  decode winners were timed on (:data:`WINNER_SASS`), so their timings still describe this
  code and re-stamping them under a new kernel version is sound;
- ``KV_TMA=True`` builds at the tiles the tuner will try on an H200 (BLOCK_N 64/128, 2-4
  stages, head dim 128), with TMA loads, without spilling, within an H200 block's shared memory.

Each launch is recorded from the real launch code on meta tensors (:mod:`sm90_build`), and one
subprocess without ``TRITON_INTERPRET`` builds the distinct ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sm90_build

from tritune.kernels.decode.kernel import KERNEL
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import smem_limit_bytes
from tritune.search_spaces.base import attention_smem_bytes
from tritune.search_spaces.splitk_decode import SPACE, block_m_for, kv_tma_smem_bytes

H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
SMEM_LIMIT = smem_limit_bytes(H200.capability)
SCRIPT = Path(__file__).with_name("sm90_build.py")
SPLIT_KERNEL = "_decode_split_kernel"

#: The shipped H200 bundle's decode winners (bf16, GQA 4, one new token; tuned 2026-11-29):
#: (head_dim, bh_bucket, lkv_bucket, TARGET_WAVES, MIN_CHUNK, BLOCK_N, num_warps, num_stages,
#: FUSED_MERGE) -> the first 16 hex digits of the sha256 of ``_decode_split_kernel``'s SASS
#: (``nvdisasm -c``) as the winner launches it on an H200, before ``KV_TMA`` existed. Another
#: digest means the bundle's timings describe other code: re-tune rather than re-stamp.
WINNER_SASS = {
    (64, 8, 1024, 4, 64, 64, 2, 3, False): "f173c9201388fc3e",
    (64, 8, 4096, 2, 128, 64, 4, 3, False): "ac88d42fc5caf126",
    (64, 8, 16384, 2, 512, 64, 2, 3, False): "f173c9201388fc3e",
    (64, 8, 32768, 2, 512, 128, 2, 3, False): "e69fd3fa773410d7",
    (64, 8, 131072, 2, 1024, 128, 2, 3, False): "e69fd3fa773410d7",
    (64, 32, 1024, 2, 128, 64, 4, 3, False): "ac88d42fc5caf126",
    (64, 32, 4096, 4, 512, 64, 2, 3, False): "f173c9201388fc3e",
    (64, 32, 16384, 4, 128, 64, 4, 3, False): "ac88d42fc5caf126",
    (64, 32, 32768, 4, 128, 64, 4, 3, False): "ac88d42fc5caf126",
    (64, 32, 131072, 2, 256, 128, 2, 3, False): "e69fd3fa773410d7",
    (64, 64, 1024, 2, 64, 64, 2, 3, False): "f173c9201388fc3e",
    (64, 64, 4096, 4, 256, 64, 2, 3, False): "f173c9201388fc3e",
    (64, 64, 16384, 4, 128, 64, 2, 3, False): "f173c9201388fc3e",
    (64, 64, 32768, 4, 128, 128, 4, 4, False): "dac61c47c251f890",
    (64, 64, 131072, 2, 256, 128, 2, 3, False): "e69fd3fa773410d7",
    (64, 128, 1024, 2, 512, 128, 2, 3, True): "76090d9502f3d960",
    (64, 128, 4096, 2, 2048, 128, 2, 3, False): "e69fd3fa773410d7",
    (64, 128, 16384, 4, 128, 128, 4, 4, False): "dac61c47c251f890",
    (64, 128, 32768, 4, 128, 128, 4, 4, False): "dac61c47c251f890",
    (64, 128, 131072, 2, 1024, 128, 4, 4, False): "dac61c47c251f890",
    (64, 256, 1024, 2, 128, 128, 2, 3, False): "91aa6b7ff0ffc946",
    (64, 256, 4096, 4, 2048, 64, 2, 3, True): "ff12738dc0bdbb28",
    (64, 256, 16384, 4, 512, 128, 4, 4, False): "dac61c47c251f890",
    (64, 256, 32768, 4, 2048, 64, 2, 4, True): "bc8cb311d6aa4894",
    (64, 256, 131072, 4, 2048, 64, 2, 4, False): "9af706be4c94ef44",
    (64, 512, 1024, 2, 128, 64, 2, 3, False): "2461c478fda0ca22",
    (64, 512, 4096, 2, 128, 64, 2, 3, False): "2461c478fda0ca22",
    (64, 512, 16384, 2, 128, 64, 2, 3, False): "2461c478fda0ca22",
    (64, 512, 32768, 2, 128, 64, 2, 3, False): "2461c478fda0ca22",
    (64, 512, 131072, 2, 128, 64, 2, 3, False): "2461c478fda0ca22",
    (128, 8, 1024, 2, 64, 64, 4, 3, False): "89467872231f4aab",
    (128, 8, 4096, 2, 256, 64, 8, 3, False): "84981fa61b74f5e1",
    (128, 8, 16384, 2, 64, 64, 4, 3, False): "89467872231f4aab",
    (128, 8, 32768, 2, 128, 64, 4, 3, False): "89467872231f4aab",
    (128, 8, 131072, 2, 128, 64, 4, 3, False): "89467872231f4aab",
    (128, 32, 1024, 1, 128, 64, 4, 3, False): "89467872231f4aab",
    (128, 32, 4096, 2, 256, 64, 4, 3, False): "89467872231f4aab",
    (128, 32, 16384, 4, 2048, 32, 2, 4, False): "dd15ec3998387b62",
    (128, 32, 32768, 2, 64, 64, 4, 3, False): "89467872231f4aab",
    (128, 32, 131072, 4, 1024, 32, 2, 4, False): "dd15ec3998387b62",
    (128, 64, 1024, 2, 64, 64, 4, 3, False): "89467872231f4aab",
    (128, 64, 4096, 2, 64, 64, 4, 3, False): "89467872231f4aab",
    (128, 64, 16384, 2, 128, 64, 4, 3, False): "89467872231f4aab",
    (128, 64, 32768, 4, 1024, 128, 4, 4, True): "5e305111c30da2cf",
    (128, 64, 131072, 4, 1024, 32, 2, 4, False): "dd15ec3998387b62",
    (128, 128, 1024, 2, 64, 64, 4, 3, True): "a570f72e3818b9c0",
    (128, 128, 4096, 4, 2048, 32, 2, 4, False): "dd15ec3998387b62",
    (128, 128, 16384, 4, 2048, 128, 4, 4, True): "92fd0c1976be9f0d",
    (128, 128, 32768, 4, 256, 128, 4, 3, True): "c1a518200a81a204",
    (128, 128, 131072, 4, 256, 128, 4, 3, True): "c1a518200a81a204",
    (128, 256, 1024, 2, 128, 64, 4, 3, False): "304d99a649b6cdbe",
    (128, 256, 4096, 4, 512, 128, 4, 2, False): "c1cfd1b2efbcfa91",
    (128, 256, 16384, 4, 512, 128, 4, 3, True): "86cd3ebc4a9e8ce7",
    (128, 256, 32768, 4, 512, 128, 4, 3, True): "86cd3ebc4a9e8ce7",
    (128, 256, 131072, 4, 512, 128, 4, 3, True): "86cd3ebc4a9e8ce7",
    (128, 512, 1024, 2, 128, 32, 2, 3, False): "154bfe9bb5c3abfb",
    (128, 512, 4096, 2, 128, 128, 8, 4, False): "f76f103b98003aef",
    (128, 512, 16384, 2, 128, 32, 2, 3, False): "154bfe9bb5c3abfb",
    (128, 512, 32768, 2, 128, 32, 2, 3, False): "154bfe9bb5c3abfb",
    (128, 512, 131072, 2, 128, 32, 2, 3, False): "154bfe9bb5c3abfb",
}
_CONFIG_FIELDS = ("TARGET_WAVES", "MIN_CHUNK", "BLOCK_N", "num_warps", "num_stages", "FUSED_MERGE")

#: KV_TMA builds: an H200 default key of head dim 128 (8 sequences x 8 KV heads, 32K cache:
#: several splits) at BLOCK_N 64/128 x 2-4 stages, with and without the fused merge; then head
#: dim 64, and a 64-row M tile (GQA 8 x 8 new tokens). (key changes, config fields) each.
TMA_KEY = {"head_dim": 128, "bh_bucket": 64, "lkv_bucket": 32768}
TMA_BUILDS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({}, {"BLOCK_N": block_n, "num_stages": stages, "FUSED_MERGE": fused})
    for block_n in (64, 128)
    for stages in (2, 3, 4)
    for fused in (False, True)
] + [
    ({"head_dim": 64}, {"BLOCK_N": 128, "num_stages": 4}),
    ({"gqa_group": 8, "lq": 8}, {"BLOCK_N": 64, "num_stages": 3, "num_warps": 8}),
]


#: Pointer-load builds at a 64-row M tile (GQA 8 x 8 new tokens, head dim 128), where the MMAs are
#: wgmma and the pipeliner holds one more K/V pair than with 16-row tiles: (config fields) each.
POINTER_M64_KEY = {"gqa_group": 8, "lq": 8}
POINTER_M64_BUILDS: list[dict[str, Any]] = [
    {"BLOCK_N": block_n, "num_stages": stages, "num_warps": 4} for block_n, stages in ((64, 3), (128, 3), (128, 4))
]


def _winner_key(head_dim: int, bh_bucket: int, lkv_bucket: int) -> dict[str, Any]:
    return {"arch": "sm90", "sm_count": 132, "dtype": "bf16", "head_dim": head_dim, "gqa_group": 4, "lq": 1,
            "bh_bucket": bh_bucket, "lkv_bucket": lkv_bucket}  # fmt: skip


def _tma_key(changes: dict[str, Any]) -> Any:
    (key,) = [k for k in KERNEL.default_keys(H200) if all(getattr(k, n) == v for n, v in TMA_KEY.items())]
    return dataclasses.replace(key, **changes)


def _tma_entries() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [
        (dataclasses.asdict(_tma_key(changes)), SPACE.to_dict(SPACE.parse({**fields, "KV_TMA": True})))
        for changes, fields in TMA_BUILDS
    ]


@pytest.fixture(scope="module")
def decode_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[list[int], dict[str, Any]]]]:
    """``"winners"``, ``"kv_tma"`` and ``"pointer_m64"``: per distinct launch of the split kernel, the indices of the
    entries that launch it and its build (:func:`sm90_build.code_report`'s fields)."""
    reason = sm90_build.build_reason()
    if reason is not None:
        pytest.skip(reason)
    groups = {
        "winners": [(_winner_key(*row[:3]), dict(zip(_CONFIG_FIELDS, row[3:], strict=True))) for row in WINNER_SASS],
        "kv_tma": _tma_entries(),
        "pointer_m64": [
            (dataclasses.asdict(_tma_key(POINTER_M64_KEY)), SPACE.to_dict(SPACE.parse(fields)))
            for fields in POINTER_M64_BUILDS
        ],
    }
    found = {name: sm90_build.record_winners(KERNEL.name, entries, SPLIT_KERNEL) for name, entries in groups.items()}
    records = [{**item["record"], "id": f"{name}/{i}"} for name, items in found.items() for i, item in enumerate(items)]
    tmp = tmp_path_factory.mktemp("decode-sm90")
    (tmp / "records.json").write_text(json.dumps(records))
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--records", str(tmp / "records.json"), "--detail"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = {result["id"]: result for result in map(json.loads, run.stdout.splitlines())}
    return {
        name: [(item["entries"], results[f"{name}/{i}"]) for i, item in enumerate(items)]
        for name, items in found.items()
    }


def test_pointer_loads_build_the_code_the_shipped_winners_measured(decode_builds):
    """Each winner, launched with this source (``KV_TMA`` left at its default, False), builds the
    SASS it was timed on, so the winners' timings hold under this kernel version."""
    rows = list(WINNER_SASS)
    built = decode_builds["winners"]
    assert sorted(i for entries, _ in built for i in entries) == list(range(len(rows)))
    changed = []
    for entries, result in built:
        assert result["error"] is None, result["error"]
        assert result["tma_loads"] == 0, result
        for i in entries:
            if result["sass_sha256"][:16] != WINNER_SASS[rows[i]]:
                changed.append(rows[i])
    assert not changed, f"_decode_split_kernel's pointer path builds other code at {changed}"


def test_kv_tma_builds_with_tma_loads_without_spills(decode_builds):
    """Every KV_TMA build loads through TMA, within the space's shared-memory estimate (at most a
    K/V tile and 1 KiB above it); those the rule admits fit an H200 block and spill nothing
    (BLOCK_N 128 with 4 stages at head dim 128 needs more than the block has: the rule refuses
    it, where the pointer loads' twin fits)."""
    built = decode_builds["kv_tma"]
    assert sorted(i for entries, _ in built for i in entries) == list(range(len(TMA_BUILDS)))
    limits = KERNEL.limits(H200)
    refused = []
    for entries, result in built:
        for i in entries:
            changes, fields = TMA_BUILDS[i]
            key = _tma_key(changes)
            config = SPACE.parse({**fields, "KV_TMA": True})
            where = (changes, fields, result)
            assert result["error"] is None, where
            assert result["tma_loads"] > 0, where
            rows = block_m_for(key.gqa_group * key.lq)
            estimate = kv_tma_smem_bytes(rows, config.BLOCK_N, key.head_dim, config.num_stages, config.num_warps)
            # At most one K/V tile and the 1 KiB barrier allowance above the build.
            assert result["shared"] <= estimate <= result["shared"] + config.BLOCK_N * key.head_dim * 2 + 1024, where
            reason = SPACE.infeasible_reason(config, key, limits)
            if reason is not None:
                assert result["shared"] > SMEM_LIMIT and "shared memory" in reason, where
                assert SPACE.infeasible_reason(dataclasses.replace(config, KV_TMA=False), key, limits) is None
                refused.append((tuple(changes.items()), config.BLOCK_N, config.num_stages))
                continue
            assert result["shared"] <= SMEM_LIMIT, where
            assert result["spill_bytes"] == 0, where
    assert sorted(refused) == [((), 128, 4)] * 2  # with and without the fused merge


def test_pointer_loads_at_64_row_tiles_fit_what_the_rule_admits(decode_builds):
    """With 64-row M tiles the pointer build holds Q and ``2 num_stages`` K/V tiles (wgmma): the
    rule's estimate is exactly that, and it refuses the one build past an H200 block (BLOCK_N 128,
    4 stages: 278,528 bytes), which a Q + P + ``2 (num_stages - 1)`` K/V tiles estimate admitted."""
    built = decode_builds["pointer_m64"]
    assert sorted(i for entries, _ in built for i in entries) == list(range(len(POINTER_M64_BUILDS)))
    key = _tma_key(POINTER_M64_KEY)
    limits = KERNEL.limits(H200)
    refused = []
    for entries, result in built:
        for i in entries:
            config = SPACE.parse(POINTER_M64_BUILDS[i])
            where = (POINTER_M64_BUILDS[i], result)
            assert result["error"] is None and result["tma_loads"] == 0, where
            rows = block_m_for(key.gqa_group * key.lq)
            estimate = attention_smem_bytes(rows, config.BLOCK_N, key.head_dim, config.num_warps, config.num_stages)
            assert estimate == result["shared"], where
            reason = SPACE.infeasible_reason(config, key, limits)
            if reason is not None:
                assert result["shared"] > SMEM_LIMIT and "shared memory" in reason, where
                refused.append((config.BLOCK_N, config.num_stages))
                continue
            assert result["shared"] <= SMEM_LIMIT, where
    assert refused == [(128, 4)]
