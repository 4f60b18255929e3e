"""Candidates run in a worker process, so a crash, a hang or a poisoned CUDA context costs one trial.

The tuner process keeps Optuna, the DB and the winner choice; a :class:`Worker` (one per device,
reused across trials and keys) compiles, checks and times candidates in a child process started
with ``spawn`` (a fresh interpreter: no CUDA state is inherited). The child builds each key's
problems itself from plain values (kernel name and registry target, key dict, seed, portable
default, device string), so nothing but plain dicts crosses the pipe, plus the timer object once.

When a request does not come back, the trial is recorded as ``failed-runtime`` with the reason
("worker died with exit code -11 (SIGSEGV)", "timed out after 120 s") and the next request starts
a fresh worker, which rebuilds the open key's problems before going on. A worker killed by a
signal sent from outside (:data:`EXTERNAL_SIGNALS`: the OOM killer's SIGKILL, a SIGTERM) says
little about its candidate, which is tried once more in a fresh worker first; a candidate whose
worker dies twice is failed with both deaths in its reason. A candidate that raises
(out of memory included) is an ordinary failed trial and the worker stays. A candidate after which
the CUDA context is unusable (an illegal memory access) is reported by the worker, which then exits.

The worker exits by itself when the tuner process dies (a thread waits on the parent), so a
tune killed with ``kill -9`` leaves no worker behind, even one stuck in a hung candidate.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import re
import signal
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import torch

from tritune.kernels.spec import KernelSpec, TuningKey

from .candidates import (
    FAILED_RUNTIME,
    BenchError,
    RetimeOutcome,
    TrialOutcome,
    describe_exception,
    outcome,
    spec_target,
)
from .noise import NoisePolicy
from .timing import Timer

log = logging.getLogger("tritune.tuner")

#: Exit status of a worker whose CUDA context became unusable.
EXIT_CONTEXT_LOST = 75
#: How long a worker asked to stop may take before it is killed.
STOP_GRACE_S = 10.0


#: Signals that end a worker from outside rather than through a fault of its own (SIGSEGV, SIGBUS,
#: SIGABRT are a candidate's): the OOM killer's SIGKILL, a stop request's SIGTERM, a hang-up.
EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT})

#: How :func:`death_reason` words a worker's death by a signal.
_DIED_BY_SIGNAL = re.compile(r"worker died with exit code -([0-9]+) \((SIG[A-Z0-9]+)\)")


class WorkerFailure(Exception):
    """A request got no answer: the worker died or timed out (``reason`` says which).

    ``exitcode``: the dead worker's exit status (negative: the signal that ended it); ``None``
    where it timed out or its status is unknown.
    """

    def __init__(self, reason: str, exitcode: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exitcode = exitcode


def killed_from_outside(exitcode: int | None) -> bool:
    """Whether a worker's exit status is a death by one of the :data:`EXTERNAL_SIGNALS`."""
    return exitcode is not None and exitcode < 0 and -exitcode in EXTERNAL_SIGNALS


def external_death(reason: str) -> bool:
    """Whether a stored trial's reason is one death by an external signal, never tried again.

    A candidate tried again after such a death and killed once more is stored with both deaths
    (the reason is then more than this one clause): that is a verdict on it, this is not.
    """
    match = _DIED_BY_SIGNAL.fullmatch(reason)
    return match is not None and killed_from_outside(-int(match.group(1)))


def worker_device(device: torch.device) -> str:
    """The device string a worker is started with: ``cpu`` or ``cuda:N``."""
    if device.type == "cpu":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{device.type}:{index}"


def death_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "worker stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            return f"worker died with exit code {exitcode}"
        return f"worker died with exit code {exitcode} ({name})"
    if exitcode == EXIT_CONTEXT_LOST:
        return f"worker died with exit code {exitcode} (CUDA context lost)"
    return f"worker died with exit code {exitcode}"


@contextlib.contextmanager
def _interpreter_environment(wanted: bool) -> Iterator[None]:
    """``TRITON_INTERPRET=1`` while a CPU worker is spawned.

    A spawned child imports the parent's main module before it runs anything of ours, and Triton
    decides interpreter or compiler when a kernel is decorated: a main module that imports
    kernels would define them compiled. The child inherits the environment at its start.
    """
    previous = os.environ.get("TRITON_INTERPRET")
    if wanted:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if wanted:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous


