"""Split-K decode with ``KV_TMA``: K/V tiles through host-side tensor descriptors.

CPU tier: the interpreter runs the descriptors' loads (rows past the cache read as zeros, rows
past a split's end as the cache holds them), so the kernel's own masking is what keeps a cache's
NaN/inf past ``kv_len`` out of the result; every numerics test also checks that descriptors were
built, so the TMA branch really ran. Cache views a descriptor cannot describe keep pointer loads
for that call. GPU tier (``gpu`` marker): a real shape, CUDA-graph replay with new lengths, and
``torch.compile``, which must keep pointer loads (torch cannot trace host descriptors yet).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode import (  # the fixtures apply here as there
    FUSED,
    MANY_SPLITS,
    ONE_SPLIT,
    counters_stay_zero,  # noqa: F401
    make_case,
    many_sms,  # noqa: F401
    run_and_compare,
)
from torch._library.triton import set_wrap_triton_enabled

from tritune.kernels.decode import launch as decode_launch
from tritune.kernels.decode.kernel import KERNEL, decode_attention
from tritune.kernels.decode.reference import compare, decode_reference
from tritune.kernels.device import DeviceInfo, interpreter_device
from tritune.kernels.pins import use_config
from tritune.search_spaces.splitk_decode import SPACE, DecodeConfig, portable_config

H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
A100 = DeviceInfo(name="NVIDIA A100-SXM4-80GB", vendor="nvidia", capability=(8, 0), sm_count=108, arch="sm80")
CPU = interpreter_device()
#: 64 SMs planned on the interpreter, so that the split kernel, the merge and empty splits run.
pytestmark = pytest.mark.usefixtures("many_sms")
TMA_CONFIGS = pytest.mark.parametrize(
    "config",
    [{**MANY_SPLITS, "KV_TMA": True}, {**FUSED, "KV_TMA": True}, {**ONE_SPLIT, "KV_TMA": True}],
    ids=["many-splits", "fused-merge", "one-split"],
)
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@pytest.fixture
def descriptors(monkeypatch):
    """The boxes of the descriptors decode launches build (one list entry per descriptor)."""
    built: list[list[int]] = []
    real = decode_launch.unchecked_descriptor

    def spy(t, box):
        built.append(list(box))
        return real(t, box)

    monkeypatch.setattr(decode_launch, "unchecked_descriptor", spy)
    return built


# ---- numerics against the reference ------------------------------------------------------------

CASES = [
    pytest.param(dict(batch=3, kv_heads=2, group=4, lq=1, head_dim=64, lmax=100, lengths=[0, 37, 100]),
                 id="gqa4-d64-zero-and-full"),
    pytest.param(dict(batch=2, kv_heads=1, group=8, lq=2, head_dim=128, lmax=72, lengths=[72, 5]), id="gqa8-d128-lq2"),
    pytest.param(dict(batch=2, kv_heads=2, group=1, lq=1, head_dim=256, lmax=40, lengths=[1, 33]), id="mha-d256"),
    pytest.param(dict(batch=2, kv_heads=2, group=2, lq=5, head_dim=64, lmax=90, lengths=[3, 89]), id="lq5-short"),
]  # fmt: skip


@DTYPES
@TMA_CONFIGS
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tail", [float("nan"), float("inf")], ids=["nan-tail", "inf-tail"])
def test_kv_tma_matches_reference(device, descriptors, case, config, dtype, tail):
    """Whatever the cache holds past each kv_len (NaN, inf) stays out: K's by the score mask,
    V's by zeroing the rows past the split's end before the second MMA."""
    run_and_compare(*make_case(device, dtype=dtype, tail=tail, **case), config)
    assert descriptors == [[1, 1, config["BLOCK_N"], case["head_dim"]]] * 2


@TMA_CONFIGS
def test_kv_tma_split_ends_inside_the_cache(device, descriptors, config):
    """Splits that end inside a sequence read the next split's keys through the box: they must not
    count twice (huge finite values there would dominate any score that reached them)."""
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=1, group=4, lq=1, head_dim=64, lmax=200,
                                lengths=[199, 131], tail=3e4)  # fmt: skip
    run_and_compare(q, k, v, kv_len, config)
    assert descriptors


def test_kv_tma_and_pointer_loads_agree(device, descriptors):
    """One problem, one split plan: the two load paths give the same bits."""
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=2, group=4, lq=1, head_dim=64, lmax=150, lengths=[150, 77])
    outs = []
    for kv_tma in (False, True):
        out = torch.full_like(q, float("nan"))
        with use_config("splitk_decode", {**FUSED, "KV_TMA": kv_tma}):
            decode_attention(q, k, v, kv_len, out=out)
        outs.append(out)
    assert len(descriptors) == 2
    assert torch.equal(outs[0], outs[1])


# ---- cache views a descriptor cannot describe ------------------------------------------------------


def _view(buffer_shape: tuple[int, ...], shape: tuple[int, ...], offset: int, source: torch.Tensor) -> torch.Tensor:
    """``source``'s values in a view of a larger buffer: ``offset`` elements in, last dim sliced."""
    flat = torch.full((offset + torch.Size(buffer_shape).numel(),), float("nan"), dtype=source.dtype,
                      device=source.device)  # fmt: skip
    view = flat[offset:].view(buffer_shape)[..., : shape[-1]]
    view.copy_(source)
    return view


