"""``prefill_attention`` against the fp64 reference: both paths, awkward shapes and layouts, the op.

CPU tier: the Triton interpreter at tiny shapes. GPU tier (``gpu`` marker): the same cases on the
GPU, plus bigger shapes, CUDA-graph replay with new lengths and ``torch.compile`` with inductor.

Error bound: twice the error of a dense computation with the numerics every bf16/fp16 flash kernel
has by construction (scores and softmax in fp32, P and the output rounded to the input dtype),
measured against the same fp64 reference; plus the spec's own fixed check. The interpreter
rounds fp32 -> bf16 by truncation, so on the CPU tier the dense computation truncates too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

from tritune.kernels import prefill_attention, settings, use_config
from tritune.kernels.device import device_info
from tritune.kernels.prefill import launch as prefill_launch
from tritune.kernels.prefill.kernel import KERNEL as SPEC
from tritune.kernels.prefill.reference import prefill_reference, visible_keys

HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"
BF16, FP16 = torch.bfloat16, torch.float16


@dataclass(frozen=True)
class Case:
    batch: int
    q_heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = True
    #: None: no kv_len; an int: shape []; a tuple: shape [B].
    kv_len: int | tuple[int, ...] | None = None
    dtype: torch.dtype = FP16
    #: "bhld" contiguous; "blhd": [B, L, H, D] storage viewed as [B, H, L, D] (out too);
    #: "strided_d": every other element of a twice-as-wide head dim (inner stride 2).
    layout: str = "bhld"


def _tensor(shape: tuple[int, ...], case: Case, gen: torch.Generator) -> torch.Tensor:
    b, h, n, d = shape
    if case.layout == "blhd":
        return torch.randn(b, n, h, d, generator=gen).to(DEVICE, case.dtype).transpose(1, 2)
    if case.layout == "strided_d":
        return torch.randn(b, h, n, 2 * d, generator=gen).to(DEVICE, case.dtype)[..., ::2]
    return torch.randn(b, h, n, d, generator=gen).to(DEVICE, case.dtype)


def _inputs(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = _tensor((case.batch, case.q_heads, case.seqlen_q, case.head_dim), case, gen)
    k = _tensor((case.batch, case.kv_heads, case.seqlen_k, case.head_dim), case, gen)
    v = _tensor((case.batch, case.kv_heads, case.seqlen_k, case.head_dim), case, gen)
    kv_len = None
    if case.kv_len is not None:
        kv_len = torch.tensor(case.kv_len, dtype=torch.int32, device=DEVICE)
        # The unused tail of a KV cache may hold anything: NaN there must not leak into the output.
        for b, n in enumerate(kv_len.expand(case.batch).tolist()):
            k[b, :, n:] = float("nan")
            v[b, :, n:] = float("nan")
    return q, k, v, kv_len


def _poisoned_out(case: Case, q: torch.Tensor) -> torch.Tensor:
    if case.layout == "blhd":
        out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype, device=q.device)
        out = out.transpose(1, 2)
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out.fill_(float("nan"))


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> dtype -> fp32 the way the kernels round on this tier."""
    if INTERPRETED and dtype == BF16:
        return (x.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)
    return x.to(dtype).float()


def _flash_numerics(q, k, v, *, causal, kv_len, scale):
    """Dense attention with a bf16/fp16 flash kernel's rounding points (fp32 scores, P and O rounded)."""
    batch, q_heads, seqlen_q, _ = q.shape
    group = q_heads // k.shape[1]
    mask = visible_keys(batch, seqlen_q, k.shape[2], causal=causal, kv_len=kv_len, device=q.device)[:, None]
    kk = k.float().nan_to_num().repeat_interleave(group, 1)
    vv = v.float().nan_to_num().repeat_interleave(group, 1)
    scores = (q.float() @ kk.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(top.isinf(), 0.0, top))
    total = p.sum(-1, keepdim=True)
    return _round((_round(p, q.dtype) @ vv) / torch.where(total > 0, total, 1.0), q.dtype)


