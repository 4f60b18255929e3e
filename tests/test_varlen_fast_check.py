"""``varlen_attention``'s generated one-pass check against the detailed checks of its declaration.

A plain eager call is reduced to its facts by the fast check generated from the declaration, and
anything it does not accept goes to the detailed checks, which explain errors. The facts key the
dispatcher's memo, so the two must agree exactly wherever the fast check accepts a call, and the
fast check must never accept a call the detailed checks refuse. Valid calls of every served layout
must take the fast path; calls it defers (an int scale, a tensor subclass) are still served. The
launch is stubbed out: only the host work before it is under test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritune.kernels import declare, dispatcher, varlen_attention
from tritune.kernels.varlen.kernel import KERNEL

BF, FP = torch.bfloat16, torch.float16
#: The GPU when there is one, else CPU tensors on the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Subclass(torch.Tensor):
    """A tensor subclass: the fast check leaves it to the detailed checks."""


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, tuple[Any, ...]]]]:
    """Records ``(route, facts)`` of each dispatch; nothing launches."""
    seen: list[tuple[str, tuple[Any, ...]]] = []
    eager, detailed = dispatcher.dispatch_choice_eager, dispatcher.dispatch_config

    def record_eager(kernel: str, device: torch.device, facts: tuple[Any, ...]) -> Any:
        seen.append(("eager", tuple(facts)))
        return eager(kernel, device, facts)

    def record_detailed(kernel: str, device_type: str, device_index: int, facts: tuple[Any, ...]) -> Any:
        seen.append(("detailed", tuple(facts)))
        return detailed(kernel, device_type, device_index, facts)

    # Where declared calls look them up.
    monkeypatch.setattr(declare, "dispatch_choice_eager", record_eager)
    monkeypatch.setattr(declare, "dispatch_config", record_detailed)
    monkeypatch.setattr(KERNEL, "_launch", lambda config, *args: None)
    yield seen


def bf(*shape: int, dtype: torch.dtype = BF) -> torch.Tensor:
    return torch.randn(shape).to(DEVICE, dtype)


def strided(shape: tuple[int, ...], pad: int, dtype: torch.dtype = BF) -> torch.Tensor:
    """A view of ``shape`` whose last dimension is padded by ``pad`` elements in its buffer."""
    return bf(*shape[:-1], shape[-1] + pad, dtype=dtype)[..., : shape[-1]]


def only_call(served: list[tuple[str, tuple[Any, ...]]], route: str) -> tuple[Any, ...]:
    assert [r for r, _ in served] == [route], served
    return served.pop()[1]


def _detailed_facts(q, k, v, info, **call: Any) -> tuple[Any, ...]:
    return tuple(KERNEL.facts(q, k, v, info, **call))


def _info() -> torch.Tensor:
    return torch.tensor([[0, 3, 0, 10], [3, 1, 1, 7], [4, 0, 2, 0]], dtype=torch.int32, device=DEVICE)


VALID_CALLS: dict[str, Callable[[], dict[str, Any]]] = {
    "contiguous": lambda: dict(q=bf(6, 4, 64), k=bf(16, 3, 2, 64), v=bf(16, 3, 2, 64), seq_info=_info()),
    "fp16-window-ring": lambda: dict(q=bf(6, 2, 128, dtype=FP), k=bf(8, 3, 2, 128, dtype=FP),
                                     v=bf(8, 3, 2, 128, dtype=FP), seq_info=_info(), window=4, ring=True),
    "not-causal-strided": lambda: dict(q=strided((6, 4, 64), 64), k=strided((16, 3, 2, 64), 8), v=bf(16, 3, 2, 64),
                                       seq_info=_info(), causal=False, softmax_scale=0.1),
    "out-given": lambda: dict(q=bf(6, 4, 64), k=bf(16, 3, 2, 64), v=bf(16, 3, 2, 64), seq_info=_info(),
                              out=torch.empty(6, 4, 64, dtype=BF, device=DEVICE)),
    "out-transposed": lambda: dict(q=bf(6, 4, 64), k=bf(16, 3, 2, 64), v=bf(16, 3, 2, 64), seq_info=_info(),
                                   out=torch.empty(4, 6, 64, dtype=BF, device=DEVICE).transpose(0, 1)),
    "seq_info-view": lambda: dict(q=bf(6, 4, 80), k=bf(16, 3, 1, 80), v=bf(16, 3, 1, 80),
                                  seq_info=torch.zeros(3, 8, dtype=torch.int32, device=DEVICE)[:, ::2]),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(VALID_CALLS))
def test_valid_calls_take_the_fast_path_with_the_detailed_facts(served, name):
    call = VALID_CALLS[name]()
    q, k, v, info = call.pop("q"), call.pop("k"), call.pop("v"), call.pop("seq_info")
    out = varlen_attention(q, k, v, info, **call)
    if "out" in call:
        assert out is call["out"]
    assert only_call(served, "eager") == _detailed_facts(q, k, v, info, **{**call, "out": out})


def test_unusual_calls_take_the_detailed_path(served):
    q, k, v = bf(6, 4, 64), bf(16, 3, 2, 64), bf(16, 3, 2, 64)
    info = torch.tensor([[0, 3, 0, 10]], dtype=torch.int32, device=DEVICE)
    varlen_attention(q, k, v, info, softmax_scale=1)
    assert only_call(served, "detailed") == _detailed_facts(q, k, v, info)
    varlen_attention(q, k, v, info.as_subclass(Subclass))
    assert only_call(served, "detailed") == _detailed_facts(q, k, v, info)


def test_zero_tokens_return_before_dispatch(served):
    info = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    out = varlen_attention(bf(0, 4, 64), bf(16, 3, 2, 64), bf(16, 3, 2, 64), info)
    assert out.shape == (0, 4, 64) and served == []


# ---- the property: never accepted where the detailed checks refuse, the same facts where accepted ----


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, layout: str = "contiguous") -> torch.Tensor:
    """A tensor of ``shape`` laid out as asked (the data does not matter: nothing launches)."""
    if layout == "padded":
        return torch.zeros((*shape[:-1], shape[-1] + 8), dtype=dtype, device=DEVICE)[..., : shape[-1]]
    if layout == "inner-strided":
        return torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=dtype, device=DEVICE)[..., ::2]
    if layout == "subclass":
        return torch.zeros(shape, dtype=dtype, device=DEVICE).as_subclass(Subclass)
    if layout == "meta":
        return torch.zeros(shape, dtype=dtype, device="meta")
    assert layout == "contiguous"
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


#: What a drawn call may get wrong (each fault alone is refused, or served by the detailed path).
FAULTS = (
    "q-fp32", "kv-dtype", "no-kv-heads", "gqa", "head-dim-48", "v-head-dim", "no-rows", "no-cols", "v-rows",
    "no-segments", "info-3-fields", "info-rank", "info-int64", "q-inner-stride", "k-inner-stride",
    "v-inner-stride", "q-subclass", "info-subclass", "k-meta", "info-meta", "all-meta", "causal-int", "ring-int",
    "window-0", "window-negative", "window-float", "window-bool", "scale-nan", "scale-inf", "scale-past-bound",
    "scale-huge-int", "scale-int", "scale-bool", "scale-str", "out-zero-stride", "out-is-q", "out-inside-v",
    "out-shape", "out-dtype", "out-subclass", "out-inner-stride",
)  # fmt: skip


@st.composite
def _calls(draw: Any) -> tuple[Any, ...]:
    """A valid call of a drawn shape and layout, then none, one or two faults."""
    faults = draw(st.one_of(st.just(frozenset()), st.frozensets(st.sampled_from(FAULTS), min_size=1, max_size=2)))
    tokens, kv_heads, group = draw(st.integers(0, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    head_dim = 48 if "head-dim-48" in faults else draw(st.sampled_from([64, 80]))
    rows, cols, segments = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    rows, cols = (0 if "no-rows" in faults else rows), (0 if "no-cols" in faults else cols)
    kv_heads = 0 if "no-kv-heads" in faults else kv_heads
    dtype = torch.float32 if "q-fp32" in faults else draw(st.sampled_from([BF, FP]))
    kv_dtype = (FP if dtype == BF else BF) if "kv-dtype" in faults else dtype
    q_heads = kv_heads * group + (1 if "gqa" in faults and kv_heads > 1 else 0)

    def layout(name: str) -> str:
        for fault in ("inner-stride", "subclass", "meta"):
            if f"{name}-{fault}" in faults:
                return {"inner-stride": "inner-strided"}.get(fault, fault)
        return "meta" if "all-meta" in faults else draw(st.sampled_from(["contiguous", "padded"]))

    q = _tensor((tokens, q_heads, head_dim), dtype, layout("q"))
    store = (rows, cols, kv_heads, head_dim)
    k = _tensor(store, kv_dtype, layout("k"))
    v_store = (rows + ("v-rows" in faults), cols, kv_heads, 32 if "v-head-dim" in faults else head_dim)
    v = _tensor(v_store, kv_dtype, layout("v"))
    info_shape = (0 if "no-segments" in faults else segments, 3 if "info-3-fields" in faults else 4)
    info_shape = (4,) if "info-rank" in faults else info_shape
    info = _tensor(info_shape, torch.int64 if "info-int64" in faults else torch.int32, layout("info"))
    causal = 1 if "causal-int" in faults else draw(st.booleans())
    ring = 0 if "ring-int" in faults else draw(st.booleans())
    windows = {"window-0": 0, "window-negative": -2, "window-float": 2.5, "window-bool": True}
    window = next((windows[f] for f in faults if f in windows), draw(st.sampled_from([None, 1, 7])))
    scales = {"scale-nan": math.nan, "scale-inf": -math.inf, "scale-past-bound": 1e4 * (1 + 1e-9),
              "scale-huge-int": 10**400, "scale-int": 2, "scale-bool": True, "scale-str": "0.1"}  # fmt: skip
    scale = next((scales[f] for f in faults if f in scales), draw(st.sampled_from([None, 0.0, -0.3, 1e4, -1e4])))
    shape = tuple(q.shape)
    out: Any = draw(st.sampled_from(["none", "fresh", "transposed", "padded"]))
    if "out-zero-stride" in faults:
        out = torch.empty(1, *shape[1:], dtype=dtype, device=DEVICE).expand(shape)
    elif "out-is-q" in faults:
        out = q
    elif "out-inside-v" in faults and v.numel() >= math.prod(shape) and v.is_contiguous():
        out = v.view(-1)[: math.prod(shape)].view(shape)
    elif "out-shape" in faults:
        out = torch.empty(*shape[:-1], shape[-1] + 1, dtype=dtype, device=DEVICE)
    elif "out-dtype" in faults:
        out = torch.empty(shape, dtype=torch.float32 if dtype != torch.float32 else BF, device=DEVICE)
    elif "out-subclass" in faults:
        out = _tensor(shape, dtype, "subclass")
    elif "out-inner-stride" in faults:
        out = _tensor(shape, dtype, "inner-strided")
    elif out == "transposed":
        out = torch.empty(shape[1], shape[0], shape[2], dtype=dtype, device=DEVICE).transpose(0, 1)
    else:
        out = None if out == "none" else _tensor(shape, dtype, "contiguous" if out == "fresh" else out)
    return q, k, v, info, causal, window, ring, scale, out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=_calls())
def test_the_fast_check_never_accepts_what_the_detailed_checks_refuse(args):
    """Drawn calls, most of them wrong in one or more ways: the fast check returns None or exactly
    the detailed checks' facts, device and resolved arguments."""
    fast = KERNEL.fast_check().fn(*args)
    try:
        facts, device, checked = KERNEL.check_call(args)
        if device.type == "meta":
            raise ValueError("q: meta tensors have nowhere to run")
    except (TypeError, ValueError) as exc:
        assert fast is None, f"the fast check accepted a call the detailed checks refuse ({exc}): {fast}"
        return
    if fast is None:
        return
    fast_facts, fast_device, fast_args = fast
    assert fast_facts == tuple(facts)
    assert fast_device == device
    names = [a.name for a in KERNEL.arguments]
    for name, mine, theirs in zip(names[:-1], fast_args[:-1], checked[:-1], strict=True):
        # The same tensors, and the scalars as the launch receives them (softmax_scale resolved).
        same = mine is theirs if isinstance(mine, torch.Tensor) else mine == theirs and type(mine) is type(theirs)
        assert same, name
    given_out = args[-1]
    if given_out is not None:
        assert fast_args[-1] is given_out and checked[-1] is given_out
    else:
        assert fast_args[-1].shape == checked[-1].shape and fast_args[-1].dtype == checked[-1].dtype


def test_the_rules_and_the_default_scale_are_written_in_place():
    """No Python call per rule: the generated check holds the declaration's lambdas as expressions."""
    source = KERNEL.fast_check().source
    assert "_rule" not in source and "_resolve" not in source
    assert "if not (Hkv > 0 and Hq % Hkv == 0): return None" in source
    # One allowed dtype is one identity test.
    assert "if seq_info.dtype is not _dtype" in source
