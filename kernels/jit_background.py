"""The background worker of online tuning (``TRITUNE_JIT=background``), seen from the serving process.

:class:`BackgroundWorker` owns the one worker process (``python -m tritune.tuner.jit_worker``): a
call only puts its key on a queue, a writer thread starts the process and writes each request as
a JSON line, and a reader thread hands each report back. :func:`record_from_plain` checks a
reported winner field by field before anything admits it. What is tuned, and within which
budget, is decided in :mod:`.jit`; this module only carries keys to the worker and reports back.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.values import check_flat, printable, strict_loads, text_problem, winner_numbers_problem
from tritune.configs_db.winner_fields import eager_alternative, portable_config_problem

from . import registry
from .device import DeviceInfo
from .settings import Settings
from .spec import KernelSpec, TuningKey

__all__ = ["SKIPPED", "WORKER_ARGS", "BackgroundWorker", "record_from_plain"]

# The same logger as online tuning's: one name for a user to turn up or down.
log = logging.getLogger("tritune.jit")


#: Extra arguments of the background worker's command line (tests pass a fake timer this way).
WORKER_ARGS: list[str] = []

#: The outcome of a key handed to the worker and never sent to it (its kernel cannot be imported there).
SKIPPED = "skipped"


def _device_text(where: torch.device) -> str:
    """``cpu`` or ``cuda:N``: what the tuner and the worker are told."""
    if where.type == "cpu":
        return "cpu"
    index = where.index if where.index is not None else torch.cuda.current_device()
    return f"{where.type}:{index}"


def record_from_plain(values: Any, source: str) -> WinnerRecord:
    """A winner from the plain JSON values the background worker reports; ``ValueError`` names what is off."""
    if not isinstance(values, dict):
        raise ValueError(f"winner is {type(values).__name__}, expected an object")
    texts = ("kernel", "kernel_version", "gpu", "triton_version", "torch_version", "tritune_version")
    for name in texts:
        if not isinstance(values.get(name), str):
            raise ValueError(f"winner.{name} is missing or not a string")
        problem = text_problem(values[name], f"winner.{name}")
        if problem is not None:
            raise ValueError(problem)
    problem = winner_numbers_problem(values.get("time_ms"), values.get("portable_ms"), values.get("speedup"),
                                     values.get("trials"))  # fmt: skip
    if problem is not None:
        raise ValueError(f"winner: {problem}")
    return WinnerRecord(
        **{name: values[name] for name in texts},
        key=check_flat(values.get("key"), "winner.key"),
        config=check_flat(values.get("config"), "winner.config"),
        time_ms=float(values["time_ms"]),
        portable_ms=float(values["portable_ms"]),
        speedup=float(values["speedup"]),
        trials=int(values["trials"]),
        source=source,
        eager=eager_alternative(values.get("eager")),
        portable_config=_portable_config(values.get("portable_config")),
    )


def _portable_config(value: Any) -> dict[str, Any] | None:
    """A reported winner's portable default (see :class:`~tritune.configs_db.records.WinnerRecord`);
    ``ValueError`` where it is malformed."""
    problem = portable_config_problem(value)
    if problem is not None:
        raise ValueError(f"winner: {problem}")
    return None if value is None else dict(value)


class BackgroundWorker:
    """The one worker process of ``TRITUNE_JIT=background``, fed and read by two daemon threads.

    A call only puts the key on a queue: the process is started, and each request built and
    written, by the writer thread; the reader thread hands each report to ``on_report``. Neither
    ever holds up a call, whatever the worker does.
    """

    def __init__(
        self,
        on_report: Callable[[dict[str, Any], DeviceInfo, TuningKey], None],
        on_death: Callable[[int, str], None],
    ) -> None:
        self._on_report, self._on_death = on_report, on_death
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        #: (kernel, device, key as JSON) -> what the report is about.
        self._pending: dict[tuple[str, str, str], tuple[DeviceInfo, TuningKey]] = {}
        self._process: subprocess.Popen[str] | None = None
        threading.Thread(target=self._write, name="tritune-jit-writer", daemon=True).start()

    def hand(
        self, spec: KernelSpec[Any, Any], device: DeviceInfo, where: torch.device, key: TuningKey,
        current: Settings, seconds: float, wait_s: float,
    ) -> None:  # fmt: skip
        """Queue ``key`` for the worker: ``seconds`` to tune it, ``wait_s`` to wait for another process's claim."""
        self._queue.put((spec, device, where, key, current, seconds, wait_s))

    def close(self) -> None:
        """Let the worker finish its key and exit (its input ends)."""
        self._queue.put(None)

    def _command(self, current: Settings) -> list[str]:
        total = f"{current.jit_total_seconds:g}"
        return [sys.executable, "-m", "tritune.tuner.jit_worker", "--total-seconds", total, *WORKER_ARGS]

    def _start(self, current: Settings) -> subprocess.Popen[str]:
        env = dict(os.environ)
        env["TRITUNE_JIT"] = "off"
        # The serving process's import path: a user's kernel module resolves in the worker too.
        env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
        process = subprocess.Popen(
            self._command(current), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1
        )
        log.info("online tuning worker started (pid %d)", process.pid)
        threading.Thread(target=self._read, args=(process,), name="tritune-jit-reader", daemon=True).start()
        return process

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                if self._process is not None and self._process.stdin is not None:
                    self._process.stdin.close()
                return
            spec, device, where, key, current, seconds, wait_s = item
            target = registry.target_of(spec)
            if target is None:
                log.info("%s: not found in any module, so the online tuning worker cannot import it", spec.name)
                # Handed out but never sent: its reserved seconds are free again.
                self._on_report({"kernel": spec.name, "outcome": SKIPPED, "seconds": 0.0}, device, key)
                continue
            request = {
                "kernel": spec.name,
                "target": target,
                "device": _device_text(where),
                "key": key.to_dict(),
                "trials": current.jit_trials,
                "seconds": seconds,
                "wait_s": wait_s,
                "db_url": current.db_url,
            }
            self._pending[(spec.name, request["device"], json.dumps(request["key"], sort_keys=True))] = (device, key)
            try:
                if self._process is None:
                    self._process = self._start(current)
                assert self._process.stdin is not None
                self._process.stdin.write(json.dumps(request) + "\n")
                self._process.stdin.flush()
            except (OSError, ValueError) as exc:
                if self._process is None:
                    self._on_death(-1, f"could not be started ({exc})")
                # Otherwise the reader sees the worker's end and says why.
                return

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            try:
                report = strict_loads(line)
                if not isinstance(report, dict):
                    raise ValueError("a report is not an object")
                about = (str(report.get("kernel")), str(report.get("device")),
                         json.dumps(check_flat(report.get("key"), "key"), sort_keys=True))  # fmt: skip
                pending = self._pending.pop(about, None)
                if pending is None:
                    raise ValueError(f"a report about a key not handed out: {about}")
                self._on_report(report, *pending)
            except Exception as exc:  # a report must never take the reader down
                log.warning("online tuning worker: report not used (%s)", printable(str(exc), limit=1000))
        code = process.wait()
        if code != 0 or not self._queue.empty() or self._pending:
            self._on_death(code, f"(pid {process.pid}) exited with code {code}")
