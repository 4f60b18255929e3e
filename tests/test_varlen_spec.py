"""The ``varlen_sdpa`` declaration and search space: keys and buckets, feasibility, defaults, tuning problems."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tritune.kernels.arguments import DYNAMIC
from tritune.kernels.device import DeviceInfo, interpreter_device
from tritune.kernels.dispatcher import DISPATCHER, NEAREST_MAX_LOG2, dispatch_config
from tritune.kernels.registry import get_spec
from tritune.kernels.varlen.kernel import KERNEL, VarlenKey
from tritune.kernels.varlen.tuning import TUNING, segment_lengths
from tritune.search_spaces.base import TargetLimits
from tritune.search_spaces.varlen_sdpa import (
    SPACE,
    VarlenConfig,
    block_m_for,
    split_budget,
    tokens_per_tile,
)

SPEC = KERNEL
VarlenFacts = KERNEL.Facts
H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
CPU = interpreter_device()


def _key(**changes) -> VarlenKey:
    base = VarlenKey(arch="sm90", sm_count=132, dtype="bf16", head_dim=128, gqa_group=4, causal=True, windowed=False,
                     ring=False, t_bucket=32, s_bucket=32, rows_bucket=32768)  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_registered_under_its_name():
    assert get_spec("varlen_sdpa") is SPEC
    assert SPEC.space is SPACE and SPEC.key_type is VarlenKey
    assert len(SPEC.version) == 16


@pytest.mark.parametrize(
    "facts, expected",
    [
        (VarlenFacts("bf16", 128, 32, 8, 32, 32, 30000, True, False, False),
         dict(t_bucket=32, s_bucket=32, rows_bucket=32768)),
        (VarlenFacts("bf16", 128, 32, 8, 2076, 32, 32768, True, True, True),
         dict(t_bucket=4096, s_bucket=32, rows_bucket=32768, windowed=True, ring=True)),
        (VarlenFacts("fp16", 64, 8, 1, 3, 5, 7, False, False, False),
         dict(dtype="fp16", head_dim=64, gqa_group=8, causal=False, t_bucket=4, s_bucket=8, rows_bucket=16)),
        (VarlenFacts("bf16", 128, 32, 8, DYNAMIC, DYNAMIC, DYNAMIC, True, False, False),
         dict(t_bucket=0, s_bucket=0, rows_bucket=0)),
    ],
    ids=["decode", "mixed-ring", "tiny", "symbolic"],
)  # fmt: skip
def test_key_for_buckets(facts, expected):
    key = SPEC.key_for(H200, facts)
    assert key == _key(**expected)
    assert VarlenKey.from_dict(key.to_dict()) == key
    # Bucket fields move; everything else (GPU, dtype, head dim, group, flags) fixes the group.
    assert key.group() == ("sm90", 132, key.dtype, key.head_dim, key.gqa_group, key.causal, key.windowed, key.ring)
    assert key.distance(dataclasses.replace(key, t_bucket=key.t_bucket * 4 or 4)) >= 2


def test_facts_from_a_call():
    q = torch.zeros(5, 8, 64, dtype=torch.bfloat16)
    store = torch.zeros(100, 3, 2, 64, dtype=torch.bfloat16)
    seq_info = torch.zeros(3, 4, dtype=torch.int32)
    facts = SPEC.facts(q, store, store, seq_info, window=7, ring=True)
    assert facts == VarlenFacts("bf16", 64, 8, 2, 5, 3, 100, True, True, True)


def test_dispatch_serves_the_default_config():
    DISPATCHER.clear()
    facts = VarlenFacts("bf16", 64, 8, 2, 16, 4, 64, True, False, False)
    config = dispatch_config("varlen_sdpa", "cpu", -1, tuple(facts))
    assert config == SPEC.default_config(SPEC.key_for(CPU, facts))


def test_default_keys():
    gpu = SPEC.default_keys(H200)
    assert len(gpu) == 8
    assert {k.head_dim for k in gpu} == {128, 64}
    assert {(k.t_bucket, k.s_bucket, k.rows_bucket) for k in gpu} == {
        (32, 32, 32768),
        (64, 64, 16384),
        (4096, 32, 32768),
        (2048, 4, 32768),
    }
    # The two decode mixes are too far apart for either to borrow the other's winner.
    decode_32, decode_64 = (next(k for k in gpu if k.t_bucket == t and k.head_dim == 128) for t in (32, 64))
    assert decode_32.distance(decode_64) > NEAREST_MAX_LOG2
    assert {(k.gqa_group, k.dtype, k.causal, k.windowed, k.ring) for k in gpu} == {(4, "bf16", True, False, False)}
    tiny = SPEC.default_keys(CPU)
    assert [(k.arch, k.head_dim, k.t_bucket, k.s_bucket) for k in tiny] == [
        ("cpu-interpreter", 64, 4, 4),
        ("cpu-interpreter", 64, 32, 16),
    ]


def test_valid_keys_and_key_names():
    """``tune --key`` overrides: served dtypes and head dims, whole groups, static power-of-two buckets."""
    key = SPEC.default_keys(H200)[0]
    assert TUNING.valid_key(key) and TUNING.valid_key(dataclasses.replace(key, head_dim=256, dtype="fp16"))
    for bad in (dict(head_dim=48), dict(dtype="fp32"), dict(gqa_group=0), dict(t_bucket=DYNAMIC), dict(s_bucket=3),
                dict(rows_bucket=8)):  # fmt: skip
        assert not TUNING.valid_key(dataclasses.replace(key, **bad)), bad
    sizes = {"tokens": 100, "segments": 3, "rows": 1000}
    named = {name: (field, bucket(sizes[name])) for name, (field, bucket) in TUNING.key_aliases.items()}
    assert named == {"tokens": ("t_bucket", 128), "segments": ("s_bucket", 4), "rows": ("rows_bucket", 1024)}
    assert TUNING.key_aliases["tokens"][1](1) == 1 and TUNING.key_aliases["rows"][1](3) == 16


@pytest.mark.parametrize(
    "tokens, segments, lengths",
    [
        (32, 32, [1] * 32),
        (4, 16, [1] * 4),
        (4096, 32, [512] * 4 + [1] * 28),
        (2048, 4, [512] * 4),
        (33, 16, [10, 9] + [1] * 14),
        (1024, 4, [256] * 4),
    ],
    ids=["decode", "decode-few-tokens", "mixed-padded", "prefill", "mixed-remainder", "prefill-short-chunks"],
)
def test_problem_mixes(tokens, segments, lengths):
    assert segment_lengths(tokens, segments, max_chunk=512) == lengths
    assert sum(lengths) <= tokens


# ---- geometry, feasibility and the portable default ----------------------------------------------


def test_tile_geometry():
    assert [block_m_for(16, g) for g in (1, 4, 7, 8, 16, 32)] == [16, 16, 16, 16, 16, 32]
    assert [tokens_per_tile(64, g) for g in (1, 4, 7, 8)] == [64, 16, 9, 8]
    assert split_budget(VarlenConfig(), 132, 8) == 33
    assert split_budget(VarlenConfig(TARGET_WAVES=1), 1, 8) == 1


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8, 16])
def test_portable_default_fits_every_cuda_gpu(head_dim, group):
    key = _key(head_dim=head_dim, gqa_group=group)
    config = SPEC.default_config(key)
    assert SPACE.contains(config)
    for smem_kib in (96, 99, 163, 227):
        assert SPACE.infeasible_reason(config, key, TargetLimits(smem_bytes=smem_kib * 1024)) is None


def test_interpreter_default_and_space():
    key = _key(arch=CPU.arch, sm_count=1, head_dim=64, gqa_group=2)
    default = SPEC.default_config(key)
    limits = SPEC.limits(CPU)
    assert SPACE.infeasible_reason(default, key, limits) is None
    feasible = SPACE.feasible(key, limits)
    # Small enough to tune quickly at tiny shapes, with both tiles and both load kinds in it.
    assert default in feasible and 10 <= len(feasible) <= 300
    assert {c.KV_TMA for c in feasible} == {False, True}
    assert any(c.SHORT_M < c.BLOCK_M for c in feasible)
    assert all(c.BLOCK_M <= 32 and c.BLOCK_N <= 32 and c.num_warps == 4 for c in feasible)


@pytest.mark.parametrize(
    "changes, reason",
    [
        (dict(BLOCK_M=16), "raised to the group's 32 rows"),
        (dict(MAX_SPLITS=1, MIN_CHUNK=1024), "moot with MAX_SPLITS=1"),
        (dict(BLOCK_N=128, MIN_CHUNK=64), "MIN_CHUNK below BLOCK_N"),
        (dict(MIN_CHUNK=64), "chunks under 128 keys"),
        (dict(BLOCK_M=128, BLOCK_N=128, num_warps=4), "fp32 registers per thread"),
        (dict(BLOCK_M=32, num_warps=8), "8 warps need BLOCK_M >= 64"),
        (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4), "shared memory"),
        (dict(SHORT_M=16), "SHORT_M=16 is raised to the group's 32 rows"),
        (dict(SHORT_M=128), "SHORT_M=128 above BLOCK_M=64 is one tile for all"),
    ],
    ids=["block-m-under-group", "split-off-duplicates", "chunk-under-block-n", "short-chunk", "registers", "warps",
         "smem", "short-under-group", "short-above-block-m"],
)  # fmt: skip
def test_infeasible_configs(changes, reason):
    key = _key(gqa_group=32) if "group" in reason else _key()
    config = dataclasses.replace(VarlenConfig(), **changes)
    assert reason in (SPACE.infeasible_reason(config, key, SPEC.limits(H200)) or "")


def test_kv_tma_rules():
    """Descriptor loads: flat stores, power-of-two head dims, SM90+ (the interpreter runs them too)."""
    config = dataclasses.replace(VarlenConfig(), KV_TMA=True)
    limits = SPEC.limits(H200)
    assert SPACE.infeasible_reason(config, _key(), limits) is None
    assert "flat store" in (SPACE.infeasible_reason(config, _key(ring=True), limits) or "")
    assert "power-of-two head dim" in (SPACE.infeasible_reason(config, _key(head_dim=80), limits) or "")
    for arch in ("sm80", "sm89", "rocm-gfx942"):
        assert "SM90 or newer" in (SPACE.infeasible_reason(config, _key(arch=arch), limits) or "")
    cpu_config = dataclasses.replace(config, BLOCK_M=16, BLOCK_N=16, MIN_CHUNK=64)
    assert SPACE.infeasible_reason(cpu_config, _key(arch=CPU.arch, head_dim=64, gqa_group=2), SPEC.limits(CPU)) is None


def test_serveable_keeps_pointer_loads_before_sm90(monkeypatch):
    """A pinned KV_TMA config on an older GPU (or a build listing one) serves pointer loads."""
    config = dataclasses.replace(VarlenConfig(), KV_TMA=True)
    facts = VarlenFacts("bf16", 128, 32, 8, 32, 32, 30000, True, False, False)
    a100 = dataclasses.replace(H200, name="NVIDIA A100", capability=(8, 0), arch="sm80")
    assert SPEC.serveable(config, a100, facts).KV_TMA is False
    assert SPEC.serveable(config, H200, facts) == config
    assert SPEC.serveable(config, CPU, facts) == config
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    assert SPEC.serveable(config, H200, facts).KV_TMA is False


def test_portable_default_short_tile_holds_a_group():
    for group in (1, 4, 8, 16, 32):
        for device in (H200, CPU):
            key = _key(arch=device.arch, gqa_group=group)
            default = SPEC.default_config(key)
            assert min(block_m_for(16, group), default.BLOCK_M) == default.SHORT_M
            if device is H200:
                assert SPACE.infeasible_reason(default, key, SPEC.limits(H200)) is None


def test_gpu_space_keeps_a_real_choice():
    feasible = SPACE.feasible(_key(), SPEC.limits(H200))
    assert SPEC.default_config(_key()) in feasible
    assert {c.MAX_SPLITS for c in feasible} == {1, 4, 16, 64}
    assert {c.BLOCK_M for c in feasible} == {16, 32, 64, 128}


# ---- tuning problems ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [dict(), dict(t_bucket=32, s_bucket=16), dict(t_bucket=8, s_bucket=4, windowed=True, ring=True, causal=False)],
    ids=["decode", "mixed", "ring-window-draft"],
)
def test_problems_pass_the_check_on_the_interpreter(changes):
    key = dataclasses.replace(_key(arch=CPU.arch, sm_count=1, head_dim=64, gqa_group=2, t_bucket=4, s_bucket=4,
                                   rows_bucket=64), **changes)  # fmt: skip
    problem = SPEC.make_problem(key, torch.device("cpu"), seed=3)
    q, k_store, _, seq_info = problem.args
    assert q.shape == (min(key.t_bucket, 32), 2, 64) and k_store.shape[0] == 64
    assert 0 < int(seq_info[:, 1].sum()) <= q.shape[0] and problem.flops > 0 and problem.launch_bound
    if key.ring:
        assert int(seq_info[:, 3].max()) > k_store.shape[0]
    out = SPEC.launch(SPEC.default_config(key), *problem.args, **problem.kwargs)
    assert SPEC.check(out, SPEC.reference(*problem.args, **problem.kwargs), problem) is None
    assert SPEC.check(torch.full_like(out, float("nan")), SPEC.reference(*problem.args, **problem.kwargs), problem)


def test_starting_configs_follow_the_mix_only_on_a_gpu():
    """Rules from the key, not stored numbers: a decode mix in one group's tile, a mix with chunks in
    the largest tile with and without the short one, descriptor and pointer loads alike."""
    keys = {(k.head_dim, k.t_bucket): k for k in SPEC.default_keys(H200)}
    limits = SPEC.limits(H200)
    decode, mixed = SPEC.starting_configs(keys[128, 64], H200), SPEC.starting_configs(keys[128, 4096], H200)
    assert decode and mixed
    assert all(SPEC.space.infeasible_reason(c, keys[128, 64], limits) is None for c in decode)
    assert {(c.BLOCK_M, c.SHORT_M) for c in decode} == {(16, 16)} and {c.KV_TMA for c in decode} == {False, True}
    assert {(c.BLOCK_M, c.SHORT_M, c.num_warps) for c in mixed} == {(128, 16, 8), (128, 128, 8)}
    assert min(c.BLOCK_M for c in decode) == 16 and min(c.BLOCK_M for c in mixed) > 16
    assert any(c.KV_TMA and c.SHORT_M < c.BLOCK_M for c in mixed)
    assert any(c.SHORT_M == c.BLOCK_M for c in mixed), "the one-tile shape is seeded too"
    # Groups wider than the 16-row short tile get it raised to a whole group, not dropped.
    for group in (24, 32, 64):
        wide = dataclasses.replace(keys[128, 4096], gqa_group=group)
        seeds = SPEC.starting_configs(wide, H200)
        assert seeds and any(c.KV_TMA and c.SHORT_M < c.BLOCK_M for c in seeds), group
    a100 = dataclasses.replace(H200, name="NVIDIA A100", capability=(8, 0), arch="sm80")
    a100_key = dataclasses.replace(keys[128, 4096], arch="sm80")
    assert SPEC.starting_configs(a100_key, a100) and not any(c.KV_TMA for c in SPEC.starting_configs(a100_key, a100))
    assert SPEC.default_config(keys[128, 64]) not in decode
    assert SPEC.starting_configs(SPEC.default_keys(CPU)[0], CPU) == []
