"""Optuna storage shared by several tuner workers: opening it, study names, locks, heartbeats, summaries.

Optuna is the distributed engine: workers that share a storage cooperate on one study per
(kernel, kernel version, GPU model, Triton version, key). The storage is one of

- an RDB URL (``postgresql+psycopg://...``; ``sqlite:///...`` for one process): Optuna's
  ``RDBStorage`` with heartbeats. A worker records a heartbeat for each trial it holds; any worker
  fails the trials whose heartbeat went silent for the grace period and enqueues them again
  (``RetryHeartbeatStaleTrialCallback``), so the trials of a dead worker on any host are retried.
- a journal file (``JournalStorage``): several workers on one host without a database server.
  Optuna recommends it over SQLite for concurrent processes, whose write transactions start as
  reads and fail with "database is locked" when two upgrade at once. It has no heartbeats: each
  worker holds a presence lock beside the journal while it lives (:mod:`.journal`), and any worker
  fails and retries the running trials of a worker that no longer holds it (so does the local
  coordinator, :mod:`.fleet`, as soon as it sees a worker process exit).

A :class:`StudyStorage` is plain values, sent as is to worker processes. Besides the storage it
gives a cross-process lock per study (a PostgreSQL advisory lock, or an ``fcntl`` record lock
beside a SQLite or journal file), which the workers take to seed a study and to choose its winner.
Opening an RDB storage takes such a lock too: Optuna creates its tables and stamps their version
on first open, and processes doing that at once fail on a unique constraint.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import hashlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from . import journal

log = logging.getLogger("tritune.tuner")

#: Prefix of every study name tritune creates (``tune status`` lists only these).
STUDY_PREFIX = "tritune"
#: Study user attribute holding what the study tunes (kernel, version, GPU, Triton, key).
META_ATTR = "tritune"
#: Study user attribute holding the seeds the first worker enqueued (later workers add no others).
SEEDS_ATTR = "seeds"
#: Study user attribute set once a worker has chosen and offered the key's winner.
FINALIZED_ATTR = "finalized"
#: Trial user attributes: the worker that asked the trial, and what became of it.
WORKER_ATTR = "worker"
OUTCOME_ATTR = "outcome"
#: Outcomes of trials that were not measured: answered from a stored trial, or left to an earlier
#: trial of the same config that another worker holds.
REUSED = "reused"
#: System attribute Optuna's retry callback sets on a retried trial: the number of the failed one.
FAILED_TRIAL_ATTR = "failed_trial"
DUPLICATE = "duplicate"
#: Dialects of RDB storages a study lock is implemented for.
RDB_DIALECTS = ("postgresql", "sqlite")
#: How long closing a :class:`Heartbeat` waits for a beat being recorded.
HEARTBEAT_CLOSE_S = 5.0
#: Name of the lock taken while an RDB storage is opened (no study name starts this way).
SCHEMA_LOCK = "tritune-storage-schema"


class StudyStorageError(ValueError):
    """The study storage cannot be opened: the message names it and says what to do."""


@contextlib.contextmanager
def _quiet_experimental() -> Iterator[None]:
    """Heartbeats and trial retries are marked experimental by Optuna; they are what we rely on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def study_name(kernel: str, kernel_version: str, gpu: str, triton_version: str, key: dict[str, Any]) -> str:
    """The shared study of one key, readable in ``tune status`` and optuna-dashboard.

    The Triton version is part of the name: it decides the generated code, and the runtime refuses
    winners measured under another one, so their times must not be pooled.
    """
    fields = ",".join(f"{name}={value}" for name, value in key.items())
    return f"{STUDY_PREFIX}:{kernel}:{kernel_version}:{gpu}:triton-{triton_version}:{fields}"


def trial_ident(trial: FrozenTrial) -> tuple[tuple[str, Any], ...] | None:
    """The config a trial stands for (enqueued ones carry it before their params are set); ``None`` if unknown yet."""
    params = trial.params or trial.system_attrs.get("fixed_params") or {}
    return tuple(sorted(params.items())) if params else None


def measured_outcome(trial: FrozenTrial) -> bool:
    """Whether a finished trial holds a real result: measured (or reused) rather than deferred or lost."""
    outcome = trial.user_attrs.get(OUTCOME_ATTR)
    if trial.state == TrialState.COMPLETE:
        return True
    return trial.state == TrialState.FAIL and isinstance(outcome, str) and outcome.startswith("failed")


