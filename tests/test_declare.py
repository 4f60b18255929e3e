"""The declaration API: one declaration gives checks that cannot disagree, an op, dispatch and facts."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritune.kernels import use_config
from tritune.kernels.declare import Derived, Kernel, Obj, Output, Rule, Scalar, Tensor
from tritune.kernels.spec import TuningKey, pow2_bucket
from tritune.search_spaces.base import SearchSpace, choice

# The kernel declared here launches on CPU tensors: the framework's host logic is the point.
pytestmark = pytest.mark.interpreter


@triton.jit
def _scaled_add_kernel(X, Y, Lo, Out, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask)
    y = tl.load(Y + offs % tl.load(Lo), mask=mask)
    tl.store(Out + offs, x * alpha + y, mask=mask)


class Table:
    """A non-tensor argument: one tensor and its length, as a packed weight would be."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values
        self.shape = tuple(values.shape)
        self.device = values.device


@dataclasses.dataclass(frozen=True)
class AddConfig:
    BLOCK: int = choice(16, (16, 32, 64))


@dataclasses.dataclass(frozen=True)
class AddKey(TuningKey):
    dtype: str
    rows_bucket: int
    flag: bool

    BUCKETS: ClassVar[tuple[str, ...]] = ("rows_bucket",)


def _launch(
    config: AddConfig,
    x: torch.Tensor,
    table: Table,
    lo: torch.Tensor | None,
    alpha: float,
    flag: bool,
    out: torch.Tensor,
) -> None:
    y = table.values.expand(x.shape).contiguous()
    lengths = torch.full((1,), y.numel(), dtype=torch.int32, device=x.device) if lo is None else lo.reshape(1)
    n = x.numel()
    _scaled_add_kernel[(triton.cdiv(n, config.BLOCK),)](x.contiguous(), y, lengths, out, n, alpha, BLOCK=config.BLOCK)


def _reference(x: torch.Tensor, table: Table, lo: torch.Tensor | None, alpha: float | None, flag: bool) -> torch.Tensor:
    scale = alpha if alpha is not None else 1.0 / x.shape[-1]
    return x.double() * scale + table.values.double().expand(x.shape)


KERNEL = Kernel(
    "test_scaled_add",
    arguments=[
        Tensor("x", ("*M", "H", "N"), dtypes=(torch.float32, torch.float16)),
        Obj("table", Table, ("H", "N"), parts=("values",), split=lambda t: (t.values,), join=Table),
        Tensor("lo", shapes=((), ("H",)), dtypes=(torch.int32,), optional=True),
        Scalar("alpha", float, optional=True, bounds=(-100.0, 100.0), resolve=lambda N: 1.0 / N),
        Scalar("flag", bool, default=False),
        Output("out", like="x"),
    ],
    rules=[Rule("x", lambda H, N: H <= N, "{H} rows of the table exceed its {N} columns")],
    derived=[Derived("contiguous", lambda x, out: x.is_contiguous() and out.is_contiguous())],
    facts=("dtype", "M", "H", "N", "flag", "has_lo", "contiguous"),
    space=SearchSpace("test_scaled_add", AddConfig),
    key_type=AddKey,
    key=lambda device, f: AddKey(device.arch, device.sm_count, f.dtype, pow2_bucket(f.M, 1), f.flag),
    launch=_launch,
    reference=_reference,
    jit_kernels=(_scaled_add_kernel,),
    protocol=1,
)


def _call(**changes: Any) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 8, generator=gen)
    values = {
        "x": x,
        "table": Table(torch.randn(2, 8, generator=gen)),
        "lo": None,
        "alpha": 0.5,
        "flag": False,
        "out": None,
    }
    values.update(changes)
    return tuple(values[a.name] for a in KERNEL.arguments)


