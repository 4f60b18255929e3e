"""Which launches count as traced: those get fresh arrival counters and plain-int shapes."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tritune.kernels._launch import traced


def test_a_parameter_launches_as_a_plain_tensor():
    """An nn.Parameter adds no dispatch: its launches share the cached counters as a tensor's do."""
    assert not traced(torch.randn(4))
    assert not traced(torch.nn.Parameter(torch.randn(4)))


def test_fake_tensors_and_dispatch_modes_are_traced():
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(4))
        assert traced(fake)
        assert traced(torch.randn(4))  # a plain tensor inside a dispatch mode
