"""A key tuned by this process alone: the search loop (:mod:`.search`) on a study in memory.

The study lives in this process; the config DB is the record. Trials already stored for this
key (by a killed earlier run, or another tuner on the same DB right now) are taken in before each
batch, so they are answered, not measured again. Candidates run on a bench (:mod:`.candidates`), by
default in a worker process (:mod:`.worker`): a candidate that kills or hangs it is a failed trial.
This process keeps Optuna, the DB writes and the choice of the winner; the bench only measures.
"""

from __future__ import annotations

import contextlib
from typing import Any

import optuna
import torch

from tritune.configs_db.store import ConfigStore
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, TuningKey

from .backend import Asked, KeyBench
from .candidates import (
    FAILED_COMPILE,
    FAILED_CORRECTNESS,
    FAILED_RUNTIME,
    OK,
    PRUNED,
    Bench,
    BenchError,
)
from .known import OnTrial
from .options import KeyResult, TuneOptions, TuningError, environment_id, pick_winner, tritune_version
from .search import KeySearch
from .strategy import EARLIER_SEEDS, NEIGHBOUR_SEEDS
from .timing import Timer

__all__ = [
    "EARLIER_SEEDS",
    "FAILED_COMPILE",
    "FAILED_CORRECTNESS",
    "FAILED_RUNTIME",
    "NEIGHBOUR_SEEDS",
    "OK",
    "PRUNED",
    "KeyResult",
    "KeyTuner",
    "LocalStudy",
    "TuneOptions",
    "TuningError",
    "environment_id",
    "pick_winner",
    "tritune_version",
]


class LocalStudy:
    """A study in this process's memory: one worker, nothing running elsewhere, nothing to hand back."""

    shared = False
    worker = "this process"

    def sampler_seed(self, seed: int) -> int:
        return seed

    def lock(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def open(self, name: str, sampler: optuna.samplers.BaseSampler) -> tuple[optuna.Study, bool]:
        return optuna.create_study(study_name=name, direction="minimize", sampler=sampler), True

    def sweep(self, study: optuna.Study) -> None:
        return None

    def sign(self, study: optuna.Study, trial: optuna.trial.Trial) -> int | None:
        return trial.number

    def drop(self, trial_id: int) -> None:
        return None

    def release(self, study: optuna.Study, asked: list[Asked]) -> None:
        # Only this process asks the study, and it is gone with the run that failed.
        return None


class KeyTuner(KeySearch):
    """Tunes one key of one kernel on one device into one store, alone.

    ``bench`` is where candidates run; without one, the tuner makes its own for this key (a
    worker process when ``options.isolate``, else this process) and closes it afterwards. The
    ``tune`` command passes one worker for the whole run so that its start-up is paid once.
    """

    def __init__(
        self,
        spec: KernelSpec[Any, Any],
        key: TuningKey,
        device: DeviceInfo,
        torch_device: torch.device,
        store: ConfigStore,
        env_id: int,
        timer: Timer,
        options: TuneOptions,
        on_trial: OnTrial | None = None,
        bench: Bench | None = None,
    ) -> None:
        super().__init__(
            spec, key, device, torch_device, store, env_id, timer, options, backend=LocalStudy(), on_trial=on_trial
        )
        self.bench = bench

    def run(self) -> KeyResult:
        """Search the key to the end of its budget and offer its winner; the result."""
        default = self.spec.default_config(self.key)
        why = self.space.infeasible_reason(default, self.key, self.limits)
        if why is not None:
            raise TuningError(f"{self.spec.name} {self.key}: the portable default is infeasible here ({why})")
        owned = self.bench is None
        bench = KeyBench(self.options.make_bench(self.torch_device, self.timer) if self.bench is None else self.bench)
        try:
            # The problems first: a key whose portable default cannot run records no trial.
            self._ready(bench, default)
            try:
                visit = self.visit(bench)
            except BenchError as exc:
                raise TuningError(f"{self.spec.name} {self.key}: {exc}") from exc
        finally:
            if owned:
                bench.close()
        if visit.result is None:
            # Nothing else asks this study: it ends with every result in.
            raise TuningError(f"{self.spec.name} {self.key}: the search ended without a result")
        return visit.result