def test_a_call_matches_its_reference_and_fills_a_poisoned_output():
    args = _call()
    out = torch.full_like(args[0], float("nan"))
    result = KERNEL.call(*args[:-1], out)
    assert result is out
    expected = _reference(*args[:-1])
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["fast", "checked"])
def test_tensors_on_another_device_launch_with_it_current(monkeypatch, path):
    """Triton launches on the current device: a call whose tensors are on another one launches
    inside the context that makes their device current (both the fast and the checked way), and
    its layout is never remembered for an early replay, which would launch on the current one."""
    from tritune.kernels import declare

    inside: list[bool] = [False]
    entered: list[torch.device] = []

    class Current:
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def __enter__(self) -> None:
            entered.append(self.device)
            inside[0] = True

        def __exit__(self, *exc: object) -> None:
            inside[0] = False

    # Stands in for tensors on another GPU: every call's device is "another" until made current.
    monkeypatch.setattr(declare, "make_current", lambda device: None if inside[0] else Current(device))
    launched_inside: list[bool] = []
    run_unwrapped, call_op = declare.run_unwrapped, KERNEL._call_op

    def spy_run(*a: Any, **k: Any) -> Any:
        launched_inside.append(inside[0])
        return run_unwrapped(*a, **k)

    def spy_op(*a: Any, **k: Any) -> Any:
        launched_inside.append(inside[0])
        return call_op(*a, **k)

    monkeypatch.setattr(declare, "run_unwrapped", spy_run)
    monkeypatch.setattr(KERNEL, "_call_op", spy_op)
    remembered: list[Any] = []
    monkeypatch.setattr(declare.LaunchPlans, "remember_early", lambda self, *a: remembered.append(a))
    if path == "checked":
        monkeypatch.setattr(KERNEL, "_fast", type("Refuse", (), {"fn": staticmethod(lambda *a: None)})())
    args = _call()
    for _ in range(3):
        out = torch.full_like(args[0], float("nan"))
        assert KERNEL.call(*args[:-1], out) is out
        torch.testing.assert_close(out.double(), _reference(*args[:-1]), rtol=1e-6, atol=1e-6)
    assert launched_inside and all(launched_inside), launched_inside
    assert entered == [args[0].device] * 3
    assert not remembered, "a call on another device was remembered for an early replay"


def test_none_resolves_from_the_dims_and_keywords_bind_by_name():
    x, table = _call()[:2]
    out = KERNEL(x, table, alpha=None)
    torch.testing.assert_close(out.double(), _reference(x, table, None, None, False), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"x": "not a tensor"}, TypeError, r"^x: expected a torch.Tensor"),
        ({"x": torch.randn(3, 2, 8, dtype=torch.float64)}, TypeError, r"^x: expected dtype torch.float32 or torch"),
        ({"x": torch.randn(8)}, ValueError, r"^x: expected shape \[\.\.\., H, N\]"),
        ({"table": Table(torch.randn(2, 9))}, ValueError, r"^table: expected shape \[H=2, N=8\].*N is 9 where x has"),
        ({"table": torch.randn(2, 8)}, TypeError, r"^table: expected a Table"),
        ({"lo": torch.ones(3, dtype=torch.int32)}, ValueError, r"^lo: expected shape \[\] or \[H=2\]"),
        ({"lo": torch.ones(2, dtype=torch.int64)}, TypeError, r"^lo: expected dtype torch.int32"),
        ({"alpha": 1e9}, ValueError, r"^alpha: expected a number with \|alpha\| <= 100"),
        ({"alpha": float("nan")}, ValueError, r"^alpha: expected"),
        ({"alpha": 10**400}, ValueError, r"^alpha: expected"),
        ({"alpha": True}, TypeError, r"^alpha: expected a float or None, got bool"),
        ({"flag": 1}, TypeError, r"^flag: expected a bool, got int"),
        ({"x": torch.randn(3, 9, 8), "table": Table(torch.randn(9, 8))}, ValueError, r"^x: 9 rows of the table"),
        ({"out": torch.empty(3, 2, 7)}, ValueError, r"^out: expected shape \(3, 2, 8\)"),
        ({"out": torch.empty(3, 2, 8, dtype=torch.float16)}, TypeError, r"^out: expected dtype torch.float32"),
        ({"out": torch.empty(1, 2, 8).expand(3, 2, 8)}, ValueError, r"^out: some of its elements share memory"),
    ],
    ids=[
        "not-tensor",
        "dtype",
        "rank",
        "dim-clash",
        "obj-type",
        "alternatives",
        "optional-dtype",
        "bounds",
        "nan",
        "huge-int",
        "bool-for-float",
        "int-for-bool",
        "rule",
        "out-shape",
        "out-dtype",
        "out-overlap",
    ],
)
def test_errors_name_the_argument(changes: dict[str, Any], error: type[Exception], match: str) -> None:
    args = _call(**changes)
    assert KERNEL.fast_check().fn(*args) is None
    with pytest.raises(error, match=match):
        KERNEL.call(*args)


