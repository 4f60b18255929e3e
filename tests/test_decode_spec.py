"""The ``splitk_decode`` declaration and search space: keys and buckets, the split policy, feasibility, problems."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tritune.kernels.decode.kernel import KERNEL as SPEC
from tritune.kernels.decode.kernel import DecodeKey, lq_bucket
from tritune.kernels.decode.reference import compare
from tritune.kernels.decode.tuning import TUNING
from tritune.kernels.device import DeviceInfo, device_info, interpreter_device
from tritune.kernels.dispatcher import DISPATCHER, dispatch_config
from tritune.kernels.registry import get_spec
from tritune.search_spaces.base import TargetLimits
from tritune.search_spaces.splitk_decode import (
    SPACE,
    DecodeConfig,
    block_m_for,
    max_splits,
    row_blocks,
    splits_target,
)

H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
CPU = interpreter_device()
H200_LIMITS = SPEC.limits(H200)


def _facts(dtype, head_dim, batch, q_heads, kv_heads, lq, lmax):
    """A call's facts, by the declaration's names."""
    return SPEC.Facts(dtype=dtype, D=head_dim, B=batch, Hq=q_heads, Hkv=kv_heads, Lq=lq, Lmax=lmax)


def _key(**changes) -> DecodeKey:
    base = DecodeKey(arch="sm90", sm_count=132, dtype="bf16", head_dim=128, gqa_group=4, lq=1, bh_bucket=8,
                     lkv_bucket=4096)  # fmt: skip
    return dataclasses.replace(base, **changes)


# ---- keys and buckets ------------------------------------------------------------------------------


def test_registered_under_its_name():
    assert get_spec("splitk_decode") is SPEC
    assert SPEC.space is SPACE and SPEC.key_type is DecodeKey
    assert len(SPEC.version) == 16


@pytest.mark.parametrize(
    "facts, expected",
    [
        (_facts("bf16", 128, 1, 32, 8, 1, 1000), dict(gqa_group=4, lq=1, bh_bucket=8, lkv_bucket=1024)),
        (_facts("fp16", 64, 3, 24, 8, 3, 4097), dict(gqa_group=3, lq=4, bh_bucket=32, lkv_bucket=8192)),
        (_facts("bf16", 256, 64, 8, 8, 8, 131072), dict(gqa_group=1, lq=8, bh_bucket=512, lkv_bucket=131072)),
        (_facts("bf16", 80, 1, 1, 1, 5, 7), dict(gqa_group=1, lq=8, bh_bucket=1, lkv_bucket=16)),
    ],
    ids=["b1-gqa4", "b3-lq3", "b64-lq8", "tiny"],
)
def test_key_for_buckets(facts, expected):
    key = SPEC.key_for(H200, facts)
    assert key == _key(dtype=facts.dtype, head_dim=facts.D, **expected)
    assert DecodeKey.from_dict(key.to_dict()) == key
    # Bucket fields move, everything else (GPU, dtype, head dim, group, lq) fixes the group.
    assert key.group() == ("sm90", 132, facts.dtype, facts.D, expected["gqa_group"], expected["lq"])
    assert key.distance(dataclasses.replace(key, bh_bucket=key.bh_bucket * 4)) == 2


def test_tuning_keys_outside_what_calls_can_have_are_invalid():
    assert TUNING.valid_key(_key())
    for bad in (_key(head_dim=72), _key(lq=3), _key(lq=16), _key(dtype="fp32"), _key(gqa_group=0)):
        assert not TUNING.valid_key(bad), bad


def test_launch_plans_are_cached_per_config():
    from tritune.kernels.decode.launch import plan

    plan.cache_clear()
    first = plan(DecodeConfig(), 132, 1, 8, 4, 4096, 128)
    again = plan(DecodeConfig(), 132, 1, 8, 4, 4096, 128)
    assert again is first and plan.cache_info().hits == 1
    assert plan(DecodeConfig(FUSED_MERGE=True), 132, 1, 8, 4, 4096, 128).counters == 8


def test_lq_buckets():
    assert [lq_bucket(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_key_rejects_wrong_field_types():
    values = _key().to_dict()
    values["lkv_bucket"] = "4096"
    with pytest.raises(ValueError, match="lkv_bucket"):
        DecodeKey.from_dict(values)


def test_dispatch_serves_the_portable_default_without_winners():
    DISPATCHER.clear()
    facts = _facts("bf16", 64, 2, 8, 2, 1, 128)
    config = dispatch_config("splitk_decode", "cpu", -1, tuple(facts))
    assert config == SPEC.default_config(SPEC.key_for(CPU, facts))


def test_default_keys():
    gpu = SPEC.default_keys(H200)
    assert len(gpu) == 2 * 6 * 5
    assert {k.head_dim for k in gpu} == {128, 64}
    assert {k.bh_bucket for k in gpu} == {8, 32, 64, 128, 256, 512}
    assert {k.lkv_bucket for k in gpu} == {1024, 4096, 16384, 32768, 131072}
    assert {(k.lq, k.gqa_group, k.dtype) for k in gpu} == {(1, 4, "bf16")}
    # tune --key batch=2 lkv=3000: the aliases bucket as calls do (8 KV heads a sequence on the GPU).
    batch_field, batch = TUNING.key_aliases["batch"]
    lkv_field, lkv = TUNING.key_aliases["lkv"]
    assert (batch_field, batch(2), lkv_field, lkv(3000)) == ("bh_bucket", 16, "lkv_bucket", 4096)
    assert batch(1) == 8
    tiny = SPEC.default_keys(CPU)
    assert [(k.arch, k.head_dim, k.bh_bucket, k.lkv_bucket) for k in tiny] == [
        ("cpu-interpreter", 64, 2, 64),
        ("cpu-interpreter", 64, 2, 128),
    ]


# ---- the split policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, batch_kv_heads, rows, lmax, target, launched",
    [
        (DecodeConfig(), 8, 4, 131072, 33, 33),  # B=1, 8 KV heads: 132 SMs x 2 waves / 8
        (DecodeConfig(), 8, 4, 1024, 33, 8),  # a 1K cache never needs more than 1024 / MIN_CHUNK splits
        (DecodeConfig(), 512, 4, 131072, 1, 1),  # B=64 fills the GPU without splitting
        (DecodeConfig(TARGET_WAVES=4, MIN_CHUNK=64), 1, 4, 131072, 528, 528),
        (DecodeConfig(), 8, 128, 131072, 16, 16),  # two row blocks per KV head count as programs
    ],
    ids=["b1-long", "b1-short", "b64", "mqa-b1", "row-blocks"],
)
def test_split_plan_from_static_facts(config, batch_kv_heads, rows, lmax, target, launched):
    assert splits_target(config, 132, batch_kv_heads, rows) == target
    assert max_splits(config, 132, batch_kv_heads, rows, lmax) == launched


def test_row_tiles():
    assert [block_m_for(r) for r in (1, 4, 16, 17, 32, 64, 128)] == [16, 16, 16, 32, 32, 64, 64]
    assert [row_blocks(r) for r in (4, 64, 65, 128)] == [1, 1, 2, 2]


# ---- feasibility and the portable default ----------------------------------------------------------


def test_portable_default_is_the_dataclass_default_where_it_fits():
    assert SPEC.default_config(_key()) == DecodeConfig()
    assert SPEC.default_config(_key(arch=CPU.arch, sm_count=1)) == DecodeConfig()


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group, lq", [(1, 1), (4, 1), (8, 8), (16, 8)], ids=["mha", "gqa4", "gqa8-lq8", "gqa16-lq8"])
def test_portable_default_fits_every_cuda_gpu(head_dim, group, lq):
    key = _key(head_dim=head_dim, gqa_group=group, lq=lq)
    config = SPEC.default_config(key)
    assert SPACE.contains(config)
    for smem_kib in (96, 99, 163, 227):
        assert SPACE.infeasible_reason(config, key, TargetLimits(smem_bytes=smem_kib * 1024)) is None


def test_default_keys_have_feasible_configs_on_h200():
    for key in SPEC.default_keys(H200):
        feasible = SPACE.feasible(key, H200_LIMITS)
        assert SPEC.default_config(key) in feasible
        assert 20 < len(feasible) < SPACE.size()


def test_infeasible_reasons():
    limits = TargetLimits(smem_bytes=99 * 1024)
    big = DecodeConfig(BLOCK_N=128, num_stages=4, num_warps=8)
    assert "shared memory" in SPACE.infeasible_reason(big, _key(head_dim=256), limits)
    crowded = DecodeConfig(BLOCK_N=64, num_warps=2)
    assert "registers" in SPACE.infeasible_reason(crowded, _key(head_dim=256, gqa_group=8, lq=8), limits)
    assert "MIN_CHUNK" in SPACE.infeasible_reason(DecodeConfig(MIN_CHUNK=64, BLOCK_N=128), _key(), limits)


def test_a_large_wave_target_past_the_chunk_cap_is_a_duplicate():
    """Where a cache of the key's length takes at most 8 chunks of MIN_CHUNK keys, the large wave
    targets launch as a small one does; at a large batch's long caches they split and stay."""
    short = _key(lkv_bucket=1024)  # B=1 x 8 KV heads: targets 16, 33, 66, ... split 8 ways at most
    for waves in (8, 16, 32):
        reason = SPACE.infeasible_reason(DecodeConfig(TARGET_WAVES=waves), short, H200_LIMITS)
        assert reason == f"TARGET_WAVES={waves} gives the same 8 splits as TARGET_WAVES=1"
    # The small targets keep their own rule (stored winners stay admitted).
    assert SPACE.infeasible_reason(DecodeConfig(TARGET_WAVES=4), short, H200_LIMITS) is None
    long = _key(bh_bucket=512, lkv_bucket=131072)
    assert {c.TARGET_WAVES for c in SPACE.feasible(long, H200_LIMITS)} == {2, 8, 16, 32}


