"""Which ``triton.testing`` routine the GPU timer uses for which problem (the routines are faked).

Launch-bound problems whose real workload exceeds the L2 are captured in a CUDA graph and the
replay is timed with ``do_bench``, which flushes the L2 before each repetition; only a problem that
asks for a warm L2 uses ``do_bench_cudagraph``. A candidate that cannot be captured is timed
eagerly with ``do_bench`` (host launch cost included) instead of failing its trial.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import triton.testing

from tritune.tuner import timing


class FakeGraph:
    def replay(self) -> None:
        pass


@pytest.fixture
def calls(monkeypatch):
    seen: list[tuple[str, object]] = []

    def do_bench(fn, warmup, rep, quantiles):
        seen.append(("do_bench", fn))
        return [1.0, 2.0, 3.0]

    def do_bench_cudagraph(fn, rep, quantiles):
        seen.append(("do_bench_cudagraph", fn))
        return [4.0, 5.0, 6.0]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", do_bench_cudagraph)
    return seen


def candidate() -> None:
    pass


def test_large_problems_are_timed_eagerly_with_the_l2_flushed(calls):
    m = timing.GpuTimer().measure(candidate, config=None, flush_l2=True, launch_bound=False)
    assert calls == [("do_bench", candidate)]
    assert (m.ms, m.p20, m.p80) == (2.0, 1.0, 3.0)


def test_launch_bound_problems_replay_a_graph_with_the_l2_flushed(calls, monkeypatch):
    graph = FakeGraph()
    monkeypatch.setattr(timing, "_captured", lambda fn: graph)
    m = timing.GpuTimer().measure(candidate, config=None, flush_l2=True, launch_bound=True)
    assert calls == [("do_bench", graph.replay)]
    assert m.ms == 2.0


def test_a_warm_l2_problem_uses_do_bench_cudagraph(calls, monkeypatch):
    monkeypatch.setattr(timing, "_captured", lambda fn: pytest.fail("no capture wanted"))
    assert timing.GpuTimer().measure(candidate, config=None, flush_l2=False, launch_bound=True).ms == 5.0
    assert calls == [("do_bench_cudagraph", candidate)]


def uncapturable() -> None:
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_candidate_that_cannot_be_captured_is_timed_eagerly(calls, caplog):
    # It fails in its warm-up on a GPU; on the CPU creating the side stream fails first.
    with caplog.at_level(logging.WARNING, logger=timing.__name__):
        assert timing._captured(uncapturable) is None
        assert timing.GpuTimer().measure(uncapturable, config=None, flush_l2=True, launch_bound=True).ms == 2.0
    assert calls == [("do_bench", uncapturable)]
    assert "capture for cold-L2 timing failed" in caplog.text


class FakeStream:
    def __init__(self, name: str = "side") -> None:
        self.name = name

    def wait_stream(self, other: FakeStream) -> None:
        pass


def test_a_failed_capture_puts_the_current_stream_back(monkeypatch):
    """torch.cuda.graph's exit skips restoring the stream when capture_end raises; _captured restores it."""
    default = FakeStream("default")
    current = [default]

    @contextlib.contextmanager
    def stream(s: FakeStream):
        previous = current[0]
        current[0] = s
        try:
            yield
        finally:
            current[0] = previous

    class InvalidatedCapture:
        def __init__(self, graph: object) -> None:
            pass

        def __enter__(self) -> None:
            current[0] = FakeStream("capture")

        def __exit__(self, *exc: object) -> None:
            # As torch.cuda.graph does: capture_end raises before the stream context is left.
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", InvalidatedCapture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    assert timing._captured(candidate) is None
    assert current[0] is default
