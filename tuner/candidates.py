"""What happens to one candidate config: first launch, correctness gate, timing, final re-timing.

A :class:`CandidateBench` holds one key's problems (the timed problem, the smaller check problem
with its reference result, and the portable default's outputs of both) and answers requests that
take and give plain values: configs as dicts in, :class:`TrialOutcome` dicts out. It normally runs
inside a worker process (:mod:`.worker`), where a candidate that crashes, hangs or poisons the
CUDA context takes only the worker down; :class:`~.local_bench.LocalBench` runs it in the tuner's
own process (``TuneOptions(isolate=False)``, for tests with a fake timer).

Every bench, local or isolated, offers the same :class:`Bench` interface to the study.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypedDict

import torch

from tritune.configs_db.winner_fields import peer_problem
from tritune.kernels.spec import KernelSpec, Peer, Problem, TuningKey

from .noise import ClockMonitor, NoisePolicy, monitor_for, stable_measurement
from .timing import HOST_CALLS, HOST_ROUNDS, Timer, measure

log = logging.getLogger("tritune.tuner")

OK, FAILED_COMPILE, FAILED_CORRECTNESS, FAILED_RUNTIME, PRUNED = (
    "ok",
    "failed-compile",
    "failed-correctness",
    "failed-runtime",
    "pruned",
)
#: A failure message beyond this says nothing more (the DB cuts at 8 KB anyway).
MAX_ERROR_CHARS = 2000


class TrialOutcome(TypedDict):
    status: str
    ms: float | None
    #: Why the trial failed; for an ``ok`` trial, a note on a measurement that stayed noisy.
    error: str | None
    #: The candidate left the CUDA context unusable: the process that ran it must be replaced.
    fatal: bool


class RetimeOutcome(TypedDict):
    #: Median of the interleaved rounds, one per config, in the order asked.
    ms: list[float]
    notes: list[str]
    #: The peer's median over the same rounds and its name; ``None`` when it was not asked for,
    #: the kernel names none at this key, or it failed (``peer_error`` says why).
    peer_ms: float | None
    peer_name: str | None
    peer_error: str | None


class BenchError(RuntimeError):
    """The key's problems cannot be set up (or the process running them cannot be started)."""


class ContextLost(RuntimeError):
    """The CUDA context is unusable: nothing more can run in this process."""


class Bench(Protocol):
    """Where candidates of one key at a time run (this process or a worker process)."""

    def open(self, spec: KernelSpec[Any, Any], key: TuningKey, seed: int, default: dict[str, Any]) -> None:
        """Build the problems of ``key``; raise :class:`BenchError` if the portable default cannot run."""
        ...

    def precompile(self, configs: list[dict[str, Any]]) -> list[TrialOutcome | None] | None:
        """First launches of a batch in parallel: a failed outcome or ``None`` each; ``None`` if unknown."""
        ...

    def trial(self, config: dict[str, Any], compiled: bool) -> TrialOutcome:
        """Launch (unless ``compiled``), check and time one config."""
        ...

    def retime(self, configs: list[dict[str, Any]], rounds: int, peer: bool = False) -> RetimeOutcome | None:
        """Time ``configs`` in interleaved rounds (with the kernel's peer last in each round when
        ``peer``); ``None`` if that failed."""
        ...

    def host_times(self, configs: list[dict[str, Any]]) -> list[float] | None:
        """Host milliseconds per launch of each config, called back to back; ``None`` if that failed."""
        ...

    def close(self) -> None: ...


def outcome(status: str, ms: float | None = None, error: str | None = None, fatal: bool = False) -> TrialOutcome:
    return {"status": status, "ms": ms, "error": error, "fatal": fatal}


def describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def context_alive(device: torch.device) -> bool:
    """Whether this process can still run GPU work (an illegal memory access poisons the context)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.empty(1, device=device).add_(1)
        torch.cuda.synchronize(device)
    except Exception:
        return False
    return True


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def consistency_problem(out: torch.Tensor, portable: torch.Tensor) -> str | None:
    """A loose size-dependent sanity check against the portable output at the timed size.

    The portable output is finite (checked when the bench is built), so the scale is a number.
    """
    if not bool(torch.isfinite(out).all()) and bool(torch.isfinite(portable).all()):
        return "non-finite values where the portable path has none"
    scale = float(portable.float().abs().max()) or 1.0
    err = float((out.float() - portable.float()).abs().max()) / scale
    return None if err <= 5e-2 else f"differs from the portable output by {err:.3g} of max|out| at the timed size"


def resolve_spec(kernel: str, target: str) -> KernelSpec[Any, Any]:
    """The kernel ``kernel`` declared at ``target`` ("module:attribute" or "path/file.py:attribute").

    A worker process learns kernels from where the tuner process found them (:func:`spec_target`),
    so a kernel declared at run time there (a user's file, a test's toy kernel) resolves here too.
    """
    from tritune.kernels import registry

    spec = registry.get_spec(kernel) if registry.known(kernel) else registry.load(target)
    if spec.name != kernel:
        raise BenchError(f"{target} declares a kernel named {spec.name!r}, not {kernel!r}")
    return spec


def spec_target(spec: KernelSpec[Any, Any]) -> str:
    """Where a worker process imports ``spec`` from: "module:attribute" or "path/file.py:attribute"."""
    from tritune.kernels import registry

    target = registry.target_of(spec)
    if target is None:
        raise BenchError(f"{spec.name}: not found in any module, so a worker process cannot import it")
    return str(target)


class CandidateBench:
    """One key's problems, and what each candidate config goes through."""

    def __init__(
        self,
        spec: KernelSpec[Any, Any],
        key: TuningKey,
        device: torch.device,
        seed: int,
        default: Any,
        timer: Timer,
        *,
        monitor: ClockMonitor | None = None,
        noise: NoisePolicy | None = None,
        compile_workers: int = 1,
    ) -> None:
        self.spec, self.key, self.device, self.timer = spec, key, device, timer
        self.monitor, self.noise = monitor, noise or NoisePolicy()
        self.compile_workers = compile_workers
        self.problem = spec.make_problem(key, device, seed)
        self.check_problem = spec.check_problem(key, device, seed + 1)
        self.expected = spec.reference(*self.check_problem.args, **self.check_problem.kwargs)
        self.portable_out = spec.launch(default, *self.problem.args, **self.problem.kwargs)
        self.check_out_template = spec.launch(default, *self.check_problem.args, **self.check_problem.kwargs)
        self._sync()
        if not bool(torch.isfinite(self.portable_out).all()):
            # Every candidate is cross-checked against this output: it must be a number.
            raise BenchError(f"{spec.name}: the portable default's output at the timed size is not finite")

    @classmethod
    def from_plain(
        cls,
        kernel: str,
        target: str,
        key: Mapping[str, Any],
        seed: int,
        default: Mapping[str, Any],
        device: str,
        timer: Timer,
        *,
        noise: NoisePolicy | None = None,
        compile_workers: int = 1,
    ) -> CandidateBench:
        """Build a bench from plain values only (what crosses into a worker process)."""
        spec = resolve_spec(kernel, target)
        torch_device = torch.device(device)
        return cls(
            spec,
            spec.key_type.from_dict(key),
            torch_device,
            seed,
            spec.space.parse(default),
            timer,
            monitor=monitor_for(torch_device),
            noise=noise,
            compile_workers=compile_workers,
        )

    # ---- helpers ------------------------------------------------------------------------------

    def _launch(self, config: Any, problem: Problem, out: torch.Tensor) -> None:
        self.spec.launch(config, *problem.args, **{**problem.kwargs, "out": out})

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def context_alive(self) -> bool:
        return context_alive(self.device)

    def _failed(self, exc: Exception, status: str) -> TrialOutcome:
        fatal = not self.context_alive()
        # Running out of memory, or a launch that broke the context, happened at run time even
        # when it was the first launch (which also compiles).
        if fatal or is_out_of_memory(exc):
            status = FAILED_RUNTIME
        if is_out_of_memory(exc) and not fatal and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return outcome(status, None, describe_exception(exc), fatal=fatal)

    def _first_launch(self, config: Any) -> TrialOutcome | None:
        try:
            self._launch(config, self.problem, torch.empty_like(self.portable_out))
            return None
        except Exception as exc:
            return self._failed(exc, FAILED_COMPILE)

    # ---- requests -----------------------------------------------------------------------------

    def precompile(self, configs: list[dict[str, Any]]) -> list[TrialOutcome | None]:
        """First launch of each config (which compiles it), in parallel threads on a GPU."""
        parsed = [self.spec.space.parse(c) for c in configs]
        if self.device.type != "cuda" or self.compile_workers <= 1:
            # The interpreter patches triton.language globally while it runs: one at a time.
            return [self._first_launch(c) for c in parsed]
        # Triton's compiler and ptxas release the GIL for most of their work. The current CUDA device
        # is per thread and new threads start on device 0: each one is pointed at ours first.
        with ThreadPoolExecutor(
            max_workers=self.compile_workers, initializer=torch.cuda.set_device, initargs=(self.device,)
        ) as pool:
            results = list(pool.map(self._first_launch, parsed))
        if not self.context_alive():
            raise ContextLost("the CUDA context was lost while compiling a batch")
        return results

    def trial(self, values: dict[str, Any], compiled: bool = False) -> TrialOutcome:
        config = self.spec.space.parse(values)
        if not compiled:
            failure = self._first_launch(config)
            if failure is not None:
                return failure
        try:
            out = _nan_like(self.check_out_template)
            self._launch(config, self.check_problem, out)
            self._sync()
            problem_text = self.spec.check(out, self.expected, self.check_problem, config)
            if problem_text is None:
                full = _nan_like(self.portable_out)
                self._launch(config, self.problem, full)
                self._sync()
                problem_text = consistency_problem(full, self.portable_out)
                if problem_text is None:
                    problem_text = self.spec.check_full(full, self.portable_out, config)
            if problem_text is not None:
                return outcome(FAILED_CORRECTNESS, None, problem_text)
            sample, note = self._measure(config)
        except Exception as exc:
            return self._failed(exc, FAILED_RUNTIME)
        if not math.isfinite(sample) or sample <= 0:
            return outcome(FAILED_RUNTIME, None, f"timer returned {sample!r}")
        return outcome(OK, sample, note)

    def _measure(self, config: Any) -> tuple[float, str | None]:
        target = torch.empty_like(self.portable_out)
        # Checked once: each timed call costs what the launch costs, not the argument checks too.
        run = self.spec.prepare(config, *self.problem.args, **{**self.problem.kwargs, "out": target})

        def take() -> Any:
            return measure(
                self.timer,
                run,
                config=config,
                flush_l2=self.problem.flush_l2,
                launch_bound=self.problem.launch_bound,
            )

        sample, note = stable_measurement(take, self.monitor, self.noise)
        return sample.ms, note

    def retime(self, configs: list[dict[str, Any]], rounds: int, peer: bool = False) -> RetimeOutcome:
        """Interleaved rounds over ``configs``: each round sees the same clocks and temperature.

        With ``peer``, the kernel's peer (:meth:`KernelSpec.peer`) is timed last in each round, with
        the same timer and flags; a peer that cannot be built, disagrees with the portable output
        or raises is dropped with the reason (``peer_error``), and the configs' rounds go on.
        """
        parsed = [self.spec.space.parse(c) for c in configs]
        samples: list[list[float]] = [[] for _ in parsed]
        notes: list[str] = []
        rival, peer_error = self._peer() if peer else (None, None)
        peer_samples: list[float] = []
        for _ in range(rounds):
            for index, config in enumerate(parsed):
                ms, note = self._measure(config)
                samples[index].append(ms)
                if note is not None:
                    notes.append(f"final re-timing of {configs[index]}: {note}")
            if rival is not None:
                try:
                    peer_ms, note = self._measure_peer(rival)
                except Exception as exc:
                    rival, peer_error = None, describe_exception(exc)
                    self._recover()
                    continue
                peer_samples.append(peer_ms)
                if note is not None:
                    notes.append(f"final re-timing of the peer {rival.name}: {note}")
        return {
            "ms": [_median(s) for s in samples],
            "notes": notes,
            "peer_ms": _median(peer_samples) if rival is not None and peer_samples else None,
            "peer_name": rival.name if rival is not None and peer_samples else None,
            "peer_error": peer_error,
        }

    def host_times(self, configs: list[dict[str, Any]]) -> list[float]:
        """Host milliseconds per eager call of each config, called back to back on an idle GPU: what
        an eager caller pays per call where the GPU keeps up. Each config's prepared launch (which
        replays as eager calls do) plus what a plain public call adds to it (its early key or
        checks, dispatch and output allocation, the same for every config: measured once, on the
        first config, where the kernel is callable). Interleaved rounds; the median of each counts."""
        runs = []
        for values in configs:
            target = torch.empty_like(self.portable_out)
            config = self.spec.space.parse(values)
            runs.append(self.spec.prepare(config, *self.problem.args, **{**self.problem.kwargs, "out": target}))
        public = self._public_call(configs[0]) if configs else None
        timed = runs if public is None else [*runs, public[1]]
        calls = HOST_CALLS if self.device.type == "cuda" else 2
        samples: list[list[float]] = [[] for _ in timed]
        with public[0] if public is not None else contextlib.nullcontext():
            for run in timed:
                run()
            for _ in range(HOST_ROUNDS):
                for index, run in enumerate(timed):
                    self._sync()
                    start = time.perf_counter()
                    for _ in range(calls):
                        run()
                    samples[index].append((time.perf_counter() - start) / calls * 1e3)
        self._sync()
        times = [_median(s) for s in samples]
        overhead = max(0.0, times.pop() - times[0]) if public is not None else 0.0
        return [ms + overhead for ms in times]

    def _public_call(self, values: dict[str, Any]) -> tuple[Any, Callable[[], Any]] | None:
        """The kernel's public call on the timed problem pinned to ``values`` (the pin, a context to
        hold around the calls, and the call), or None where the kernel is not callable.

        The call allocates its output, as a plain eager call does: a passed ``out`` takes the
        checked way every call (its overlap with the inputs is checked), which plain calls skip
        once their layout replays, and would charge every config a cost eager callers do not pay.
        """
        if not callable(self.spec):
            return None
        from tritune.kernels.pins import use_config

        spec, args, kwargs = self.spec, self.problem.args, self.problem.kwargs
        return use_config(spec.name, values), lambda: spec(*args, **kwargs)

    def _peer(self) -> tuple[Peer | None, str | None]:
        """The kernel's peer on the timed problem, run once and cross-checked; else ``None`` and why."""
        try:
            rival = self.spec.peer(self.key, self.problem)
            if rival is None:
                return None, "the kernel names no peer at this key"
            problem = peer_problem(1.0, rival.name)
            if problem is not None:
                return None, problem
            out = rival.fn()
            self._sync()
            if not isinstance(out, torch.Tensor) or out.shape != self.portable_out.shape:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                return None, f"{rival.name} returned {shape}, not the kernel's {tuple(self.portable_out.shape)}"
            mismatch = consistency_problem(out, self.portable_out)
            if mismatch is not None:
                return None, f"{rival.name} {mismatch}"
        except Exception as exc:
            self._recover()
            return None, describe_exception(exc)
        return rival, None

    def _measure_peer(self, rival: Peer) -> tuple[float, str | None]:
        """The peer timed as a candidate is (:meth:`_measure`): the same timer, flags and noise checks."""

        def take() -> Any:
            return measure(
                self.timer,
                rival.fn,
                config=rival,
                flush_l2=self.problem.flush_l2,
                launch_bound=self.problem.launch_bound,
            )

        sample, note = stable_measurement(take, self.monitor, self.noise)
        if not math.isfinite(sample.ms) or sample.ms <= 0:
            raise ValueError(f"the timer returned {sample.ms!r} for the peer")
        return sample.ms, note

    def _recover(self) -> None:
        """After a failed peer: give back what an out-of-memory left cached; a lost context ends the process."""
        if not self.context_alive():
            raise ContextLost("the CUDA context was lost while running the peer")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


__all__ = [
    "FAILED_COMPILE",
    "FAILED_CORRECTNESS",
    "FAILED_RUNTIME",
    "OK",
    "PRUNED",
    "Bench",
    "BenchError",
    "CandidateBench",
    "ContextLost",
    "RetimeOutcome",
    "TrialOutcome",
]