@pytest.mark.parametrize("bh_bucket", [128, 256, 512])
def test_a_large_batch_tune_starts_with_split_caches(bh_bucket):
    """Where the space's default wave target leaves a sequence one or two splits, a tune starts at
    the two largest wave targets (each splitting a sequence 4 ways or more, with 3 and 4 stages),
    then the unsplit 32-key tiles of 2 warps, and the unsplit launch with 4 stages where the
    default splits; every start feasible and none the default."""
    key = _key(bh_bucket=bh_bucket, lkv_bucket=131072)
    default = SPEC.default_config(key)
    unsplit = dataclasses.replace(default, TARGET_WAVES=2)
    assert splits_target(unsplit, key.sm_count, key.bh_bucket, 4) <= 2
    starts = TUNING.starting_configs(key, H200)
    wide = [(32, 3), (32, 4), (16, 3), (16, 4)]
    if default != unsplit:  # the default is the first of them, which every tune measures anyway
        wide.remove((default.TARGET_WAVES, default.num_stages))
    assert [(c.TARGET_WAVES, c.num_stages) for c in starts[: len(wide)]] == wide
    assert all(splits_target(c, key.sm_count, key.bh_bucket, 4) >= 4 for c in starts[: len(wide)])
    unsplit_starts = [dataclasses.replace(unsplit, BLOCK_N=32, num_warps=2)]
    if default != unsplit:
        unsplit_starts.append(dataclasses.replace(unsplit, num_stages=4))
    assert starts[len(wide) :] == unsplit_starts
    assert all(SPACE.infeasible_reason(c, key, H200_LIMITS) is None for c in starts)
    assert default not in starts


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bh_bucket, lkv_bucket, waves", [
    (512, 16384, 32), (512, 131072, 32), (1024, 32768, 32), (2048, 32768, 32),
    (512, 8192, 2), (256, 131072, 2), (128, 131072, 2), (8192, 131072, 2),
])  # fmt: skip
def test_the_default_splits_a_large_batch_over_long_caches(head_dim, bh_bucket, lkv_bucket, waves):
    """Past two unsplit programs per SM, from 16K keys, the default takes the largest wave target;
    below either, or where even that target leaves one split (8192 sequence-heads), the space's."""
    key = _key(head_dim=head_dim, bh_bucket=bh_bucket, lkv_bucket=lkv_bucket)
    default = SPEC.default_config(key)
    assert default == dataclasses.replace(DecodeConfig(), TARGET_WAVES=waves)
    assert SPACE.infeasible_reason(default, key, H200_LIMITS) is None
    assert SPEC.default_config(dataclasses.replace(key, arch=CPU.arch, sm_count=1)).TARGET_WAVES == 2


