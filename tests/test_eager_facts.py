"""The one-pass checks of plain eager calls give the detailed checks' facts, and defer everything else.

Every public entry point reduces a plain eager call to its facts in one pass over the tensors'
attributes (the per-call host cost the dispatcher promises to keep small), and hands anything unusual to the detailed
checks, which explain errors (``test_fuzz_inputs.py`` throws bad arguments at the public functions).
Here: for valid calls of many layouts, the fast path must be the one taken and its facts must be
exactly what the detailed path computes, since the facts key the dispatcher's memo; and calls the
fast path does not take (an int scale, a tensor subclass) must still be served, by the detailed path.
The launch is stubbed out: only the host work before it is under test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tritune.kernels import (
    Q4KWeight,
    dispatcher,
    q4k_linear,
)
from tritune.kernels._oplib import TritonOp
from tritune.kernels.q4k import op as q4k_op
from tritune.kernels.q4k.spec import SPEC as Q4K

BF, FP = torch.bfloat16, torch.float16


class Subclass(torch.Tensor):
    """A tensor subclass: the fast paths leave it to the detailed checks."""


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, tuple[Any, ...]]]]:
    """Records ``(route, facts)`` of each dispatch of the four ops; nothing launches."""
    seen: list[tuple[str, tuple[Any, ...]]] = []

    def eager(kernel: str, device: torch.device, facts: tuple[Any, ...]) -> tuple[Any, ...]:
        seen.append(("eager", facts))
        return dispatcher.dispatch_eager(kernel, device, facts)

    def detailed(kernel: str, device_type: str, device_index: int, facts: tuple[Any, ...]) -> tuple[Any, ...]:
        seen.append(("detailed", facts))
        return dispatcher.dispatch(kernel, device_type, device_index, facts)

    for module in (q4k_op,):
        monkeypatch.setattr(module, "dispatch_eager", eager)
        monkeypatch.setattr(module, "dispatch", detailed)
    monkeypatch.setattr(TritonOp, "__call__", lambda self, *args: None)
    yield seen


def bf(*shape: int, dtype: torch.dtype = BF) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def strided(shape: tuple[int, ...], pad: int, dtype: torch.dtype = BF) -> torch.Tensor:
    """A view of ``shape`` whose last dimension is padded by ``pad`` elements in its buffer."""
    return bf(*shape[:-1], shape[-1] + pad, dtype=dtype)[..., : shape[-1]]


def misaligned(shape: tuple[int, ...], dtype: torch.dtype = BF) -> torch.Tensor:
    """A contiguous view whose base is one element (2 bytes) past a 16-byte boundary."""
    return bf(math.prod(shape) + 1, dtype=dtype)[1:].view(shape)


def only_call(served: list[tuple[str, tuple[Any, ...]]], route: str) -> tuple[Any, ...]:
    assert [r for r, _ in served] == [route], served
    return served.pop()[1]


# ---- q4k -------------------------------------------------------------------------------------


def _weight(n: int = 32, k: int = 512) -> Q4KWeight:
    u8 = dict(dtype=torch.uint8)
    return Q4KWeight(
        torch.zeros(n, k // 2, **u8),
        torch.zeros(n, k // 32, **u8),
        torch.zeros(n, k // 32, **u8),
        torch.zeros(n, k // 256, 2, dtype=torch.float16),
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda w: dict(x=bf(3, 512)),
        lambda w: dict(x=bf(2, 3, 512, dtype=FP), bias=torch.zeros(32)),
        lambda w: dict(x=bf(512)),
        lambda w: dict(x=bf(5, 512), out=torch.empty(5, 32, dtype=BF)),
        lambda w: dict(x=strided((5, 512), 8)),
        lambda w: dict(x=bf(512, 4).t()),
    ],
    ids=["2d", "3d-fp16-bias", "1d", "out-given", "row-stride", "inner-stride"],
)
def test_q4k_eager_facts_are_the_detailed_facts(served, make):
    weight = _weight()
    call = make(weight)
    x = call.pop("x")
    out = q4k_linear(x, weight, **call)
    assert out.shape == (*x.shape[:-1], 32)
    facts = only_call(served, "eager")
    assert facts == tuple(Q4K.facts(x.reshape(-1, 512), weight, call.get("bias")))


def test_q4k_tensor_subclass_takes_the_detailed_path(served):
    weight, x = _weight(), bf(3, 512)
    q4k_linear(x.as_subclass(Subclass), weight)
    assert only_call(served, "detailed") == tuple(Q4K.facts(x, weight))


# ---- out memory and the scale bound: the fast paths defer exactly what the detailed checks refuse ----

SCALES = [None, 0.0, -0.3, 1e4, -1e4, 1e4 * (1 + 1e-9), -3e38, float("nan"), float("inf")]


def _outs(shape: tuple[int, ...], inputs: dict[str, torch.Tensor], into: str) -> Callable[[str], torch.Tensor | None]:
    """``make(case)``: an out of ``shape`` (last dim 64), separate from ``inputs`` or not; the
    ``*-an-input`` cases first move ``inputs[into]`` into a storage that out then shares."""
    dtype = inputs["q"].dtype

    def shared(offset: Callable[[int], int]) -> torch.Tensor:
        t, size = inputs[into], math.prod(shape)
        storage = torch.randn(2 * (t.numel() + size)).to(dtype)
        inputs[into] = storage[: t.numel()].view(t.shape)
        start = offset(t.numel())
        return storage[start : start + size].view(shape)

    def make(case: str) -> torch.Tensor | None:
        if case == "none":
            return None
        if case == "fresh":
            return torch.empty(shape, dtype=dtype)
        if case == "transposed":
            return torch.empty((*shape[:-3], shape[-2], shape[-3], shape[-1]), dtype=dtype).transpose(-2, -3)
        if case == "padded":
            return torch.empty((*shape[:-1], 128), dtype=dtype)[..., :64]
        if case == "zero-stride":
            return torch.empty((*shape[:-2], 1, shape[-1]), dtype=dtype).expand(shape)
        if case == "is-q":
            return inputs["q"]
        if case == "inside-an-input":
            return shared(lambda n: n // 2)
        assert case == "beside-an-input"
        return shared(lambda n: n)

    return make


OUT_CASES = ["none", "fresh", "transposed", "padded", "zero-stride", "is-q", "inside-an-input", "beside-an-input"]


def _in_step(fast: Callable[[], Any], detailed: Callable[[], Any], valid: bool) -> None:
    """The fast path returns the detailed facts, or None; None whenever the detailed checks refuse."""
    facts = fast()
    try:
        expected = detailed()
    except (TypeError, ValueError) as exc:
        assert facts is None, f"the fast path accepted what the detailed checks refuse: {exc}"
        assert not valid, f"refused: {exc}"
        return
    assert valid, "accepted an out sharing memory or a scale past the bound"
    # Plain valid calls must keep the fast path.
    assert facts == tuple(expected)


def _valid(out_case: str, scale: float | None) -> bool:
    scale_ok = scale is None or abs(scale) <= 1e4
    return scale_ok and out_case in ("none", "fresh", "transposed", "padded", "beside-an-input")


@pytest.mark.parametrize("out_case", ["none", "fresh", "is-x", "inside-x", "beside-x", "inside-bias", "inside-qs"])
def test_q4k_fast_path_defers_what_the_detailed_checks_refuse(out_case):
    weight, x, bias = _weight(), bf(4, 512), bf(32)
    storage = bf(200 + 4 * 512)
    out: torch.Tensor | None = None
    if out_case == "fresh":
        out = torch.empty(4, 32, dtype=BF)
    elif out_case == "is-x":
        out = x.view(-1)[:128].view(4, 32)
    elif out_case == "inside-x":
        out = x.view(-1)[1000:1128].view(4, 32)
    elif out_case == "beside-x":
        x, out = storage[:2048].view(4, 512), storage[2048:2176].view(4, 32)
    elif out_case == "inside-bias":
        bias, out = storage[:32], storage[16:144].view(4, 32)
    elif out_case == "inside-qs":
        out = weight.qs.view(-1)[:256].view(BF).view(4, 32)

    def detailed() -> tuple[Any, ...]:
        q4k_op._check(x, weight, bias, out)
        return tuple(Q4K.facts(x, weight, bias))

    _in_step(
        lambda: q4k_op._eager_facts(x, weight, bias, out),
        detailed,
        out_case in ("none", "fresh", "beside-x"),
    )
