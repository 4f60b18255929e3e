"""Online tuning (``TRITUNE_JIT``): a key with no stored winner is tuned on its first eager call.

The dispatcher imports this module only when the setting is not ``off``, at its first miss: a key
with no admitted winner of its own. Nothing here imports Optuna; the tuner (``tritune.tuner``, the
``tune`` extra) runs the search:

- ``sync``: in the calling thread (:func:`tritune.tuner.jit.tune_one_key`), within
  ``TRITUNE_JIT_TRIALS`` configs and ``TRITUNE_JIT_KEY_SECONDS``; the winner, stored in the user DB
  with every trial, is admitted into the dispatcher's table and serves this call if it clears the
  margin like any stored winner.
- ``background``: the call is served at once (nearest bucket, fallback key or portable default) and
  the key is handed to one worker process (``python -m tritune.tuner.jit_worker``, JSON lines over
  pipes, :mod:`.jit_background`); a daemon thread admits each winner it reports. Calls never wait
  for it.

A key is attempted at most once per process, and no more than ``TRITUNE_JIT_TOTAL_SECONDS`` are
spent in all. Nothing is tuned under CUDA-graph capture, ``torch.compile`` or ``torch.jit``
tracing, FakeTensor or any other dispatch mode, or a ``torch.func`` transform (``vmap``, ``grad``):
such a call's choice is remembered until an eager call could tune its key. Two processes on one
host never tune one key at once (a claim in a lock file beside a SQLite DB; for a server DB the
lock file is in the user's cache folder, so the claim holds per host and user there): the second
serves the best available config and admits the first one's winner when its claim ends. Processes
on other hosts (or of other users, for a server DB) may tune the same key at the same time; the DB
keeps the faster winner.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tritune.configs_db.records import Rejection, WinnerRecord, key_text
from tritune.configs_db.values import printable

from .device import DeviceInfo
from .jit_background import SKIPPED, BackgroundWorker, record_from_plain
from .misses import in_capture_or_trace
from .settings import Settings, settings
from .spec import KernelSpec, TuningKey
from .winners import Entry, admit

if TYPE_CHECKING:
    from .dispatcher import Dispatcher

__all__ = ["ONLINE", "OnlineTuning", "eager", "record_from_plain"]

log = logging.getLogger("tritune.jit")

#: What installs the tuner, in the one warning given when it is missing.
INSTALL_HINT = "pip install 'tritune[tune]'"


def claim_wait_s(key_seconds: float) -> float:
    """How long a process that found a key being tuned elsewhere waits for that tune to end.

    The other tune explores for ``key_seconds`` after setting up its problems and then re-times
    its best configs; this leaves room for both.
    """
    return 3.0 * key_seconds + 30.0


def eager() -> bool:
    """Whether the current call runs eagerly, where a tune may run in its stead (see
    :func:`.misses.in_capture_or_trace`: the config of a traced call is baked into its graph, and a
    capture must not synchronise or allocate)."""
    return not in_capture_or_trace()


def _tunable(spec: KernelSpec[Any, Any]) -> bool:
    """Whether the tuner can make problems for ``spec``: a declaration names a tuning half."""
    # Kernel(..., tuning=None) keeps None here; a KernelSpec subclass implements make_problem itself.
    return getattr(spec, "_tuning", True) is not None


def _tuner_missing() -> list[str]:
    """The ``tune`` extra's modules this interpreter cannot import (found, not imported)."""
    from tritune.tuner.entry import missing

    return missing()


Slot = tuple[str, str, TuningKey]