@pytest.mark.parametrize(
    "pad, offset, tma",
    [(0, 1, False), (4, 0, False), (8, 0, True), (8, 8, True)],
    ids=["base-2-bytes-in", "row-pitch-136-bytes", "row-pitch-144-bytes", "base-16-bytes-in"],
)
def test_cache_views_a_descriptor_cannot_describe_keep_pointer_loads(device, descriptors, pad, offset, tma):
    """A base or an outer stride that is not a multiple of 16 bytes keeps pointer loads for the
    call (still right); a padded row pitch of whole 16 bytes goes through descriptors."""
    q, k0, v0, kv_len = make_case(device, batch=2, kv_heads=2, group=2, lq=1, head_dim=64, lmax=96, lengths=[96, 41])
    buffer_shape = (2, 2, 96, 64 + pad)
    k = _view(buffer_shape, tuple(k0.shape), offset, k0)
    v = _view(buffer_shape, tuple(v0.shape), offset, v0)
    with set_wrap_triton_enabled(False):  # as in the op's body
        assert decode_launch.descriptors_allowed(k, v, 64) is tma
    out = torch.full_like(q, float("nan"))
    with use_config("splitk_decode", {**MANY_SPLITS, "KV_TMA": True}):
        decode_attention(q, k, v, kv_len, out=out)
    assert compare(out, decode_reference(q, k0, v0, kv_len), q.dtype) is None
    assert bool(descriptors) is tma


def test_descriptors_need_a_power_of_two_head_dim_and_a_direct_body(device):
    k80 = torch.zeros(1, 1, 16, 80, dtype=torch.bfloat16, device=device)
    k64 = torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16, device=device)
    with set_wrap_triton_enabled(False):  # an op body called directly, or by triton_op's backend
        assert not decode_launch.descriptors_allowed(k80, k80, 80)
        assert decode_launch.descriptors_allowed(k64, k64, 64)
    # A tracer runs op bodies with wrap_triton on.
    with set_wrap_triton_enabled(True):
        assert not decode_launch.descriptors_allowed(k64, k64, 64)


def test_padded_head_dim_pinned_with_kv_tma_keeps_pointer_loads(device, descriptors):
    """A direct launch (below the dispatcher's feasibility rule) with a head dim of 80 is served by pointer loads."""
    q, k, v, kv_len = make_case(device, batch=1, kv_heads=2, group=2, lq=1, head_dim=80, lmax=50, lengths=[49])
    out = torch.full_like(q, float("nan"))
    config = DecodeConfig(**{**MANY_SPLITS, "KV_TMA": True})
    decode_launch.launch(config, q, k, v, kv_len, 80**-0.5, out)
    assert compare(out, decode_reference(q, k, v, kv_len), q.dtype) is None
    assert not descriptors


# ---- the registered op and torch.compile ------------------------------------------------------------


