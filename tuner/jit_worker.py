"""The worker process of ``TRITUNE_JIT=background``: tunes the keys one serving process hands it, in order.

The serving process starts it on its first miss (``python -m tritune.tuner.jit_worker``,
:mod:`tritune.kernels.jit`) and writes one JSON request per line on its input::

    {"kernel": "toy_scale", "target": "module:NAME", "device": "cuda:0", "key": {...},
     "trials": 16, "seconds": 5.0, "wait_s": 45.0, "db_url": "sqlite:///..."}

and reads one JSON report per line on its output, in the same order::

    {"kernel": ..., "device": ..., "key": {...}, "outcome": "tuned", "winner": {...} | null,
     "seconds": 3.2, "measured": 16, "detail": ""}

Each key is :func:`.jit.tune_one_key` within its budgets, and all of them within
``--total-seconds``; a key another process is tuning is waited for (``wait_s``) and its stored
winner reported. Logs go to the standard error (nothing but reports reaches the output: a stray
print of a library goes to the standard error too). The worker ends when its input ends, its
``--total-seconds`` are spent, or its parent dies.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import IO, Any

from tritune.configs_db.values import check_flat, printable, strict_loads

log = logging.getLogger("tritune.jit")

#: Seconds between two looks at whether the serving process still lives.
PARENT_POLL_S = 1.0


def _watch_parent() -> None:
    """Exit as soon as the serving process is gone, even in the middle of a key."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="tritune-parent-watch", daemon=True).start()


def _attribute(target: str) -> Any:
    """``module:ATTRIBUTE`` imported; a class is instantiated (``--timer``)."""
    module, _, attribute = target.rpartition(":")
    if not module or not attribute.isidentifier():
        raise SystemExit(f"--timer {target!r}: expected module:ATTRIBUTE")
    value = getattr(importlib.import_module(module), attribute)
    return value() if isinstance(value, type) else value


class Requests:
    """Reads and checks requests; prepares the device (the interpreter before any kernel is defined)."""

    def __init__(self) -> None:
        self._devices: set[str] = set()

    def device(self, text: str) -> str:
        if text not in self._devices:
            import torch

            if text == "cpu":
                # Triton decides at decoration time: before the kernel's module is imported.
                os.environ["TRITON_INTERPRET"] = "1"
                from tritune.kernels._interpreter import fix_interpreter_index

                fix_interpreter_index()
            elif text.startswith("cuda:") and text[5:].isdigit():
                torch.cuda.set_device(torch.device(text))
            else:
                raise ValueError(f"device {text!r}: expected cpu or cuda:N")
            self._devices.add(text)
        return text

    def parse(self, line: str) -> dict[str, Any]:
        request = strict_loads(line)
        if not isinstance(request, dict):
            raise ValueError("a request is not an object")
        for name in ("kernel", "target", "device", "db_url"):
            if not isinstance(request.get(name), str):
                raise ValueError(f"request.{name} is missing or not a string")
        check_flat(request.get("key"), "request.key")
        for name in ("trials", "seconds", "wait_s"):
            value = request.get(name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"request.{name} is missing or not a number of at least 0")
        return request


def serve(requests: Iterable[str], reports: IO[str], total_s: float) -> None:
    """Tune each requested key in order and report it, within ``total_s`` seconds in all.

    Returns as soon as ``total_s`` is spent, without reading another request: the serving process
    sees the worker end (status 0) and tunes nothing more online.
    """
    from .candidates import resolve_spec
    from .jit import FAILED, close_benches, plain_winner, tune_one_key

    reader = Requests()
    spent = 0.0
    try:
        for line in requests:
            if not line.strip():
                continue
            report: dict[str, Any] = {"outcome": FAILED, "winner": None, "seconds": 0.0, "measured": 0, "detail": ""}
            try:
                request = reader.parse(line)
                report.update(kernel=request["kernel"], device=request["device"], key=request["key"])
                left = total_s - spent
                if left <= 0:
                    report["detail"] = f"the online tuning budget of {total_s:g} s is spent"
                else:
                    device = reader.device(request["device"])
                    spec = resolve_spec(request["kernel"], request["target"])
                    key = spec.key_type.from_dict(request["key"])
                    result = tune_one_key(
                        spec,
                        device,
                        key,
                        trials=max(1, int(request["trials"])),
                        seconds=min(float(request["seconds"]), left),
                        db_url=request["db_url"],
                        wait_s=float(request["wait_s"]),
                    )
                    spent += result.seconds
                    report.update(
                        outcome=result.outcome,
                        winner=None if result.winner is None else plain_winner(result.winner),
                        seconds=result.seconds,
                        measured=result.measured,
                        detail=result.detail,
                    )
            except Exception as exc:  # one key's failure is reported; the next key is tuned
                log.warning("online tuning worker: %s", printable(f"{type(exc).__name__}: {exc}", limit=1000))
                report["detail"] = f"{type(exc).__name__}: {exc}"
            if "kernel" in report:
                reports.write(json.dumps(report) + "\n")
                reports.flush()
            if spent >= total_s:
                log.info("online tuning worker: the budget of %g s is spent", total_s)
                return
    finally:
        close_benches()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tritune.tuner.jit_worker",
        description="Tune the keys a serving process hands over (TRITUNE_JIT=background); JSON lines in and out.",
    )
    parser.add_argument("--total-seconds", type=float, required=True, help="seconds of tuning in all")
    parser.add_argument("--timer", help="module:ATTRIBUTE of the timer to use (tests); default: the device's own")
    parser.add_argument("--no-isolate", action="store_true", help="run candidates in this process (tests)")
    args = parser.parse_args(argv)
    # The reports keep the real output; everything else written there goes to the standard error.
    reports = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    from tritune.kernels.settings import settings

    logging.basicConfig(level=settings().log_level, format="tritune online tuning worker: %(message)s")
    _watch_parent()
    from . import jit

    if args.timer is not None:
        jit.TIMER = _attribute(args.timer)
    if args.no_isolate:
        jit.ISOLATE = False
    serve(sys.stdin, reports, args.total_seconds)
    from .worker import leave

    leave(0)


if __name__ == "__main__":
    main()
