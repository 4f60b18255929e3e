"""The generated one-pass checks of prefill and decode against their detailed checks.

Every plain eager call pays the fast check (:mod:`tritune.kernels.fastcheck`); anything it does not
accept goes to the detailed checks, which explain the error or serve the call. So for any call:
the fast check never accepts what the detailed checks refuse, and where both accept they agree on
the facts (which key the dispatcher's memo), the device and the resolved scale. A plain valid call
(exact tensors, a float or no scale) must take the fast path: otherwise it pays the detailed checks
on every call. Nothing launches here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritune.kernels import attention, decode_attention, prefill_attention
from tritune.kernels.decode.kernel import KERNEL as DECODE
from tritune.kernels.fastcheck import FastCheck
from tritune.kernels.prefill.kernel import KERNEL as PREFILL

BF, FP = torch.bfloat16, torch.float16
#: The GPU when there is one, else CPU tensors on the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Layouts of an input tensor; each keeps its shape ("subclass" is valid but never plain).
LAYOUTS = ("contiguous", "transposed", "padded", "misaligned", "expanded")
OUTS = ("none", "fresh", "transposed", "padded", "misaligned", "beside-k")
BAD_OUTS = ("zero-stride", "is-q", "inside-k", "wrong-shape", "wrong-dtype", "not-a-tensor")
SCALES = (None, 0.0, -0.3, 0.125, 1e4, -1e4)
BAD_SCALES = (1e4 * (1 + 1e-9), -3e38, float("nan"), float("inf"), 1, True, "0.1")
KV_LENS = ("none", "scalar", "batch", "strided")
BAD_KV_LENS = ("int64", "wrong-batch", "2d", "python-int")


class Subclass(torch.Tensor):
    """A tensor subclass: the fast checks leave it to the detailed checks."""


def laid_out(shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A random tensor of ``shape`` in ``layout`` (the values do not matter here)."""
    if layout == "transposed" and len(shape) >= 3:
        t = torch.randn(*shape[:-3], shape[-2], shape[-3], shape[-1]).to(DEVICE, dtype).transpose(-2, -3)
    elif layout == "padded":
        t = torch.randn(*shape[:-1], shape[-1] + 4).to(DEVICE, dtype)[..., : shape[-1]]
    elif layout == "head-strided":
        t = torch.randn(*shape[:-1], 2 * shape[-1]).to(DEVICE, dtype)[..., ::2]
    elif layout == "misaligned":
        t = torch.randn(math.prod(shape) + 1).to(DEVICE, dtype)[1:].view(shape)
    elif layout == "expanded" and shape and shape[0] > 1:
        t = torch.randn(1, *shape[1:]).to(DEVICE, dtype).expand(shape)
    else:
        t = torch.randn(shape).to(DEVICE, dtype)
    return t.as_subclass(Subclass) if layout == "subclass" else t


class Chooser:
    """Draws each aspect of a call from its valid values, except where the fault falls: ``"none"``
    (a valid call), one named aspect (drawn from its wrong values), or ``"any"`` (every aspect
    from all its values)."""

    def __init__(self, draw: Any, fault: str) -> None:
        self.draw = draw
        self.fault = fault

    def __call__(self, aspect: str, good: Any, bad: Any = ()) -> Any:
        if self.fault == "any":
            return self.draw(st.sampled_from((*good, *bad)))
        return self.draw(st.sampled_from(bad if self.fault == aspect and bad else good))


def draw_out(pick: Chooser, q: torch.Tensor, k: torch.Tensor, strided_ok: bool) -> tuple[Any, torch.Tensor]:
    """``(out, k)``; the ``*-k`` cases move k into a storage that out shares (or borders)."""
    good = (*OUTS, "head-strided") if strided_ok else OUTS
    case = pick("out", good, BAD_OUTS if strided_ok else (*BAD_OUTS, "head-strided"))
    shape, dtype = tuple(q.shape), q.dtype
    if case == "none":
        return None, k
    if case in ("fresh", "transposed", "padded", "head-strided", "misaligned"):
        return laid_out(shape, dtype, "contiguous" if case == "fresh" else case), k
    if case == "zero-stride":
        return torch.empty((*shape[:-2], 1, shape[-1]), dtype=dtype, device=DEVICE).expand(shape), k
    if case == "is-q":
        return q, k
    if case == "wrong-shape":
        return torch.empty((*shape[:-1], shape[-1] + 1), dtype=dtype, device=DEVICE), k
    if case == "wrong-dtype":
        return torch.empty(shape, dtype=BF if dtype == FP else FP, device=DEVICE), k
    if case == "not-a-tensor":
        return [0.0], k
    size = math.prod(shape)
    storage = torch.empty(k.numel() + size + 64, dtype=dtype, device=DEVICE)
    moved = storage[: k.numel()].view(k.shape).copy_(k)
    start = k.numel() // 2 if case == "inside-k" and k.numel() else k.numel()
    return storage[start : start + size].view(shape), moved