class OnlineTuning:
    """This process's online tuning: keys attempted, seconds spent, the background worker.

    A key's seconds are reserved when it is handed out (to this thread or the worker) and settled
    with what it took when it ends: misses of several threads at once never hand out more than
    ``TRITUNE_JIT_TOTAL_SECONDS`` between them. Once the seconds spent reach it, the bench (sync)
    and the worker (background) are closed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (kernel, device slug, key) attempted in this process: each at most once.
        self.attempted: set[Slot] = set()
        #: Seconds the keys that ended took.
        self.spent_s = 0.0
        #: Seconds held by each key being tuned (handed out, not ended yet).
        self._reserved: dict[Slot, float] = {}
        #: Why online tuning stopped in this process (the tuner is not installed, the worker died).
        self.stopped: str | None = None
        #: Whether it stopped for want of the tuner: the one reason a forked child inherits.
        self._tuner_absent = False
        self._worker: BackgroundWorker | None = None
        self._budget_logged = False
        self._failure_logged = False
        #: Set while this thread tunes: what the tuner runs must not start a tune of its own.
        self._local = threading.local()

    def reset(self) -> None:
        """Forget attempts, spending and a stop (tests); the worker, if any, is stopped."""
        with self._lock:
            worker, self._worker = self._worker, None
            self.attempted.clear()
            self.spent_s = 0.0
            self._reserved.clear()
            self.stopped = None
            self._tuner_absent = False
            self._budget_logged = False
        if worker is not None:
            worker.close()

    def after_fork(self) -> None:
        """A forked child starts with nothing of its parent's: a fresh lock (another thread may have
        held it at the fork), no worker (its process and threads are the parent's: not closed here),
        no attempts, reservations or spending of its own yet (the budget is per process), and no
        stop unless the tuner is missing (the parent's worker dying or spending its budget says
        nothing of the child's)."""
        if not self._tuner_absent:
            self.stopped = None
        self._lock = threading.Lock()
        self._local = threading.local()
        self._worker = None
        self.attempted = set()
        self._reserved = {}
        self.spent_s = 0.0
        self._budget_logged = False

    def seconds_free(self) -> bool:
        """Whether a miss now could be handed seconds: the process's budget is not all spent or held
        by keys being tuned, and online tuning has not stopped here."""
        with self._lock:
            held = self.spent_s + sum(self._reserved.values())
            return self.stopped is None and held < settings().jit_total_seconds

    def on_miss(
        self, dispatcher: Dispatcher, spec: KernelSpec[Any, Any], device: DeviceInfo, where: torch.device,
        key: TuningKey,
    ) -> Entry | None:  # fmt: skip
        """Tune ``key`` (sync: the winner's entry, admitted; background: handed out, ``None``) where allowed.

        Never raises into the call: online tuning only ever improves on what serves, so a failure
        of its own is logged (a warning the first time, DEBUG after) and the best available config
        serves.
        """
        try:
            return self._on_miss(dispatcher, spec, device, where, key)
        except Exception as exc:
            with self._lock:
                first, self._failure_logged = not self._failure_logged, True
            log.log(logging.WARNING if first else logging.DEBUG,
                    "%s %s: online tuning failed unexpectedly (%s); the best available config serves",
                    spec.name, key_text(key), printable(f"{type(exc).__name__}: {exc}", limit=1000))  # fmt: skip
            return None

    def _on_miss(
        self, dispatcher: Dispatcher, spec: KernelSpec[Any, Any], device: DeviceInfo, where: torch.device,
        key: TuningKey,
    ) -> Entry | None:  # fmt: skip
        current = settings()
        if current.jit == "off" or getattr(self._local, "tuning", False) or not eager() or not _tunable(spec):
            return None
        slot = (spec.name, device.slug, key)
        with self._lock:
            if self.stopped is not None or slot in self.attempted:
                return None
            spent = self.spent_s >= current.jit_total_seconds
            first = spent and not self._budget_logged
            if spent:
                self._budget_logged = True
            else:
                # Seconds other keys being tuned hold are not free; once they settle, what is left is.
                left = current.jit_total_seconds - self.spent_s - sum(self._reserved.values())
                if left <= 0:
                    # Not remembered: the key is tried again once those keys settle and free seconds.
                    dispatcher.defer()
                    return None
                seconds = min(current.jit_key_seconds, left)
                self.attempted.add(slot)
                self._reserved[slot] = seconds
                if current.jit == "background":
                    if self._worker is None:
                        absent = _tuner_missing()
                        if absent:
                            self._reserved.pop(slot)
                            self._tuner_absent = True
                            self.stopped = (f"online tuning (TRITUNE_JIT) needs the tune extra ({', '.join(absent)} "
                                            f"not installed here): {INSTALL_HINT}; serving without online "
                                            "tuning")  # fmt: skip
                            log.warning("%s", self.stopped)
                            return None
                        self._worker = BackgroundWorker(self._report_handler(dispatcher), self._worker_ended)
                    self._worker.hand(spec, device, where, key, current, seconds, claim_wait_s(seconds))
                    return None
        if spent:
            if first:
                log.info("online tuning budget of %g s spent (TRITUNE_JIT_TOTAL_SECONDS): no more keys are "
                         "tuned in this process", current.jit_total_seconds)  # fmt: skip
                self._close_spent()
            return None
        return self._sync(dispatcher, spec, device, where, key, current, seconds)

    # ---- sync -------------------------------------------------------------------------------

    def _tuner(self) -> Any:
        """``tritune.tuner.jit``, or ``None`` (with one warning) where the ``tune`` extra is missing."""
        try:
            return importlib.import_module("tritune.tuner.jit")
        except ImportError as exc:
            self._tuner_absent = True
            self._stop(f"online tuning (TRITUNE_JIT) needs the tune extra, which is not installed here ({exc}): "
                       f"{INSTALL_HINT}; serving without online tuning")  # fmt: skip
            return None

    def _sync(
        self, dispatcher: Dispatcher, spec: KernelSpec[Any, Any], device: DeviceInfo, where: torch.device,
        key: TuningKey, current: Settings, seconds: float,
    ) -> Entry | None:  # fmt: skip
        slot = (spec.name, device.slug, key)
        tuner = self._tuner()
        if tuner is None:
            self._settle(slot, 0.0)
            return None
        self._local.tuning = True
        started = time.monotonic()
        result = None
        try:
            result = tuner.tune_one_key(
                spec, where, key, trials=current.jit_trials, seconds=seconds, db_url=current.db_url
            )
        except Exception as exc:  # a DB that cannot be written, a bench that cannot start: serve on
            log.warning("%s %s: online tuning failed (%s); the best available config serves",
                        spec.name, key_text(key), printable(str(exc), limit=1000))  # fmt: skip
            return None
        finally:
            self._local.tuning = False
            # Settled however the tune ended (Ctrl-C too): a reservation left behind would defer
            # every other key of this process for good.
            self._settle(slot, time.monotonic() - started if result is None else result.seconds)
        if result.outcome == tuner.BUSY:
            self._await(dispatcher, spec, device, where, key, current, seconds)
            return None
        return self._take(dispatcher, device, spec.name, key, result.outcome, result.winner, result.seconds,
                          result.measured, result.detail, current.margin)  # fmt: skip

    def _await(
        self, dispatcher: Dispatcher, spec: KernelSpec[Any, Any], device: DeviceInfo, where: torch.device,
        key: TuningKey, current: Settings, seconds: float,
    ) -> None:  # fmt: skip
        """Another process tunes ``key``: admit its winner when its claim ends (a daemon thread)."""
        log.info("%s %s: being tuned by another process; the best available config serves meanwhile",
                 spec.name, key_text(key))  # fmt: skip
        tuner = self._tuner()

        def wait() -> None:
            try:
                record = tuner.await_winner(spec, where, key, db_url=current.db_url, wait_s=claim_wait_s(seconds))
            except Exception as exc:
                log.warning("%s %s: the winner tuned by another process was not read (%s)",
                            spec.name, key_text(key), printable(str(exc), limit=1000))  # fmt: skip
                return
            if record is not None:
                self._take(dispatcher, device, spec.name, key, "found", record, 0.0, 0, "", current.margin)

        threading.Thread(target=wait, name="tritune-jit-await", daemon=True).start()

    # ---- both -------------------------------------------------------------------------------

    def _settle(self, slot: Slot, seconds: float) -> None:
        """``slot``'s tune ended after ``seconds``: its reservation becomes what it spent. Once the
        budget is spent and no other key is being tuned, the bench and the worker are closed."""
        with self._lock:
            self._reserved.pop(slot, None)
            self.spent_s += max(0.0, seconds)
            spent = self.spent_s >= settings().jit_total_seconds and not self._reserved
        if spent:
            self._close_spent()

    def _close_spent(self) -> None:
        """The budget is spent: stop the worker process (it finishes the keys it holds) and close the
        benches of this process's sync tunes, unless a key is still being tuned here."""
        with self._lock:
            if self._reserved:
                return
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()
        # Imported only if a sync tune imported it: the benches are its.
        tuner = sys.modules.get("tritune.tuner.jit")
        if tuner is not None:
            tuner.close_benches()

    def _stop(self, reason: str) -> None:
        """Stop online tuning in this process, saying why once."""
        with self._lock:
            if self.stopped is not None:
                return
            self.stopped = reason
        log.warning("%s", reason)

    def _take(
        self, dispatcher: Dispatcher, device: DeviceInfo, kernel: str, key: TuningKey, outcome: str,
        winner: WinnerRecord | None, seconds: float, measured: int, detail: str, margin: float,
    ) -> Entry | None:  # fmt: skip
        """Log what a tune came to and admit its winner into the dispatcher; the winner's entry."""
        if winner is None:
            log.warning("%s %s: online tuning found no winner (%s); the best available config serves",
                        kernel, key_text(key), printable(detail or outcome, limit=1000))  # fmt: skip
            return None
        admitted = admit(winner, device)
        if isinstance(admitted, Rejection):
            log.warning("%s %s: online tuning's winner refused: %s", kernel, key_text(key),
                        printable(admitted.reason, limit=1000))  # fmt: skip
            return None
        _, admitted_key, entry = admitted
        config = " ".join(f"{name}={value}" for name, value in winner.config.items())
        serves = "" if winner.speedup >= 1.0 + margin else " (below the margin: the portable default serves)"
        if outcome == "tuned":
            log.warning("%s %s: tuned online in %.1f s (%d trials): %s, %.2fx the portable default%s",
                        kernel, key_text(key), seconds, measured, printable(config, limit=1000), winner.speedup,
                        serves)  # fmt: skip
        else:
            log.info("%s %s: took the winner another process stored: %s, %.2fx the portable default%s",
                     kernel, key_text(key), printable(config, limit=1000), winner.speedup, serves)  # fmt: skip
        dispatcher.admit_online(device, kernel, admitted_key, entry)
        return entry

    # ---- background -------------------------------------------------------------------------

    def _report_handler(self, dispatcher: Dispatcher) -> Callable[[dict[str, Any], DeviceInfo, TuningKey], None]:
        def handle(report: dict[str, Any], device: DeviceInfo, key: TuningKey) -> None:
            seconds = report.get("seconds")
            seconds = float(seconds) if isinstance(seconds, int | float) and not isinstance(seconds, bool) else 0.0
            outcome = str(report.get("outcome"))
            kernel = str(report.get("kernel"))
            self._settle((kernel, device.slug, key), seconds)
            if outcome == SKIPPED:
                return
            winner = None
            if report.get("winner") is not None:
                try:
                    winner = record_from_plain(report["winner"], "online tuning worker")
                except ValueError as exc:
                    log.warning("online tuning worker: a malformed report refused (%s)", printable(str(exc)))
                    return
            measured = report.get("measured")
            measured = measured if isinstance(measured, int) and not isinstance(measured, bool) else 0
            detail = str(report.get("detail") or "")
            self._take(dispatcher, device, kernel, key, outcome, winner, seconds, measured, detail,
                       settings().margin)  # fmt: skip

        return handle

    def _worker_ended(self, code: int, reason: str) -> None:
        """The worker exited with keys still handed to it: it died, or (status 0) its budget was spent."""
        if code == 0:
            with self._lock:
                self.stopped = self.stopped or "the online tuning worker's budget is spent"
                self._reserved.clear()
            log.info("online tuning worker %s: its budget (TRITUNE_JIT_TOTAL_SECONDS) is spent; no more keys "
                     "are tuned online in this process", reason)  # fmt: skip
            return
        self._stop(f"online tuning worker {reason}; no more keys are tuned online in this process")


#: This process's online tuning.
ONLINE = OnlineTuning()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: ONLINE.after_fork())
