"""Declared kernels launch directly in plain eager mode and through their registered op everywhere else.

Both routes must give the same result; the direct one exists only to skip ``torch.library``'s
per-call Python cost, so every situation where the op matters (a dispatch mode such as
FakeTensor or ``make_fx``, tensors that require grad, ``torch.compile``) must still reach the op.
"""

from __future__ import annotations

import pytest
import torch
from torch._library.triton import is_wrap_triton_enabled
from torch.utils._python_dispatch import TorchDispatchMode

from tritune.kernels._oplib import in_direct_body, no_modes, run_unwrapped

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
def test_no_modes_sees_every_tracer_and_mode():
    assert no_modes()
    with CountingMode():
        assert not no_modes()
    with torch.device("cpu"):  # a torch function mode
        assert not no_modes()
    seen: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(no_modes())
        return x

    torch.func.vmap(probe)(torch.ones(3, 2))  # a functorch transform: its tensors look plain
    torch.jit.trace(probe, (torch.ones(2),), check_trace=False)
    assert seen == [False, False]


def test_run_unwrapped_launches_bare_kernels_and_bumps_the_version():
    out = torch.zeros(3)
    version = out._version
    inside: list[bool] = []

    def launch(value: float, target: torch.Tensor) -> None:
        inside.append(is_wrap_triton_enabled())
        assert in_direct_body()
        target.fill_(value)

    run_unwrapped(launch, (2.0, out), [out])
    assert inside == [False] and torch.equal(out, torch.full((3,), 2.0))
    assert out._version > version
    assert is_wrap_triton_enabled() and not in_direct_body()


def _decode_case() -> tuple[torch.Tensor, ...]:
    from test_decode import make_case

    return make_case(_DEVICE, batch=2, kv_heads=2, group=2, lq=1, head_dim=64, lmax=32, lengths=[5, 9])


@pytest.mark.filterwarnings("ignore:splitk_decode is forward-only")
def test_a_plain_call_skips_the_op_and_a_call_with_grad_takes_it():
    """A plain call's launch is the op's body run directly (no op reaches a mode that was not
    active then); one whose inputs require grad must reach the op, which autograd knows."""
    from tritune.kernels import decode_attention

    q, k, v, kv_len = _decode_case()
    out = torch.full_like(q, float("nan"))
    version = out._version
    decode_attention(q, k, v, kv_len, out=out)
    assert out._version > version and not torch.isnan(out).any()
    calls: list[tuple[object, ...]] = []
    with pytest.MonkeyPatch.context() as patch:
        from tritune.kernels import declare

        def counting(self: object, config: object, args: tuple[object, ...]) -> None:
            calls.append(args)
            original_call_op(self, config, args)

        original_call_op = declare.Kernel._call_op
        patch.setattr(declare.Kernel, "_call_op", counting)
        decode_attention(q, k, v, kv_len, out=torch.empty_like(q))
        assert calls == []
        decode_attention(q.clone().requires_grad_(True), k, v, kv_len, out=torch.empty_like(q))
        assert len(calls) == 1


@pytest.mark.parametrize("route", ["direct", "op"])
def test_decode_results_are_the_same_either_way(route):
    from tritune.kernels import decode_attention

    q, k, v, kv_len = _decode_case()
    expected = decode_attention(q, k, v, kv_len)
    out = torch.full_like(q, float("nan"))
    if route == "op":
        with CountingMode() as mode:
            decode_attention(q, k, v, kv_len, out=out)
        assert "tritune.decode_attention.default" in mode.seen
    else:
        decode_attention(q, k, v, kv_len, out=out)
    assert torch.equal(out, expected)


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


def test_a_call_whose_input_requires_grad_warns_once_that_the_kernel_is_forward_only(monkeypatch):
    """The kernels have no backward: a result that silently carried no gradient would be a wrong
    training step nobody sees, so the first such call of each kernel says so, naming the input."""
    import warnings

    from tritune.kernels import _autograd, decode_attention

    monkeypatch.setattr(_autograd, "_warned", set())
    q, k, v, kv_len = _decode_case()
    with pytest.warns(UserWarning, match=r"splitk_decode is forward-only: .* to q \(which requires grad\)"):
        decode_attention(q.clone().requires_grad_(True), k, v, kv_len)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decode_attention(q.clone().requires_grad_(True), k, v, kv_len)  # once per kernel
        with torch.no_grad():
            decode_attention(q.clone().requires_grad_(True), k, v, kv_len)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_prefill_traces_with_fake_tensors(mode):
    """Fake tensors have no data pointers: the prefill call's TMA layout fact must not ask for one
    (the TMA op's body checks the bases on real tensors at run time)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tritune.kernels import prefill_attention

    q = torch.randn(1, 2, 4, 64, device=_DEVICE).to(torch.bfloat16)
    k = torch.randn(1, 1, 8, 64, device=_DEVICE).to(torch.bfloat16)
    graph = make_fx(lambda q, k, v: prefill_attention(q, k, v), tracing_mode=mode)(q, k, torch.randn_like(k))
    assert "tritune.prefill_attention" in str(graph.code)


def test_prefill_under_vmap_says_the_op_has_no_batching_rule():
    from tritune.kernels import prefill_attention

    q = torch.randn(3, 1, 2, 4, 64, device=_DEVICE).to(torch.bfloat16)
    k = torch.randn(3, 1, 1, 8, 64, device=_DEVICE).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="Batching rule not implemented for tritune::prefill_attention"):
        torch.vmap(lambda q, k, v: prefill_attention(q, k, v))(q, k, torch.randn_like(k))
