"""The bench in the tuner's own process: :class:`LocalBench`, a :class:`~.candidates.Bench` with no crash isolation.

It holds one :class:`~.candidates.CandidateBench` at a time and runs its requests directly
(``TuneOptions(isolate=False)``, ``--no-isolate``; tests with a fake timer). A candidate that
leaves the CUDA context unusable ends the tune here, with an error that says to tune with
isolation (:mod:`.worker`), where it would cost one failed trial.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tritune.kernels.spec import KernelSpec, TuningKey

from .candidates import BenchError, CandidateBench, ContextLost, RetimeOutcome, TrialOutcome, describe_exception
from .noise import NoisePolicy, monitor_for
from .timing import Timer

log = logging.getLogger("tritune.tuner")


class LocalBench:
    """Runs candidates in this process: no crash isolation (a crash here ends the tune)."""

    def __init__(
        self, device: torch.device, timer: Timer, *, noise: NoisePolicy | None = None, compile_workers: int = 1
    ) -> None:
        self.device, self.timer, self.noise, self.compile_workers = device, timer, noise, compile_workers
        self._bench: CandidateBench | None = None

    def _current(self) -> CandidateBench:
        if self._bench is None:
            raise BenchError("no key is open")
        return self._bench

    def open(self, spec: KernelSpec[Any, Any], key: TuningKey, seed: int, default: dict[str, Any]) -> None:
        try:
            self._bench = CandidateBench(
                spec,
                key,
                self.device,
                seed,
                spec.space.parse(default),
                self.timer,
                monitor=monitor_for(self.device),
                noise=self.noise,
                compile_workers=self.compile_workers,
            )
        except Exception as exc:
            raise BenchError(describe_exception(exc)) from exc

    def precompile(self, configs: list[dict[str, Any]]) -> list[TrialOutcome | None] | None:
        try:
            return self._current().precompile(configs)
        except ContextLost as exc:
            raise BenchError(f"{exc}; tune with isolation to survive such candidates") from exc

    def trial(self, config: dict[str, Any], compiled: bool) -> TrialOutcome:
        result = self._current().trial(config, compiled)
        if result["fatal"]:
            raise BenchError(
                f"{config} left the CUDA context unusable ({result['error']}); tune with isolation to survive it"
            )
        return result

    def retime(self, configs: list[dict[str, Any]], rounds: int, peer: bool = False) -> RetimeOutcome | None:
        try:
            return self._current().retime(configs, rounds, peer)
        except Exception as exc:
            log.warning("final re-timing failed: %s", describe_exception(exc))
            return None

    def host_times(self, configs: list[dict[str, Any]]) -> list[float] | None:
        try:
            return self._current().host_times(configs)
        except Exception as exc:
            log.warning("timing the launches' host cost failed: %s", describe_exception(exc))
            return None

    def close(self) -> None:
        self._bench = None