def _expect_close(out, q, k, v, *, causal, kv_len, softmax_scale=None):
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ref = prefill_reference(q, k, v, causal=causal, kv_len=kv_len, softmax_scale=scale, dtype=torch.float64)
    assert bool(torch.isfinite(out).all()), "non-finite output"
    err = float((out.double() - ref).abs().max())
    baseline = float((_flash_numerics(q, k, v, causal=causal, kv_len=kv_len, scale=scale).double() - ref).abs().max())
    assert err <= 2 * baseline + 1e-6, f"max error {err:.3g} > 2 x {baseline:.3g} (flash numerics in {q.dtype})"
    assert SPEC.check(out, ref.float(), None) is None


class _PathSpy:
    """Counts which path's host wrapper the op ran (the real kernels still run)."""

    def __init__(self, monkeypatch):
        self.ran: list[str] = []
        for path, name in (("tma", "launch_tma"), ("portable", "launch_portable")):
            real = getattr(prefill_launch, name)

            def spy(*args, _real=real, _path=path, **kwargs):
                self.ran.append(_path)
                return _real(*args, **kwargs)

            monkeypatch.setattr(prefill_launch, name, spy)


@pytest.fixture
def spy(monkeypatch):
    return _PathSpy(monkeypatch)


# ---- the portable path through the dispatcher ---------------------------------------------

PORTABLE_CASES = {
    "gqa1-lq7-lkv63-d64": Case(1, 2, 2, 7, 63, 64),
    "gqa2-lq33-lkv97-d64-noncausal": Case(1, 4, 2, 33, 97, 64, causal=False),
    "gqa8-lq33-lkv97-d128-kvlen-per-batch": Case(2, 8, 1, 33, 97, 128, kv_len=(97, 40)),
    "lq1-d96-kvlen-scalar": Case(1, 2, 1, 1, 63, 96, kv_len=50),
    "d80-kvlen-below-lq-and-zero": Case(2, 2, 2, 33, 63, 80, kv_len=(20, 0)),
    "d256-noncausal-kvlen-bf16": Case(2, 2, 1, 7, 33, 256, causal=False, kv_len=(5, 33), dtype=BF16),
    "lq-longer-than-lkv": Case(1, 2, 1, 40, 16, 64),
    "lkv1": Case(1, 2, 2, 7, 1, 64),
    "lkv1-lq1-noncausal": Case(1, 2, 2, 1, 1, 64, causal=False),
    "bf16-gqa2-d128": Case(1, 4, 2, 17, 64, 128, dtype=BF16),
    "blhd-layout-kvlen": Case(1, 4, 2, 17, 50, 64, kv_len=(30,), layout="blhd"),
    "strided-d": Case(1, 2, 1, 9, 40, 64, layout="strided_d"),
}


@pytest.mark.parametrize("case", list(PORTABLE_CASES.values()), ids=list(PORTABLE_CASES))
def test_portable_matches_reference(case, spy):
    q, k, v, kv_len = _inputs(case)
    out = _poisoned_out(case, q)
    result = prefill_attention(q, k, v, causal=case.causal, kv_len=kv_len, out=out)
    assert result is out and spy.ran == ["portable"]
    _expect_close(out, q, k, v, causal=case.causal, kv_len=kv_len)