def test_a_small_batch_tune_has_no_such_starts():
    """Where the default already splits each sequence more than twice, or on the interpreter, none."""
    assert TUNING.starting_configs(_key(bh_bucket=64, lkv_bucket=131072), H200) == []
    assert TUNING.starting_configs(_key(bh_bucket=8), H200) == []
    assert TUNING.starting_configs(_key(arch="cpu-interpreter", sm_count=1, bh_bucket=512), CPU) == []


def test_fused_merge_is_moot_with_one_split():
    fused = DecodeConfig(FUSED_MERGE=True)
    # B=1 x 8 KV heads at 4K: up to 32 splits, so both merges stay in the space.
    assert SPACE.infeasible_reason(fused, _key(), H200_LIMITS) is None
    assert {c.FUSED_MERGE for c in SPACE.feasible(_key(), H200_LIMITS)} == {False, True}
    # B=64 fills the GPU twice without splitting; only the wave targets from 8 up split it.
    b64 = _key(bh_bucket=512)
    assert "FUSED_MERGE is moot" in SPACE.infeasible_reason(fused, b64, H200_LIMITS)
    assert {c.TARGET_WAVES for c in SPACE.feasible(b64, H200_LIMITS) if c.FUSED_MERGE} == {8, 16, 32}
    # A 128-key cache splits only with chunks below 128 keys.
    short = _key(lkv_bucket=128)
    assert "FUSED_MERGE is moot" in SPACE.infeasible_reason(fused, short, H200_LIMITS)
    assert SPACE.infeasible_reason(dataclasses.replace(fused, MIN_CHUNK=64), short, H200_LIMITS) is None


