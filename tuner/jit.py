"""One key tuned online: what a serving process (``TRITUNE_JIT=sync``) or its worker runs on a miss.

:func:`tune_one_key` is ``tune``'s own search of one key (:class:`~.study.KeyTuner`: the portable
default, stored and provisional winners, the nearest buckets' winners and the spec's starting
configs first, then TPE and a short climb; the correctness gate; every trial and the winner in
the config DB) with a smaller budget: ``trials`` configs and ``seconds`` of exploration. The bench
that runs the candidates (a worker process, so that a crashing candidate costs one trial) is made
once per process and kept for the next key.

Two processes on one host never tune one key at once: the key is claimed with a lock (one byte
per key of a lock file beside a SQLite DB, or in the user's cache folder for a server DB, where the
claim therefore holds per host and user; the kernel drops the lock when the process dies, however
it dies). A process that finds the key claimed either reports it as being tuned elsewhere
(``wait_s=0``) or waits for the claim and then takes the winner the other process stored, without
measuring. Hosts sharing a server DB do not see each other's claims; the DB keeps the faster winner.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton

from tritune.configs_db.errors import StoreError
from tritune.configs_db.records import WinnerRecord, key_text
from tritune.configs_db.store import ConfigStore
from tritune.configs_db.winner_fields import eager_fields
from tritune.kernels.device import DeviceInfo, device_info
from tritune.kernels.spec import KernelSpec, TuningKey
from tritune.kernels.winners import against_other_default, is_current

from .candidates import OK, PRUNED, Bench, BenchError
from .options import TuneOptions, TuningError, environment_id
from .studies import study_name
from .study import KeyTuner
from .timing import Timer, timer_for
from .worker import Worker

__all__ = [
    "BUSY",
    "FAILED",
    "FOUND",
    "TUNED",
    "JitResult",
    "await_winner",
    "plain_winner",
    "stored_winner",
    "tune_one_key",
]

log = logging.getLogger("tritune.jit")

#: Why a key's tune ended before it began: its seconds went on the claim or a locked DB.
_LATE = "the key's seconds ran out before its first trial"
#: The least time a tune waits for a locked DB, so that a winner stored meanwhile is read.
_MIN_DB_WAIT_S = 1.0


class _DefaultFailed(Exception):
    """The portable default failed: an online tune stops at once (no winner is possible)."""


#: What an online tune of a key came to.
TUNED, FOUND, BUSY, FAILED = "tuned", "found", "busy", "failed"

#: How often a process waiting for another's claim on a key looks again.
POLL_S = 0.1

#: The timer online tunes use (``None``: the device's own, as ``tune`` uses) and whether candidates
#: run in a worker process. Tests and the worker's ``--timer``/``--no-isolate`` replace them.
TIMER: Timer | None = None
ISOLATE = True


@dataclass(frozen=True)
class JitResult:
    """One online tune: ``outcome`` (:data:`TUNED`, :data:`FOUND`, :data:`BUSY` or :data:`FAILED`),
    the key's winner as the DB keeps it (``None`` unless tuned or found), seconds spent, trials
    measured here, and for a failure why."""

    outcome: str
    winner: WinnerRecord | None
    seconds: float
    measured: int = 0
    detail: str = ""


def tune_one_key(
    spec: KernelSpec[Any, Any],
    device: torch.device | str,
    key: TuningKey,
    *,
    trials: int,
    seconds: float,
    db_url: str,
    wait_s: float = 0.0,
    seed: int = 0,
) -> JitResult:
    """Tune ``key`` of ``spec`` on ``device`` into the config DB at ``db_url`` within the budget.

    ``trials``: configs measured at most; ``seconds``, counted from this call (the claim and the
    DB included; a start of the worker process before the key, once per process or after a
    candidate killed it, not: it would leave a first key nothing): no trial but the portable
    default starts past it (the default, the
    baseline no winner is admitted without, is measured however long its problems and compile
    took); a candidate under way and the final re-timing of the best configs finish, each
    bounded by ``tune``'s trial timeout (a candidate is never killed for the key's seconds: the
    kill would be stored as its failure). A locked DB is waited for at
    most the seconds left. The tune stops at once when the portable default fails. ``wait_s``:
    how long to wait for another process's claim on the key before reporting :data:`BUSY`. A key
    whose winner is stored already is :data:`FOUND`, not tuned again.
    """
    if trials < 1:
        raise ValueError(f"trials={trials!r}: expected a whole number of at least 1")
    if not seconds > 0:
        raise ValueError(f"seconds={seconds!r}: expected a positive number of seconds")
    started = time.monotonic()
    torch_device = torch.device(device)
    info = device_info(torch_device)
    name = study_name(spec.name, spec.version, info.slug, triton.__version__, key.to_dict())
    try:
        claim = _claim(db_url, name, wait_s)
        with claim as held:
            if not held:
                return JitResult(BUSY, None, time.monotonic() - started, detail="being tuned by another process")
            return _tune_claimed(spec, torch_device, info, key, trials, seconds, db_url, seed, started)
    except (OSError, StoreError) as exc:
        return JitResult(FAILED, None, time.monotonic() - started, detail=str(exc))


def _tune_claimed(
    spec: KernelSpec[Any, Any],
    torch_device: torch.device,
    info: DeviceInfo,
    key: TuningKey,
    trials: int,
    seconds: float,
    db_url: str,
    seed: int,
    started: float,
) -> JitResult:
    # A DB locked by another writer makes the call wait no longer than the key's seconds (a
    # moment at least: the winner a process tuned while this one waited for its claim is read).
    left = seconds - (time.monotonic() - started)
    store = ConfigStore(db_url, timeout_s=max(left, _MIN_DB_WAIT_S))
    try:
        stored = stored_winner(store, spec, info, key)
        if stored is not None:
            return JitResult(FOUND, stored, time.monotonic() - started)
        if left <= 0:
            return JitResult(FAILED, None, time.monotonic() - started, detail=_LATE)
        # The trial timeout is tune's own, never the key's seconds: a candidate killed for a short
        # budget would be stored as failed. The seconds end the search between trials instead.
        options = TuneOptions(trials=trials, time_budget_s=seconds, seed=seed, isolate=ISOLATE, time_peer=False)
        timer = TIMER if TIMER is not None else _device_timer(torch_device)
        bench, bench_lock = _bench(torch_device, timer, options)
        with bench_lock:
            budget_from = started
            if isinstance(bench, Worker):
                spawning = time.monotonic()
                try:
                    bench.start()
                except BenchError as exc:
                    return JitResult(FAILED, None, time.monotonic() - started, detail=str(exc))
                # The key's seconds resume where the worker's start-up began (the result's seconds
                # and the process's budget still count it).
                budget_from += time.monotonic() - spawning
            return _tune_on(spec, torch_device, info, key, store, timer, options, bench, trials, seconds, started,
                            budget_from)  # fmt: skip
    finally:
        store.close()


def _tune_on(
    spec: KernelSpec[Any, Any],
    torch_device: torch.device,
    info: DeviceInfo,
    key: TuningKey,
    store: ConfigStore,
    timer: Timer,
    options: TuneOptions,
    bench: Bench,
    trials: int,
    seconds: float,
    started: float,
    budget_from: float,
) -> JitResult:
    """One key's online tune on ``bench``, which the caller holds; ``started``: when the call began,
    ``budget_from``: when the key's seconds began (later by the worker's start-up, if any)."""
    log.info("%s %s: tuning online (%d trials, %g s)", spec.name, key_text(key), trials, seconds)
    default = spec.space.to_dict(spec.default_config(key))

    def on_trial(kernel: str, config: dict[str, Any], status: str, ms: float | None) -> None:
        log.info("%s %s: %s %s%s", kernel, key_text(key), " ".join(f"{k}={v}" for k, v in config.items()), status,
                 "" if ms is None else f" {ms:.4g} ms")  # fmt: skip
        if config == default and status not in (OK, PRUNED):
            # No winner can be chosen without it: the rest of the key's seconds would be wasted.
            raise _DefaultFailed(f"{spec.name} {key_text(key)}: the portable default failed ({status})")

    tuner = KeyTuner(
        spec,
        key,
        info,
        torch_device,
        store,
        environment_id(store, info),
        timer,
        options,
        on_trial=on_trial,
        bench=bench,
    )
    # The key's seconds count from the call (the claim, the DB and the problems too), not the worker's start-up.
    tuner.started = budget_from
    try:
        result = tuner.run()
    except _DefaultFailed as exc:
        ident = tuner.known.ident(spec.default_config(key))
        error = tuner.known.errors.get(ident)
        counts = tuner.known.counts
        return JitResult(FAILED, None, time.monotonic() - started, measured=counts["measured"] + counts["failed"],
                         detail=f"{exc}: {error}" if error else str(exc))  # fmt: skip
    except (TuningError, BenchError) as exc:
        return JitResult(FAILED, None, time.monotonic() - started, detail=str(exc))
    measured = result.measured + result.failed
    # What the DB keeps: the faster of this offer and one stored meanwhile (another host).
    winner = stored_winner(store, spec, info, key)
    return JitResult(TUNED, winner, time.monotonic() - started, measured=measured)


def await_winner(
    spec: KernelSpec[Any, Any], device: torch.device | str, key: TuningKey, *, db_url: str, wait_s: float
) -> WinnerRecord | None:
    """Wait up to ``wait_s`` seconds for another process's claim on ``key``, then read its stored winner.

    For a process that found the key being tuned elsewhere: it measures nothing itself.
    """
    info = device_info(torch.device(device))
    name = study_name(spec.name, spec.version, info.slug, triton.__version__, key.to_dict())
    with _claim(db_url, name, wait_s) as held:
        if not held:
            return None
        with ConfigStore(db_url) as store:
            return stored_winner(store, spec, info, key)


def stored_winner(
    store: ConfigStore, spec: KernelSpec[Any, Any], device: DeviceInfo, key: TuningKey
) -> WinnerRecord | None:
    """The current winner ``store`` holds for ``key`` (the running kernel version, Triton and torch:
    :func:`~tritune.kernels.winners.is_current`, timed against the running default), if any;
    another one is tuned again."""
    wanted = key.to_dict()
    for record in store.winners(gpu=device.slug, kernel=spec.name):
        if (
            record.key == wanted
            and record.kernel_version == spec.version
            and is_current(record)
            and not against_other_default(record)
        ):
            return record
    return None


def plain_winner(record: WinnerRecord) -> dict[str, Any]:
    """A winner as plain JSON values (what the background worker reports)."""
    return {
        "kernel": record.kernel,
        "kernel_version": record.kernel_version,
        "gpu": record.gpu,
        "key": dict(record.key),
        "config": dict(record.config),
        "time_ms": record.time_ms,
        "portable_ms": record.portable_ms,
        "speedup": record.speedup,
        "trials": record.trials,
        "triton_version": record.triton_version,
        "torch_version": record.torch_version,
        "tritune_version": record.tritune_version,
        "eager": None if record.eager is None else eager_fields(record.eager),
        "portable_config": record.portable_config,
    }


# ---- one bench per process --------------------------------------------------------------------

_benches: dict[tuple[str, int, bool], Bench] = {}
#: One lock per bench, held for a whole tune: a bench holds one key's problem open at a time, and
#: misses of several threads may be tuned at once (each would otherwise time the other's problem).
_bench_locks: dict[tuple[str, int, bool], threading.Lock] = {}
#: The device's own timer, one per device: a bench is kept per timer.
_timers: dict[str, Timer] = {}
_benches_lock = threading.Lock()


def _device_timer(device: torch.device) -> Timer:
    with _benches_lock:
        timer = _timers.get(str(device))
        if timer is None:
            timer = _timers[str(device)] = timer_for(device)
        return timer


def _bench(device: torch.device, timer: Timer, options: TuneOptions) -> tuple[Bench, threading.Lock]:
    """This process's bench for ``device`` (made on first use, closed at exit) and the lock a tune holds on it."""
    slot = (str(device), id(timer), options.isolate)
    with _benches_lock:
        bench = _benches.get(slot)
        if bench is None:
            bench = _benches[slot] = options.make_bench(device, timer)
            _bench_locks[slot] = threading.Lock()
        return bench, _bench_locks[slot]


