"""``tma_layout_ok`` checks every tensor's base address unless the tensors have none.

A tensor subclass with storage (``nn.Parameter``) has a real address and is checked like a plain
tensor: a misaligned base of q, k, v or out sends the call off the descriptor paths. Fake tensors
(``make_fx``, fake-tensor tracing), functional and functorch-wrapped tensors have no address: the
layout then counts as eligible and the TMA op's body checks the real bases at run time.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from tritune.kernels import prefill_attention, use_config
from tritune.kernels.prefill import launch as prefill_launch
from tritune.kernels.prefill.kernel import KERNEL, tma_layout_ok
from tritune.kernels.prefill.reference import prefill_reference

SHAPE = (1, 2, 16, 64)


def _aligned() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def _misaligned() -> torch.Tensor:
    """A tensor of SHAPE whose base sits 2 bytes past a 16-byte boundary (strides still aligned)."""
    flat = torch.empty(_aligned().numel() + 1, dtype=torch.bfloat16)
    t = flat[1:].view(SHAPE)
    assert t.data_ptr() % 16 == 2
    return t.copy_(_aligned())


def _parameter(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


@pytest.mark.parametrize("position", ["q", "k", "v", "out"])
def test_a_misaligned_base_is_refused_whatever_the_tensor_types(position):
    tensors = {name: _aligned() for name in ("q", "k", "v", "out")}
    assert tma_layout_ok(*tensors.values())
    tensors[position] = _misaligned()
    assert not tma_layout_ok(*tensors.values())
    # An nn.Parameter q (or the misaligned tensor itself a Parameter) has a real address to check.
    with_parameter_q = {**tensors, "q": _parameter(tensors["q"])}
    assert not tma_layout_ok(*with_parameter_q.values())
    all_parameters = {name: _parameter(t) for name, t in tensors.items()}
    assert not tma_layout_ok(*all_parameters.values())


def test_aligned_parameters_are_eligible():
    assert tma_layout_ok(*(_parameter(_aligned()) for _ in range(4)))


def test_fake_tensors_count_as_eligible_without_reading_their_addresses():
    real = [_misaligned() for _ in range(4)]
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in real]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fake tensor's data_ptr() warns
        assert tma_layout_ok(*fakes)
        assert tma_layout_ok(real[0], *fakes[1:])  # one fake among real tensors: none is read


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_make_fx_traces_the_check(tracing_mode):
    """Under ``make_fx`` the tensors are fake or functional: no address, no error, no warning."""
    seen: list[bool] = []

    def check(q, k, v, out):
        seen.append(tma_layout_ok(q, k, v, out))
        return out + 1

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_fx(check, tracing_mode=tracing_mode)(_misaligned(), _aligned(), _aligned(), _aligned())
    assert seen == [True]


def test_vmap_counts_as_eligible():
    seen: list[bool] = []

    def check(q):
        seen.append(tma_layout_ok(q, q, q, q))
        return q

    torch.vmap(check)(torch.stack([_aligned(), _aligned()]))
    assert seen == [True]


def test_a_misaligned_parameter_q_runs_the_portable_path(monkeypatch):
    """End to end on the interpreter: a TMA pin with a misaligned ``nn.Parameter`` q must not
    reach the descriptors (the facts say the layout is not eligible) and matches the reference."""
    ran: list[str] = []
    for name in ("launch_tma", "launch_portable"):
        real = getattr(prefill_launch, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            ran.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(prefill_launch, name, spy)
    q = _parameter(_misaligned())
    k, v = _aligned(), _aligned().flip(2).contiguous()
    assert not KERNEL.facts(q, k, v).tma_layout_ok
    with use_config("tma_prefill", {"path": "tma", "BLOCK_M": 16, "BLOCK_N": 16}):
        out = prefill_attention(q, k, v)
    assert ran == ["launch_portable"]
    ref = prefill_reference(q.detach(), k, v, causal=True, dtype=torch.float64)
    assert float((out.double() - ref).abs().max()) <= 2e-2 * float(ref.abs().max())
