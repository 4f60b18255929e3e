"""The ``tma_prefill`` declaration and search space without launching kernels: keys, rules, path choice."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from tritune.kernels import settings
from tritune.kernels.device import DeviceInfo, interpreter_device
from tritune.kernels.prefill.kernel import KERNEL as SPEC
from tritune.kernels.prefill.kernel import PrefillKey, tma_default
from tritune.kernels.prefill.reference import visible_keys, visible_pairs
from tritune.kernels.prefill.tuning import TUNING
from tritune.search_spaces.base import ConfigError, TargetLimits
from tritune.search_spaces.tma_prefill import SPACE, PortableConfig, TmaConfig

#: The GPU when there is one, else CPU tensors on the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
INTERPRETER = interpreter_device()
GPU_LIMITS = TargetLimits(smem_bytes=227 * 1024)
CPU_LIMITS = TargetLimits(interpreter=True)

PORTABLE = PortableConfig()
TMA = TmaConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
PORTABLE_TMA_TILES = PortableConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)


def _facts(**changes):
    base = SPEC.Facts(dtype="bf16", B=2, Hq=16, Hkv=2, Lq=1000, Lkv=5000, D=128, causal=True, has_kv_len=True,
                      tma_layout_ok=True)  # fmt: skip
    return base._replace(**changes)


def _key(**changes) -> PrefillKey:
    base = PrefillKey(
        arch="sm90", sm_count=132, dtype="bf16", head_dim=128, gqa_group=8, causal=True, lq_bucket=1024, lkv_bucket=8192
    )
    return dataclasses.replace(base, **changes)


def _fake_gpu(name: str, capability: tuple[int, int]) -> DeviceInfo:
    arch = f"sm{capability[0]}{capability[1]}"
    return DeviceInfo(name=name, vendor="nvidia", capability=capability, sm_count=108, arch=arch)


# ---- keys ---------------------------------------------------------------------------------


def test_key_buckets_lengths_and_keeps_the_rest():
    key = SPEC.key_for(H200, _facts())
    assert key == _key()
    assert PrefillKey.BUCKETS == ("lq_bucket", "lkv_bucket")
    assert key.group() == ("sm90", 132, "bf16", 128, 8, True)
    assert SPEC.key_for(H200, _facts(Lq=1, Lkv=17)).lq_bucket == 16
    assert SPEC.key_for(H200, _facts(Lq=1, Lkv=17)).lkv_bucket == 32
    assert key.distance(_key(lq_bucket=256, lkv_bucket=16384)) == 3.0


def test_key_round_trips_strictly():
    key = _key()
    assert PrefillKey.from_dict(key.to_dict()) == key
    with pytest.raises(ValueError, match="causal"):
        PrefillKey.from_dict({**key.to_dict(), "causal": 1})


def test_facts_are_plain_scalars_and_check_tma_layout():
    q = torch.zeros(1, 4, 8, 64, dtype=torch.float16, device=DEVICE)
    k = torch.zeros(1, 2, 16, 64, dtype=torch.float16, device=DEVICE)
    out = torch.zeros(1, 4, 8, 64, dtype=torch.float16, device=DEVICE)
    facts = SPEC.facts(q, k, k, causal=True, kv_len=None, softmax_scale=None, out=out)
    assert facts == ("fp16", 1, 4, 2, 8, 16, 64, True, False, True)
    assert all(isinstance(f, int | str | bool) for f in facts)
    sliced = torch.zeros(1, 4, 8, 128, dtype=torch.float16, device=DEVICE)[..., ::2]
    assert not SPEC.facts(sliced, k, k, out=out).tma_layout_ok
    misaligned = torch.zeros(1 + 4 * 8 * 64, dtype=torch.float16, device=DEVICE)[1:].view(1, 4, 8, 64)
    assert not SPEC.facts(misaligned, k, k, out=out).tma_layout_ok
    odd_stride = torch.zeros(1, 4, 8, 68, dtype=torch.float16, device=DEVICE)[..., :64]
    assert not SPEC.facts(q, k, k, out=odd_stride).tma_layout_ok
    transposed = torch.zeros(1, 8, 4, 64, dtype=torch.float16, device=DEVICE).transpose(1, 2)
    assert SPEC.facts(
        transposed, k, k, out=torch.zeros(1, 8, 4, 64, dtype=torch.float16, device=DEVICE).transpose(1, 2)
    ).tma_layout_ok
    # Without an out, the one allocated like q decides: a strided q's copy keeps its strides.
    assert SPEC.facts(q, k, k).tma_layout_ok and not SPEC.facts(sliced, k, k).tma_layout_ok


@pytest.mark.parametrize(
    "seqlen_q, kv_len, causal",
    [(7, 63, True), (33, 20, True), (1, 0, True), (5, 5, True), (9, 40, False)],
    ids=["lq7-kv63", "kv-shorter-than-lq", "kv0", "square", "non-causal"],
)
def test_visible_pairs_counts_the_mask(seqlen_q, kv_len, causal):
    mask = visible_keys(1, seqlen_q, max(kv_len, 1), causal=causal, kv_len=torch.tensor(kv_len), device="cpu")
    assert visible_pairs(seqlen_q, kv_len, causal) == int(mask.sum())


def test_default_keys_gpu_and_interpreter():
    gpu = SPEC.default_keys(H200)
    layouts = [(k.head_dim, k.gqa_group) for k in gpu]
    assert {layout: layouts.count(layout) for layout in layouts} == {(64, 8): 16, (128, 8): 16, (128, 4): 16}
    assert all(k.lkv_bucket >= k.lq_bucket and k.causal for k in gpu)
    tiny = SPEC.default_keys(INTERPRETER)
    assert [(k.head_dim, k.gqa_group, k.lq_bucket, k.lkv_bucket) for k in tiny] == [(64, 2, 16, 64), (64, 2, 32, 64)]


def test_tuning_key_aliases_bucket_as_calls_do_and_invalid_keys_are_named():
    lq_field, lq = TUNING.key_aliases["lq"]
    lkv_field, lkv = TUNING.key_aliases["lkv"]
    assert (lq_field, lq(1000), lkv_field, lkv(20000)) == ("lq_bucket", 1024, "lkv_bucket", 32768)
    assert TUNING.valid_key(_key())
    for bad in (_key(head_dim=72), _key(lq_bucket=1024, lkv_bucket=512), _key(dtype="fp32"), _key(gqa_group=0)):
        assert not TUNING.valid_key(bad), bad


def test_make_problem_on_the_interpreter_uses_the_key_shapes():
    key = SPEC.default_keys(INTERPRETER)[1]
    problem = SPEC.make_problem(key, torch.device("cpu"), seed=3)
    q, k, v = problem.args
    assert q.shape == (1, 4, 32, 64) and k.shape == v.shape == (1, 2, 64, 64)
    assert q.dtype == torch.bfloat16 and q.std() > 0.5
    assert problem.kwargs["kv_len"].dtype == torch.int32 and int(problem.kwargs["kv_len"]) == 64
    assert problem.flops == 4 * 64 * visible_pairs(32, 64, True) * 4
    # GPU time is what a config changes: graph replays, cold L2 (an eager launch's host work counted).
    assert problem.flush_l2 and problem.launch_bound


# ---- the search space ---------------------------------------------------------------------


def test_space_default_is_the_portable_default_and_in_the_space():
    assert SPACE.contains(SPACE.default())
    assert SPACE.default() == PortableConfig("portable", 64, 64, 4, 2)
    assert SPACE.default().path == "portable" and TMA.path == "tma"


@pytest.mark.parametrize("key", [*SPEC.default_keys(H200), _key(head_dim=256), _key(head_dim=80, causal=False)])
def test_defaults_are_feasible_on_gpus(key):
    for limits in (GPU_LIMITS, TargetLimits(smem_bytes=99 * 1024)):
        assert SPACE.infeasible_reason(SPEC.default_config(key), key, limits) is None
    assert SPACE.infeasible_reason(tma_default(key), key, GPU_LIMITS) is None or not key.causal


def test_interpreter_defaults_are_feasible():
    for key in SPEC.default_keys(INTERPRETER):
        assert SPACE.infeasible_reason(SPEC.default_config(key), key, CPU_LIMITS) is None
        assert SPACE.infeasible_reason(tma_default(key), key, CPU_LIMITS) is None


@pytest.mark.parametrize(
    "config, key, limits, reason",
    [
        (TMA, _key(causal=False), GPU_LIMITS, "causal"),
        (TMA, _key(head_dim=96), GPU_LIMITS, "head dims"),
        (TMA, _key(arch="sm80"), GPU_LIMITS, "SM90"),
        (dataclasses.replace(TMA, PACK_GQA=True), _key(gqa_group=1), GPU_LIMITS, "PACK_GQA"),
        (dataclasses.replace(TMA, PACK_GQA=True), _key(gqa_group=6), GPU_LIMITS, "PACK_GQA"),
        (dataclasses.replace(TMA, SPLIT_KV=8), _key(lq_bucket=4096), GPU_LIMITS, "fill"),
        (dataclasses.replace(TMA, SPLIT_KV=8, BLOCK_N=128), _key(lkv_bucket=1024), GPU_LIMITS, "two KV tiles"),
        (PortableConfig(BLOCK_N=128), _key(head_dim=256), GPU_LIMITS, "256"),
        (PortableConfig(BLOCK_M=32, num_warps=8), _key(), GPU_LIMITS, "8 warps"),
        (PortableConfig(BLOCK_M=128, BLOCK_N=128), _key(), GPU_LIMITS, "registers"),
        (PortableConfig(BLOCK_M=64, BLOCK_N=128, num_stages=4), _key(), TargetLimits(smem_bytes=99 * 1024), "shared"),
        (dataclasses.replace(TMA, BLOCK_M=32), _key(), GPU_LIMITS, "BLOCK_M >= 64"),
        (PortableConfig(), _key(arch="cpu-interpreter"), CPU_LIMITS, "at most 32"),
        (
            PortableConfig(BLOCK_M=32, BLOCK_N=32, num_stages=3),
            _key(arch="cpu-interpreter"),
            CPU_LIMITS,
            "mean nothing",
        ),
    ],
    ids=[
        "tma-non-causal",
        "tma-d96",
        "tma-sm80",
        "pack-gqa1",
        "pack-gqa6",
        "split-grid-full",
        "split-too-short",
        "d256-big-tile",
        "8-warps-small-tile",
        "register-spill",
        "smem-99k",
        "tma-small-tile",
        "interpreter-big-tile",
        "interpreter-stages",
    ],
)
def test_feasibility_prunes(config, key, limits, reason):
    why = SPACE.infeasible_reason(config, key, limits)
    assert why is not None and reason in why


@pytest.mark.parametrize("fields", [{"PACK_GQA": True}, {"SPLIT_KV": 2}, {"CONSUMER_REGS": 232}], ids=str)
def test_portable_configs_have_no_fields_of_other_paths(fields):
    with pytest.raises(ConfigError, match="path='portable' has no field"):
        SPACE.parse(fields)


def test_feasible_grid_keeps_tma_extras():
    feasible = SPACE.feasible(_key(lq_bucket=512), GPU_LIMITS)
    tma = [c for c in feasible if isinstance(c, TmaConfig)]
    assert any(c.PACK_GQA for c in tma) and any(c.SPLIT_KV == 8 for c in tma)
    tiny = SPACE.feasible(SPEC.default_keys(INTERPRETER)[0], CPU_LIMITS)
    assert 0 < len(tiny) < 40


def test_pinned_config_takes_the_named_paths_defaults():
    assert SPEC.pinned_config({"BLOCK_N": 32}) == PortableConfig(BLOCK_N=32)
    pinned = SPEC.pinned_config({"path": "tma", "SPLIT_KV": 2})
    assert pinned == dataclasses.replace(tma_default(_key()), SPLIT_KV=2)
    with pytest.raises(ValueError, match="BLOCK_M"):
        SPEC.pinned_config({"path": "tma", "BLOCK_M": 48})


# ---- which path serves a call -------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, config, facts, expected",
    [
        ("auto", PORTABLE, _facts(), PORTABLE),
        ("auto", TMA, _facts(), TMA),
        ("auto", TMA, _facts(causal=False), PORTABLE_TMA_TILES),
        ("auto", TMA, _facts(tma_layout_ok=False), PORTABLE_TMA_TILES),
        ("auto", TMA, _facts(D=96), PORTABLE_TMA_TILES),
        ("auto", dataclasses.replace(TMA, PACK_GQA=True), _facts(Hkv=16), TMA),
        (
            "auto",
            dataclasses.replace(TMA, SPLIT_KV=4),
            _facts(Lq=64, B=1),
            dataclasses.replace(TMA, SPLIT_KV=4),
        ),
        ("auto", dataclasses.replace(TMA, SPLIT_KV=4), _facts(Lq=4096, B=8), TMA),
        ("on", PORTABLE, _facts(), tma_default(_key())),
        ("on", PORTABLE, _facts(causal=False), PORTABLE),
        ("off", TMA, _facts(), PORTABLE_TMA_TILES),
        ("off", dataclasses.replace(TMA, SPLIT_KV=4, PACK_GQA=True), _facts(), PORTABLE_TMA_TILES),
        ("off", dataclasses.replace(TMA, BLOCK_N=128), _facts(D=256), SPEC.default_config(_key(head_dim=256))),
    ],
    ids=[
        "auto-portable",
        "auto-tma",
        "auto-tma-non-causal",
        "auto-tma-bad-layout",
        "auto-tma-d96",
        "auto-pack-gqa1",
        "auto-split-small-grid",
        "auto-split-grid-full",
        "on-forces-tma",
        "on-non-causal",
        "off-keeps-tiles",
        "off-drops-extras",
        "off-tiles-too-big",
    ],
)
def test_serveable_honours_the_setting(mode, config, facts, expected):
    with settings.override(enable_tma_causal_prefill=mode):
        assert SPEC.serveable(config, H200, tuple(facts)) == expected


def test_serveable_on_the_interpreter_covers_the_tma_path():
    with settings.override(enable_tma_causal_prefill="on"):
        served = SPEC.serveable(PORTABLE, INTERPRETER, tuple(_facts()))
    assert served.path == "tma" and served.BLOCK_M <= 32


def test_on_warns_once_on_an_unsupported_target(caplog):
    a100 = _fake_gpu("Fake A100 for the warn-once test", (8, 0))
    with settings.override(enable_tma_causal_prefill="on"), caplog.at_level(logging.WARNING, "tritune.prefill"):
        first = SPEC.serveable(PORTABLE, a100, tuple(_facts()))
        second = SPEC.serveable(TMA, a100, tuple(_facts()))
    assert first == PORTABLE and second == PORTABLE_TMA_TILES
    warnings = [r for r in caplog.records if r.name == "tritune.prefill"]
    assert len(warnings) == 1 and "portable" in warnings[0].getMessage()


def test_auto_does_not_warn_and_a_mixed_arch_build_serves_portable(caplog, monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    with settings.override(enable_tma_causal_prefill="auto"), caplog.at_level(logging.WARNING, "tritune.prefill"):
        assert SPEC.serveable(TMA, H200, tuple(_facts())).path == "portable"
    assert not [r for r in caplog.records if r.name == "tritune.prefill"]