def test_registered_op_uses_descriptors_and_agrees(device, descriptors):
    """Called through ``torch.ops`` (triton_op's own backend runs the body on plain tensors), the op
    loads through descriptors and gives the pointer loads' bits."""
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=1, group=4, lq=3, head_dim=64, lmax=130, lengths=[130, 61])
    config = DecodeConfig(TARGET_WAVES=4, MIN_CHUNK=64, BLOCK_N=16, FUSED_MERGE=True, KV_TMA=True)
    direct = torch.full_like(q, float("nan"))
    through_op = torch.full_like(q, float("nan"))
    decode_launch.launch(config, q, k, v, kv_len, 0.125, direct)
    torch.ops.tritune.decode_attention(q, k, v, kv_len, 0.125, through_op, **KERNEL.space.field_values(config))
    assert compare(direct, decode_reference(q, k, v, kv_len, softmax_scale=0.125), q.dtype) is None
    assert torch.equal(direct, through_op)
    # The direct launch outside an op body (wrap_triton on, as under a tracer) loads through pointers.
    assert len(descriptors) == 2


def test_opcheck_with_kv_tma(device):
    q, k, v, kv_len = make_case(device, batch=2, kv_heads=1, group=2, lq=2, head_dim=64, lmax=140, lengths=[140, 3],
                                tail=None)  # fmt: skip
    fields = KERNEL.space.field_values(DecodeConfig(TARGET_WAVES=4, MIN_CHUNK=64, BLOCK_N=16, KV_TMA=True))
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.tritune.decode_attention.default, (q, k, v, kv_len, 0.125, out), fields)


def _compiled_step(device: str, **case) -> None:
    """A compiled step around a decode call with KV_TMA pinned: right, and fullgraph."""
    q, k, v, kv_len = make_case(device, **case)

    def step(q, k, v, kv_len, out):
        return decode_attention(q, k, v, kv_len, out=out) * 2.0

    backend = "inductor" if device == "cuda" else "aot_eager"
    torch._dynamo.reset()
    out = torch.full_like(q, float("nan"))
    with use_config("splitk_decode", {**FUSED, "KV_TMA": True}):
        result = torch.compile(step, fullgraph=True, backend=backend)(q, k, v, kv_len, out)
    assert compare(out, decode_reference(q, k, v, kv_len), q.dtype) is None
    torch.testing.assert_close(result, out * 2.0, atol=0, rtol=0)


def test_torch_compile_with_kv_tma_pinned(device):
    """On the CPU (aot_eager) the compiled graph calls the op, whose body runs directly at run time
    (descriptors allowed); inductor traces the body itself (the GPU-tier test below)."""
    _compiled_step(device, batch=2, kv_heads=1, group=4, lq=1, head_dim=64, lmax=148, lengths=[148, 20])


# ---- the space's rule ------------------------------------------------------------------------------


def _key(device: DeviceInfo, **changes):
    return dataclasses.replace(KERNEL.default_keys(device)[0], **changes)


@pytest.mark.parametrize("arch", ["sm80", "sm89", "rocm-gfx942"])
def test_kv_tma_is_refused_before_sm90(arch):
    key = _key(A100, arch=arch, head_dim=128)
    reason = SPACE.infeasible_reason(DecodeConfig(KV_TMA=True), key, KERNEL.limits(A100))
    assert reason == f"KV_TMA needs SM90 or newer, not {arch}"
    assert not any(c.KV_TMA for c in SPACE.feasible(key, KERNEL.limits(A100)))


@pytest.mark.parametrize("arch", ["sm90", "sm100", "sm120"])
def test_kv_tma_is_feasible_from_sm90(arch):
    key = _key(H200, arch=arch, head_dim=128)
    assert SPACE.infeasible_reason(DecodeConfig(KV_TMA=True), key, KERNEL.limits(H200)) is None


@pytest.mark.parametrize("device_info", [H200, CPU], ids=["h200", "interpreter"])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_kv_tma_needs_a_power_of_two_head_dim(device_info, head_dim):
    key = _key(device_info, head_dim=head_dim)
    reason = SPACE.infeasible_reason(DecodeConfig(KV_TMA=True), key, KERNEL.limits(device_info))
    assert reason == f"KV_TMA needs a power-of-two head dim, not {head_dim}"


