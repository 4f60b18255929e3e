"""The miss log: keys this process resolved without a current exact winner, for ``tune --missed``.

A user runs their model once with the default settings, then ``tune --missed``, and every shape
the model called that had no winner of its own is tuned. To get there cheaply:

- :func:`note` runs where the dispatcher resolves a key of a real call without a current exact
  winner (none, or only a provisional one): once per resolution, never on the per-call memo hit.
  A process resolves a key again after ``reload_configs()`` or when online tuning admits a winner
  of the kernel, so a count is how many times the key was resolved, not how often it was called.
  It only adds to a dict in memory. Inside CUDA-graph capture or ``torch.compile`` tracing that is
  all it does; elsewhere it also starts the writer (once per process).
- The writer is a daemon thread that writes what was noted every :data:`FLUSH_INTERVAL_S` seconds,
  and once more at exit (``atexit``, registered when this module is imported: a process that only
  ever resolved keys while tracing or capturing, a ``torch.compile``-only model, gets them written
  then; with nothing noted the exit does nothing). The exit first waits, at most
  ``TRITUNE_DB_READ_TIMEOUT`` seconds, for a write of the writer's under way: a batch it could
  not store is written with the rest. Each write is one transaction on the ``misses`` table only
  (:func:`tritune.configs_db.misses.write_misses`: an upsert that adds the counts and moves
  ``last_seen``), bounded by ``TRITUNE_DB_READ_TIMEOUT`` seconds (the first write to a DB, which may
  create or upgrade it, longer), and never raises into the caller. Writes never overlap. What a
  write could not store stays in memory for the next one, except a write that ran past its bound:
  it may still complete, so its batch is dropped (the counts are advisory; a key counted twice
  would be overstated).
- The user DB does not exist yet, or is at an older schema revision: with Alembic importable
  (``pip install 'tritune[tune]'``, which anyone who runs ``tune`` has) it is created or upgraded
  the way ``tune`` does it, then written, in a folder that exists (a serving process creates no
  folder but the default DB's own; a missing one is said once at INFO and retried). Without
  Alembic the misses stay in memory, one INFO line says how to get them logged, and later writes
  try again (a ``tune`` run may create the DB).
- A DB that refuses writes (a read-only file, folder or mount): one INFO line, and this process
  stops writing misses (they stay in memory: :func:`pending`). Any other failure (a lock held past
  the bound): one INFO line the first time, retried at the next interval.

``TRITUNE_MISS_LOG=0`` turns all of it off. Each miss is logged to the DB in force when it was
noted (``TRITUNE_DB``).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from tritune.configs_db.values import canonical_json, printable

from . import settings as settings_module
from .device import DeviceInfo
from .spec import KernelSpec, TuningKey

log = logging.getLogger("tritune.misses")

#: Seconds between the writer's batches (and the exit's last one).
FLUSH_INTERVAL_S = 30.0

#: (DB URL, GPU slug, kernel, kernel version, key): what identifies one logged row.
Ident = tuple[str, str, str, str, TuningKey]


@dataclass
class Seen:
    """How often and when a key was resolved without a winner since the last write."""

    count: int
    first: datetime
    last: datetime


def in_capture_or_trace() -> bool:
    """Whether this thread traces or captures: ``torch.compile`` tracing, ``torch.jit`` tracing or
    scripting, FX tracing, a dispatch mode (FakeTensor, ``make_fx``, functionalization, ...), a
    ``torch.func`` transform (``vmap``, ``grad``, ...) or CUDA-graph capture. Nothing may tune,
    synchronise or start a thread there.

    Never raises into a call: a private check a torch release drops is skipped, and one that raises
    counts as tracing (the cautious answer).
    """
    try:
        if torch.compiler.is_compiling() or torch.jit.is_scripting() or torch.jit.is_tracing():
            return True
        # Private torch APIs: looked up, never assumed.
        dispatch_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)
        if dispatch_depth is not None and dispatch_depth() > 0:
            return True
        # torch.func transforms (vmap, grad, jvp, ...): the call's tensors are wrappers, not the
        # problem a tune would time.
        functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
        if functorch_active is not None and functorch_active():
            return True
        # is_fx_tracing logs a deprecation warning (torch >= 2.13); its successor answers the same for FX.
        symbolic_trace = getattr(torch.fx, "_symbolic_trace", None)
        fx_tracing = getattr(symbolic_trace, "is_fx_symbolic_tracing", None) or getattr(
            symbolic_trace, "is_fx_tracing", None
        )
        if fx_tracing is not None and fx_tracing():
            return True
        # No capture can run before CUDA is initialised, and the query itself needs CUDA.
        return bool(torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return True


class MissLog:
    """The process's miss log (see the module docstring); :data:`MISSES` is the one instance."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Held by one write at a time (the writer thread's and the exit's).
        self._writing = threading.Lock()
        self._pending: dict[Ident, Seen] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        #: DB URLs that refused writes: nothing more is tried there by this process.
        self._refused: set[str] = set()
        #: Messages already logged, so that each is said once.
        self._told: set[str] = set()

    def note(self, spec: KernelSpec[Any, Any], device: DeviceInfo, key: TuningKey) -> None:
        """Record that ``key`` resolved without a current exact winner; start the writer unless tracing or capturing."""
        current = settings_module.settings()
        if not current.miss_log:
            return
        now = datetime.now(timezone.utc)
        ident = (current.db_url, device.slug, spec.name, spec.version, key)
        with self._lock:
            seen = self._pending.get(ident)
            if seen is None:
                self._pending[ident] = Seen(1, now, now)
            else:
                seen.count += 1
                seen.last = now
        if self._thread is None and not in_capture_or_trace():
            self._start()

    def pending(self) -> dict[Ident, Seen]:
        """What was noted and not written yet (a copy)."""
        with self._lock:
            return {ident: Seen(s.count, s.first, s.last) for ident, s in self._pending.items()}

    def clear(self) -> None:
        """Forget what was noted and which DBs refused writes (tests)."""
        with self._lock:
            self._pending.clear()
            self._refused.clear()
            self._told.clear()

    def flush(self, timeout_s: float | None = None) -> int:
        """Write what was noted; how many rows were written. Never raises.

        ``timeout_s`` bounds each DB's write (default: ``TRITUNE_DB_READ_TIMEOUT``).
        """
        try:
            return self._flush(timeout_s)
        except Exception as exc:  # the log must never take the serving process down
            self._tell(f"missed keys not logged: {printable(str(exc), limit=1000)}")
            return 0

    def _flush(self, timeout_s: float | None) -> int:
        from tritune.configs_db import misses as store

        bound = settings_module.settings().db_read_timeout if timeout_s is None else timeout_s
        if not self._writing.acquire(timeout=bound):
            return 0
        try:
            with self._lock:
                taken, self._pending = self._pending, {}
            by_url: dict[str, list[tuple[Ident, Seen]]] = {}
            for ident, seen in taken.items():
                by_url.setdefault(ident[0], []).append((ident, seen))
            written = 0
            for url, items in by_url.items():
                if url in self._refused:
                    self._put_back(items)
                    continue
                rows = [_row(ident, seen) for ident, seen in items]
                try:
                    written += store.write_misses(url, rows, timeout_s=bound)
                except store.NotWritable as exc:
                    self._refused.add(url)
                    self._put_back(items)
                    self._tell(
                        f"config DB {store.display_url(url)} refuses writes ({exc}): missed keys are not logged by "
                        "this process (TRITUNE_MISS_LOG=0 stops noting them)"
                    )
                except store.WriteTimedOut as exc:
                    # It may still land: offered again, its counts could be added twice.
                    self._tell(f"{len(items)} missed key(s) dropped, not retried: {printable(str(exc), limit=1000)} "
                               "(the write may still complete)")  # fmt: skip
                except store.SchemaNeeded as exc:
                    self._put_back(items)
                    self._tell(
                        f"{len(items)} missed key(s) kept in memory, not logged: {exc}; install the tuner "
                        "(pip install 'tritune[tune]') so that serving creates or upgrades the DB, or run tune once"
                    )
                except Exception as exc:
                    self._put_back(items)
                    self._tell(f"missed keys not logged yet (retried later): {printable(str(exc), limit=1000)}")
            return written
        finally:
            self._writing.release()

    def _put_back(self, items: list[tuple[Ident, Seen]]) -> None:
        with self._lock:
            for ident, seen in items:
                held = self._pending.get(ident)
                if held is None:
                    self._pending[ident] = seen
                else:
                    held.count += seen.count
                    held.first = min(held.first, seen.first)
                    held.last = max(held.last, seen.last)

    def _tell(self, message: str) -> None:
        # One INFO line per distinct message: a DB that keeps refusing does not flood the log.
        if message not in self._told:
            self._told.add(message)
            log.info("%s", message)

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            thread = threading.Thread(target=self._run, name="tritune-miss-log", daemon=True)
            self._thread = thread
        thread.start()

    def _run(self) -> None:
        while not self._wake.wait(FLUSH_INTERVAL_S):
            self.flush()

    def _at_exit(self) -> None:
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # A batch the writer holds (waiting on a lock another process holds) comes back to
            # _pending if its write fails: wait for it, bounded, rather than lose it with the thread.
            thread.join(settings_module.settings().db_read_timeout)
        if self._pending:
            self.flush()

    def _after_fork(self) -> None:
        # A forked child starts with its own log: the parent writes what it noted, and its thread
        # does not exist here.
        self._lock = threading.Lock()
        self._writing = threading.Lock()
        self._pending = {}
        self._wake = threading.Event()
        self._thread = None


def _row(ident: Ident, seen: Seen) -> Any:
    import triton

    from tritune.configs_db.misses import MissRecord

    _url, gpu, kernel, version, key = ident
    return MissRecord(
        gpu=gpu,
        kernel=kernel,
        kernel_version=version,
        key_json=canonical_json(key.to_dict()),
        triton_version=str(triton.__version__),
        torch_version=str(torch.__version__),
        count=seen.count,
        first_seen=seen.first,
        last_seen=seen.last,
    )


MISSES = MissLog()
atexit.register(lambda: MISSES._at_exit())
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: MISSES._after_fork())


def note(spec: KernelSpec[Any, Any], device: DeviceInfo, key: TuningKey) -> None:
    """Record a key resolved without an exact admitted winner (the dispatcher's hook)."""
    MISSES.note(spec, device, key)


def flush(timeout_s: float | None = None) -> int:
    """Write the noted misses now; how many rows were written (never raises)."""
    return MISSES.flush(timeout_s)


def pending() -> dict[Ident, Seen]:
    """What was noted and not written yet."""
    return MISSES.pending()