@atexit.register
def close_benches() -> None:
    """Stop the worker processes online tunes started (at exit, or when a test is done with them)."""
    with _benches_lock:
        benches = list(_benches.values())
        _benches.clear()
    for bench in benches:
        with contextlib.suppress(Exception):
            bench.close()


# ---- claims on keys -----------------------------------------------------------------------------

#: This process's descriptor of each claim file: a POSIX record lock belongs to the process and
#: closing any descriptor of the file drops all of them, so each file is opened once and kept.
_claim_files: dict[Path, int] = {}
_claim_guard = threading.Lock()


def claim_path(db_url: str) -> Path:
    """The lock file of ``db_url``'s keys: beside an SQLite file, else in the user's cache folder."""
    from sqlalchemy.engine import make_url

    url = make_url(db_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        database = Path(str(url.database))
        return database.with_name(database.name + ".tritune-jit-lock")
    import platformdirs

    digest = hashlib.blake2b(db_url.encode(), digest_size=12).hexdigest()
    return Path(platformdirs.user_cache_dir("tritune", appauthor=False)) / f"jit-{digest}.lock"


@contextlib.contextmanager
def _claim(db_url: str, name: str, wait_s: float) -> Iterator[bool]:
    """Hold the claim on study ``name`` (one byte of the DB's claim file); yields whether it was taken.

    Waits up to ``wait_s`` seconds for another process to let it go.
    """
    path = claim_path(db_url)
    with _claim_guard:
        fd = _claim_files.get(path)
        if fd is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = _claim_files[path] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    offset = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") % (1 << 31)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
            break
        except (BlockingIOError, PermissionError):
            if time.monotonic() >= deadline:
                yield False
                return
            time.sleep(POLL_S)
    try:
        yield True
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)


def _after_fork() -> None:
    """A forked child starts without its parent's benches, timers and claim files: they are dropped,
    never closed (closing a bench would stop the parent's worker process; the child holds none of the
    parent's locks), and the locks guarding them are new (another thread may have held one)."""
    global _benches, _bench_locks, _timers, _benches_lock, _claim_files, _claim_guard
    _benches, _bench_locks, _timers, _benches_lock = {}, {}, {}, threading.Lock()
    _claim_files, _claim_guard = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
