"""GPU tier: a key with an eager alternative is captured in a CUDA graph after an eager warm-up.

Loading a kernel's module is not allowed while a stream captures, so the winner (what a capture
launches) must already be loaded when the capture begins, though eager calls launch the
alternative: the key's first eager call launches the winner once for that.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_eager_choice import KERNEL, LAUNCHED, _record

from tritune.kernels.device import device_info
from tritune.kernels.dispatcher import DISPATCHER
from tritune.kernels.winners import build_table

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU tier: needs a CUDA GPU (run on the H200)"),
]


@pytest.fixture
def served_on_gpu():
    """The record of ``test_eager_choice`` (winner BLOCK=32, eager BLOCK=64) re-keyed for this GPU."""
    info = device_info(torch.device("cuda", torch.cuda.current_device()))
    record = _record({"BLOCK": 32}, {"BLOCK": 64})
    key = {**record.key, "arch": info.arch, "sm_count": info.sm_count}
    DISPATCHER.clear()
    # Timed with eager replay, as a tune on this GPU does: served whatever the winner's GPU time.
    eager = dataclasses.replace(record.eager, replayed=True)
    here = dataclasses.replace(record, gpu=info.slug, key=key, eager=eager)
    DISPATCHER._tables[info.slug] = build_table([[here]], info)
    LAUNCHED.clear()
    yield
    DISPATCHER.clear()


def test_a_graph_captured_after_an_eager_warm_up_replays_the_winner(served_on_gpu) -> None:
    x = torch.randn(64, device="cuda")
    out = torch.full_like(x, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        KERNEL(x, out=out)  # eager warm-up: the winner once, then the eager alternative
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(out, x * 2)
    assert LAUNCHED == [32, 64]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        KERNEL(x, out=out)
    assert LAUNCHED == [32, 64, 32]
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 2)
