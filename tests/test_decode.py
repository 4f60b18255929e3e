"""Split-K decode attention against its fp64 reference, the op's contract, and the unified entry.

CPU tier: the kernels run on the Triton interpreter at tiny shapes. On the interpreter the SM
count is 1, which would leave every problem with one split; the ``many_sms`` fixture makes the
launch plan believe in 64 SMs so that the split kernel, the merge and empty splits are exercised.
Each split-K case runs with the merge launch and with the merge fused into the split launch
(``FUSED_MERGE``); the interpreter runs programs one after another, so the last program to arrive
on a row block's counter is always the last split, which makes the fused path deterministic here.
Every test must leave the arrival counters at zero (``counters_stay_zero``).
GPU tier (``gpu`` marker): CUDA-graph capture and replay with new lengths, and bigger shapes.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tritune.kernels import _launch
from tritune.kernels import routing as attention_module
from tritune.kernels._launch import COUNTERS
from tritune.kernels.decode import launch as decode_launch
from tritune.kernels.decode.kernel import KERNEL, decode_attention
from tritune.kernels.decode.reference import compare, decode_reference
from tritune.kernels.pins import use_config
from tritune.kernels.routing import attention
from tritune.search_spaces.splitk_decode import DecodeConfig

#: Pinned configs: many small splits (with 64 SMs planned on the interpreter), and one split per sequence.
MANY_SPLITS = {"MIN_CHUNK": 64, "BLOCK_N": 16, "TARGET_WAVES": 4}
ONE_SPLIT = {"MIN_CHUNK": 2048, "BLOCK_N": 16}
#: MANY_SPLITS with the merge done by the last split program of each row block (one launch).
FUSED = {**MANY_SPLITS, "FUSED_MERGE": True}
#: The split-K configs, each case run with both merges.
SPLIT_CONFIGS = pytest.mark.parametrize("config", [MANY_SPLITS, FUSED], ids=["merge-launch", "fused-merge"])


def make_case(
    device,
    *,
    batch: int,
    kv_heads: int,
    group: int,
    lq: int,
    head_dim: int,
    lmax: int,
    lengths: list[int],
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    tail: float | None = float("nan"),
):
    """Random q and caches; positions past each kv_len hold ``tail`` (NaN by default)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q = normal(batch, kv_heads * group, lq, head_dim)
    k = normal(batch, kv_heads, lmax, head_dim)
    v = normal(batch, kv_heads, lmax, head_dim)
    if tail is not None:
        for b, n in enumerate(lengths):
            k[b, :, n:] = tail
            v[b, :, n:] = tail
    kv_len = torch.tensor(lengths, dtype=torch.int32)
    return q.to(device), k.to(device), v.to(device), kv_len.to(device)


def run_and_compare(q, k, v, kv_len, config=None, **kwargs):
    out = torch.full_like(q, float("nan"))
    if config is None:
        decode_attention(q, k, v, kv_len, out=out, **kwargs)
    else:
        with use_config("splitk_decode", config):
            decode_attention(q, k, v, kv_len, out=out, **kwargs)
    expected = decode_reference(q, k, v, kv_len, softmax_scale=kwargs.get("softmax_scale"))
    problem = compare(out, expected, q.dtype)
    assert problem is None, problem
    return out, expected


@pytest.fixture(autouse=True)
def counters_stay_zero():
    """A fused launch resets each counter it used: after any test, every counter buffer is zero again.

    Buffers on the meta device hold no values (launches recorded on meta tensors run nothing): only
    the others are read."""
    yield
    for slot, buffer in COUNTERS.items():
        if buffer.device.type == "meta":
            continue
        nonzero = int(torch.count_nonzero(buffer))
        # Zeroed so that one failure does not cascade into later tests.
        buffer.zero_()
        assert nonzero == 0, f"{nonzero} arrival counters of {slot} left non-zero"


@pytest.fixture
def many_sms(monkeypatch, device):
    """On the interpreter, plan splits as if the device had 64 SMs (a GPU keeps its own count)."""
    if device == "cpu":
        monkeypatch.setitem(_launch.SM_COUNTS, torch.device("cpu"), 64)


