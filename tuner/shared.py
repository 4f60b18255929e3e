"""One worker of shared studies: processes on one or many hosts tune the same keys through one storage.

Optuna's study in the shared storage (:mod:`.studies`) is the sampler state every worker asks;
the config DB's trials table stays the record of every measurement (one row per config, key and
environment). A worker visits the keys of its plan in turn; one visit of a key:

1. Join the key's study (under the study lock): create it if new, add the stored trials it lacks
   as finished trials, and enqueue the seeds it lacks, each exactly once however many workers
   join: :class:`~.study.KeyTuner`'s seeds (portable default, stored winner, the spec's starting
   configs, a seeded sample of feasible configs, or the whole feasible space when that fits the
   budget).
2. Ask batches while the study has budget left, in KeyTuner's phases. The budget counts distinct
   configs measured or held (running) by any worker, so workers together measure ``--trials``
   configs per key (two workers that ask for the same spare slots at once: the older trial keeps
   its slot). The exploration (seeds, then TPE; an infeasible proposal's place goes to a random
   unseen feasible config) stops at the last ``polish`` share of the budget, for all workers
   together. The climb takes that share once as many results are in (a worker that finds the
   exploration's last trials still running elsewhere comes back later): a worker that finds the
   queue empty enqueues the neighbours of the best config so far that nobody runs.
3. Before measuring, look again: a config already in the trials table, or finished in the study
   by another worker, is answered without measuring; a config that another worker's trial holds
   since earlier is left to it (told pruned, ``outcome=duplicate``). The study is read before the
   trials table, and a measuring worker stores the trial before telling Optuna, so of two workers
   asking the same config at once exactly one measures it (both, at worst, on hosts whose clocks
   disagree).
4. Every asked trial beats a heartbeat until told (RDB storages); on a journal the worker holds a
   presence lock while it lives. Before each batch the worker fails the trials whose heartbeat
   stopped, or whose worker no longer holds its lock, and Optuna enqueues them again, so another
   worker retries the trial of a worker killed mid-measurement, and a run started after a killed
   one takes over the trials it left running.
5. When nothing runs and the budget is spent, the worker holding the study lock re-times the
   best configs on its own bench, offers the winner (the DB keeps the faster offer) and marks the
   study finalized: one winner per key and GPU model. A worker finding other workers' trials
   still running moves on to its next key and comes back.

Workers on another GPU model tune other studies (the GPU slug is in the name) and write winners
for their own GPU only.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import optuna
import torch
import triton
from optuna.trial import FrozenTrial, TrialState

from tritune.configs_db.store import ConfigStore
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, TuningKey

from .candidates import OK, PRUNED, Bench, BenchError, LocalBench, TrialOutcome
from .studies import (
    DUPLICATE,
    FINALIZED_ATTR,
    META_ATTR,
    OUTCOME_ATTR,
    REUSED,
    SEEDS_ATTR,
    WORKER_ATTR,
    Heartbeat,
    StudyStorage,
    measured_outcome,
    study_name,
)
from .study import KeyResult, KeyTuner, TuneOptions, TuningError
from .timing import Timer

log = logging.getLogger("tritune.tuner")

Ident = tuple[Any, ...]
#: Called after each trial with (kernel, config, status, ms), as ``KeyTuner`` does.
OnTrial = Callable[[str, dict[str, Any], str, float | None], None]
#: A trial this worker asked, with its storage id (what heartbeats are recorded against).
Asked = tuple[optuna.trial.Trial, int]
Started = tuple[datetime, int]


def _started(trial: FrozenTrial) -> Started:
    """When a trial started, the trial number breaking ties: of two running trials of one config, the
    first keeps it. (Clocks of two hosts may disagree; then both may measure it, but never neither.)"""
    return trial.datetime_start or datetime.max, trial.number


def worker_name(device: str, pid: int | None = None) -> str:
    """How a worker signs the trials it asks: host, process (this one by default) and device."""
    return f"{socket.gethostname()}:{os.getpid() if pid is None else pid}:{device}"


@dataclass
class Visit:
    """What one visit of a key came to."""

    done: bool
    measured: int = 0
    result: KeyResult | None = None
    #: Who finalized the key, when it was done by another worker.
    finalized: dict[str, Any] | None = None


class KeyBench:
    """The worker's bench and the key open on it: a key is opened again only after another was."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self._open: tuple[str, str, TuningKey] | None = None

    def ready(self, tuner: KeyTuner, default: Any) -> Bench:
        wanted = (tuner.spec.name, tuner.spec.version, tuner.key)
        if self._open != wanted:
            self._open = None
            try:
                self.bench.open(tuner.spec, tuner.key, tuner.options.seed, tuner.space.to_dict(default))
            except BenchError as exc:
                raise TuningError(f"{tuner.spec.name} {tuner.key}: cannot set up the problem ({exc})") from exc
            self._open = wanted
        return self.bench

    def close(self) -> None:
        self.bench.close()


