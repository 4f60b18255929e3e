"""Several workers on one host: ``tune --device 0,1,2,3`` (or ``--device cpu --workers 3``).

The ``tune`` process becomes a coordinator: it plans the keys of each device, starts one worker
process per device (``spawn``: a fresh interpreter each), and waits. Each worker runs
:func:`.shared.run_worker` on the shared storage, from its own place in the plan, so workers
start on different keys and then help each other with whatever is left. The config DB is one
for all (SQLite takes several writers; see ``configs_db/storage.py``).

The coordinator opens the study storage before it starts any worker: a journal that is not one
is refused at once (:class:`.studies.StudyStorageError`), and a fresh RDB storage gets its tables
from one process.

Without ``--storage`` the studies live in a journal file in a temporary folder of their own
(:class:`ScratchStudies`), removed at the end: the trials table is the record, and a later run
resumes from it. The coordinator holds a lock on a file in that folder while it runs; a folder
whose lock nobody holds belongs to a coordinator that was killed, and the next coordinator
removes it before it makes its own.

Journal storages have no heartbeat, so the coordinator releases the trials of a worker process
that dies (fails them and enqueues them again) as soon as it sees the process gone; the surviving
workers then retry them. Workers also release the trials of any worker that no longer holds its
presence lock beside the journal, which is how a run started after a killed one takes over the
trials it left running. On an RDB storage the heartbeat does the same for workers on any host.

A worker process exits by itself when the coordinator dies, like the candidate worker of
:mod:`.worker`, and at once when its work is done (its results are in the config DB and the
study storage by then): the coordinator waits for every process to end, and an ordinary
interpreter exit (leftover threads, exit handlers, CUDA teardown) may take long.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from tritune.configs_db.records import key_text

from .shared import worker_name
from .studies import StudyStorage
from .study import TuneOptions
from .timing import Timer
from .worker import STOP_GRACE_S, _exit_with_parent, _interpreter_environment, leave

log = logging.getLogger("tritune.tuner")

#: Name prefix of the temporary folders of runs without ``--storage``.
SCRATCH_PREFIX = "tritune-studies-"
#: File in such a folder that its coordinator holds locked (and writes its pid into) while it runs.
SCRATCH_OWNER = "coordinator.lock"


class ScratchStudies:
    """A temporary journal for one coordinator's studies, in a folder removed when the run ends.

    A coordinator killed with SIGKILL cannot remove its folder. It holds an exclusive ``flock`` on
    :data:`SCRATCH_OWNER` there while it lives, so a folder whose lock is free (and whose owner
    file has its pid written, which happens once the lock is held) is a dead run's: the next
    coordinator removes such folders before it makes its own (:func:`remove_abandoned`).
    """

    def __init__(self, root: Path | None = None) -> None:
        root = Path(tempfile.gettempdir()) if root is None else root
        remove_abandoned(root)
        self.folder = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=root))
        self._owner: int | None = os.open(self.folder / SCRATCH_OWNER, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._owner, fcntl.LOCK_EX)
        os.write(self._owner, f"{os.getpid()}\n".encode())
        self.where = StudyStorage(str(self.folder / "studies.log"))

    def remove(self) -> None:
        """Remove the folder (then let the lock go: nobody finds it half-removed and unlocked)."""
        if self._owner is None:
            return
        shutil.rmtree(self.folder, ignore_errors=True)
        os.close(self._owner)
        self._owner = None

    def __enter__(self) -> ScratchStudies:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def remove_abandoned(root: Path) -> list[Path]:
    """Remove the temporary studies folders under ``root`` whose coordinator is dead; the folders removed."""
    removed = []
    for folder in sorted(root.glob(SCRATCH_PREFIX + "*")):
        try:
            fd = os.open(folder / SCRATCH_OWNER, os.O_RDWR)
        except OSError:
            # Not one of ours, or one being made right now (its owner file comes first).
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            # An empty owner file: its coordinator opened it but has not locked it yet.
            if os.fstat(fd).st_size == 0:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d temporary studies folder(s) of killed runs: %s", len(removed), removed)
    return removed


@dataclass(frozen=True)
class WorkerJob:
    """Everything one worker process needs, as plain values (it is pickled into the process)."""

    label: str
    index: int
    count: int
    #: ``cpu`` or ``cuda:N``.
    device: str
    #: Kernel name -> where the worker imports it ("module:attribute" or "path/file.py:attribute"), so
    #: kernels declared at run time (a user's file) reach the worker.
    targets: dict[str, str]
    #: (kernel name, key dict) in plan order.
    keys: list[tuple[str, dict[str, Any]]]
    #: Kept out of the repr: the URL may hold a password.
    db_url: str = field(repr=False)
    where: StudyStorage
    options: TuneOptions
    timer: Timer
    poll_s: float = 1.0


def worker_process_main(job: WorkerJob) -> None:
    """Entry point of a worker process: tune the job's keys on its device, then exit."""
    import sys

    import torch

    _exit_with_parent()
    if job.device == "cpu":
        # Before any kernel module is imported: Triton decides at decoration time.
        os.environ["TRITON_INTERPRET"] = "1"
        from tritune.kernels._interpreter import fix_interpreter_index

        fix_interpreter_index()
    else:
        torch.cuda.set_device(torch.device(job.device))

    from rich.console import Console
    from rich.markup import escape

    from tritune.configs_db.store import ConfigStore
    from tritune.kernels import settings
    from tritune.kernels.device import device_info

    from .candidates import resolve_spec
    from .shared import SharedKeyTuner, Visit, run_worker
    from .study import environment_id

    logging.basicConfig(level=settings.settings().log_level, format=f"[{job.label}] %(levelname)s %(message)s")
    console = Console(width=None if sys.stdout.isatty() else 160)
    specs = {name: resolve_spec(name, target) for name, target in job.targets.items()}
    plan = [(specs[name], specs[name].key_type.from_dict(key)) for name, key in job.keys]
    torch_device = torch.device(job.device)
    info = device_info(torch_device)
    name = worker_name(job.device)

    tag = escape(f"[{job.label}]")

    def done(tuner: SharedKeyTuner, visit: Visit) -> None:
        key = key_text(tuner.key_dict)
        if visit.result is not None:
            config = " ".join(f"{k}={v}" for k, v in visit.result.config.items())
            console.print(
                f"{tag} {tuner.spec.name} {key}: winner {config} ({visit.result.best_ms:.4g} ms, "
                f"{visit.result.speedup:.3f}x); measured {visit.result.measured} here"
            )
        else:
            console.print(f"{tag} {tuner.spec.name} {key}: finalized by another worker")

    with ConfigStore(job.db_url) as store:
        env_id = environment_id(store, info)
        report = run_worker(
            plan,
            device=info,
            torch_device=torch_device,
            store=store,
            env_id=env_id,
            timer=job.timer,
            options=job.options,
            where=job.where,
            worker=name,
            start=job.index * len(plan) // max(1, job.count),
            poll_s=job.poll_s,
            on_done=done,
        )
    for error in report.errors:
        console.print(f"[red]{tag} {escape(error)}[/red]")