def test_an_output_aliasing_an_input_is_refused():
    args = _call()
    with pytest.raises(ValueError, match=r"^out: overlaps x"):
        KERNEL.call(*args[:-1], args[0])


_shapes = st.tuples(st.integers(0, 3), st.integers(1, 3), st.integers(1, 9))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=_shapes,
    table_shape=st.sampled_from(["same", "wide", "flat"]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.float64]),
    lo=st.sampled_from(["none", "scalar", "per-row", "long", "bad"]),
    alpha=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-200, 200), st.booleans()),
    flag=st.sampled_from([False, True, 0]),
    out=st.sampled_from(["none", "fresh", "transposed", "wrong-shape", "expanded", "alias"]),
)
def test_the_fast_check_never_accepts_what_the_detailed_checks_refuse(shape, table_shape, dtype, lo, alpha, flag, out):
    """Generated calls: the one-pass check returns None or exactly the detailed path's facts."""
    m, h, n = shape
    x = torch.randn(m, h, n).to(dtype)
    table = Table(torch.randn({"same": (h, n), "wide": (h, n + 1), "flat": (n,)}[table_shape]).to(dtype))
    lo_value = {
        "none": None,
        "scalar": torch.tensor(n, dtype=torch.int32),
        "per-row": torch.ones(h, dtype=torch.int32),
        "long": torch.ones(h, dtype=torch.int64),
        "bad": torch.ones(h + 1, dtype=torch.int32),
    }[lo]
    out_value = {
        "none": None,
        "fresh": torch.empty_like(x),
        "transposed": torch.empty(n, h, m, dtype=dtype).permute(2, 1, 0),
        "wrong-shape": torch.empty(m, h, n + 1, dtype=dtype),
        "expanded": torch.empty(1, h, n, dtype=dtype).expand(m, h, n),
        "alias": x,
    }[out]
    args = (x, table, lo_value, alpha, flag, out_value)
    fast = KERNEL.fast_check().fn(*args)
    try:
        facts, device, checked = KERNEL.check_call(args)
    except (TypeError, ValueError):
        assert fast is None, f"the fast check accepted a call the detailed checks refuse: {fast}"
        return
    if fast is not None:
        assert fast[0] == tuple(facts)
        assert fast[1] == device
        assert fast[2][3] == checked[3]  # the resolved scalar


def test_the_schema_carries_config_fields_by_name_and_opcheck_passes():
    assert KERNEL.schema() == (
        "(Tensor x, Tensor table_values, Tensor? lo, float alpha, bool flag, Tensor(a!) out, *, int BLOCK) -> ()"
    )
    x, table = _call()[:2]
    torch.library.opcheck(KERNEL.op, (x, table.values, None, 0.5, False, torch.empty_like(x)), {"BLOCK": 32})