class Worker:
    """One worker process for one device, serving one key at a time (a :class:`~.candidates.Bench`)."""

    def __init__(
        self,
        device: str,
        timer: Timer,
        *,
        trial_timeout_s: float | None = 120.0,
        startup_timeout_s: float | None = 600.0,
        noise: NoisePolicy | None = None,
        compile_workers: int = 1,
    ) -> None:
        self.device = device
        self.timer = timer
        self.trial_timeout_s = trial_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.noise = noise or NoisePolicy()
        self.compile_workers = compile_workers
        try:
            pickle.dumps(timer)
        except Exception as exc:
            raise BenchError(
                f"the timer {timer!r} cannot be sent to a worker process ({describe_exception(exc)}); "
                "use a module-level timer, or tune in-process (isolate=False)"
            ) from exc
        #: Worker processes started so far (1 + restarts).
        self.starts = 0
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        #: The open key's request, replayed in a restarted worker.
        self._opened: dict[str, Any] | None = None

    # ---- process management -------------------------------------------------------------------

    def _alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _discard(self, kill: bool) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if process is not None:
            if kill and process.is_alive():
                process.kill()
            process.join(STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
            process.close()
        if conn is not None:
            conn.close()

    def _spawn(self) -> None:
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe()
        process = context.Process(target=serve, args=(child_end, self.device), name="tritune-worker", daemon=True)
        with _interpreter_environment(self.device == "cpu"):
            process.start()
        child_end.close()
        self._process, self._conn = process, parent_end
        self.starts += 1
        init = {"op": "init", "timer": self.timer, "noise": self.noise, "compile_workers": self.compile_workers}
        try:
            reply = self._exchange(init, self.startup_timeout_s)
        except WorkerFailure as exc:
            raise BenchError(f"the worker process did not start: {exc.reason}") from exc
        if not reply["ok"]:
            self._discard(kill=True)
            raise BenchError(f"the worker process did not start: {reply['error']}")

    def start(self) -> None:
        """Start the worker process now if none runs (the first measurement would otherwise):
        for a caller that keeps the start-up apart from the time it budgets. A worker that died
        with the previous key is started bare: the next key opens its own problems."""
        if self._alive():
            return
        self._opened = None
        self._discard(kill=True)
        self._spawn()

    def _ensure(self) -> None:
        """A live worker with the open key's problems built (restarting a dead one)."""
        if self._alive():
            return
        self._discard(kill=True)
        self._spawn()
        if self._opened is not None:
            self._setup(self._opened)

    def _setup(self, message: dict[str, Any]) -> None:
        try:
            reply = self._exchange(message, self.startup_timeout_s)
        except WorkerFailure as exc:
            raise BenchError(f"setting up {message['kernel']} {message['key']} in the worker: {exc.reason}") from exc
        if not reply["ok"]:
            raise BenchError(reply["error"])

    def _exchange(self, message: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        """Send one request and wait for its reply; :class:`WorkerFailure` if none comes."""
        process, conn = self._process, self._conn
        assert process is not None and conn is not None
        try:
            conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            # Died before the request was read: its exit status says why.
            process.join(STOP_GRACE_S)
            exitcode = process.exitcode
            self._discard(kill=True)
            raise WorkerFailure(death_reason(exitcode), exitcode) from None
        ready = wait([conn, process.sentinel], timeout_s)
        if conn in ready or conn.poll():
            try:
                reply: dict[str, Any] = conn.recv()
            except (EOFError, ConnectionResetError):
                pass
            else:
                if reply.get("exiting"):
                    # It exits after this reply (lost CUDA context): collect it now, so the next
                    # request starts a fresh worker instead of blaming its candidate for the exit.
                    self._discard(kill=False)
                return reply
        if not ready:
            self._discard(kill=True)
            raise WorkerFailure(f"timed out after {timeout_s:g} s")
        process.join(STOP_GRACE_S)
        exitcode = process.exitcode
        self._discard(kill=True)
        raise WorkerFailure(death_reason(exitcode), exitcode)

    def _request(self, message: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        self._ensure()
        return self._exchange(message, timeout_s)

    # ---- the Bench interface ------------------------------------------------------------------

    def open(self, spec: KernelSpec[Any, Any], key: TuningKey, seed: int, default: dict[str, Any]) -> None:
        message = {
            "op": "open",
            "kernel": spec.name,
            "target": spec_target(spec),
            "key": key.to_dict(),
            "seed": seed,
            "default": default,
        }
        self._opened = None
        self._ensure()
        self._setup(message)
        self._opened = message

    def precompile(self, configs: list[dict[str, Any]]) -> list[TrialOutcome | None] | None:
        # A batch compiles in rounds of compile_workers threads, each round as long as one trial may be.
        timeout = None
        if self.trial_timeout_s is not None:
            rounds = -(-len(configs) // max(1, self.compile_workers))
            timeout = self.trial_timeout_s * max(1, rounds)
        try:
            reply = self._request({"op": "precompile", "configs": configs}, timeout)
        except WorkerFailure as exc:
            log.warning("compiling a batch of %d in the worker failed (%s); compiling one by one", len(configs), exc)
            return None
        if not reply["ok"]:
            log.warning("compiling a batch of %d failed (%s); compiling one by one", len(configs), reply["error"])
            return None
        results: list[TrialOutcome | None] = reply["result"]
        return results

    def trial(self, config: dict[str, Any], compiled: bool) -> TrialOutcome:
        try:
            reply = self._request({"op": "trial", "config": config, "compiled": compiled}, self.trial_timeout_s)
        except WorkerFailure as exc:
            if not killed_from_outside(exc.exitcode):
                log.warning("%s: %s; the next trial starts a fresh worker", config, exc.reason)
                return outcome(FAILED_RUNTIME, None, exc.reason)
            # Killed from outside (the OOM killer, a stop request): once more, in a fresh worker
            # that has not compiled it.
            log.warning("%s: %s; trying it again in a fresh worker", config, exc.reason)
            try:
                reply = self._request({"op": "trial", "config": config, "compiled": False}, self.trial_timeout_s)
            except WorkerFailure as again:
                reason = f"{exc.reason}; tried again in a fresh worker: {again.reason}"
                log.warning("%s: %s; the next trial starts a fresh worker", config, reason)
                return outcome(FAILED_RUNTIME, None, reason)
        if not reply["ok"]:
            return outcome(FAILED_RUNTIME, None, reply["error"])
        result: TrialOutcome = reply["result"]
        return result

    def retime(self, configs: list[dict[str, Any]], rounds: int, peer: bool = False) -> RetimeOutcome | None:
        timeout = None if self.trial_timeout_s is None else self.trial_timeout_s * max(1, rounds)
        try:
            reply = self._request({"op": "retime", "configs": configs, "rounds": rounds, "peer": peer}, timeout)
        except WorkerFailure as exc:
            log.warning("final re-timing failed: %s", exc)
            return None
        if not reply["ok"]:
            log.warning("final re-timing failed: %s", reply["error"])
            return None
        result: RetimeOutcome = reply["result"]
        return result

    def host_times(self, configs: list[dict[str, Any]]) -> list[float] | None:
        timeout = None if self.trial_timeout_s is None else self.trial_timeout_s * max(1, len(configs))
        try:
            reply = self._request({"op": "host_times", "configs": configs}, timeout)
        except WorkerFailure as exc:
            log.warning("timing the launches' host cost failed: %s", exc)
            return None
        if not reply["ok"]:
            log.warning("timing the launches' host cost failed: %s", reply["error"])
            return None
        times: list[float] = reply["result"]
        return times

    def close(self) -> None:
        """Stop the worker (asked first, killed if it does not go)."""
        if self._alive() and self._conn is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, EOFError):
                self._conn.send({"op": "stop"})
        self._discard(kill=False)
        self._opened = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the worker process -----------------------------------------------------------------------


def leave(code: int) -> NoReturn:
    """End this process now, its output flushed, without the interpreter's exit.

    A worker process's results are with its parent (or in the databases) by then. What an ordinary
    exit still does (join the threads left over, run Triton's and torch's exit handlers, tear down
    CUDA) can take seconds to minutes, and the parent waits for the process to end.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _exit_with_parent() -> None:
    """Exit as soon as the tuner process is gone, even from the middle of a hung candidate."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(0)

    threading.Thread(target=watch, name="tritune-parent-watch", daemon=True).start()


def serve(conn: Connection, device: str) -> None:
    """The worker process's main loop: one request in, one reply out, until told to stop."""
    # Ctrl-C reaches the whole process group; the tuner decides when its worker ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    if device == "cpu":
        # Before any kernel module is imported: Triton decides at decoration time.
        os.environ["TRITON_INTERPRET"] = "1"
        from tritune.kernels._interpreter import fix_interpreter_index

        fix_interpreter_index()
    elif device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))

    from .candidates import CandidateBench, ContextLost, context_alive

    try:
        init = conn.recv()
        timer, noise, compile_workers = init["timer"], init["noise"], init["compile_workers"]
    except EOFError:
        return
    except Exception as exc:
        conn.send({"ok": False, "error": f"cannot receive the timer: {describe_exception(exc)}"})
        return
    conn.send({"ok": True, "result": os.getpid()})

    bench: CandidateBench | None = None
    while True:
        try:
            message = conn.recv()
        except EOFError:
            leave(0)
        op = message["op"]
        if op == "stop":
            conn.close()
            leave(0)
        exiting = False
        try:
            if op == "open":
                bench = None
                bench = CandidateBench.from_plain(
                    message["kernel"],
                    message["target"],
                    message["key"],
                    message["seed"],
                    message["default"],
                    device,
                    timer,
                    noise=noise,
                    compile_workers=compile_workers,
                )
                result: Any = None
            elif bench is None:
                raise RuntimeError(f"{op!r} before any key was opened")
            elif op == "precompile":
                result = bench.precompile(message["configs"])
            elif op == "trial":
                result = bench.trial(message["config"], message["compiled"])
                exiting = result["fatal"]
            elif op == "retime":
                result = bench.retime(message["configs"], message["rounds"], message.get("peer", False))
            elif op == "host_times":
                result = bench.host_times(message["configs"])
            else:
                raise ValueError(f"unknown request {op!r}")
            reply = {"ok": True, "result": result, "exiting": exiting}
        except ContextLost as exc:
            reply, exiting = {"ok": False, "error": str(exc), "exiting": True}, True
        except Exception as exc:
            exiting = not context_alive(torch.device(device))
            reply = {"ok": False, "error": describe_exception(exc), "exiting": exiting}
        conn.send(reply)
        if exiting:
            conn.close()
            leave(EXIT_CONTEXT_LOST)


__all__ = [
    "EXIT_CONTEXT_LOST",
    "EXTERNAL_SIGNALS",
    "Worker",
    "WorkerFailure",
    "death_reason",
    "external_death",
    "killed_from_outside",
    "leave",
    "serve",
    "worker_device",
]