class SharedKeyTuner(KeyTuner):
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
        super().__init__(spec, key, device, torch_device, store, env_id, timer, options, on_trial=on_trial)
        self.where, self.heartbeat, self.worker = where, heartbeat, worker
        self.name = study_name(spec.name, spec.version, device.slug, triton.__version__, self.key_dict)
        self.distributions = self._distributions()
        self.feasible = self.space.feasible(key, self.limits)
        self.exhaustive = len(self.feasible) <= options.trials
        # Workers share the seeds (the study's start) but not the sampler's random stream.
        self.worker_seed = options.seed + zlib.crc32(worker.encode()) % 65536
        self.rng = random.Random(self.worker_seed)
        self.study: optuna.Study | None = None
        self._study_id: int | None = None

    # ---- what is known ----------------------------------------------------------------------

    def _trial_ident(self, trial: FrozenTrial) -> Ident | None:
        params = trial.params or trial.system_attrs.get("fixed_params")
        if not params:
            return None
        try:
            return self._ident(self.space.parse(params))
        except (TypeError, ValueError):
            return None

    def _refresh_table(self) -> None:
        """Take in this key's stored trials (this environment): measured by anyone, ever."""
        for row in self.store.measured_trials(self.env_id, self.spec.name, self.spec.version, self.key_dict):
            try:
                ident = self._ident(self.space.parse(row.config))
            except ValueError:
                continue
            self.status[ident] = row.status
            if row.error is not None:
                self.errors[ident] = row.error
            if row.status == OK and row.time_ms is not None:
                self.times[ident] = row.time_ms

    def _results(self, trials: list[FrozenTrial]) -> set[Ident]:
        """Configs with a result: stored (measured or failed), or finished in the study with one."""
        found = {ident for ident, status in self.status.items() if status != PRUNED}
        for trial in trials:
            if measured_outcome(trial):
                ident = self._trial_ident(trial)
                if ident is not None:
                    found.add(ident)
        return found

    def _claimed(self, trials: list[FrozenTrial]) -> set[Ident]:
        """Configs that count against the budget: those with a result, and those running."""
        claimed = self._results(trials)
        for trial in trials:
            if trial.state == TrialState.RUNNING:
                ident = self._trial_ident(trial)
                if ident is not None:
                    claimed.add(ident)
        return claimed

    def _finalized(self, study: optuna.Study) -> dict[str, Any] | None:
        """The study's finalized mark, if it covers this worker's budget."""
        mark = study.user_attrs.get(FINALIZED_ATTR)
        if not isinstance(mark, dict):
            return None
        if mark.get("exhausted") or int(mark.get("budget", 0)) >= self.options.trials:
            return mark
        return None

    # ---- joining ----------------------------------------------------------------------------

    def _join(self, default: Any) -> optuna.Study:
        sampler = self._sampler(self.exhaustive, self.worker_seed, shared=True)
        storage = self.where.open()
        with self.where.lock(self.name):
            try:
                study = optuna.create_study(study_name=self.name, storage=storage, sampler=sampler)
                meta = {
                    "kernel": self.spec.name,
                    "kernel_version": self.spec.version,
                    "gpu": self.device.slug,
                    "triton": triton.__version__,
                    "key": self.key_dict,
                }
                study.set_user_attr(META_ATTR, meta)
            except optuna.exceptions.DuplicatedStudyError:
                study = optuna.load_study(study_name=self.name, storage=storage, sampler=sampler)
            if self._finalized(study) is None:
                self._seed(study, default)
        self._study_id = storage.get_study_id_from_name(self.name)
        return study

    def _seed(self, study: optuna.Study, default: Any) -> None:
        """Add the stored measurements and the seeds the study lacks (called under the study lock)."""
        self._refresh_table()
        trials = study.get_trials(deepcopy=False)
        finished = {self._trial_ident(t) for t in trials if t.state == TrialState.COMPLETE}
        present = {self._trial_ident(t) for t in trials if t.state != TrialState.FAIL or measured_outcome(t)}
        for ident, ms in self.times.items():
            if ident in finished:
                continue
            params = self.space.to_dict(self.space.config_type(*ident))
            study.add_trial(
                optuna.trial.create_trial(
                    params=params,
                    distributions=self.distributions,
                    value=ms,
                    user_attrs={OUTCOME_ATTR: REUSED, WORKER_ATTR: "config DB"},
                )
            )
            present.add(ident)
        # The shared start does not depend on the worker: the seeds of a single-process tune, fixed
        # by the first worker to seed the study (they include the nearest buckets' winners, which
        # a worker joining later could find more of in the DB).
        seeds = study.user_attrs.get(SEEDS_ATTR)
        if not isinstance(seeds, list):
            seeds = self._seeds(default, self.feasible, self.exhaustive, random.Random(self.options.seed))
            study.set_user_attr(SEEDS_ATTR, seeds)
        for values in seeds:
            try:
                ident = self._ident(self.space.parse(values))
            except ValueError:
                continue
            if ident not in present:
                study.enqueue_trial(values)
                present.add(ident)

    # ---- one visit --------------------------------------------------------------------------

    def visit(self, bench: KeyBench) -> Visit:
        """Measure this worker's share of the key, and finalize it if it is complete."""
        default = self.spec.default_config(self.key)
        why = self.space.infeasible_reason(default, self.key, self.limits)
        if why is not None:
            raise TuningError(f"{self.spec.name} {self.key}: the portable default is infeasible here ({why})")
        if self.study is None:
            self.study = self._join(default)
        study = self.study
        mark = self._finalized(study)
        if mark is not None:
            if "error" in mark:
                raise TuningError(f"{mark['error']} (found in the shared study)")
            return Visit(done=True, finalized=mark)
        measured, stop = self._measure_share(study, bench, default)
        return self._finalize(study, bench, default, measured, stop)

    def _measure_share(self, study: optuna.Study, bench: KeyBench, default: Any) -> tuple[int, str]:
        """Ask and measure until the study's budget is spent; how many were measured here, and why it stopped.

        The phases are :class:`~.study.KeyTuner`'s, counted over all workers: the exploration (seeds,
        then TPE, a random unseen feasible config in place of each infeasible proposal) stops at the
        polish share, however many workers ask at once; the climb starts once that many results are
        in, from the best of them. A worker that finds the exploration's last trials still running
        elsewhere stops with ``wait`` (it comes back), as a lone tuner would wait for its batch.
        """
        opts = self.options
        started = time.monotonic()
        budget = opts.trials
        polish_from = self._polish_from(self.exhaustive)
        max_asks = 20 * budget + len(self.feasible)
        asks = measured = 0
        while asks < max_asks:
            if opts.time_budget_s is not None and time.monotonic() - started > opts.time_budget_s:
                return measured, "time"
            self.where.fail_stale(study, self.heartbeat)
            trials = study.get_trials(deepcopy=False)
            self._refresh_table()
            claimed = self._claimed(trials)
            if len(claimed) >= budget:
                return measured, "budget"
            waiting = any(t.state == TrialState.WAITING for t in trials)
            if self.exhaustive:
                unseen = [
                    c for c in self.feasible if self._ident(c) not in claimed and self._ident(c) not in self.status
                ]
                if not unseen:
                    return measured, "budget"
                if not waiting:
                    # Deferred configs (two workers backed off) come back through the queue.
                    for config in self.rng.sample(unseen, min(len(unseen), opts.batch_size)):
                        study.enqueue_trial(self.space.to_dict(config))
            elif len(claimed) >= polish_from:
                if len(self._results(trials)) < polish_from:
                    return measured, "wait"
                if not waiting:
                    # The incumbent's neighbours that nobody measures or runs.
                    for config in self._climb(self._room(len(claimed), polish_from), claimed):
                        study.enqueue_trial(self.space.to_dict(config))
            limit = polish_from if len(claimed) < polish_from else budget
            room = self._room(len(claimed), polish_from)
            queued = {self._trial_ident(t) for t in trials if t.state == TrialState.WAITING}
            pending: list[tuple[Asked, Any]] = []
            while len(pending) < room and asks < max_asks:
                asked = [self._ask(study) for _ in range(min(room - len(pending), max_asks - asks))]
                asks += len(asked)
                found, infeasible = self._sort_out(study, asked, limit)
                pending.extend(found)
                # As KeyTuner: each infeasible proposal's place goes to an unseen feasible config, asked
                # next; not one already queued (a seed), which two workers would then ask at once.
                taken = claimed | queued | {self._ident(config) for _, config in pending}
                replaced = 0
                for _ in range(infeasible):
                    stand_in = self._stand_in(self.feasible, self.rng, taken)
                    if stand_in is None:
                        break
                    study.enqueue_trial(self.space.to_dict(stand_in))
                    taken.add(self._ident(stand_in))
                    replaced += 1
                if not replaced:
                    break
            if pending:
                measured += self._measure(study, bench, default, pending)
        return measured, "asks"

    def _ask(self, study: optuna.Study) -> Asked:
        """A new trial, held and signed by this worker."""
        assert self._study_id is not None
        while True:
            with warnings.catch_warnings():
                # Optuna beats only inside optimize() and says so; this worker beats itself (Heartbeat).
                warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used", UserWarning)
                trial = study.ask(self.distributions)
            trial_id = self.where.open().get_trial_id_from_study_id_trial_number(self._study_id, trial.number)
            self.heartbeat.hold(trial_id, self.name, trial.number)
            try:
                trial.set_user_attr(WORKER_ATTR, self.worker)
            except optuna.exceptions.UpdateFinishedTrialError:
                # Released by another process before it was signed (taken for a dead worker's): not ours.
                self.heartbeat.drop(trial_id)
                log.warning("%s: trial %d was released before this worker signed it; asking another", self.name,
                            trial.number)  # fmt: skip
                continue
            return trial, trial_id

    def _tell(self, study: optuna.Study, asked: Asked, outcome: str, value: float | None = None) -> None:
        trial, trial_id = asked
        self.heartbeat.drop(trial_id)
        try:
            trial.set_user_attr(OUTCOME_ATTR, outcome)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Failed as stale meanwhile (heartbeats that did not reach the database): its retry
            # finds this result in the trials table, where it was stored first.
            log.warning("%s: trial %d was failed as stale while this worker held it", self.name, trial.number)
            return
        if value is not None:
            study.tell(trial, value, skip_if_finished=True)
        elif outcome.startswith("failed"):
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        else:
            study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)

    def _sort_out(self, study: optuna.Study, asked: list[Asked], limit: int) -> tuple[list[tuple[Asked, Any]], int]:
        """Answer what is known, leave what others hold, prune the infeasible; the rest is to be measured.

        Returns the trials to measure (as many as fit under ``limit`` claimed configs) and how many
        infeasible proposals are to be replaced.
        """
        mine = {trial.number for trial, _ in asked}
        # The study first, then the trials table: see the module docstring for why this order.
        trials = study.get_trials(deepcopy=False)
        self._refresh_table()
        finished: dict[Ident, float] = {}
        failed: set[Ident] = set()
        # Per config, when the first of the other workers' running trials of it started.
        running: dict[Ident, Started] = {}
        started = {trial.number: _started(trial) for trial in trials}
        for trial in trials:
            ident = self._trial_ident(trial)
            if ident is None or trial.number in mine:
                continue
            if trial.state == TrialState.COMPLETE and trial.value is not None:
                finished[ident] = min(trial.value, finished.get(ident, trial.value))
            elif measured_outcome(trial):
                failed.add(ident)
            elif trial.state == TrialState.RUNNING:
                running[ident] = min(started[trial.number], running.get(ident, started[trial.number]))
        pending = []
        taken: set[Ident] = set()
        told: set[int] = set()
        infeasible = 0
        try:
            for item in asked:
                config = self.space.parse(item[0].params)
                ident = self._ident(config)
                if ident in taken:
                    self._tell(study, item, DUPLICATE)
                elif ident in self.status or ident in finished or ident in failed:
                    self._tell(study, item, REUSED, self.times.get(ident, finished.get(ident)))
                elif ident in running and running[ident] < started.get(item[0].number, (datetime.max, item[0].number)):
                    # Another worker's trial of this config started first: it measures it. (Of two
                    # running at once, exactly one backs off, so a config, the portable default
                    # included, is never left unmeasured by both.)
                    self._tell(study, item, DUPLICATE)
                else:
                    reason = self.space.infeasible_reason(config, self.key, self.limits)
                    if reason is None:
                        pending.append((item, config))
                        taken.add(ident)
                        continue
                    self._record(config, PRUNED, None, reason)
                    self._tell(study, item, PRUNED)
                    infeasible += 1
                taken.add(ident)
                told.add(item[0].number)
        except BaseException:
            self._release([item for item in asked if item[0].number not in told])
            raise
        kept = self._within_budget(study, trials, pending, limit)
        # Past the limit, nothing takes the place of an infeasible proposal.
        return kept, infeasible if len(kept) == len(pending) else 0

    def _within_budget(
        self, study: optuna.Study, trials: list[FrozenTrial], pending: list[tuple[Asked, Any]], limit: int
    ) -> list[tuple[Asked, Any]]:
        """The pending trials that fit under ``limit`` claimed configs (the key's budget, or the end of
        its exploration); the rest are told as duplicates, unmeasured.

        Workers that read the same spare budget at once each ask for it. Of the claims running
        side by side, the older trial (lower number) keeps its place: a worker counts the other
        workers' running trials that are older than its own first pending one, so of two racing
        workers exactly one backs off, and the budget is never overshot by a race.
        """
        if not pending:
            return pending
        mine = {asked[0].number for asked, _ in pending}
        first = min(mine)
        claimed = {ident for ident, status in self.status.items() if status != PRUNED}
        for trial in trials:
            if trial.number in mine:
                continue
            if measured_outcome(trial) or (trial.state == TrialState.RUNNING and trial.number < first):
                ident = self._trial_ident(trial)
                if ident is not None:
                    claimed.add(ident)
        room = max(0, limit - len(claimed))
        for asked, _ in pending[room:]:
            self._tell(study, asked, DUPLICATE)
        return pending[:room]

    def _measure(self, study: optuna.Study, bench: KeyBench, default: Any, pending: list[tuple[Asked, Any]]) -> int:
        told: set[int] = set()

        def tell(index: int, result: TrialOutcome) -> None:
            item = pending[index][0]
            value = result["ms"] if result["status"] == OK else None
            self._tell(study, item, result["status"], value)
            told.add(index)

        try:
            self._measure_batch(bench.ready(self, default), [config for _, config in pending], on_result=tell)
        except BaseException:
            # Left to another worker at once, rather than after the heartbeat's grace period.
            self._release([item for index, (item, _) in enumerate(pending) if index not in told])
            raise
        return len(pending)

    def _release(self, items: list[Asked]) -> None:
        study = self.study
        if study is None or not items:
            return
        try:
            self.where.release(study, [trial.number for trial, _ in items])
        except Exception as exc:
            log.warning("%s: could not hand %d trial(s) back to the study: %s", self.name, len(items), exc)
        for _, trial_id in items:
            self.heartbeat.drop(trial_id)

    # ---- the winner -------------------------------------------------------------------------

    def _finalize(self, study: optuna.Study, bench: KeyBench, default: Any, measured: int, stop: str) -> Visit:
        if stop == "wait":
            return Visit(done=False, measured=measured)
        with self.where.lock(self.name):
            mark = self._finalized(study)
            if mark is not None:
                return Visit(done=True, measured=measured, finalized=mark)
            trials = study.get_trials(deepcopy=False)
            if any(t.state == TrialState.RUNNING for t in trials):
                return Visit(done=False, measured=measured)
            self._refresh_table()
            claimed = self._claimed(trials)
            exhausted = all(self._ident(c) in claimed or self._ident(c) in self.status for c in self.feasible)
            if stop == "budget" and len(claimed) < self.options.trials and not exhausted:
                # Trials counted while running were lost and are queued again: measure them first.
                return Visit(done=False, measured=measured)
            for trial in trials:
                ident = self._trial_ident(trial)
                if trial.state == TrialState.COMPLETE and trial.value is not None and ident is not None:
                    self.times[ident] = min(trial.value, self.times.get(ident, trial.value))
            ok = set(self.times)
            self.counts["reused"] = max(0, len(ok) - self.counts["measured"])
            try:
                result = self._finish(bench.ready(self, default), default)
            except TuningError as exc:
                study.set_user_attr(FINALIZED_ATTR, {"error": str(exc), "budget": self.options.trials})
                raise
            study.set_user_attr(
                FINALIZED_ATTR,
                {
                    "worker": self.worker,
                    "budget": self.options.trials,
                    "exhausted": exhausted,
                    "config": result.config,
                    "time_ms": result.best_ms,
                    "portable_ms": result.portable_ms,
                },
            )
        return Visit(done=True, measured=measured, result=result)


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