def _worker_process(main: Callable[[WorkerJob], None], job: WorkerJob) -> None:
    """A worker process: ``main(job)``, then out at once (exit status 1 if it raised)."""
    code = 0
    try:
        main(job)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    leave(code)


@dataclass
class WorkerExit:
    job: WorkerJob
    pid: int
    exitcode: int | None
    released: int = 0


def run_fleet(jobs: Sequence[WorkerJob], study_names: Sequence[str]) -> list[WorkerExit]:
    """Start a process per job, wait for all, and release the trials of any that died.

    Raises :class:`.studies.StudyStorageError`, before any process starts, if a job's study storage
    cannot be opened. The caller fails the command when a process exited with a status other than
    0: the other workers may have finished its keys, but it died.
    """
    for where in dict.fromkeys(job.where for job in jobs):
        where.open()
    context = multiprocessing.get_context("spawn")
    running: dict[Any, tuple[BaseProcess, WorkerJob]] = {}
    exits: list[WorkerExit] = []
    try:
        for job in jobs:
            # Looked up at each start, so a test can substitute the entry point.
            process: BaseProcess = context.Process(
                target=_worker_process, args=(worker_process_main, job), name=f"tritune-tuner-{job.label}"
            )
            with _interpreter_environment(job.device == "cpu"):
                process.start()
            running[process.sentinel] = (process, job)
        while running:
            for sentinel in wait(list(running)):
                gone, job = running.pop(sentinel)
                gone.join()
                assert gone.pid is not None
                ended = WorkerExit(job, gone.pid, gone.exitcode)
                if gone.exitcode != 0:
                    # Its trials are retried by the others now, not after a heartbeat's grace period.
                    try:
                        ended.released = job.where.release_worker(worker_name(job.device, gone.pid), study_names)
                    except Exception as exc:
                        log.warning("could not release the trials of worker %s: %s", job.label, exc)
                exits.append(ended)
    finally:
        for left, _ in running.values():
            left.join(STOP_GRACE_S)
            if left.is_alive():
                left.kill()
                left.join()
    return exits
