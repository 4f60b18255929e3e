"""How a benchmark row is checked and timed: one checked call, then eager, host and CUDA-graph replay times.

A row (:class:`TimedRow`) is filled by :func:`measure`. Timing on a GPU is
``triton.testing.do_bench`` (median; a warm-up, then the L2 flushed before every repetition). A
CUDA-graph time is the same ``do_bench`` around ``graph.replay()`` of one captured call, so eager
and graph numbers see the same cold L2. An eager time is the larger of that ``do_bench`` time and
the host time per call (:data:`EAGER_NOTE` says why). On the CPU (smoke mode) times are wall-clock
medians of the interpreter: they prove the script runs, nothing more. Like ``_benchlib``, this
module imports triton and tritune only inside its functions.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _benchlib import error_text, join_notes, log, synchronize


@dataclass(kw_only=True)
class TimedRow:
    """One implementation at one shape: what every benchmark row records (each script adds its shape fields)."""

    impl: str
    status: str = "ok"  # ok | FAILED | unavailable
    #: What an eager caller pays per call: the larger of ``eager_gpu_us`` and ``host_us`` (:func:`eager_cost_us`).
    eager_us: float | None = None
    #: ``do_bench`` of one eager call after the L2 flush (the host work overlapping the flush is not in it).
    eager_gpu_us: float | None = None
    #: Host microseconds per call with calls queued back to back (GPU only: :func:`host_us_per_call`).
    host_us: float | None = None
    graph_us: float | None = None
    #: "ok", or why the graph column is empty ("cannot capture: ...", "FAILED after replay: ...").
    graph_status: str = ""
    note: str = ""


def measure(
    row: TimedRow,
    fn: Callable[[], torch.Tensor] | None,
    check: Callable[[torch.Tensor], str | None],
    device: torch.device,
    graphs: bool,
    *,
    error: str = "",
    raised: str | None = None,
    recheck: Callable[[torch.Tensor], str | None] | None = None,
) -> TimedRow:
    """Check one call of ``fn``, then time it eagerly and (with ``graphs``) as a CUDA-graph replay, into ``row``.

    ``check(out)`` returns None for a right output, else what is wrong (it may also record an error
    metric on the row); ``recheck`` checks the replayed graph's output instead, when given. No
    ``fn`` means the implementation cannot run here (``error`` says why): unavailable. A failed
    check is FAILED and never timed. An exception makes the row ``raised``: a peer missing here is
    unavailable, our own kernel raising is FAILED; by default (None) a row is ours when
    :func:`is_ours` says so. The other rows run either way.
    """
    if raised is None:
        raised = "FAILED" if is_ours(row.impl) else "unavailable"
    if fn is None:
        row.status, row.note = "unavailable", error
        return row
    try:
        started = time.perf_counter()
        out = fn()
        synchronize(device)
        first_s = time.perf_counter() - started
        if first_s > 5:
            log.info("  %s: first call (compiles) took %.0f s", row.impl, first_s)
        problem = check(out)
        if problem is not None:
            row.status, row.note = "FAILED", join_notes(f"FAILED correctness check: {problem}", row.note)
            return row
        row.eager_gpu_us = time_ms(fn, device) * 1e3
        row.host_us = host_us_per_call(fn, device)
        row.eager_us = eager_cost_us(row.eager_gpu_us, row.host_us)
    except Exception as exc:  # reported in the row, and the other rows still run
        row.status, row.note = raised, join_notes(row.note, error_text(exc))
        return row
    if graphs:
        row.graph_us, row.graph_status = graph_time(fn, recheck or check)
    return row


def is_ours(impl: str) -> bool:
    """Whether a row's implementation is tritune's (its name says so): an exception there is a failure."""
    return "tritune" in impl.lower()


def eager_cost_us(gpu_us: float | None, host_us: float | None) -> float | None:
    """What an eager caller pays per call: the larger of the flushed ``do_bench`` time and the host time.

    ``do_bench`` launches the L2 flush (a 256 MB ``zero_``, about 55-65 us on an H200) before every
    call, so the host work of a call overlaps the flush and shows in the GPU time only where it
    outlasts it. In a model's eager loop nothing hides it: each call costs at least its host time.
    """
    known = [us for us in (gpu_us, host_us) if us is not None]
    return max(known) if known else None


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of one call of ``fn``: ``do_bench`` on a GPU, wall-clock on the interpreter."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


#: A report's note on its host column and on how eager is timed.
HOST_NOTE = (
    "host: CPU time per call with calls queued back to back, the GPU never waited for (median of 5 rounds of 20 calls)."
)
EAGER_NOTE = (
    "eager: max(do_bench GPU time, host time) per call, for every row alike. do_bench flushes the L2 "
    "before each call, and the call's host work overlaps that flush and never shows in its time; an "
    "eager caller pays at least the host time per call. The flushed GPU time alone is the JSON's "
    "eager_gpu_us."
)


def host_us_per_call(fn: Callable[[], object], device: torch.device, rounds: int = 5, calls: int = 20) -> float | None:
    """Median host microseconds one call of ``fn`` takes to queue its work, on a GPU (None elsewhere).

    Each round times ``calls`` calls back to back on the CPU, then waits for the GPU before the
    next round, so no round waits for a full launch queue (20 calls of a few launches each stay
    far below it). What an eager caller pays per call is about the larger of this and the GPU time.
    The tuner's own measure (``tune bench``'s host column), in microseconds.
    """
    from tritune.tuner.timing import host_ms_per_call

    ms = host_ms_per_call(fn, device, calls=calls, rounds=rounds)
    return None if ms is None else ms * 1e3


def capture_graph(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture one call of ``fn`` (warmed up on a side stream first); returns the graph and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def graph_replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """Median milliseconds of one replay, L2 flushed before each (``do_bench`` around ``replay``)."""
    import triton.testing

    return float(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))


def graph_time(fn: Callable[[], torch.Tensor], check: Callable[[torch.Tensor], str | None]) -> tuple[float | None, str]:
    """Capture one call of ``fn``, poison its output with NaN, replay, check it, then time replays.

    ``check(out)`` returns None for a right output, else what is wrong with it. Returns (microseconds, status):
    the time only with status "ok"; otherwise "cannot capture: ...", "FAILED after replay: ..." or
    "replay failed: ...", whose part before the colon fits a table cell.
    """
    try:
        graph, out = capture_graph(fn)
    except Exception as exc:
        # torch.cuda.graph's exit ends a failed capture; make sure nothing is left pending.
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return None, f"cannot capture: {error_text(exc, 160)}"
    try:
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        problem = check(out)
        if problem is not None:
            return None, f"FAILED after replay: {problem}"
        return graph_replay_ms(graph) * 1e3, "ok"
    except Exception as exc:
        return None, f"replay failed: {error_text(exc, 160)}"
    finally:
        del graph