def test_a_pinned_config_serves_and_the_output_version_moves():
    args = _call()
    out = torch.empty_like(args[0])
    before = out._version
    with use_config("test_scaled_add", {"BLOCK": 64}):
        KERNEL.call(*args[:-1], out)
    assert out._version > before
    torch.testing.assert_close(out.double(), _reference(*args[:-1]), rtol=1e-6, atol=1e-6)


def test_torch_compile_traces_the_op():
    x, table = _call()[:2]

    @torch.compile(fullgraph=True, backend="eager")
    def step(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return KERNEL.call(x, Table(values), None, 0.5, False, None)

    torch.testing.assert_close(step(x, table.values).double(), _reference(x, table, None, 0.5, False))


def test_facts_and_key_come_from_the_declaration():
    facts = KERNEL.facts(*_call()[:-1])
    assert facts == ("fp32", 3, 2, 8, False, False, True)
    assert facts.M == 3 and facts.has_lo is False


def test_a_key_declared_without_postponed_annotations_reads_back_from_a_file():
    """A user's key module need not use ``from __future__ import annotations``: its field types are types."""
    key_type = dataclasses.make_dataclass(
        "PlainKey", [("dtype", str), ("n_bucket", int)], bases=(TuningKey,), frozen=True
    )
    key = key_type(arch="sm90", sm_count=132, dtype="bf16", n_bucket=1024)
    assert key_type.from_dict(key.to_dict()) == key
    with pytest.raises(ValueError, match="n_bucket='1024': expected int"):
        key_type.from_dict({**key.to_dict(), "n_bucket": "1024"})


def test_a_prepared_launch_checks_once_and_then_only_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner times ``prepare``'s function: a timed call must not pay the argument checks again."""
    args = _call()
    checks: list[int] = []
    original = KERNEL.check_call
    monkeypatch.setattr(KERNEL, "check_call", lambda *a, **k: checks.append(1) or original(*a, **k))
    out = torch.full_like(args[0], float("nan"))
    run = KERNEL.prepare(AddConfig(BLOCK=32), *args[:-1], out=out)
    for _ in range(3):
        assert run() is out
    assert checks == [1]
    torch.testing.assert_close(out.double(), _reference(*args[:-1]), rtol=1e-6, atol=1e-6)


def _small_kernel(
    name: str, arguments: list[Any], launch: Any, reference: Any, facts: tuple[str, ...] = ("dtype", "N")
) -> Kernel:
    """A kernel on ``AddConfig``'s space keyed by its first fact after the dtype: for declaring one
    argument pattern per test."""
    size = facts[1]
    return Kernel(
        name,
        arguments=arguments,
        facts=facts,
        space=SearchSpace(name, AddConfig),
        key_type=AddKey,
        key=lambda device, f: AddKey(device.arch, device.sm_count, f.dtype, pow2_bucket(getattr(f, size), 1), False),
        launch=launch,
        reference=reference,
        jit_kernels=(_scaled_add_kernel,),
        protocol=1,
    )


def _scale_launch(config: AddConfig, x: torch.Tensor, alpha: float, count: int, out: torch.Tensor) -> None:
    out.copy_(x * alpha)


UNBOUNDED = _small_kernel(
    "test_unbounded_scalars",
    [Tensor("x", ("N",), dtypes=(torch.float32,)), Scalar("alpha", float), Scalar("count", int, default=1),
     Output("out", like="x")],
    _scale_launch,
    lambda x, alpha, count: x.double() * alpha,
)  # fmt: skip


@pytest.mark.parametrize(
    ("alpha", "count", "match"),
    [
        (float("nan"), 1, r"^alpha: expected a number other than NaN, got nan"),
        (
            2.0,
            2**63,
            r"^count: expected an int in \[-9223372036854775808, 9223372036854775807\], got 9223372036854775808",
        ),
        (2.0, -(2**63) - 1, r"^count: expected an int in \["),
    ],
    ids=["nan-float", "int-above-int64", "int-below-int64"],
)
def test_unbounded_scalars_are_held_to_what_the_op_takes_by_both_checks(alpha, count, match):
    """A float scalar without bounds still refuses NaN, and an int one is held to int64 (the op's
    schema type): the one-pass check defers such a call and the detailed check names the argument."""
    x = torch.randn(8)
    assert UNBOUNDED.fast_check().fn(x, alpha, count, None) is None
    with pytest.raises(ValueError, match=match):
        UNBOUNDED(x, alpha, count)
    out = torch.full_like(x, float("nan"))
    assert UNBOUNDED(x, 2.0, 2**63 - 1, out) is out  # the largest int64 passes both checks
    torch.testing.assert_close(out.double(), x.double() * 2.0, rtol=0, atol=4 * torch.finfo(x.dtype).eps)


FLOATING_FIRST = _small_kernel(
    "test_floating_first",
    [Tensor("x", ("N",), floating=True), Scalar("alpha", float), Scalar("count", int, default=1),
     Output("out", like="x")],
    _scale_launch,
    lambda x, alpha, count: x.double() * alpha,
)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_a_floating_first_tensor_is_dtype_checked_by_both_checks(dtype):
    x = torch.zeros(8, dtype=dtype)
    assert FLOATING_FIRST.fast_check().fn(x, 2.0, 1, None) is None
    with pytest.raises(TypeError, match=r"^x: expected a floating-point dtype, got torch\.(int32|bool)"):
        FLOATING_FIRST(x, 2.0)
    y = torch.randn(8)
    assert FLOATING_FIRST.fast_check().fn(y, 2.0, 1, None) is not None


def test_a_declaration_reading_a_dim_only_an_optional_tensor_binds_is_refused():
    """With the tensor left out the dim has no value: the declaration fails, not the call."""
    with pytest.raises(ValueError, match=r"facts read dims \['L'\], which only optional tensors bind"):
        _small_kernel(
            "test_loose_dim",
            [Tensor("x", ("N",), dtypes=(torch.float32,)),
             Tensor("bias", ("L",), dtypes=(torch.float32,), optional=True), Output("out", like="x")],
            lambda config, x, bias, out: out.copy_(x),
            lambda x, bias: x.double(),
            facts=("dtype", "N", "L"),
        )  # fmt: skip


def _copy_launch(config: AddConfig, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_((x.reshape(-1, x.shape[-1]) + y.reshape(-1, y.shape[-1])).reshape(out.shape))


SHARED_STAR = _small_kernel(
    "test_shared_star",
    [Tensor("x", ("*M", "N"), dtypes=(torch.float32,)), Tensor("y", ("*M", "N"), dtype_of="x"),
     Output("out", like="x", dims=("*M", "N"))],
    _copy_launch,
    lambda x, y: x.double() + y.double().reshape(x.shape),
    facts=("dtype", "M", "N"),
)  # fmt: skip


def test_a_star_dim_two_tensors_share_takes_the_first_ones_leading_dims_on_both_paths():
    x, y = torch.randn(2, 3, 4), torch.randn(6, 4)
    checked = SHARED_STAR.fast_check().fn(x, y, None)
    assert checked is not None and tuple(checked[2][-1].shape) == (2, 3, 4)
    assert tuple(SHARED_STAR(x, y).shape) == (2, 3, 4)
    assert SHARED_STAR.fast_check().fn(x, y, torch.empty(2, 3, 4)) is not None
    assert SHARED_STAR.fast_check().fn(x, torch.randn(5, 4), None) is None  # M differs: the detailed check says why


def test_a_numpy_scalar_is_refused_with_the_conversion_to_make():
    import numpy as np

    with pytest.raises(TypeError, match=r"^alpha: expected a float, got numpy\.float32 \(pass float\(alpha\)\)$"):
        UNBOUNDED(torch.randn(8), np.float32(2.0))