def test_kv_tma_twins_the_feasible_pointer_configs():
    """Every other rule is unchanged: at an SM90 key of a power-of-two head dim each feasible pointer
    config has its KV_TMA twin unless the twin's extra K/V tile overflows shared memory, and no
    KV_TMA config is feasible elsewhere; the portable default keeps pointer loads."""
    limits = KERNEL.limits(H200)
    for key in KERNEL.default_keys(H200)[::7]:
        feasible = SPACE.feasible(key, limits)
        twins = {dataclasses.replace(c, KV_TMA=True) for c in feasible if not c.KV_TMA}
        tma = {c for c in feasible if c.KV_TMA}
        assert tma <= twins and tma
        for config in twins - tma:
            assert "shared memory" in SPACE.infeasible_reason(config, key, limits), config
        assert not portable_config(key, interpreter=False).KV_TMA
    key = _key(H200, head_dim=80)
    assert not any(c.KV_TMA for c in SPACE.feasible(key, limits))
    assert not KERNEL.default_config(_key(CPU)).KV_TMA


# ---- GPU tier ------------------------------------------------------------------------------------


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize(
    "config",
    [{"KV_TMA": True}, {"KV_TMA": True, "FUSED_MERGE": True, "BLOCK_N": 128, "num_stages": 3}],
    ids=["default-tiles", "fused-bn128-s3"],
)
def test_gpu_kv_tma_at_a_real_shape(descriptors, config, dtype):
    """B=8 x 8 KV heads, GQA 4, D 128, a 16K cache with NaN past each length (one sequence empty, one full)."""
    lengths = [16384, 0, 1, 129, 4095, 8191, 12000, 16383]
    run_and_compare(*make_case("cuda", batch=8, kv_heads=8, group=4, lq=1, head_dim=128, lmax=16384,
                               lengths=lengths, dtype=dtype), config)  # fmt: skip
    assert descriptors


@pytest.mark.gpu
def test_gpu_torch_compile_with_kv_tma_pinned_keeps_pointer_loads(descriptors):
    """Inductor traces the op's body with wrap_triton on: no host descriptor is built there (torch
    would bake it into the graph), and the result is still right."""
    _compiled_step("cuda", batch=4, kv_heads=8, group=4, lq=1, head_dim=128, lmax=8192, lengths=[8192, 1, 5000, 0])
    assert not descriptors


def test_a_stored_winner_is_followed_by_its_kv_tma_and_one_launch_twins() -> None:
    """A re-tune seeded from the shipped winners measures each one's one-launch twin
    (``FUSED_MERGE``, the likely eager choice at small batches) right after it, then its descriptor
    twin (all were tuned before ``KV_TMA`` existed)."""
    from tritune.kernels.decode.tuning import TUNING
    from tritune.search_spaces.splitk_decode import DecodeConfig

    pointer = DecodeConfig(BLOCK_N=64, num_stages=3)
    fused, twin = TUNING.winner_variants(pointer, None, None)
    assert fused == dataclasses.replace(pointer, FUSED_MERGE=True)
    assert twin == dataclasses.replace(pointer, KV_TMA=True)
    assert TUNING.winner_variants(twin, None, None) == [dataclasses.replace(twin, FUSED_MERGE=True)]
    assert TUNING.winner_variants(dataclasses.replace(twin, FUSED_MERGE=True), None, None) == []


def test_an_empty_cache_with_kv_tma_pinned_keeps_pointer_loads(descriptors) -> None:
    """No key at all (a cache of length 0): a descriptor needs every dimension, so pointer loads
    serve, and the output is the zeros of an empty sequence."""
    q = torch.randn(1, 4, 1, 64).to(torch.bfloat16)
    cache = torch.empty(1, 1, 0, 64, dtype=torch.bfloat16)
    with use_config("splitk_decode", {**ONE_SPLIT, "KV_TMA": True}):
        out = decode_attention(q, cache, cache, torch.zeros(1, dtype=torch.int32))
    assert descriptors == []
    assert torch.equal(out, torch.zeros_like(out))


def test_a_pinned_kv_tma_config_keeps_pointer_loads_before_sm90(monkeypatch) -> None:
    config = DecodeConfig(KV_TMA=True)
    h200 = dataclasses.replace(A100, name="NVIDIA H200", capability=(9, 0), sm_count=132, arch="sm90")
    facts = ("bf16", 128, 1, 32, 8, 1, 4096)
    assert KERNEL.serveable(config, A100, facts).KV_TMA is False
    assert KERNEL.serveable(config, h200, facts) == config
    assert KERNEL.serveable(config, CPU, facts) == config
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    assert KERNEL.serveable(config, h200, facts).KV_TMA is False
