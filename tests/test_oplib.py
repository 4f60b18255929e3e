"""``TritonOp``: the body runs directly in plain eager mode, the registered op everywhere else.

Both routes must give the same result; the direct one exists only to skip ``torch.library``'s
per-call Python cost, so every situation where the op matters (a dispatch mode such as
FakeTensor or ``make_fx``, tensors that require grad, ``torch.compile``) must still reach the op.
"""

from __future__ import annotations

import pytest
import torch
from torch._library.triton import is_wrap_triton_enabled
from torch.utils._python_dispatch import TorchDispatchMode

from tritune.kernels._oplib import TritonOp, _plain_eager, in_direct_body, plain_tensors_call, register_op

#: Where the kernels run: the GPU when there is one, else CPU tensors on the interpreter.
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class CountingMode(TorchDispatchMode):
    """Records the ops that reach the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_every_declared_op_writes_only_its_out():
    """The schema marks ``out`` as the one written argument: what functionalization and opcheck rely on."""
    from tritune.kernels.decode.kernel import KERNEL as DECODE
    from tritune.kernels.prefill.kernel import KERNEL as PREFILL

    for op in (PREFILL.op, DECODE.op, torch.ops.tritune.prefill_attention_tma.default):
        written = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert written == ["out"], op


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_plain_eager_only_for_plain_tensors_without_modes_or_grad():
    plain = torch.ones(2)
    assert _plain_eager((plain, 1, None))
    assert not _plain_eager((torch.ones(2, requires_grad=True),))
    with torch.no_grad():
        assert _plain_eager((torch.ones(2, requires_grad=True),))
    with CountingMode():
        assert not _plain_eager((plain,))
    with torch.device("cpu"):  # a torch function mode
        assert not _plain_eager((plain,))
    seen: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(_plain_eager((x,)))
        return x

    torch.func.vmap(probe)(torch.ones(3, 2))  # a functorch transform: its tensors look plain
    torch.jit.trace(probe, (plain,), check_trace=False)
    assert seen == [False, False]


def _toy_op() -> tuple[TritonOp, list[bool]]:
    calls: list[bool] = []

    def _body(x: torch.Tensor, out: torch.Tensor, alpha: float) -> None:
        calls.append(is_wrap_triton_enabled())
        assert in_direct_body() is not calls[-1]
        out.copy_(x * alpha)

    return register_op("tritune_test::scaled_copy", _body, mutates_args=("out",), kernels=[]), calls


TOY, TOY_CALLS = _toy_op()


def test_direct_call_skips_the_dispatcher_and_bumps_the_version():
    x, out = torch.randn(5), torch.full((5,), float("nan"))
    version = out._version
    with CountingMode() as mode:
        pass
    TOY_CALLS.clear()
    TOY(x, out, 3.0)
    assert torch.equal(out, x * 3.0)
    assert out._version > version
    assert mode.seen == []
    # The body launches bare kernels, as triton_op's backend would run it.
    assert TOY_CALLS == [False]
    assert is_wrap_triton_enabled()
    assert not in_direct_body()


def test_a_dispatch_mode_sees_the_op():
    x, out = torch.randn(5), torch.full((5,), float("nan"))
    with CountingMode() as mode:
        TOY(x, out, 2.0)
    assert "tritune_test.scaled_copy.default" in mode.seen
    assert torch.equal(out, x * 2.0)


@pytest.mark.parametrize("route", ["direct", "op"])
def test_decode_results_are_the_same_either_way(route):
    from test_decode import make_case

    from tritune.kernels import decode_attention

    q, k, v, kv_len = make_case("cuda" if torch.cuda.is_available() else "cpu", batch=2, kv_heads=2, group=2, lq=1,
                                head_dim=64, lmax=32, lengths=[5, 9])  # fmt: skip
    expected = decode_attention(q, k, v, kv_len)
    out = torch.full_like(q, float("nan"))
    if route == "op":
        with CountingMode() as mode:
            decode_attention(q, k, v, kv_len, out=out)
        assert "tritune.decode_attention.default" in mode.seen
    else:
        decode_attention(q, k, v, kv_len, out=out)
    assert torch.equal(out, expected)


def test_plain_tensors_call_rules_out_modes_and_autograd_like_plain_eager():
    plain = torch.ones(2)
    assert plain_tensors_call(plain, None)
    assert not plain_tensors_call(plain, torch.ones(2, requires_grad=True))
    with torch.no_grad():
        assert plain_tensors_call(torch.ones(2, requires_grad=True))
    with CountingMode():
        assert not plain_tensors_call(plain)
    with torch.device("cpu"):
        assert not plain_tensors_call(plain)


def test_public_prefill_under_a_dispatch_mode_reaches_the_op():
    """The public wrapper's own shortcut to the op body must not bypass a dispatch mode."""
    from tritune.kernels import prefill_attention

    q = torch.randn(1, 2, 4, 64, dtype=torch.bfloat16, device=_DEVICE)
    k = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16, device=_DEVICE)
    out = torch.full_like(q, float("nan"))
    with CountingMode() as mode:
        prefill_attention(q, k, k, out=out)
    assert "tritune.prefill_attention.default" in mode.seen
    assert not torch.isnan(out).any()