@dataclass(frozen=True)
class StudyStorage:
    """Where shared studies live: an RDB URL or a journal file path, and the retry policy."""

    location: str
    heartbeat_interval_s: int = 10
    grace_period_s: int = 60
    max_retry: int = 3

    def __repr__(self) -> str:
        # The URL may hold a password: keep it out of logs and tracebacks.
        return f"StudyStorage({self.display()!r})"

    @property
    def is_rdb(self) -> bool:
        return "://" in self.location

    @property
    def dialect(self) -> str:
        return self.location.split("://", 1)[0].split("+", 1)[0].lower() if self.is_rdb else "journal"

    @property
    def has_heartbeat(self) -> bool:
        return self.is_rdb

    def display(self) -> str:
        """The location fit for messages (a password is masked)."""
        if not self.is_rdb:
            return self.location
        from sqlalchemy.engine import make_url

        return make_url(self.location).render_as_string(hide_password=True)

    def problem(self) -> str | None:
        """Why this storage cannot hold shared studies; ``None`` if it can."""
        if self.is_rdb and self.dialect not in RDB_DIALECTS:
            return f"{self.display()}: shared studies live in PostgreSQL, SQLite or a journal file, not {self.dialect}"
        if self.is_rdb and self.dialect == "sqlite" and self._sqlite_path() is None:
            return f"{self.display()}: an in-memory SQLite storage cannot be shared; give a file"
        if self.heartbeat_interval_s < 1 or self.grace_period_s <= self.heartbeat_interval_s:
            return "the grace period must be longer than the heartbeat interval (both whole seconds, >= 1)"
        return None

    def _sqlite_path(self) -> Path | None:
        from tritune.configs_db.urls import sqlite_file

        path: Path | None = sqlite_file(self.location)
        return path

    def open(self) -> optuna.storages.BaseStorage:
        """This process's storage object (one per process and location)."""
        return _open_storage(self)

    def retry(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """Enqueue ``trial`` (failed, never measured) again, up to ``max_retry`` times.

        The copy does not carry the failed trial's worker (Optuna's retry copies every user
        attribute): once taken and until signed by its new worker, it would pass for a running trial
        of the dead one and be released again (:meth:`fail_stale`).
        """
        unsigned = copy.copy(trial)
        unsigned.user_attrs = {name: value for name, value in trial.user_attrs.items() if name != WORKER_ATTR}
        with _quiet_experimental():
            optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=self.max_retry)(study, unsigned)

    def fail_stale(self, study: optuna.Study, heartbeat: Heartbeat) -> int:
        """Fail and retry the trials whose worker is gone; how many this process released.

        On an RDB storage, those whose heartbeat stopped (Optuna's check). On a journal, those whose
        worker no longer holds its presence lock, and those signed with this worker's own name that
        it does not hold (a dead process whose pid this one reuses). On both, those that were never
        signed at all once they are older than the grace period (a worker killed between asking a
        trial and signing it, a few milliseconds: such a trial has no heartbeat either, and would
        hold its key unfinished for ever).
        """
        oldest = datetime.now().timestamp() - self.grace_period_s
        lost = []
        if self.has_heartbeat:
            with _quiet_experimental():
                optuna.storages.fail_stale_trials(study)
            lost = [
                trial.number
                for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if not isinstance(trial.user_attrs.get(WORKER_ATTR), str) and _started_before(trial, oldest)
            ]
            released = self.release(study, lost) if lost else 0
            if released:
                log.warning("%s: released %d trial(s) never signed by a worker", study.study_name, released)
            return released
        journal_path = Path(self.location)
        verdicts: dict[str, bool] = {}
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            worker = trial.user_attrs.get(WORKER_ATTR)
            if not isinstance(worker, str):
                dead = _started_before(trial, oldest)
            elif worker == heartbeat.worker:
                dead = not heartbeat.holds(study.study_name, trial.number)
            else:
                if worker not in verdicts:
                    verdicts[worker] = journal.alive(journal_path, worker)
                dead = not verdicts[worker]
            if dead:
                lost.append(trial.number)
        released = self.release(study, lost) if lost else 0
        if released:
            log.warning("%s: released %d trial(s) of worker(s) no longer running", study.study_name, released)
        return released

    def release(self, study: optuna.Study, numbers: Sequence[int]) -> int:
        """Fail the still-running trials ``numbers`` of ``study`` and enqueue them again; how many were released.

        A trial finished meanwhile (by its worker, or failed by another worker's heartbeat check)
        is left alone: only the process whose update turns it from RUNNING to FAIL retries it.
        """
        storage = self.open()
        study_id = storage.get_study_id_from_name(study.study_name)
        released = 0
        for number in numbers:
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
            try:
                if not storage.set_trial_state_values(trial_id, TrialState.FAIL):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue
            self.retry(study, storage.get_trial(trial_id))
            released += 1
        return released

    def release_worker(self, worker: str, names: Sequence[str]) -> int:
        """Release every running trial that ``worker`` asked in the studies ``names`` (its process is gone)."""
        released = 0
        existing = set(optuna.study.get_all_study_names(self.open()))
        for name in names:
            if name not in existing:
                continue
            study = self.load(name)
            mine = [
                t.number
                for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if t.user_attrs.get(WORKER_ATTR) == worker
            ]
            released += self.release(study, mine)
        return released

    def load(self, name: str, sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
        return optuna.load_study(
            study_name=name, storage=self.open(), sampler=sampler or optuna.samplers.RandomSampler()
        )

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Hold the cross-process lock of study ``name`` (released too if this process dies)."""
        key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)
        if self.dialect == "postgresql":
            from sqlalchemy import text

            with _lock_engine(self.location).connect() as connection:
                connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
                try:
                    yield
                finally:
                    connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
            return
        base = self._sqlite_path() if self.is_rdb else Path(self.location)
        assert base is not None
        # One byte per study: studies lock independently of each other.
        with _file_lock(base.with_name(base.name + ".tritune-lock"), key % (1 << 31)):
            yield


#: This process's descriptors of lock files, and how deep each (file, byte) lock is held. A POSIX record
#: lock belongs to the process and is dropped when any descriptor of its file is closed, and taking it
#: twice then releasing once drops it too: one descriptor per file, kept open, and a count per byte.
_lock_files: dict[Path, int] = {}
_lock_depth: dict[tuple[Path, int], int] = {}
_lock_guard = threading.Lock()


@contextlib.contextmanager
def _file_lock(path: Path, offset: int) -> Iterator[None]:
    """Hold byte ``offset`` of ``path`` exclusively against other processes (re-entrant in this one)."""
    with _lock_guard:
        fd = _lock_files.get(path)
        if fd is None:
            fd = _lock_files[path] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    slot = (path, offset)
    if _lock_depth.get(slot, 0) == 0:
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, offset)
    _lock_depth[slot] = _lock_depth.get(slot, 0) + 1
    try:
        yield
    finally:
        _lock_depth[slot] -= 1
        if _lock_depth[slot] == 0:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)


@functools.cache
def _open_storage(where: StudyStorage) -> optuna.storages.BaseStorage:
    if not where.is_rdb:
        return _open_journal(Path(where.location))
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if where.dialect == "sqlite":
        # Wait for another process's write lock instead of failing at once.
        engine_kwargs = {"connect_args": {"timeout": 60}}
        path = where._sqlite_path()
        assert path is not None
        path.parent.mkdir(parents=True, exist_ok=True)
    from sqlalchemy.exc import SQLAlchemyError

    try:
        # Optuna creates its tables and stamps their version on first open: one process at a time.
        with where.lock(SCHEMA_LOCK), _quiet_experimental():
            return optuna.storages.RDBStorage(
                where.location,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=where.heartbeat_interval_s,
                grace_period=where.grace_period_s,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                    max_retry=where.max_retry
                ),
            )
    except (SQLAlchemyError, OSError, RuntimeError) as exc:
        # RuntimeError: Optuna's tables are of another Optuna version (its message says how to upgrade).
        raise StudyStorageError(f"study storage {where.display()}: cannot be opened: {_first_line(exc)}") from exc


def _open_journal(path: Path) -> optuna.storages.BaseStorage:
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    what = f"study journal {path}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StudyStorageError(f"{what}: its folder cannot be created ({exc.strerror or exc})") from exc
    wrong = journal.problem(path)
    if wrong is not None:
        raise StudyStorageError(f"{what} {wrong}")
    try:
        return JournalStorage(JournalFileBackend(str(path)))
    except Exception as exc:
        raise StudyStorageError(f"{what} {journal.unreadable(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@functools.cache
def _lock_engine(url: str) -> Any:
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    return create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")


class Heartbeat:
    """Shows that worker ``worker`` lives and which trials it holds.

    On an RDB storage it records a heartbeat for every trial the worker holds, at the storage's
    interval, in a thread. Optuna beats only inside ``study.optimize``; the tuner asks and tells, so
    it beats itself. A trial is beaten as soon as it is asked: Optuna never fails a running trial
    that has no heartbeat at all, so a worker killed before its first beat would block the study for
    good. On a journal it holds the worker's presence lock (:class:`.journal.Presence`) instead.
    """

    def __init__(self, storage: optuna.storages.BaseStorage, where: StudyStorage, worker: str) -> None:
        self.worker = worker
        self._storage = storage if where.has_heartbeat else None
        self._interval = where.heartbeat_interval_s
        #: Storage id of each held trial -> its study name and number.
        self._held: dict[int, tuple[str, int]] = {}
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._presence = None if where.is_rdb else journal.Presence(Path(where.location), worker)
        if self._storage is not None:
            self._thread = threading.Thread(target=self._beat, name="tritune-heartbeat", daemon=True)
            self._thread.start()

    def _record(self, trial_id: int) -> None:
        record = getattr(self._storage, "record_heartbeat", None)
        if record is not None:
            record(trial_id)

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            with self._guard:
                held = sorted(self._held)
            for trial_id in held:
                try:
                    self._record(trial_id)
                except Exception as exc:
                    # A passing database hiccup must not end the beat; a long one makes the trial stale.
                    log.warning("heartbeat of trial %d not recorded: %s", trial_id, exc)

    def hold(self, trial_id: int, study_name: str, number: int) -> None:
        """From now on this worker holds trial ``trial_id`` (number ``number`` of study ``study_name``)."""
        if self._storage is not None:
            self._record(trial_id)
        with self._guard:
            self._held[trial_id] = (study_name, number)

    def drop(self, trial_id: int) -> None:
        with self._guard:
            self._held.pop(trial_id, None)

    def holds(self, study_name: str, number: int) -> bool:
        """Whether this worker holds trial ``number`` of ``study_name``."""
        with self._guard:
            return (study_name, number) in self._held.values()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # A beat stuck on a locked or distant database does not hold the worker (a daemon thread).
            self._thread.join(HEARTBEAT_CLOSE_S)
        if self._presence is not None:
            self._presence.close()


@dataclass
class StudySummary:
    """One tritune study as ``tune status`` shows it."""

    name: str
    gpu: str
    kernel: str
    kernel_version: str
    key: dict[str, Any]
    counts: dict[str, int] = field(default_factory=dict)
    best_ms: float | None = None
    best_params: dict[str, Any] = field(default_factory=dict)
    finalized: dict[str, Any] | None = None


def summaries(where: StudyStorage, gpu: str | None = None, kernel: str | None = None) -> list[StudySummary]:
    """The tritune studies in the storage, with trial counts by state and the best result so far."""
    names = sorted(n for n in optuna.study.get_all_study_names(where.open()) if n.startswith(STUDY_PREFIX + ":"))
    found = []
    for name in names:
        study = where.load(name)
        attrs = study.user_attrs
        meta = attrs.get(META_ATTR)
        if not isinstance(meta, dict):
            continue
        if (gpu is not None and meta.get("gpu") != gpu) or (kernel is not None and meta.get("kernel") != kernel):
            continue
        summary = StudySummary(
            name=name,
            gpu=str(meta.get("gpu")),
            kernel=str(meta.get("kernel")),
            kernel_version=str(meta.get("kernel_version")),
            key=dict(meta.get("key") or {}),
            finalized=attrs.get(FINALIZED_ATTR),
        )
        counts = dict.fromkeys(("measured", "reused", "failed", "running", "waiting", "lost", "retried"), 0)
        measured: set[Any] = set()
        for trial in study.get_trials(deepcopy=False):
            outcome = trial.user_attrs.get(OUTCOME_ATTR)
            if FAILED_TRIAL_ATTR in trial.system_attrs and trial.state.is_finished():
                counts["retried"] += 1
            if trial.state == TrialState.RUNNING:
                counts["running"] += 1
            elif trial.state == TrialState.WAITING:
                counts["waiting"] += 1
            elif trial.state == TrialState.FAIL and not measured_outcome(trial):
                # Failed by a heartbeat check or a coordinator: the worker died holding it.
                counts["lost"] += 1
            elif outcome == REUSED:
                counts["reused"] += 1
            elif trial.state == TrialState.COMPLETE or measured_outcome(trial):
                ident = trial_ident(trial)
                if ident not in measured:
                    measured.add(ident)
                    counts["failed" if trial.state == TrialState.FAIL else "measured"] += 1
            better = trial.value is not None and (summary.best_ms is None or trial.value < summary.best_ms)
            if trial.state == TrialState.COMPLETE and better:
                summary.best_ms, summary.best_params = trial.value, dict(trial.params)
        summary.counts = counts
        found.append(summary)
    return found


def _started_before(trial: FrozenTrial, timestamp: float) -> bool:
    """Whether ``trial`` started before ``timestamp`` (seconds since the epoch)."""
    started = trial.datetime_start
    return started is not None and started.timestamp() < timestamp
