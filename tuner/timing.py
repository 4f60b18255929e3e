"""How the tuner times a candidate.

On a GPU: ``triton.testing.do_bench`` (median, warm-up, the L2 flushed before every repetition,
which is what a workload larger than the L2 sees). Launch-bound sizes are captured once in a CUDA
graph and ``graph.replay`` is timed the same way, so Python launch overhead does not drown the
kernel and the L2 is still cold, as it is for one layer's decode among many and in the benchmark
scripts' graph columns (``do_bench_cudagraph`` replays warm: only when ``flush_l2`` is off).
On the interpreter, wall-clock medians: meaningless as GPU numbers, but they exercise the same loop end to end.
Tests substitute a :class:`FakeTimer` where timing is not the point.

A timer may also offer ``measure``, which returns a :class:`Measurement` with the spread of the
repetitions; :func:`measure` asks any timer for one. The noise checks (:mod:`.noise`) need the
spread, and only :class:`GpuTimer` has one to give.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger(__name__)


class Timer(Protocol):
    def __call__(self, fn: Callable[[], object], *, config: object, flush_l2: bool, launch_bound: bool) -> float:
        """Median milliseconds of one call of ``fn`` (which launches ``config``).

        The kernel's peer is timed through the same timer with the same flags; its ``config`` is
        then the :class:`~tritune.kernels.spec.Peer` itself.
        """
        ...


@dataclass(frozen=True)
class Measurement:
    """One timing of a candidate: the median and, where the timer has them, the 20th and 80th percentiles."""

    ms: float
    p20: float | None = None
    p80: float | None = None

    @property
    def spread(self) -> float | None:
        """``(p80 - p20) / median``: how much the repetitions disagree; ``None`` without percentiles."""
        if self.p20 is None or self.p80 is None or not self.ms > 0:
            return None
        return (self.p80 - self.p20) / self.ms


def measure(
    timer: Timer, fn: Callable[[], object], *, config: object, flush_l2: bool, launch_bound: bool
) -> Measurement:
    """A :class:`Measurement` from any timer: its ``measure`` where it has one, else its median alone."""
    method = getattr(timer, "measure", None)
    if callable(method):
        result = method(fn, config=config, flush_l2=flush_l2, launch_bound=launch_bound)
        if not isinstance(result, Measurement):
            raise TypeError(f"{type(timer).__name__}.measure returned {type(result).__name__}, not a Measurement")
        return result
    return Measurement(float(timer(fn, config=config, flush_l2=flush_l2, launch_bound=launch_bound)))


#: Percentiles the GPU timer asks ``do_bench`` for: the spread and the median.
QUANTILES = (0.2, 0.5, 0.8)


class GpuTimer:
    def __init__(self, warmup_ms: int = 25, rep_ms: int = 100) -> None:
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms

    def measure(self, fn: Callable[[], object], *, config: object, flush_l2: bool, launch_bound: bool) -> Measurement:
        import triton.testing

        quantiles = list(QUANTILES)
        if launch_bound and not flush_l2:
            # Replays on do_bench_cudagraph's own side stream, without flushing the L2 between them.
            p20, p50, p80 = triton.testing.do_bench_cudagraph(fn, rep=self.rep_ms, quantiles=quantiles)
        else:
            graph = _captured(fn) if launch_bound else None
            # One replay is one launch: do_bench's L2 flush before it hides the host's cost. A
            # candidate that cannot be captured is timed eagerly (host launch cost included).
            # do_bench zeroes a buffer larger than the L2 before each repetition.
            target = graph.replay if graph is not None else fn
            p20, p50, p80 = triton.testing.do_bench(target, warmup=self.warmup_ms, rep=self.rep_ms, quantiles=quantiles)
        return Measurement(float(p50), float(p20), float(p80))

    def __call__(self, fn: Callable[[], object], *, config: object, flush_l2: bool, launch_bound: bool) -> float:
        return self.measure(fn, config=config, flush_l2=flush_l2, launch_bound=launch_bound).ms


def _captured(fn: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
    """``fn`` captured in a CUDA graph after two warm-up calls on a side stream; None if it cannot be."""
    previous = None
    try:
        previous = torch.cuda.current_stream()
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph
    except Exception as exc:  # a capture the candidate cannot take: time it eagerly instead
        log.warning("CUDA-graph capture for cold-L2 timing failed (%s); timing eager launches instead", exc)
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        if previous is not None:
            # When capture_end raises (an invalidated capture), torch.cuda.graph's exit skips
            # restoring the stream: this thread would go on launching on the capture stream.
            with contextlib.suppress(Exception):
                torch.cuda.set_stream(previous)
        return None


class InterpreterTimer:
    """Wall-clock median for the Triton interpreter (CPU)."""

    def __init__(self, reps: int = 3) -> None:
        self.reps = reps

    def __call__(self, fn: Callable[[], object], *, config: object, flush_l2: bool, launch_bound: bool) -> float:
        fn()
        samples = []
        for _ in range(self.reps):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)


class FakeTimer:
    """Deterministic times from a function of the config, for tests of the tuning loop."""

    def __init__(self, cost: Callable[[object], float]) -> None:
        self.cost = cost
        self.calls = 0

    def __call__(self, fn: Callable[[], object], *, config: object, flush_l2: bool, launch_bound: bool) -> float:
        fn()
        self.calls += 1
        return float(self.cost(config))


#: Back-to-back calls per round of a host timing on a GPU: few enough that the launch queue never
#: fills (the host then never waits for the GPU), enough to average.
HOST_CALLS = 50
#: Rounds of a host timing (the median counts).
HOST_ROUNDS = 3


def host_ms_per_call(
    fn: Callable[[], object], device: torch.device, *, calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS
) -> float | None:
    """Median host milliseconds one call of ``fn`` takes to queue its work, on a GPU; None elsewhere.

    Calls run back to back, ``calls`` a round, the GPU drained between rounds: what an
    eager caller pays per call where the GPU keeps up. Such a caller pays about ``max(GPU time,
    host time)`` a call. On the interpreter every launch is host work, so there is nothing to tell apart.
    """
    if device.type != "cuda":
        return None
    for _ in range(3):
        fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e3)
    torch.cuda.synchronize(device)
    return statistics.median(samples)


def timer_for(device: torch.device) -> Timer:
    return InterpreterTimer() if device.type == "cpu" else GpuTimer()