def test_softmax_scale_and_default_out():
    case = Case(1, 2, 1, 9, 40, 64)
    q, k, v, _ = _inputs(case, seed=1)
    out = prefill_attention(q, k, v, causal=False, softmax_scale=0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    _expect_close(out, q, k, v, causal=False, kv_len=None, softmax_scale=0.3)


@pytest.mark.parametrize("scale", [0.3, -0.3, 0.0], ids=["positive", "negative", "zero"])
@pytest.mark.parametrize(
    "pinned",
    [{"BLOCK_M": 16, "BLOCK_N": 16}, {"path": "tma", "BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_KV": 2}],
    ids=["portable", "tma-split2"],
)
def test_any_softmax_scale_sign(scale, pinned, spy):
    """The kernels take the row max on raw scores and scale it once: a negative scale (q is flipped
    instead) and a zero one (every visible key weighs the same, masked keys and rows with no key
    still nothing, never NaN) must match the reference like a positive one."""
    case = Case(2, 4, 2, 17, 40, 64, kv_len=(40, 9))
    q, k, v, kv_len = _inputs(case, seed=14)
    with use_config("tma_prefill", pinned):
        out = prefill_attention(q, k, v, kv_len=kv_len, softmax_scale=scale, out=_poisoned_out(case, q))
    assert spy.ran == [pinned.get("path", "portable")]
    _expect_close(out, q, k, v, causal=True, kv_len=kv_len, softmax_scale=scale)


def test_fully_masked_rows_are_zero():
    case = Case(2, 2, 1, 9, 16, 64, kv_len=(4, 0))
    q, k, v, kv_len = _inputs(case, seed=2)
    out = prefill_attention(q, k, v, kv_len=kv_len, out=_poisoned_out(case, q))
    # Batch 0: queries 0..4 sit at negative positions; batch 1 has no keys at all.
    assert torch.equal(out[0, :, :5], torch.zeros_like(out[0, :, :5]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    _expect_close(out, q, k, v, causal=True, kv_len=kv_len)


def test_empty_query_returns_out_untouched(spy):
    q = torch.randn(1, 2, 0, 64, device=DEVICE, dtype=FP16)
    k = torch.randn(1, 2, 8, 64, device=DEVICE, dtype=FP16)
    assert prefill_attention(q, k, k).shape == q.shape and spy.ran == []
    out = torch.empty_like(q)
    assert prefill_attention(q, k, k, out=out) is out and spy.ran == []


# ---- the TMA path, forced -----------------------------------------------------------------

TMA_CASES = {
    "d64-gqa1": (Case(1, 2, 2, 33, 97, 64, kv_len=80), {"BLOCK_M": 32, "BLOCK_N": 16}),
    "d128-gqa2-split2": (Case(2, 4, 2, 17, 63, 128, kv_len=(63, 9)), {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_KV": 2}),
    "d64-gqa8-pack-bf16": (
        Case(1, 8, 1, 7, 64, 64, kv_len=64, dtype=BF16),
        {"BLOCK_M": 32, "BLOCK_N": 16, "PACK_GQA": True},
    ),
    "d64-gqa8-pack-split4": (
        Case(2, 8, 1, 9, 97, 64, kv_len=(97, 30)),
        {"BLOCK_M": 32, "BLOCK_N": 16, "PACK_GQA": True, "SPLIT_KV": 4},
    ),
    "d128-gqa2-blhd-no-kvlen": (Case(1, 4, 2, 20, 40, 128, layout="blhd"), {"BLOCK_M": 16, "BLOCK_N": 32}),
    "d64-kvlen-below-lq-split2": (
        Case(2, 2, 1, 33, 64, 64, kv_len=(10, 0)),
        {"BLOCK_M": 32, "BLOCK_N": 32, "SPLIT_KV": 2},
    ),
    # Packed groups of 2 and 4 (not only 8), eight splits of which some see no key, head dim 256.
    "d64-gqa2-pack": (Case(2, 4, 2, 13, 50, 64, kv_len=(50, 20)), {"BLOCK_M": 32, "BLOCK_N": 16, "PACK_GQA": True}),
    "d64-gqa4-pack-split8": (
        Case(1, 8, 2, 9, 150, 64, kv_len=(150,)),
        {"BLOCK_M": 32, "BLOCK_N": 16, "PACK_GQA": True, "SPLIT_KV": 8},
    ),
    "d256-gqa2": (Case(1, 4, 2, 17, 40, 256, kv_len=(33,)), {"BLOCK_M": 16, "BLOCK_N": 16}),
}


class _PoisonedTorch:
    """``torch``, except that ``empty`` hands out NaN-filled float tensors: the split-KV partials
    (``part_o``, ``part_ml``) must be written before the merge reads them, not be found zero."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs) -> torch.Tensor:
        tensor = torch.empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor


@pytest.mark.parametrize("case, config", list(TMA_CASES.values()), ids=list(TMA_CASES))
def test_tma_matches_portable_and_reference(case, config, spy, monkeypatch):
    monkeypatch.setattr(prefill_launch, "torch", _PoisonedTorch())
    q, k, v, kv_len = _inputs(case, seed=3)
    outs = {}
    for path, pinned in (("tma", {"path": "tma", **config}), ("portable", {"BLOCK_M": 32, "BLOCK_N": 32})):
        with use_config("tma_prefill", pinned):
            outs[path] = prefill_attention(q, k, v, kv_len=kv_len, out=_poisoned_out(case, q))
        _expect_close(outs[path], q, k, v, causal=True, kv_len=kv_len)
    assert spy.ran == ["tma", "portable"]
    scale = float(outs["portable"].float().abs().max())
    assert float((outs["tma"].float() - outs["portable"].float()).abs().max()) <= 2e-2 * scale


def test_eager_tma_call_runs_the_tma_body_directly(monkeypatch, spy):
    """In plain eager mode the prefill op's body calls the TMA op's body directly (its arguments are
    plain tensors already); a dispatch through torch.library would raise here."""

    def through_the_library(*args):
        raise AssertionError("the nested TMA op went through torch.library")

    monkeypatch.setattr(prefill_launch, "_TMA_OP", through_the_library)
    case = Case(1, 4, 2, 9, 40, 64)
    q, k, v, _ = _inputs(case, seed=12)
    with use_config("tma_prefill", {"path": "tma", "BLOCK_M": 16, "BLOCK_N": 16}):
        out = prefill_attention(q, k, v, out=_poisoned_out(case, q))
    assert spy.ran == ["tma"]
    _expect_close(out, q, k, v, causal=True, kv_len=None)


def test_tma_kernel_also_runs_non_causal():
    """The spec routes only causal calls to the TMA path; the kernel itself takes either."""
    case = Case(2, 4, 2, 17, 40, 64, causal=False, kv_len=(40, 7))
    q, k, v, kv_len = _inputs(case, seed=10)
    config = SPEC.pinned_config({"path": "tma", "BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_KV": 2})
    out = SPEC.launch(config, q, k, v, causal=False, kv_len=kv_len, out=_poisoned_out(case, q))
    _expect_close(out, q, k, v, causal=False, kv_len=kv_len)


def test_tma_pinned_on_a_strided_head_dim_falls_back_to_portable(spy):
    case = Case(1, 4, 2, 9, 40, 64, layout="strided_d")
    q, k, v, _ = _inputs(case, seed=4)
    with use_config("tma_prefill", {"path": "tma", "BLOCK_M": 32, "BLOCK_N": 32}):
        out = prefill_attention(q, k, v, out=_poisoned_out(case, q))
    assert spy.ran == ["portable"]
    _expect_close(out, q, k, v, causal=True, kv_len=None)


def test_tma_op_on_a_misaligned_base_runs_portable_tiles_that_fit(monkeypatch):
    """A compiled graph can hand the TMA op a base that is not 16-byte aligned (its facts cannot see
    pointers): the portable stand-in must keep the TMA tiles only where the portable kernel fits them."""
    case = Case(1, 4, 2, 9, 40, 128)
    q0, k, v, _ = _inputs(case, seed=11)
    q = torch.empty(q0.numel() + 1, dtype=q0.dtype, device=DEVICE)[1:].view(q0.shape)
    q.copy_(q0)
    assert q.data_ptr() % 16
    configs = []
    real = prefill_launch.launch_portable

    def portable(config, *args):
        configs.append(config)
        return real(config, *args)

    monkeypatch.setattr(prefill_launch, "launch_portable", portable)
    out = _poisoned_out(case, q)
    # 128 x 128 tiles in 4 stages: past the interpreter's tiles, and past an H200's shared memory at D 128.
    tiles = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, PACK_GQA=False, SPLIT_KV=1)
    torch.ops.tritune.prefill_attention_tma(q, k, v, None, True, 0.125, out, **tiles)
    [config] = configs
    device = device_info(q.device)
    key = SPEC.key_for(device, SPEC.facts(q, k, v, causal=True, out=out))
    assert config.path == "portable"
    assert SPEC.space.infeasible_reason(config, key, SPEC.limits(device)) is None
    _expect_close(out, q, k, v, causal=True, kv_len=None, softmax_scale=0.125)


def test_a_direct_call_of_the_tma_op_with_strides_descriptors_cannot_cover_runs_portable(monkeypatch):
    """The nested TMA op builds its descriptors unchecked: called directly with a row pitch that is
    not a multiple of 16 bytes (no eligibility rule ran), it must run the portable stand-in."""
    case = Case(1, 4, 2, 9, 40, 64)
    q0, k, v, _ = _inputs(case, seed=12)
    q = torch.empty(*q0.shape[:-1], 68, dtype=q0.dtype, device=DEVICE)[..., :64]  # rows 136 bytes apart
    q.copy_(q0)
    assert q.stride(2) * q.element_size() % 16
    configs = []
    real = prefill_launch.launch_portable
    monkeypatch.setattr(prefill_launch, "launch_portable", lambda c, *a: configs.append(c) or real(c, *a))
    out = _poisoned_out(case, q)
    tiles = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2, PACK_GQA=False, SPLIT_KV=1)
    torch.ops.tritune.prefill_attention_tma(q, k, v, None, True, 0.125, out, **tiles)
    assert [c.path for c in configs] == ["portable"]
    _expect_close(out, q, k, v, causal=True, kv_len=None, softmax_scale=0.125)


def test_wide_kv_tiles_take_64_bit_offsets():
    """A K/V tile whose elements lie 2**31 or more apart needs 64-bit in-tile offsets (set on the host)."""
    narrow = torch.empty_strided((1, 2, 64, 128), (0, 128, 256, 1), device="meta", dtype=BF16)
    wide = torch.empty_strided((1, 2, 64, 128), (0, 128, 2**25, 1), device="meta", dtype=BF16)
    wide_d = torch.empty_strided((1, 2, 64, 128), (0, 1, 2, 2**24), device="meta", dtype=BF16)
    assert not prefill_launch._wide_tile(narrow, 64, 128)
    assert prefill_launch._wide_tile(wide, 64, 128) and not prefill_launch._wide_tile(wide, 32, 128)
    assert prefill_launch._wide_tile(wide_d, 64, 128)


@pytest.mark.parametrize("case", [PORTABLE_CASES["gqa8-lq33-lkv97-d128-kvlen-per-batch"],
                                  PORTABLE_CASES["strided-d"], PORTABLE_CASES["d80-kvlen-below-lq-and-zero"]],
                         ids=["gqa8-kvlen", "strided-d", "d80"])  # fmt: skip
def test_portable_kernel_with_64_bit_kv_tile_offsets(case, spy, monkeypatch):
    """The WIDE_KV_TILES variant of the portable kernel, forced at small shapes, is as exact as the other."""
    monkeypatch.setattr(prefill_launch, "_INT32_SPAN", 1)
    q, k, v, kv_len = _inputs(case)
    out = prefill_attention(q, k, v, causal=case.causal, kv_len=kv_len, out=_poisoned_out(case, q))
    assert spy.ran == ["portable"]
    _expect_close(out, q, k, v, causal=case.causal, kv_len=kv_len)


@pytest.mark.parametrize(
    "mode, pinned, expected",
    [("auto", None, "portable"), ("on", None, "tma"), ("off", None, "portable"), ("off", {"path": "tma"}, "portable")],
    ids=["auto", "on", "off", "off-overrides-pinned-tma"],
)
def test_each_setting_serves_its_path(mode, pinned, expected, spy):
    case = Case(1, 4, 2, 17, 33, 64, kv_len=30)
    q, k, v, kv_len = _inputs(case, seed=5)
    with settings.override(enable_tma_causal_prefill=mode), use_config("tma_prefill", pinned or {}):
        out = prefill_attention(q, k, v, kv_len=kv_len, out=_poisoned_out(case, q))
    assert spy.ran == [expected]
    _expect_close(out, q, k, v, causal=True, kv_len=kv_len)


# ---- the op: torch.library and torch.compile ----------------------------------------------


@pytest.mark.parametrize(
    "pinned",
    [{"BLOCK_M": 32, "BLOCK_N": 32}, {"path": "tma", "BLOCK_M": 32, "BLOCK_N": 16, "PACK_GQA": True, "SPLIT_KV": 2}],
    ids=["portable", "tma-pack-split"],
)
def test_opcheck(pinned):
    """The op carries every field of the union (fillers for those the path lacks); the nested TMA
    op carries the TMA member's fields alone."""
    case = Case(1, 4, 2, 7, 33, 64, kv_len=20)
    q, k, v, kv_len = _inputs(case, seed=6)
    out = torch.empty_like(q)
    args = (q, k, v, kv_len, True, 0.125, out)
    config = SPEC.pinned_config(pinned)
    fields = SPEC.space.field_values(config)
    assert set(fields) == set(SPEC.space.field_types)
    torch.library.opcheck(torch.ops.tritune.prefill_attention.default, args, fields)
    own = SPEC.space.to_dict(config)
    if own.pop("path") == "tma":
        torch.library.opcheck(torch.ops.tritune.prefill_attention_tma.default, args, own)


@pytest.mark.parametrize(
    "pinned, path",
    [({}, "portable"), ({"path": "tma", "BLOCK_M": 32, "BLOCK_N": 16}, "tma")],
    ids=["dispatched", "tma"],
)
def test_torch_compile_fullgraph_matches_eager(pinned, path, spy):
    case = Case(1, 4, 2, 9, 40, 64, kv_len=(33,))
    q, k, v, kv_len = _inputs(case, seed=7)

    def attend(q, k, v, kv_len):
        return prefill_attention(q, k, v, causal=True, kv_len=kv_len) * 2

    torch._dynamo.reset()
    with use_config("tma_prefill", pinned):
        eager = attend(q, k, v, kv_len)
        compiled = torch.compile(attend, fullgraph=True, backend="inductor" if HAS_CUDA else "aot_eager")
        result = compiled(q, k, v, kv_len)
    torch._dynamo.reset()
    assert torch.equal(result, eager)
    _expect_close(eager / 2, q, k, v, causal=True, kv_len=kv_len)
    # Inductor also runs a triton_op's body while it traces: count paths, not calls.
    assert set(spy.ran) == {path}


# ---- bad input ----------------------------------------------------------------------------


def _bad(name: str):
    q = torch.randn(1, 4, 8, 64, dtype=FP16, device=DEVICE)
    k = torch.randn(1, 2, 16, 64, dtype=FP16, device=DEVICE)
    kwargs: dict = {"q": q, "k": k, "v": k.clone(), "kv_len": None}
    meta = torch.device("meta")
    k72 = torch.randn(1, 2, 16, 72, dtype=FP16, device=DEVICE)
    k3 = torch.randn(1, 3, 16, 64, dtype=FP16, device=DEVICE)
    changes = {
        "q-not-a-tensor": {"q": q.tolist()},
        "q-float32": {"q": q.float()},
        "k-dtype-differs": {"k": k.to(BF16)},
        "q-rank-3": {"q": q[0]},
        "v-other-device": {"v": k.to(meta)},
        "head-dims-differ": {"k": torch.randn(1, 2, 16, 128, dtype=FP16, device=DEVICE)},
        "head-dim-72": {"q": torch.randn(1, 4, 8, 72, dtype=FP16, device=DEVICE), "k": k72, "v": k72},
        "q-heads-not-multiple": {"k": k3, "v": k3},
        "k-v-heads-differ": {"v": k[:, :1]},
        "k-v-lengths-differ": {"v": k[:, :, :9]},
        "batch-differs": {"k": k.expand(2, -1, -1, -1), "v": k.expand(2, -1, -1, -1)},
        "kv_len-int64": {"kv_len": torch.tensor(3, device=DEVICE)},
        "kv_len-python-int": {"kv_len": 3},
        "kv_len-wrong-batch": {"kv_len": torch.tensor([3, 4], dtype=torch.int32, device=DEVICE)},
        "kv_len-2d": {"kv_len": torch.tensor([[3]], dtype=torch.int32, device=DEVICE)},
        "kv_len-other-device": {"kv_len": torch.tensor(3, dtype=torch.int32, device=meta)},
        "out-shape": {"out": torch.empty(1, 4, 8, 32, dtype=FP16, device=DEVICE)},
        "out-dtype": {"out": torch.empty(1, 4, 8, 64, dtype=BF16, device=DEVICE)},
        "out-other-device": {"out": torch.empty(1, 4, 8, 64, dtype=FP16, device=meta)},
        "causal-not-bool": {"causal": 1},
        "softmax_scale-str": {"softmax_scale": "0.1"},
    }[name]
    return {**kwargs, **changes}


#: (case, error, the message as a regex: each names the argument first).
BAD_INPUTS = [
    ("q-not-a-tensor", TypeError, r"q: expected a torch.Tensor"),
    ("q-float32", TypeError, r"q: expected dtype torch.bfloat16 or torch.float16, got torch.float32"),
    ("k-dtype-differs", TypeError, r"k: expected dtype torch.float16 \(the dtype of q\)"),
    ("q-rank-3", ValueError, r"q: expected shape \[B, Hq, Lq, D\], got \(4, 8, 64\): 3 dims, expected 4"),
    ("v-other-device", ValueError, r"v: expected device \S+ \(the device of q\), got meta"),
    ("head-dims-differ", ValueError, r"k: expected shape .*: D is 128 where q has D=64"),
    ("head-dim-72", ValueError, r"q: head dim 72 is not supported"),
    ("q-heads-not-multiple", ValueError, r"q: 4 query heads are not a multiple of k's 3 KV heads"),
    ("k-v-heads-differ", ValueError, r"v: expected shape .*: Hkv is 1 where k has Hkv=2"),
    ("k-v-lengths-differ", ValueError, r"v: expected shape .*: Lkv is 9 where k has Lkv=16"),
    ("batch-differs", ValueError, r"k: expected shape .*: B is 2 where q has B=1"),
    ("kv_len-int64", TypeError, r"kv_len: expected dtype torch.int32"),
    ("kv_len-python-int", TypeError, r"kv_len: expected a torch.Tensor or None, got int"),
    ("kv_len-wrong-batch", ValueError, r"kv_len: expected shape \[\] or \[B=1\], got \(2,\)"),
    ("kv_len-2d", ValueError, r"kv_len: expected shape"),
    ("kv_len-other-device", ValueError, r"kv_len: expected device \S+ \(the device of q\)"),
    ("out-shape", ValueError, r"out: expected shape \(1, 4, 8, 64\)"),
    ("out-dtype", TypeError, r"out: expected dtype torch.float16 \(the dtype of q\)"),
    ("out-other-device", ValueError, r"out: expected device \S+ \(the device of q\)"),
    ("causal-not-bool", TypeError, r"causal: expected a bool"),
    ("softmax_scale-str", TypeError, r"softmax_scale: expected a float or None, got str"),
]


@pytest.mark.parametrize("name, error, message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_the_argument(name, error, message):
    kwargs = _bad(name)
    with pytest.raises(error, match="^" + message):
        prefill_attention(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), **kwargs)


# ---- GPU tier -----------------------------------------------------------------------------

GPU_CONFIGS = {
    "portable-default": {},
    "tma-default": {"path": "tma"},
    "tma-pack": {"path": "tma", "PACK_GQA": True},
    "tma-split4": {"path": "tma", "SPLIT_KV": 4, "BLOCK_M": 64},
    "tma-128x128": {"path": "tma", "BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 2},
}
GPU_CASES = (
    {
        "gqa8-lq1000-lkv4099-d128-kvlen": Case(2, 16, 2, 1000, 4099, 128, kv_len=(4099, 3001), dtype=BF16),
        "gqa1-square-513-d64": Case(1, 8, 8, 513, 513, 64, dtype=BF16),
        "gqa4-lq257-lkv8200-d256": Case(1, 8, 2, 257, 8200, 256, kv_len=8000, dtype=BF16),
        "gqa2-lq300-lkv2000-d80-noncausal": Case(1, 4, 2, 300, 2000, 80, causal=False, dtype=FP16),
        "gqa8-blhd-lq129-lkv1025-d128": Case(2, 32, 4, 129, 1025, 128, kv_len=(1025, 100), layout="blhd"),
    }
    if HAS_CUDA
    else {}
)


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", list(GPU_CONFIGS.values()), ids=list(GPU_CONFIGS))
@pytest.mark.parametrize("case", list(GPU_CASES.values()), ids=list(GPU_CASES))
def test_gpu_bigger_shapes(case, pinned):
    q, k, v, kv_len = _inputs(case, seed=8)
    device = device_info(q.device)
    facts = SPEC.facts(q, k, v, causal=case.causal, kv_len=kv_len, out=_poisoned_out(case, q))
    served = SPEC.serveable(SPEC.pinned_config(pinned), device, tuple(facts))
    why = SPEC.space.infeasible_reason(served, SPEC.key_for(device, facts), SPEC.limits(device))
    if why is not None:
        pytest.skip(f"{served} is infeasible here: {why}")
    with use_config("tma_prefill", pinned):
        out = prefill_attention(q, k, v, causal=case.causal, kv_len=kv_len, out=_poisoned_out(case, q))
    _expect_close(out, q, k, v, causal=case.causal, kv_len=kv_len)


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", list(GPU_CONFIGS.values()), ids=list(GPU_CONFIGS))
def test_gpu_cuda_graph_replays_with_new_kv_len(pinned):
    case = Case(2, 16, 2, 256, 2048, 128, kv_len=(2048, 1500), dtype=BF16)
    q, k, v, kv_len = _inputs(case, seed=9)
    k, v = k.nan_to_num(), v.nan_to_num()
    out = torch.empty_like(q)
    with use_config("tma_prefill", pinned):
        prefill_attention(q, k, v, kv_len=kv_len, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            prefill_attention(q, k, v, kv_len=kv_len, out=out)
    for lengths in ((1000, 2048), (200, 0)):
        kv_len.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _expect_close(out, q, k, v, causal=True, kv_len=kv_len)


@pytest.mark.gpu
@pytest.mark.parametrize("pinned, causal", [({}, False), ({"path": "tma"}, True)], ids=["portable", "tma"])
@pytest.mark.parametrize("long", ["q", "kv"], ids=["long-q", "long-kv"])
def test_gpu_offsets_past_int32(pinned, causal, long, spy):
    """[1, L, H, D] views whose L * H * D passes 2**31 elements: every offset along L must be 64-bit.

    ``long-q``: q and out span the range, over few keys (quick); the last rows (the largest
    offsets) are checked, and with causal masking every row before the first key's position must
    be zero. ``long-kv``: K and V span it, under a few query rows. The reference covers a few heads.
    """
    length, heads, d = 139264, 128, 128
    assert (length - 1) * heads * d >= 2**31
    lq, lkv, kv_heads = (length, 128, 8) if long == "q" else (64, length, heads)
    gen = torch.Generator(device="cuda").manual_seed(13)

    def blhd(n: int, h: int) -> torch.Tensor:
        return torch.randn(1, n, h, d, generator=gen, device="cuda", dtype=BF16).transpose(1, 2)

    q, k, v = blhd(lq, heads), blhd(lkv, kv_heads), blhd(lkv, kv_heads)
    out = torch.full((1, lq, heads, d), float("nan"), device="cuda", dtype=BF16).transpose(1, 2)
    with use_config("tma_prefill", pinned):
        prefill_attention(q, k, v, causal=causal, out=out)
    assert spy.ran == [pinned.get("path", "portable")]
    assert bool(torch.isfinite(out).all()), "some rows were never written"
    # Bottom-right alignment: the last rows keep their positions when sliced off.
    rows = slice(max(lq - 256, 0), lq)
    group = heads // kv_heads
    kv_part = max(1, 4 // group)
    q_heads = slice(0, kv_part * group)
    sub_q, sub_out = q[:, q_heads, rows], out[:, q_heads, rows]
    _expect_close(sub_out, sub_q, k[:, :kv_part], v[:, :kv_part], causal=causal, kv_len=None)
    if causal and lq > lkv:
        assert not bool(out[:, :, : lq - lkv].any()), "rows that see no key must be zero"
