"""How the tuner times a candidate.

On a GPU: ``triton.testing.do_bench`` (median, warm-up, the L2 flushed before every repetition,
which is what a workload larger than the L2 sees), or ``do_bench_cudagraph`` for launch-bound
sizes so that Python launch overhead does not drown the kernel. On the interpreter, wall-clock
medians: meaningless as GPU numbers, but they exercise the same loop end to end.
Tests substitute a :class:`FakeTimer` where timing is not the point.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Protocol

import torch


class Timer(Protocol):
    def __call__(self, fn: Callable[[], object], *, config: object, flush_l2: bool, launch_bound: bool) -> float:
        """Median milliseconds of one call of ``fn`` (which launches ``config``)."""
        ...


class GpuTimer:
    def __init__(self, warmup_ms: int = 25, rep_ms: int = 100) -> None:
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms

    def __call__(self, fn: Callable[[], object], *, config: object, flush_l2: bool, launch_bound: bool) -> float:
        import triton.testing

        if launch_bound:
            # Replaying a captured graph removes the host launch gaps from the measurement.
            with torch.cuda.stream(torch.cuda.Stream()):
                ms = triton.testing.do_bench_cudagraph(fn, rep=self.rep_ms, return_mode="median")
        else:
            # do_bench zeroes a buffer larger than the L2 before each repetition.
            ms = triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
        return float(ms)


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


def timer_for(device: torch.device) -> Timer:
    return InterpreterTimer() if device.type == "cpu" else GpuTimer()
