"""One worker of shared studies: processes on one or many hosts tune the same keys through one storage.

Optuna's study in the shared storage (:mod:`.studies`) is the sampler state every worker asks;
the config DB's trials table stays the record of every measurement (one row per config, key and
environment). The search is :mod:`.search`'s loop, the one a lone tuner runs; what sharing adds is
this module's :class:`SharedStudy` backend:

1. The study is joined under a cross-process lock (created by the first worker), and the seeds
   are enqueued once, by the first worker to seed it: workers share the seeds, not the random
   stream (each samples with its own seed).
2. The budget counts distinct configs measured or held (running) by any worker, so workers
   together measure ``--trials`` configs per key; two workers that ask for the same spare slots at
   once: the older trial keeps its slot. A config that another worker's trial holds since earlier
   is left to it (told pruned, ``outcome=duplicate``). The exploration stops at the polish share
   for all workers together, and the climb starts once that many results are in: a worker that
   finds the exploration's last trials still running elsewhere visits its other keys meanwhile.
3. Every asked trial beats a heartbeat until told (RDB storages); on a journal the worker holds a
   presence lock while it lives. Before each batch the worker fails the trials whose heartbeat
   stopped, or whose worker no longer holds its lock, and Optuna enqueues them again, so another
   worker retries the trial of a worker killed mid-measurement, and a run started after a killed
   one takes over the trials it left running.
4. When nothing runs and the budget is spent, the worker holding the study lock re-times the
   best configs on its own bench, offers the winner (the DB keeps the faster offer) and marks the
   study finalized: one winner per key and GPU model. A worker finding other workers' trials
   still running moves on to its next key and comes back.

Workers on another GPU model tune other studies (the GPU slug is in the name) and write winners
for their own GPU only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna
import torch

from tritune.configs_db.store import ConfigStore
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, TuningKey

from .backend import Asked, KeyBench, Visit
from .candidates import Bench
from .known import OnTrial
from .local_bench import LocalBench
from .options import KeyResult, TuneOptions, TuningError
from .search import KeySearch
from .studies import WORKER_ATTR, Heartbeat, StudyStorage
from .timing import Timer

__all__ = ["KeyBench", "SharedKeyTuner", "SharedStudy", "Visit", "WorkerReport", "run_worker", "worker_name"]

log = logging.getLogger("tritune.tuner")


def worker_name(device: str, pid: int | None = None) -> str:
    """How a worker signs the trials it asks: host, process (this one by default) and device."""
    return f"{socket.gethostname()}:{os.getpid() if pid is None else pid}:{device}"


class SharedStudy:
    """A study in a storage several workers share: claims by heartbeat, a lock across processes."""

    shared = True

    def __init__(self, where: StudyStorage, heartbeat: Heartbeat, worker: str) -> None:
        self.where, self.heartbeat, self.worker = where, heartbeat, worker
        self._study_id: int | None = None

    def sampler_seed(self, seed: int) -> int:
        return seed + zlib.crc32(self.worker.encode()) % 65536

    def lock(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.where.lock(name)

    def open(self, name: str, sampler: optuna.samplers.BaseSampler) -> tuple[optuna.Study, bool]:
        storage = self.where.open()
        try:
            study = optuna.create_study(study_name=name, storage=storage, sampler=sampler)
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
            created = False
        self._study_id = storage.get_study_id_from_name(name)
        return study, created

    def sweep(self, study: optuna.Study) -> None:
        self.where.fail_stale(study, self.heartbeat)

    def sign(self, study: optuna.Study, trial: optuna.trial.Trial) -> int | None:
        assert self._study_id is not None
        trial_id = self.where.open().get_trial_id_from_study_id_trial_number(self._study_id, trial.number)
        self.heartbeat.hold(trial_id, study.study_name, trial.number)
        try:
            trial.set_user_attr(WORKER_ATTR, self.worker)
        except optuna.exceptions.UpdateFinishedTrialError:
            self.heartbeat.drop(trial_id)
            return None
        return trial_id

    def drop(self, trial_id: int) -> None:
        self.heartbeat.drop(trial_id)

    def release(self, study: optuna.Study, asked: list[Asked]) -> None:
        try:
            self.where.release(study, [trial.number for trial, _ in asked])
        except Exception as exc:
            log.warning("%s: could not hand %d trial(s) back to the study: %s", study.study_name, len(asked), exc)
        for _, trial_id in asked:
            self.heartbeat.drop(trial_id)


class SharedKeyTuner(KeySearch):
    """Tunes one key together with the other workers of its shared study (see the module docstring)."""

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
        *,
        where: StudyStorage,
        heartbeat: Heartbeat,
        worker: str,
        on_trial: OnTrial | None = None,
    ) -> None:
        backend = SharedStudy(where, heartbeat, worker)
        super().__init__(spec, key, device, torch_device, store, env_id, timer, options, backend, on_trial)
        self.where, self.heartbeat, self.worker = where, heartbeat, worker


@dataclass
class WorkerReport:
    results: list[KeyResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Keys finalized by other workers: study name -> their finalized mark.
    by_others: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_worker(
    plan: list[tuple[KernelSpec[Any, Any], TuningKey]],
    *,
    device: DeviceInfo,
    torch_device: torch.device,
    store: ConfigStore,
    env_id: int,
    timer: Timer,
    options: TuneOptions,
    where: StudyStorage,
    worker: str,
    start: int = 0,
    poll_s: float = 1.0,
    on_trial_for: Callable[[KernelSpec[Any, Any], TuningKey], OnTrial | None] | None = None,
    on_done: Callable[[SharedKeyTuner, Visit], None] | None = None,
) -> WorkerReport:
    """Visit the plan's keys (from ``start``, so that workers spread over keys) until every one is finalized.

    ``on_trial_for(spec, key)`` gives each key's trial callback (progress bars); ``on_done`` is
    called once per key, when it is finalized by this worker or found finalized by another.
    """
    heartbeat = Heartbeat(where.open(), where, worker)
    bench: Bench
    if options.isolate:
        from .worker import Worker, worker_device

        bench = Worker(
            worker_device(torch_device),
            timer,
            trial_timeout_s=options.trial_timeout_s,
            noise=options.noise,
            compile_workers=options.compile_workers,
        )
    else:
        bench = LocalBench(torch_device, timer, noise=options.noise, compile_workers=options.compile_workers)
    key_bench = KeyBench(bench)
    order = plan[start % len(plan) :] + plan[: start % len(plan)] if plan else []
    pending = [
        SharedKeyTuner(
            spec, key, device, torch_device, store, env_id, timer, options,
            where=where, heartbeat=heartbeat, worker=worker,
            on_trial=on_trial_for(spec, key) if on_trial_for is not None else None,
        )
        for spec, key in order
    ]  # fmt: skip
    report = WorkerReport()
    try:
        while pending:
            progressed = False
            for tuner in list(pending):
                try:
                    visit = tuner.visit(key_bench)
                except TuningError as exc:
                    report.errors.append(str(exc))
                    pending.remove(tuner)
                    continue
                progressed = progressed or visit.measured > 0
                if not visit.done:
                    continue
                pending.remove(tuner)
                if visit.result is not None:
                    report.results.append(visit.result)
                elif visit.finalized is not None:
                    report.by_others[tuner.name] = visit.finalized
                if on_done is not None:
                    on_done(tuner, visit)
            if pending and not progressed:
                # Other workers hold the remaining trials: wait for them (or for their heartbeats to stop).
                time.sleep(poll_s)
    finally:
        heartbeat.close()
        key_bench.close()
    return report
