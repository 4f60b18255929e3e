"""``q4k_linear``'s argument checks: the generated fast check and the detailed checks agree.

The declaration (``kernels/q4k/kernel.py``) gives both: the one-pass check a plain eager call
pays, and the detailed checks that name the argument. The fast check may defer a valid call to
the detailed ones (a tensor subclass, ``torch.compile``), never accept one they refuse, and its
facts are the dispatcher's memo key, so they must be exactly the detailed facts. No kernel runs
here: the checks and the facts are the whole subject.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritune.kernels import Q4KWeight
from tritune.kernels.q4k.kernel import KERNEL

BF, FP = torch.bfloat16, torch.float16
N, K = 32, 512
#: The GPU when there is one (where CPU tensors are refused), else CPU tensors on the interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Subclass(torch.Tensor):
    """A tensor subclass: the fast check leaves it to the detailed checks."""


def _weight(n: int = N, k: int = K) -> Q4KWeight:
    u8 = {"dtype": torch.uint8, "device": DEVICE}
    return Q4KWeight(
        torch.zeros(n, k // 2, **u8),
        torch.zeros(n, k // 32, **u8),
        torch.zeros(n, k // 32, **u8),
        torch.zeros(n, k // 256, 2, dtype=torch.float16, device=DEVICE),
    )


WEIGHT = _weight()


def bf(*shape: int, dtype: torch.dtype = BF) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE).to(dtype)


def _both(x: Any, weight: Any, bias: Any = None, out: Any = None) -> tuple[Any, Any]:
    """(the fast check's result, the detailed checks' result or the exception they raise)."""
    args = (x, weight, bias, out)
    fast = KERNEL.fast_check().fn(*args)
    try:
        detailed: Any = KERNEL.check_call(args)
    except (TypeError, ValueError) as exc:
        detailed = exc
    return fast, detailed


@pytest.mark.parametrize(
    ("call", "facts"),
    [
        (lambda: {"x": bf(3, K)}, (3, N, K, "bf16")),
        (lambda: {"x": bf(2, 3, K, dtype=FP), "bias": torch.zeros(N, device=DEVICE)}, (6, N, K, "fp16")),
        (lambda: {"x": bf(K)}, (1, N, K, "bf16")),
        (lambda: {"x": bf(0, K)}, (0, N, K, "bf16")),
        (lambda: {"x": bf(5, K), "out": torch.empty(5, N, dtype=BF, device=DEVICE)}, (5, N, K, "bf16")),
        (lambda: {"x": bf(5, K + 8)[:, :K]}, (5, N, K, "bf16")),
        (lambda: {"x": bf(K, 4).t()}, (4, N, K, "bf16")),
        (lambda: {"x": bf(3, K), "bias": bf(2 * N)[::2]}, (3, N, K, "bf16")),
    ],
    ids=["2d", "3d-fp16-bias", "1d", "no-rows", "out-given", "row-stride", "inner-stride", "bias-view"],
)
def test_the_fast_facts_are_the_detailed_facts(call, facts):
    fast, detailed = _both(weight=WEIGHT, **call())
    assert fast is not None and not isinstance(detailed, Exception)
    assert fast[0] == tuple(detailed[0]) == facts
    assert fast[1] == detailed[1] == DEVICE
    # The output the check allocates has x's leading dims and the weight's N.
    assert fast[2][3].shape == detailed[2][3].shape


def test_a_tensor_subclass_takes_the_detailed_checks():
    x = bf(3, K)
    fast, detailed = _both(x.as_subclass(Subclass), WEIGHT)
    assert fast is None
    assert tuple(detailed[0]) == (3, N, K, "bf16")


def test_an_output_inside_the_weight_is_refused_by_both():
    """The weight is an object of four tensors: an ``out`` over any of them is refused, by the fast
    check (it defers) and the detailed checks (naming the tensor)."""
    for part in ("qs", "scales", "mins", "super_scales"):
        tensor = getattr(WEIGHT, part)
        out = tensor.view(-1)[: tensor.numel() // 2 * 2].view(BF)[: 3 * N].view(3, N)
        fast, detailed = _both(bf(3, K), WEIGHT, out=out)
        assert fast is None, part
        assert isinstance(detailed, ValueError) and str(detailed).startswith(f"out: overlaps weight.{part}"), part


_X_SHAPES = {"rows": (3, K), "batched": (2, 2, K), "vector": (K,), "no-rows": (0, K), "short-k": (3, K - 256),
             "scalar": ()}  # fmt: skip
#: Per argument: the choices a valid call draws from, then those the detailed checks refuse.
_CHOICES: dict[str, tuple[list[Any], list[Any]]] = {
    "x_shape": (["rows", "batched", "vector", "no-rows"], ["short-k", "scalar"]),
    "x_layout": (["contiguous", "row-padded", "inner-strided", "subclass"], []),
    "dtype": ([BF, FP], [torch.float32, torch.int8]),
    "weight": (["weight"], ["narrow", "tensor", "none"]),
    "bias": (["none", "fp32", "bf16-view"], ["int", "wide", "matrix", "list", "meta"]),
    "out": (["none", "fresh", "beside-x"], ["wrong-shape", "fp16", "strided", "expanded", "is-x", "inside-bias",
                                            "inside-qs", "meta"]),
}  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fault=st.sampled_from(["none", *_CHOICES, "any"]), data=st.data())
def test_the_fast_check_never_accepts_what_the_detailed_checks_refuse(fault, data):
    """Drawn calls, valid or with one argument (or any number) wrong: the fast check returns None
    or exactly the detailed facts."""
    drawn = {
        name: data.draw(st.sampled_from(valid + invalid if fault in (name, "any") else valid), label=name)
        for name, (valid, invalid) in _CHOICES.items()
        if valid + invalid
    }
    x_shape, x_layout, dtype, weight, bias, out = (drawn[name] for name in _CHOICES)
    shape = _X_SHAPES[x_shape]
    lead, rows = shape[:-1], torch.Size(shape[:-1]).numel()
    floating = dtype.is_floating_point
    # x at the start of a buffer whose end can hold an output beside it.
    storage = (
        torch.randn(4096 + 4 * N, device=DEVICE).to(dtype)
        if floating
        else torch.ones(4096 + 4 * N, dtype=dtype, device=DEVICE)
    )
    x = storage[: torch.Size(shape).numel()].view(shape) if shape else storage[0]
    if x_layout == "row-padded" and len(shape) == 2:
        x = torch.empty(shape[0], shape[1] + 8, dtype=dtype, device=DEVICE)[:, : shape[1]]
    elif x_layout == "inner-strided" and shape:
        x = torch.empty(*lead, 2 * shape[-1], dtype=dtype, device=DEVICE)[..., ::2]
    elif x_layout == "subclass":
        x = x.as_subclass(Subclass)
    weight_value = {
        "weight": WEIGHT,
        "narrow": _weight(N, K - 256),
        "tensor": torch.zeros(N, K, device=DEVICE),
        "none": None,
    }[weight]
    bias_value: Any = {
        "none": None,
        "fp32": torch.zeros(N, device=DEVICE),
        "bf16-view": bf(2 * N)[::2],
        "int": torch.zeros(N, dtype=torch.int32, device=DEVICE),
        "wide": torch.zeros(N + 1, device=DEVICE),
        "matrix": torch.zeros(1, N, device=DEVICE),
        "list": [0.0] * N,
        "meta": torch.zeros(N, device="meta"),
    }[bias]
    out_dtype = dtype if floating else BF
    out_value: Any = None
    if out == "fresh":
        out_value = torch.empty(*lead, N, dtype=out_dtype, device=DEVICE)
    elif out == "wrong-shape":
        out_value = torch.empty(*lead, N + 1, dtype=out_dtype, device=DEVICE)
    elif out == "fp16":
        out_value = torch.empty(*lead, N, dtype=FP, device=DEVICE)
    elif out == "strided":
        out_value = torch.empty(*lead, 2 * N, dtype=out_dtype, device=DEVICE)[..., ::2]
    elif out == "expanded":
        out_value = torch.empty(N, dtype=out_dtype, device=DEVICE).expand(*lead, N)
    elif out == "is-x":
        out_value = x
    elif out == "inside-bias" and bias in ("fp32", "bf16-view"):
        # The bias and out share a buffer, out starting halfway through the bias.
        shared = torch.zeros(N + rows * N, dtype=out_dtype, device=DEVICE)
        bias_value, out_value = shared[:N], shared[N // 2 : N // 2 + rows * N].view(*lead, N)
    elif out == "inside-qs" and out_dtype == BF:
        out_value = WEIGHT.qs.view(-1)[: 2 * rows * N].view(BF).view(*lead, N)
    elif out == "beside-x" and floating and rows <= 4:
        out_value = storage[4096 : 4096 + rows * N].view(*lead, N)
    elif out == "meta":
        out_value = torch.empty(*lead, N, dtype=out_dtype, device="meta")
    fast, detailed = _both(x, weight_value, bias_value, out_value)
    if isinstance(detailed, Exception):
        assert fast is None, f"the fast check accepted a call the detailed checks refuse ({detailed}): {fast[0]}"
        return
    if fast is not None:
        assert fast[0] == tuple(detailed[0])
        assert fast[1] == detailed[1]