def make_kv_len(case: str, batch: int, lkv: int) -> Any:
    if case == "none":
        return None
    if case == "scalar":
        return torch.tensor(lkv, dtype=torch.int32, device=DEVICE)
    if case == "batch":
        return torch.full((batch,), lkv, dtype=torch.int32, device=DEVICE)
    if case == "strided":
        return torch.full((2 * batch,), lkv, dtype=torch.int32, device=DEVICE)[::2]
    if case == "int64":
        return torch.full((batch,), lkv, dtype=torch.int64, device=DEVICE)
    if case == "wrong-batch":
        return torch.full((batch + 1,), lkv, dtype=torch.int32, device=DEVICE)
    if case == "2d":
        return torch.full((batch, 1), lkv, dtype=torch.int32, device=DEVICE)
    return lkv


ASPECTS = ("heads", "lq", "head_dim", "dtype", "k_dtype", "q_layout", "k_layout", "v_layout", "subclass", "v_shape",
           "kv_len", "scale", "out", "causal")  # fmt: skip


def draw_call(draw: Any, family: str, fault: str) -> tuple[Any, ...]:
    """Arguments of a prefill or decode call in declared order: valid, or wrong where ``fault`` says."""
    pick = Chooser(draw, fault)
    decode = family == "decode"
    batch, group, lkv = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(0, 9))
    kv_heads = pick("heads", (1, 2), (0,))
    q_heads = kv_heads * group if kv_heads else group
    if pick("heads", (False,), (True,)) and kv_heads == 2:
        q_heads = 3
    lq = pick("lq", tuple(range(1, 9)) if decode else tuple(range(11)), (0, 9, 10) if decode else ())
    head_dim = pick("head_dim", (64, 80), (72,))
    dtype = pick("dtype", (BF, FP), (torch.float32,))
    # Decode refuses a head dim of stride other than 1; prefill takes it.
    layouts = LAYOUTS if decode else (*LAYOUTS, "head-strided")
    bad_layouts = ("head-strided",) if decode else ()
    q_layout = "subclass" if pick("subclass", (False,), (True,)) else pick("q_layout", layouts, bad_layouts)
    q = laid_out((batch, q_heads, lq, head_dim), dtype, q_layout)
    kv_shape = (batch, kv_heads, lkv, head_dim)
    k_dtype = pick("k_dtype", (dtype,), (FP if dtype == BF else BF,))
    k = laid_out(kv_shape, k_dtype, pick("k_layout", layouts, bad_layouts))
    v_shape = pick("v_shape", (kv_shape,), ((batch, kv_heads, lkv + 1, head_dim), (batch + 1, *kv_shape[1:])))
    v = laid_out(v_shape, dtype, pick("v_layout", layouts, bad_layouts))
    good_lengths = ("batch", "strided") if decode else KV_LENS
    kv_len = make_kv_len(pick("kv_len", good_lengths, BAD_KV_LENS + (("none", "scalar") if decode else ())), batch, lkv)
    scale = pick("scale", SCALES, BAD_SCALES)
    out, k = draw_out(pick, q, k, strided_ok=not decode)
    if decode:
        return q, k, v, kv_len, scale, out
    return q, k, v, kv_len, pick("causal", (True, False), (1,)), scale, out


KERNELS = {"prefill": PREFILL, "decode": DECODE}


@pytest.mark.parametrize("fault", ["none", "any", *ASPECTS])
@pytest.mark.parametrize("family", sorted(KERNELS))
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_fast_check_never_accepts_what_the_detailed_checks_refuse(family, fault, data):
    """Drawn calls: the fast check returns None or exactly the detailed checks' facts, device and
    scale; and a valid call of exact tensors with a float or no scale takes the fast path."""
    kernel = KERNELS[family]
    args = draw_call(data.draw, family, fault)
    fast = kernel.fast_check().fn(*args)
    try:
        facts, device, checked = kernel.check_call(args)
    except (TypeError, ValueError) as exc:
        assert fast is None, f"the fast check accepted a call the detailed checks refuse ({exc})"
        return
    scale_position = [a.name for a in kernel.arguments].index("softmax_scale")
    scale = args[scale_position]
    plain = all(type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor))
    plain = plain and (scale is None or type(scale) is float) and (family == "decode" or type(args[4]) is bool)
    if plain:
        assert fast is not None, "a plain valid call missed the fast path"
    if fast is not None:
        assert fast[0] == tuple(facts)
        assert fast[1] == device
        assert fast[2][scale_position] == checked[scale_position]


# ---- the calls the dispatcher sees: public entry points ---------------------------------------------