def splits_used(q, k, config: dict, lengths: list[int]) -> list[int]:
    """How many splits each sequence used, by the same rule the kernels apply on the device."""
    spec_config = DecodeConfig(**config)
    plan = decode_launch.plan(
        spec_config, decode_launch.sm_count(q.device), q.shape[0], k.shape[1],
        q.shape[1] // k.shape[1] * q.shape[2], k.shape[2], q.shape[3],
    )  # fmt: skip
    used = []
    for n in lengths:
        n = min(max(n, 0), k.shape[2])
        chunk = max(spec_config.MIN_CHUNK, -(-n // plan.splits_target))
        chunk = -(-chunk // spec_config.BLOCK_N) * spec_config.BLOCK_N
        used.append(-(-n // chunk))
    return used


# ---- numerics against the reference ------------------------------------------------------------

REFERENCE_CASES = [
    pytest.param(dict(batch=1, kv_heads=2, group=1, lq=1, head_dim=64, lmax=64, lengths=[1]), id="mha-d64-len1"),
    pytest.param(dict(batch=2, kv_heads=2, group=4, lq=1, head_dim=64, lmax=100, lengths=[37, 97]), id="gqa4-d64-odd"),
    pytest.param(dict(batch=3, kv_heads=1, group=8, lq=1, head_dim=128, lmax=72, lengths=[0, 7, 63]),
                 id="gqa8-d128-zero"),
    pytest.param(dict(batch=4, kv_heads=1, group=4, lq=1, head_dim=256, lmax=40, lengths=[1, 17, 33, 40]),
                 id="gqa4-d256-b4"),
    pytest.param(dict(batch=2, kv_heads=2, group=1, lq=1, head_dim=80, lmax=50, lengths=[49, 3]), id="mha-d80-padded"),
    pytest.param(dict(batch=1, kv_heads=1, group=7, lq=2, head_dim=96, lmax=40, lengths=[25]), id="gqa7-d96-lq2"),
]  # fmt: skip


#: fp16 next to bf16: its tolerance is four times tighter, so a small softmax-scale error that
#: bf16's tolerance absorbs shows here.
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@DTYPES
@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_default_config_matches_reference(device, case, dtype):
    run_and_compare(*make_case(device, dtype=dtype, **case))


@pytest.mark.parametrize(
    "case, dtype",
    [
        pytest.param(dict(batch=2, kv_heads=1, group=4, lq=1, head_dim=64, lmax=300, lengths=[300, 129]),
                     torch.bfloat16, id="bf16-lengths-300-129"),
        pytest.param(dict(batch=3, kv_heads=2, group=2, lq=1, head_dim=64, lmax=260, lengths=[0, 64, 257]),
                     torch.float16, id="fp16-lengths-0-64-257"),
        pytest.param(dict(batch=1, kv_heads=1, group=8, lq=4, head_dim=128, lmax=200, lengths=[199]),
                     torch.bfloat16, id="bf16-gqa8-lq4-d128"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("config", [MANY_SPLITS, FUSED, ONE_SPLIT], ids=["many-splits", "fused-merge", "one-split"])
def test_split_policies_match_reference(device, many_sms, monkeypatch, case, dtype, config):
    q, k, v, kv_len = make_case(device, dtype=dtype, **case)
    used = splits_used(q, k, config, case["lengths"])
    if config is not ONE_SPLIT:
        assert max(used) >= 3, used
    else:
        assert max(used) <= 1, used
    # The workspace is never initialised: poison it to prove only written partials are read.
    monkeypatch.setattr(
        decode_launch, "workspace", lambda n, dev: torch.full((n,), float("nan"), dtype=torch.float32, device=dev)
    )
    run_and_compare(q, k, v, kv_len, config)


@SPLIT_CONFIGS
def test_merge_in_head_dim_blocks(device, many_sms, monkeypatch, config):
    """Many splits with a small merge tile: the merge takes the head dim 16 columns at a time."""
    monkeypatch.setattr(decode_launch, "MERGE_TILE", 64)
    decode_launch.plan.cache_clear()
    q, k, v, kv_len = make_case(device, batch=1, kv_heads=1, group=2, lq=2, head_dim=80, lmax=300, lengths=[300])
    plan = decode_launch.plan(DecodeConfig(**config), decode_launch.sm_count(q.device), 1, 1, 4, 300, 80)
    assert plan.num_splits == 5 and plan.merge_block_d == 16
    assert plan.counters == (1 if config is FUSED else 0)
    run_and_compare(q, k, v, kv_len, config)
    decode_launch.plan.cache_clear()


# ---- the fused merge --------------------------------------------------------------------------------

FUSED_CASES = [
    pytest.param(dict(batch=1, kv_heads=2, group=1, lq=1, head_dim=64, lmax=200, lengths=[1]), id="mha-d64-len1"),
    pytest.param(dict(batch=2, kv_heads=2, group=4, lq=1, head_dim=64, lmax=260, lengths=[137, 257]),
                 id="gqa4-d64-odd"),
    pytest.param(dict(batch=3, kv_heads=1, group=8, lq=1, head_dim=128, lmax=200, lengths=[0, 7, 199]),
                 id="gqa8-d128-zero"),
    pytest.param(dict(batch=4, kv_heads=1, group=4, lq=1, head_dim=256, lmax=140, lengths=[1, 65, 129, 140]),
                 id="gqa4-d256-b4"),
    pytest.param(dict(batch=2, kv_heads=2, group=1, lq=1, head_dim=80, lmax=150, lengths=[149, 3]),
                 id="mha-d80-padded"),
    pytest.param(dict(batch=1, kv_heads=1, group=7, lq=2, head_dim=96, lmax=190, lengths=[187]), id="gqa7-d96-lq2"),
    # 128 rows per KV head: two row blocks, each with its own counter.
    pytest.param(dict(batch=2, kv_heads=1, group=16, lq=8, head_dim=64, lmax=150, lengths=[150, 77]),
                 id="gqa16-lq8-row-blocks"),
]  # fmt: skip


class _NoLaunch:
    """Stands in for the merge kernel where a launch must not use it."""

    def __getitem__(self, grid: tuple[int, ...]) -> None:
        raise AssertionError("the merge kernel was launched")


@DTYPES
@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_merge_matches_reference(device, many_sms, monkeypatch, case, dtype):
    q, k, v, kv_len = make_case(device, dtype=dtype, **case)
    used = splits_used(q, k, FUSED, case["lengths"])
    assert max(used) >= 2 or case["lengths"] == [1], used

    # One launch: the merge kernel is never used, and the workspace is never initialised. (The
    # stand-in goes through the module's wrap_triton: patching the kernel object's own run would
    # leave an instance attribute behind that hides later class-level patches, as sm90_build's.)
    wrap = decode_launch.wrap_triton
    merge = decode_launch._decode_merge_kernel
    monkeypatch.setattr(decode_launch, "wrap_triton", lambda kernel: _NoLaunch() if kernel is merge else wrap(kernel))
    monkeypatch.setattr(
        decode_launch, "workspace", lambda n, dev: torch.full((n,), float("nan"), dtype=torch.float32, device=dev)
    )
    run_and_compare(q, k, v, kv_len, FUSED)


def test_fused_counters_reset_between_calls(device, many_sms):
    """Calls in a row with other lengths (so other split counts): each finds its counters at zero."""
    q, k, v, _ = make_case(device, batch=2, kv_heads=2, group=4, lq=1, head_dim=64, lmax=300, lengths=[300, 300],
                           tail=None)  # fmt: skip
    plan_counters = 2 * 2
    for lengths in ([300, 129], [65, 300], [0, 1], [300, 300], [129, 64]):
        kv_len = torch.tensor(lengths, dtype=torch.int32, device=device)
        run_and_compare(q, k, v, kv_len, FUSED)
        used = [buffer for (dev, _), buffer in COUNTERS.items() if dev.type == q.device.type]
        assert used and all(b.numel() >= plan_counters for b in used)
        assert all(int(torch.count_nonzero(b)) == 0 for b in used), lengths


def test_fused_merge_clamps_lengths_and_reads_strided_kv_len(device, many_sms):
    """Negative lengths (clamped to 0) and lengths past the cache (clamped to it) in one fused launch,
    read through a strided kv_len view: each row block still merges once and leaves its counter at 0."""
    q, k, v, _ = make_case(device, batch=3, kv_heads=2, group=4, lq=2, head_dim=64, lmax=300, lengths=[300] * 3,
                           tail=None)  # fmt: skip
    for lengths in ([-5, 10_000, 1], [1_000, 0, -1], [300, 2, 299]):
        padded = [n for length in lengths for n in (length, 7)]
        kv_len = torch.tensor(padded, dtype=torch.int32, device=device)[::2]
        run_and_compare(q, k, v, kv_len, FUSED)
        assert all(int(torch.count_nonzero(b)) == 0 for b in COUNTERS.values()), lengths


def test_arrival_counters_grow_and_keep_old_buffers(monkeypatch):
    cache: dict = {}
    retired: list = []
    monkeypatch.setattr(_launch, "COUNTERS", cache)
    monkeypatch.setattr(_launch, "_RETIRED_COUNTERS", retired)
    cpu = torch.device("cpu")
    first = _launch.arrival_counters(10, cpu)
    assert first.dtype == torch.int32 and first.numel() >= 10 and int(torch.count_nonzero(first)) == 0
    assert _launch.arrival_counters(first.numel(), cpu) is first
    grown = _launch.arrival_counters(first.numel() + 1, cpu)
    assert grown.numel() > first.numel() and int(torch.count_nonzero(grown)) == 0
    # The outgrown buffer stays alive: a captured CUDA graph may still hold its address.
    assert retired == [first] and list(cache.values()) == [grown]
    # A traced launch gets its own zeros, never the cached buffer.
    fresh = _launch.arrival_counters(3, cpu, fresh=True)
    assert fresh.numel() == 3 and fresh is not grown and list(cache.values()) == [grown]


@SPLIT_CONFIGS
def test_garbage_tails_are_never_read(device, many_sms, config):
    """Huge finite garbage past kv_len would dominate any score it reached; NaN would poison it."""
    for tail in (3e4, float("inf"), float("nan")):
        case = make_case(device, batch=2, kv_heads=1, group=4, lq=1, head_dim=64, lmax=160, lengths=[70, 150],
                         tail=tail)  # fmt: skip
        run_and_compare(*case, config)


@SPLIT_CONFIGS
@pytest.mark.parametrize("lq, lengths", [(2, [9, 2]), (5, [3, 40]), (8, [8, 77])], ids=["lq2", "lq5-short", "lq8"])
def test_new_tokens_are_causal(device, many_sms, lq, lengths, config):
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=2, group=2, lq=lq, head_dim=64, lmax=80, lengths=lengths)
    out, _ = run_and_compare(q, k, v, kv_len, config)
    for b, n in enumerate(lengths):
        # Token i sits at n - lq + i: those before position 0 see no key and must be zeros.
        blind = max(0, lq - n)
        assert torch.equal(out[b, :, :blind].float().cpu(), torch.zeros_like(out[b, :, :blind].float().cpu()))
    # Changing a key after token 0's position must not change token 0's output.
    k2 = k.clone()
    k2[:, :, int(lengths[0]) - 1] = 5.0
    with use_config("splitk_decode", config):
        out2 = decode_attention(q, k2, v, kv_len, out=torch.full_like(q, float("nan")))
    first_visible = max(0, lq - lengths[0])
    if first_visible < lq - 1:
        torch.testing.assert_close(out2[0, :, first_visible], out[0, :, first_visible], atol=0, rtol=0)


def test_zero_lengths_give_zeros(device, many_sms):
    q, k, v, kv_len = make_case(device, batch=3, kv_heads=1, group=4, lq=2, head_dim=64, lmax=64, lengths=[0, 0, 0])
    for config in (MANY_SPLITS, FUSED, ONE_SPLIT):
        with use_config("splitk_decode", config):
            out = decode_attention(q, k, v, kv_len, out=torch.full_like(q, float("nan")))
        assert torch.equal(out.float().cpu(), torch.zeros(q.shape))


@SPLIT_CONFIGS
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["scaled-q", "negated-scaled-q"])
def test_large_logits_stay_exact(device, many_sms, sign, config):
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=1, group=4, lq=1, head_dim=64, lmax=200, lengths=[200, 91])
    out, _ = run_and_compare((q.float() * 1e3 * sign).to(q.dtype), k, v, kv_len, config)
    assert torch.isfinite(out.float()).all()


@SPLIT_CONFIGS
def test_all_scores_hugely_negative(device, many_sms, config):
    """Every score near -3e4: a kernel without max subtraction would underflow to 0/0."""
    q, k, v, kv_len = make_case(device, batch=1, kv_heads=1, group=4, lq=1, head_dim=64, lmax=150, lengths=[150])
    k = k.clone()
    k[..., 0] += 200.0
    q = q.clone()
    q[..., 0] = -1200.0
    run_and_compare(q, k, v, kv_len, config)


@SPLIT_CONFIGS
def test_strided_layouts(device, many_sms, config):
    """A cache stored [B, Lmax, Hkv, D] and q stored [B, Lq, Hq, D], seen through permuted views."""
    batch, kv_heads, group, lq, dim, lmax = 2, 2, 2, 2, 64, 96
    q0, k0, v0, kv_len = make_case(device, batch=batch, kv_heads=kv_heads, group=group, lq=lq, head_dim=dim,
                                   lmax=lmax, lengths=[95, 30])  # fmt: skip
    k = k0.transpose(1, 2).contiguous().transpose(1, 2)
    v = v0.transpose(1, 2).contiguous().transpose(1, 2)
    q = q0.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k.is_contiguous() and not q.is_contiguous()
    out = torch.full((batch, lq, kv_heads * group, dim), float("nan"), dtype=q.dtype, device=device).transpose(1, 2)
    with use_config("splitk_decode", config):
        decode_attention(q, k, v, kv_len, out=out)
    assert compare(out, decode_reference(q0, k0, v0, kv_len), q.dtype) is None


def test_lengths_outside_the_cache_are_clamped(device):
    q, k, v, _ = make_case(device, batch=2, kv_heads=1, group=2, lq=1, head_dim=64, lmax=48, lengths=[48, 0])
    lengths = torch.tensor([1000, -5], dtype=torch.int32, device=device)
    out = decode_attention(q, k, v, lengths, out=torch.full_like(q, float("nan")))
    expected = decode_reference(q, k, v, torch.tensor([48, 0], dtype=torch.int32))
    assert compare(out, expected, q.dtype) is None


@pytest.mark.parametrize("config", [MANY_SPLITS, FUSED, ONE_SPLIT], ids=["many-splits", "fused-merge", "one-split"])
def test_kv_len_view_is_read_through_its_stride(device, many_sms, config):
    """``lengths[::2]``: the split and merge kernels must step over the lengths in between."""
    q, k, v, kv_len = make_case(device, batch=3, kv_heads=1, group=2, lq=1, head_dim=64, lmax=200,
                                lengths=[200, 61, 5])  # fmt: skip
    interleaved = torch.tensor([200, 1, 61, 150, 5, 0], dtype=torch.int32, device=device)[::2]
    assert interleaved.stride(0) == 2 and interleaved.tolist() == kv_len.tolist()
    run_and_compare(q, k, v, interleaved, config)
    out = torch.full_like(q, float("nan"))
    with use_config("splitk_decode", config):
        attention(q, k, v, kv_len=interleaved, out=out)
    assert compare(out, decode_reference(q, k, v, kv_len), q.dtype) is None


def test_softmax_scale_and_allocated_out(device):
    q, k, v, kv_len = make_case(device, batch=1, kv_heads=2, group=2, lq=1, head_dim=64, lmax=40, lengths=[33])
    out = decode_attention(q, k, v, kv_len, softmax_scale=0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert compare(out, decode_reference(q, k, v, kv_len, softmax_scale=0.3), q.dtype) is None


@pytest.mark.parametrize("fused", [False, True], ids=["merge-launch", "fused-merge"])
def test_direct_launch_and_registered_op_agree(device, many_sms, fused):
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=1, group=4, lq=3, head_dim=64, lmax=130, lengths=[130, 61])
    config = DecodeConfig(TARGET_WAVES=4, MIN_CHUNK=64, BLOCK_N=16, num_warps=4, num_stages=2, FUSED_MERGE=fused)
    direct = torch.full_like(q, float("nan"))
    through_op = torch.full_like(q, float("nan"))
    decode_launch.launch(config, q, k, v, kv_len, 0.125, direct)
    torch.ops.tritune.decode_attention(q, k, v, kv_len, 0.125, through_op, **KERNEL.space.field_values(config))
    assert compare(direct, decode_reference(q, k, v, kv_len, softmax_scale=0.125), q.dtype) is None
    assert torch.equal(direct, through_op)


# ---- input checks --------------------------------------------------------------------------------


def _valid_args():
    """Valid arguments on the kernels' device (a GPU machine refuses CPU tensors first)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=2, group=2, lq=1, head_dim=64, lmax=32, lengths=[5, 9])
    return {"q": q, "k_cache": k, "v_cache": v, "kv_len": kv_len}


BAD_INPUTS = [
    pytest.param(lambda a: {**a, "q": a["q"].float()}, TypeError, "q: expected dtype", id="q-dtype"),
    pytest.param(lambda a: {**a, "q": a["q"].tolist()}, TypeError, "q: expected a torch.Tensor", id="q-not-tensor"),
    pytest.param(lambda a: {**a, "q": a["q"][0]}, ValueError, "q: expected shape .*: 3 dims, expected 4", id="q-rank"),
    pytest.param(lambda a: {**a, "k_cache": a["k_cache"].half()}, TypeError, "k_cache: expected dtype", id="k-dtype"),
    pytest.param(lambda a: {**a, "v_cache": a["v_cache"][:, :, :16]}, ValueError,
                 "v_cache: expected shape .*Lmax is 16 where k_cache has Lmax=32", id="v-shape"),
    pytest.param(lambda a: {**a, "k_cache": a["k_cache"][:1]}, ValueError, "k_cache: expected shape .*B is 1 where q",
                 id="k-batch"),
    pytest.param(lambda a: {**a, "q": a["q"].repeat(1, 1, 9, 1)}, ValueError, "1 to 8 query tokens", id="lq-9"),
    pytest.param(lambda a: {**a, "q": a["q"][:, :3]}, ValueError, "q: 3 query heads are not a multiple of 2 KV heads",
                 id="gqa-divisibility"),
    pytest.param(lambda a: {**a, "q": a["q"][..., :48], "k_cache": a["k_cache"][..., :48],
                            "v_cache": a["v_cache"][..., :48]}, ValueError, "head dim 48", id="head-dim"),
    pytest.param(lambda a: {**a, "kv_len": a["kv_len"].long()}, TypeError, "kv_len: expected dtype torch.int32",
                 id="kv-len-dtype"),
    pytest.param(lambda a: {**a, "kv_len": a["kv_len"][:1]}, ValueError, "kv_len: expected shape", id="kv-len-shape"),
    pytest.param(lambda a: {**a, "kv_len": a["kv_len"][0]}, ValueError, "kv_len: expected shape .*0 dims, expected 1",
                 id="kv-len-rank"),
    pytest.param(lambda a: {**a, "kv_len": a["kv_len"].to("meta")}, ValueError, "kv_len: expected device",
                 id="kv-len-device"),
    pytest.param(lambda a: {**a, "k_cache": a["k_cache"].to("meta")}, ValueError, "k_cache: expected device",
                 id="k-device"),
    pytest.param(lambda a: {**a, "v_cache": a["v_cache"].transpose(2, 3).contiguous().transpose(2, 3)},
                 ValueError, "v_cache: the last dim must be contiguous", id="v-inner-stride"),
    pytest.param(lambda a: {**a, "out": torch.empty_like(a["q"]).float()}, TypeError, "out: expected dtype",
                 id="out-dtype"),
    pytest.param(lambda a: {**a, "out": torch.empty_like(a["q"])[:1]}, ValueError, "out: expected shape",
                 id="out-shape"),
    pytest.param(lambda a: {**a, "softmax_scale": "0.1"}, TypeError, "softmax_scale", id="scale-type"),
]  # fmt: skip


@pytest.mark.parametrize("mutate, error, message", BAD_INPUTS)
def test_bad_inputs_name_the_argument(mutate, error, message):
    args = mutate(_valid_args())
    with pytest.raises(error, match=message):
        decode_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("kv_len"), **args)


# ---- torch.library integration -------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["merge-launch", "fused-merge"])
def test_opcheck(device, many_sms, fused):
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=1, group=2, lq=2, head_dim=64, lmax=140, lengths=[140, 3],
                                tail=None)  # fmt: skip
    out = torch.empty_like(q)
    config = DecodeConfig(TARGET_WAVES=4, MIN_CHUNK=64, BLOCK_N=16, num_warps=4, num_stages=2, FUSED_MERGE=fused)
    fields = KERNEL.space.field_values(config)
    torch.library.opcheck(torch.ops.tritune.decode_attention.default, (q, k, v, kv_len, 0.125, out), fields)


@pytest.mark.parametrize("config", [{}, FUSED], ids=["default", "fused-merge"])
def test_torch_compile_fullgraph(device, many_sms, config):
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=1, group=4, lq=1, head_dim=64, lmax=148, lengths=[148, 20])

    def step(q, k, v, kv_len, out):
        return decode_attention(q, k, v, kv_len, out=out) * 2.0

    backend = "inductor" if device == "cuda" else "aot_eager"
    # The config is chosen once, at trace time: no graph of another parametrization may be reused.
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    out, eager_out = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    with use_config("splitk_decode", config):
        result = compiled(q, k, v, kv_len, out)
        expected = step(q, k, v, kv_len, eager_out)
    assert compare(out, decode_reference(q, k, v, kv_len), q.dtype) is None
    torch.testing.assert_close(result, out * 2.0, atol=0, rtol=0)
    torch.testing.assert_close(result, expected, atol=0, rtol=0)


# ---- the unified entry ---------------------------------------------------------------------------


@pytest.fixture
def spies(monkeypatch):
    """Record which kernel family the unified entry calls (prefill is faked: not needed here)."""
    calls: list[tuple[str, dict]] = []

    class FakeDecode:
        @staticmethod
        def call_named(args, names):
            calls.append(("decode", {"softmax_scale": args[4], "names": names}))
            return args[0]

    def fake_prefill(q, k, v, **kwargs):
        calls.append(("prefill", kwargs))
        return q

    monkeypatch.setattr(attention_module, "DECODE", FakeDecode())
    fake_module = types.ModuleType("tritune.kernels.prefill.kernel")
    fake_module.prefill_attention = fake_prefill
    monkeypatch.setitem(sys.modules, "tritune.kernels.prefill.kernel", fake_module)
    return calls


def _strided_head_dim(t: torch.Tensor) -> torch.Tensor:
    """The same values seen with a head-dim stride of 2 (every other element of a wider buffer)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize(
    "lq, kv_len, causal, strided, expected",
    [
        (1, [5, 6], True, None, "decode"),
        (8, [9, 9], True, None, "decode"),
        (9, [9, 9], True, None, "prefill"),
        (1, None, True, None, "prefill"),
        (1, [5, 6], False, None, "prefill"),
        (4, 5, True, None, "prefill"),
        (1, [5, 6], True, "k", "prefill"),
        (2, [5, 6], True, "q", "prefill"),
        (1, [5, 6], True, "out", "prefill"),
    ],
    ids=["lq1", "lq8", "lq9-prefill", "no-kv-len", "not-causal", "scalar-kv-len", "strided-k", "strided-q",
         "strided-out"],
)  # fmt: skip
def test_attention_routes(spies, lq, kv_len, causal, strided, expected):
    tensors = {
        "q": torch.zeros(2, 4, lq, 64, dtype=torch.bfloat16),
        "k": torch.zeros(2, 2, 16, 64, dtype=torch.bfloat16),
        "out": torch.zeros(2, 4, lq, 64, dtype=torch.bfloat16),
    }
    if strided is not None:
        tensors[strided] = _strided_head_dim(tensors[strided])
    q, k, out = tensors["q"], tensors["k"], tensors["out"]
    lengths = None if kv_len is None else torch.tensor(kv_len, dtype=torch.int32)
    attention(q, k, k, kv_len=lengths, causal=causal, softmax_scale=0.5, out=out)
    assert [name for name, _ in spies] == [expected]
    assert spies[0][1]["softmax_scale"] == 0.5
    if expected == "decode":
        assert spies[0][1]["names"] == {"k_cache": "k", "v_cache": "v"}


def test_attention_decode_step_is_decode_attention(device, monkeypatch):
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=1, group=2, lq=1, head_dim=64, lmax=40, lengths=[40, 11])
    ran: list[str] = []
    real = KERNEL.call_named
    monkeypatch.setattr(KERNEL, "call_named", lambda *args: ran.append("decode") or real(*args))
    routed, direct = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    attention(q, k, v, kv_len=kv_len, out=routed)
    decode_attention(q, k, v, kv_len, out=direct)
    assert ran == ["decode"]
    assert compare(routed, decode_reference(q, k, v, kv_len), q.dtype) is None
    assert torch.equal(routed, direct)


@pytest.mark.parametrize("strided", ["q", "k", "v", "out"])
def test_attention_serves_strided_head_dims_through_prefill(device, strided):
    """A decode step whose head dim has stride 2: decode refuses that layout, prefill takes it."""
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=1, group=2, lq=2, head_dim=64, lmax=40, lengths=[40, 11])
    out = torch.full_like(q, float("nan"))
    tensors = {"q": q, "k": k, "v": v, "out": out}
    tensors[strided] = _strided_head_dim(tensors[strided])
    if strided == "out":
        tensors["out"].fill_(float("nan"))
    result = attention(tensors["q"], tensors["k"], tensors["v"], kv_len=kv_len, out=tensors["out"])
    assert result is tensors["out"]
    assert compare(result, decode_reference(q, k, v, kv_len), q.dtype) is None


def test_attention_errors_name_its_own_arguments():
    args = _valid_args()
    q, k, v, kv_len = args["q"], args["k_cache"], args["v_cache"], args["kv_len"]
    with pytest.raises(TypeError, match=r"^k: expected dtype"):
        attention(q, k.half(), v, kv_len=kv_len)
    with pytest.raises(ValueError, match=r"^v: expected shape .* Lmax is 16 where k has Lmax=32"):
        attention(q, k, v[:, :, :16], kv_len=kv_len)
    with pytest.raises(ValueError, match=r"^q: 3 query heads are not a multiple of 2 KV heads"):
        attention(q[:, :3], k, v, kv_len=kv_len)
    with pytest.raises(ValueError, match=r"^k: expected device"):
        attention(q, k.to("meta"), v, kv_len=kv_len)
    # Called directly, decode names them as its own parameters.
    with pytest.raises(TypeError, match=r"^k_cache: expected dtype"):
        decode_attention(q, k.half(), v, kv_len)


# ---- GPU tier ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [{}, {"FUSED_MERGE": True}, {"KV_TMA": True}, {"KV_TMA": True, "FUSED_MERGE": True}],
    ids=["default", "fused-merge", "kv-tma", "kv-tma-fused-merge"],
)
def test_cuda_graph_replay_with_new_lengths(config, monkeypatch):
    """One capture serves any lengths; with KV_TMA the captured descriptors cover the whole cache."""
    q, k, v, kv_len = make_case("cuda", batch=4, kv_heads=8, group=4, lq=1, head_dim=128, lmax=16384,
                                lengths=[16384] * 4, tail=None)  # fmt: skip
    out = torch.empty_like(q)
    built: list[list[int]] = []
    real = decode_launch.unchecked_descriptor
    monkeypatch.setattr(decode_launch, "unchecked_descriptor", lambda t, box: built.append(box) or real(t, box))
    with use_config("splitk_decode", config):
        # Compiles, and sizes the counters a capture uses, outside the capture.
        decode_attention(q, k, v, kv_len, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_attention(q, k, v, kv_len, out=out)
    assert bool(built) == config.get("KV_TMA", False)
    for lengths in ([16384, 1, 0, 777], [5, 9000, 16383, 64], [0, 0, 0, 0], [129, 4096, 12000, 16384]):
        kv_len.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        problem = compare(out, decode_reference(q, k, v, kv_len), q.dtype)
        assert problem is None, f"{lengths}: {problem}"


@pytest.mark.gpu
def test_gpu_fused_merge_on_two_streams():
    """Fused launches on two streams at once: each stream has its own counters."""
    cases = [
        make_case("cuda", batch=1, kv_heads=8, group=4, lq=1, head_dim=128, lmax=32768, lengths=[32000], seed=s)
        for s in (1, 2)
    ]
    outs = [torch.full_like(case[0], float("nan")) for case in cases]
    streams = [torch.cuda.Stream() for _ in cases]
    torch.cuda.synchronize()
    with use_config("splitk_decode", {"FUSED_MERGE": True}):
        for _ in range(20):
            for stream, (q, k, v, kv_len), out in zip(streams, cases, outs, strict=True):
                with torch.cuda.stream(stream):
                    decode_attention(q, k, v, kv_len, out=out)
    torch.cuda.synchronize()
    for (q, k, v, kv_len), out in zip(cases, outs, strict=True):
        assert compare(out, decode_reference(q, k, v, kv_len), q.dtype) is None
    slots = {slot for slot in COUNTERS if slot[1] in {s.cuda_stream for s in streams}}
    assert len(slots) == 2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        dict(batch=1, kv_heads=8, group=4, lq=1, head_dim=128, lmax=32768, lengths=[32000]),
        dict(batch=16, kv_heads=8, group=8, lq=1, head_dim=64, lmax=4096, lengths=list(range(1, 4097, 273))[:16]),
        dict(batch=3, kv_heads=4, group=4, lq=4, head_dim=256, lmax=5000, lengths=[5000, 2, 3001]),
        dict(batch=2, kv_heads=2, group=16, lq=8, head_dim=128, lmax=9000, lengths=[8999, 4500]),
        dict(batch=2, kv_heads=8, group=1, lq=1, head_dim=96, lmax=3000, lengths=[2999, 1500]),
    ],
    ids=["b1-long", "b16-d64-gqa8", "d256-lq4", "gqa16-lq8-rowblocks", "d96"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_bigger_shapes(case, dtype):
    q, k, v, kv_len = make_case("cuda", dtype=dtype, **case)
    out, expected = run_and_compare(q, k, v, kv_len)
    # Stay within about twice the error of PyTorch's own SDPA in the same dtype (sequences whose
    # every token sees a key: SDPA returns NaN for a row that sees none).
    group, lq = case["group"], case["lq"]
    for b, n in enumerate(case["lengths"]):
        if n < lq:
            continue
        kk = k[b : b + 1, :, :n].repeat_interleave(group, dim=1)
        vv = v[b : b + 1, :, :n].repeat_interleave(group, dim=1)
        mask = torch.ones(lq, n, dtype=torch.bool, device="cuda").tril(n - lq)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q[b : b + 1], kk, vv, attn_mask=mask)
        ours = (out[b].double() - expected[b]).abs().max().item()
        theirs = (sdpa[0].double() - expected[b]).abs().max().item()
        assert ours <= 2 * theirs + 1e-3, (b, ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [MANY_SPLITS, ONE_SPLIT], ids=["many-splits", "one-split"])
def test_gpu_head_offsets_past_int32(config):
    """q and out as the last token of [1, Hq, L, D] buffers: head offsets pass 2**31 elements."""
    heads, kv_heads, length, dim, lmax = 32, 4, 557056, 128, 512
    assert (heads - 1) * length * dim >= 2**31
    gen = torch.Generator(device="cuda").manual_seed(14)
    q = torch.randn(1, heads, length, dim, generator=gen, device="cuda", dtype=torch.bfloat16)[:, :, -1:]
    out = torch.full((1, heads, length, dim), float("nan"), device="cuda", dtype=torch.bfloat16)[:, :, -1:]
    k = torch.randn(1, kv_heads, lmax, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, kv_heads, lmax, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv_len = torch.tensor([lmax - 11], dtype=torch.int32, device="cuda")
    with use_config("splitk_decode", config):
        decode_attention(q, k, v, kv_len, out=out)
    assert compare(out, decode_reference(q, k, v, kv_len), q.dtype) is None
