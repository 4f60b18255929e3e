"""Journal-file study storages: what is wrong with a file that is not a journal, and which workers live.

Optuna's ``JournalStorage`` replays its file when it is opened. A file that is not a journal fails
there with an error that names neither the file nor a way out; a journal cut short in the middle of
a record (a crash while writing, a full disk) is worse: Optuna reads it as far as it goes, appends
the next record to the partial line, and that record is lost. :func:`problem` reads the file under
the journal's own write lock, so that no record is half-written while it looks, and says what is
wrong in words (:meth:`.studies.StudyStorage.open` raises them as a ``StudyStorageError``).

A journal has no heartbeats. A worker of one holds an exclusive ``flock`` on a presence file of
its own beside the journal (``<journal>.tritune-workers/``) for as long as it lives, and the
kernel drops the lock when the process dies, however it dies. :func:`alive` tells another process
whether a worker still holds its lock: the trials of a worker that does not are released
(:meth:`.studies.StudyStorage.fail_stale`), so a run started after a killed one finishes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path

from optuna.storages.journal import JournalFileSymlinkLock

#: How an SQLite database file starts (a common mistake: ``--storage studies.db`` for ``sqlite:///studies.db``).
_SQLITE_HEADER = b"SQLite format 3\x00"
#: Why moving a journal away is safe.
_REBUILT = "the next run rebuilds the studies from the config DB, which keeps every measurement"


def problem(path: Path) -> str | None:
    """What makes ``path`` unfit to be opened as a journal and what to do, as the end of a sentence whose
    subject is the file; ``None`` if nothing. A missing or empty file is fine (Optuna creates it).
    """
    if path.is_dir():
        return "is a directory: give --storage a file path (the file is created if missing)"
    if not path.exists():
        return None
    lock = JournalFileSymlinkLock(str(path))
    try:
        locked = lock.acquire()
    except (OSError, RuntimeError):
        # A folder this process may not write to (``tune status`` only reads): a partial last line may
        # then be a record being written, and is left to Optuna, which skips it.
        locked = False
    try:
        content = path.read_bytes()
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    finally:
        if locked:
            with contextlib.suppress(RuntimeError):
                lock.release()
    if content.startswith(_SQLITE_HEADER):
        return f"is an SQLite database, not a journal: pass --storage sqlite:///{path}"
    if not locked:
        content = content[: content.rfind(b"\n") + 1]
    if content and not content.endswith(b"\n"):
        end = content.rfind(b"\n") + 1
        return (
            f"ends in the middle of a record (cut short while it was written): cut the partial line off with "
            f"`truncate -s {end} {path}`"
        )
    for number, line in enumerate(content.splitlines(), start=1):
        if not _is_record(line):
            return (
                f"is not an Optuna journal (line {number} is not a journal record): move it away or give "
                f"--storage another path ({_REBUILT})"
            )
    return None


def unreadable(exc: BaseException) -> str:
    """What to do with a journal whose records Optuna cannot replay (``exc``), as :func:`problem` words it."""
    text = str(exc).strip().splitlines()
    return f"cannot be replayed ({type(exc).__name__}: {text[0] if text else ''}): move it away ({_REBUILT})"


def _is_record(line: bytes) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and isinstance(record.get("op_code"), int)


# ---- which workers live ---------------------------------------------------------------------------


def _presence_path(journal: Path, worker: str) -> Path:
    # Worker names hold a host name and a device: a digest is a safe file name.
    digest = hashlib.blake2b(worker.encode(), digest_size=12).hexdigest()
    return journal.with_name(journal.name + ".tritune-workers") / f"{digest}.lock"


class Presence:
    """This worker's presence beside a journal: a file it holds an exclusive ``flock`` on while it lives."""

    def __init__(self, journal: Path, worker: str) -> None:
        self.path = _presence_path(journal, worker)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            # Another process may have found a dead worker of the same name (a reused pid) and removed
            # its file while this one waited for the lock: hold a file that is still in place.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{worker}\n".encode())
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


def alive(journal: Path, worker: str) -> bool:
    """Whether ``worker`` (another process's worker) still holds its presence beside ``journal``.

    A worker that left no presence file is dead, or never was a worker of this journal. The file of a
    dead worker is removed on the way.
    """
    path = _presence_path(journal, worker)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return False
    finally:
        os.close(fd)