def _counting(kernel: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record each result of ``kernel``'s fast check (None: the detailed path ran)."""
    fast = kernel.fast_check()
    seen: list[Any] = []

    def fn(*args: Any) -> Any:
        result = fast.fn(*args)
        seen.append(result)
        return result

    monkeypatch.setattr(kernel, "_fast", FastCheck(fn, fast.source))
    return seen


def _no_launch(kernel: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "_launch", lambda *args: None)


def test_an_attention_decode_step_pays_one_fast_check(monkeypatch):
    """``attention`` names decode's caches k and v (``call_named``); a plain step still runs the
    generated check once, as ``decode_attention`` does, and never the detailed checks."""
    seen = _counting(DECODE, monkeypatch)
    _no_launch(DECODE, monkeypatch)
    monkeypatch.setattr(DECODE, "check_call", lambda *args: pytest.fail("the detailed checks ran"))
    q, k = torch.randn(2, 4, 1, 64).to(DEVICE, BF), torch.randn(2, 2, 24, 64).to(DEVICE, BF)
    kv_len = torch.tensor([5, 17], dtype=torch.int32, device=DEVICE)
    attention(q, k, k.clone(), kv_len=kv_len)
    decode_attention(q, k, k.clone(), kv_len)
    assert len(seen) == 2 and seen[0] is not None and seen[0][0] == seen[1][0]


@pytest.mark.parametrize(
    "call",
    [
        lambda q, k, v: prefill_attention(q, k, v, softmax_scale=1),
        lambda q, k, v: prefill_attention(q.as_subclass(Subclass), k, v),
        lambda q, k, v: attention(q, k, v, kv_len=torch.tensor(33, dtype=torch.int32, device=DEVICE), softmax_scale=1),
    ],
    ids=["int-scale", "tensor-subclass", "attention-int-scale"],
)
def test_unusual_valid_calls_are_served_by_the_detailed_path(monkeypatch, call):
    """An int scale or a tensor subclass is valid: the fast check defers and the detailed path serves it."""
    seen = _counting(PREFILL, monkeypatch)
    ran: list[tuple[Any, ...]] = []
    real = PREFILL.check_call
    monkeypatch.setattr(PREFILL, "check_call", lambda *args: ran.append(args) or real(*args))
    _no_launch(PREFILL, monkeypatch)
    monkeypatch.setattr(PREFILL, "_call_op", lambda config, args: None)
    q, k, v = (
        torch.randn(1, 4, 9, 64).to(DEVICE, BF),
        torch.randn(1, 2, 33, 64).to(DEVICE, BF),
        torch.randn(1, 2, 33, 64).to(DEVICE, BF),
    )
    out = call(q, k, v)
    assert seen == [None] and len(ran) == 1 and out.shape == q.shape


def _plain_cases() -> dict[str, Callable[[], tuple[str, tuple[Any, ...]]]]:
    q, kv, dq, dkv = (1, 4, 9, 64), (1, 2, 33, 64), (2, 4, 2, 64), (2, 2, 24, 64)
    lengths = torch.tensor([5, 17], dtype=torch.int32, device=DEVICE)

    def t(shape: tuple[int, ...], layout: str = "contiguous", dtype: torch.dtype = BF) -> torch.Tensor:
        return laid_out(shape, dtype, layout)

    def prefill(q, k, v, kv_len=None, causal=True, scale=None, out=None):
        return "prefill", (q, k, v, kv_len, causal, scale, out)

    def decode(q, k, v, kv_len=lengths, scale=None, out=None):
        return "decode", (q, k, v, kv_len, scale, out)

    fp16_d80 = (2, 3, 7, 80)
    return {
        "prefill-contiguous": lambda: prefill(t(q), t(kv), t(kv)),
        "prefill-fp16-d80": lambda: prefill(t((2, 3, 5, 80), dtype=FP), t(fp16_d80, dtype=FP), t(fp16_d80, dtype=FP)),
        "prefill-kv_len-out": lambda: prefill(
            t(q), t(kv), t(kv), torch.tensor([20], dtype=torch.int32, device=DEVICE), False, 0.3, t(q)
        ),
        "prefill-strided": lambda: prefill(
            t(q, "transposed"), t(kv, "head-strided"), t(kv, "padded"), out=t(q, "misaligned")
        ),
        "prefill-empty-kv": lambda: prefill(t(q), t((1, 2, 0, 64)), t((1, 2, 0, 64))),
        "decode-contiguous": lambda: decode(t((2, 4, 1, 64)), t(dkv), t(dkv)),
        "decode-fp16-lq8-out": lambda: decode(
            t((2, 2, 8, 128), dtype=FP),
            t((2, 1, 9, 128), dtype=FP),
            t((2, 1, 9, 128), dtype=FP),
            scale=0.2,
            out=t((2, 2, 8, 128), "transposed", FP),
        ),
        "decode-padded-kv_len-view": lambda: decode(
            t(dq),
            t(dkv, "padded"),
            t(dkv, "expanded"),
            torch.tensor([5, 0, 17, 0], dtype=torch.int32, device=DEVICE)[::2],
        ),
    }


@pytest.mark.parametrize("case", sorted(_plain_cases()))
def test_plain_calls_of_many_layouts_take_the_fast_path(case):
    family, args = _plain_cases()[case]()
    kernel = KERNELS[family]
    fast = kernel.fast_check().fn(*args)
    assert fast is not None
    assert fast[0] == tuple(kernel.check_call(args)[0])