def test_interpreter_keeps_few_configs():
    key = SPEC.default_keys(CPU)[0]
    feasible = SPACE.feasible(key, SPEC.limits(CPU))
    assert DecodeConfig() in feasible
    assert 2 <= len(feasible) <= 8
    assert {c.BLOCK_N for c in feasible} <= {16, 64}


# ---- problems and the correctness gate -------------------------------------------------------------


def test_make_problem_launch_and_check(device):
    info = device_info(device)
    key = SPEC.default_keys(info)[1]
    if device != "cpu":
        key = dataclasses.replace(key, bh_bucket=16, lkv_bucket=2048)
    problem = SPEC.make_problem(key, torch.device(device), seed=3)
    q, k_cache, _, kv_len = problem.args
    lmax = k_cache.shape[2]
    assert q.shape[0] * k_cache.shape[1] == key.bh_bucket and lmax == key.lkv_bucket
    assert q.shape[1] == k_cache.shape[1] * key.gqa_group and q.shape[2] == key.lq and q.shape[3] == key.head_dim
    assert kv_len.dtype == torch.int32 and int(kv_len[0]) == lmax and int(kv_len.min()) >= lmax // 2
    assert problem.bytes_moved >= 2 * int(kv_len.sum()) * k_cache.shape[1] * key.head_dim * 2
    assert problem.launch_bound and problem.flush_l2
    expected = SPEC.reference(*problem.args, **problem.kwargs)
    for config in SPACE.feasible(key, SPEC.limits(info))[:3]:
        out = torch.full_like(q, float("nan"))
        assert SPEC.launch(config, *problem.args, **problem.kwargs, out=out) is out
        assert SPEC.check(out, expected, problem) is None
    assert SPEC.make_problem(key, torch.device(device), seed=3).args[0].equal(q)


def test_check_refuses_nan_and_wrong_values():
    key = SPEC.default_keys(CPU)[0]
    problem = SPEC.make_problem(key, torch.device("cpu"), seed=0)
    expected = SPEC.reference(*problem.args)
    good = expected.to(torch.bfloat16)
    assert SPEC.check(good, expected, problem) is None
    poisoned = good.clone()
    poisoned[0, 0, 0, 0] = float("nan")
    assert "non-finite" in SPEC.check(poisoned, expected, problem)
    off = good.clone()
    off[1, 2, 0, 5] += 0.1 * float(expected.abs().max())
    assert "max error" in SPEC.check(off, expected, problem)
    assert "shape" in compare(good[:1], expected, torch.bfloat16)


@pytest.mark.gpu
def test_problems_are_timed_as_graph_replays_at_every_size():
    # B=1 over 32K keys moves 134 MB: not launch-bound on the GPU, but serving replays it from a graph,
    # and eager timing would count the host's two launches (more than the step takes on an H200).
    key = DecodeKey(arch="sm90", sm_count=132, dtype="bf16", head_dim=128, gqa_group=4, lq=1, bh_bucket=8,
                    lkv_bucket=32768)  # fmt: skip
    problem = SPEC.make_problem(key, torch.device("cuda"), seed=1)
    assert problem.bytes_moved > 64 << 20
    assert problem.launch_bound
