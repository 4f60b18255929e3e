"""The serving process's read of the user config DB: bounded in time, read-only, never a lock others wait on.

A config DB that does not answer (a PostgreSQL host that accepts the connection and then says
nothing, a SQLite file another process holds locked) must cost the first dispatch of a device at
most the read bound (``TRITUNE_DB_READ_TIMEOUT``), with one warning; the shipped bundle and the
portable defaults serve meanwhile. A DB the process may not write (a read-only file, or a folder
on a read-only image or mount) is served as it is, and reading never changes or adds a file.

Read-only files are tested for real even as root: the reader then runs in a child process whose
capability bounding set lacks the capabilities that let root ignore file modes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
import toy_kernel
import triton

from tritune.configs_db import storage, store
from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore, StoreError, read_winners
from tritune.kernels import dispatcher, registry, settings
from tritune.kernels.device import DeviceInfo, device_info
from tritune.kernels.dispatcher import DISPATCHER, dispatch_config
from tritune.kernels.pins import use_config

CPU = device_info("cpu")
PORTABLE = {"BLOCK": 32, "BROKEN": False, "num_warps": 4}
TUNED = {"BLOCK": 128, "BROKEN": False, "num_warps": 2}
#: The read bound the tests run under (seconds) and the slack allowed on a busy machine.
BOUND = 1.0
SLACK = 3.0


@pytest.fixture(autouse=True)
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")
    monkeypatch.setenv("TRITUNE_DB_READ_TIMEOUT", str(BOUND))
    settings.reload()
    DISPATCHER.clear()
    yield
    DISPATCHER.clear()


def winner(n_bucket: int = 128, kernel: str = "toy_scale") -> WinnerRecord:
    versions = {"torch_version": torch.__version__, "triton_version": triton.__version__, "tritune_version": "test"}
    return WinnerRecord(
        kernel=kernel,
        kernel_version=toy_kernel.SPEC.version,
        gpu=CPU.slug,
        key=toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", n_bucket).to_dict(),
        config=TUNED,
        time_ms=0.1,
        portable_ms=0.2,
        speedup=2.0,
        trials=12,
        **versions,
    )


def good_db(path: Path, *records: WinnerRecord) -> Path:
    """A WAL config DB holding the toy kernel's winner at the key :func:`served` asks for."""
    with ConfigStore(f"sqlite:///{path}") as db:
        env = db.environment(
            gpu=CPU.slug, torch_version=torch.__version__, triton_version=triton.__version__, tritune_version="test"
        )
        for record in records or (winner(),):
            assert db.offer_winner(record, env)
    return path


def served(n: int = 100) -> dict[str, Any]:
    spec = toy_kernel.SPEC
    config = dispatch_config("toy_scale", "cpu", -1, tuple(spec.facts(torch.randn(n))))
    return spec.space.to_dict(config)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def within(seconds: float, call: Callable[[], Any]) -> tuple[Any, float]:
    """``call()`` in a daemon thread, failing the test if it has not returned after ``seconds``.

    A call that stalls fails the test at once instead of holding it for the stall.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test's thread below
            outcome["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    elapsed = time.monotonic() - start
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value"), elapsed


def side_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def fingerprint(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


# ---- a DB that does not answer ------------------------------------------------------------------


@pytest.fixture
def silent_postgres() -> Iterator[str]:
    """The URL of a local TCP server that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield f"postgresql+psycopg://tritune:secret@127.0.0.1:{server.getsockname()[1]}/configs"
    stop.set()
    server.close()
    for connection in held:
        connection.close()


@contextlib.contextmanager
def locked_by_another_process(path: Path, journal: str) -> Iterator[None]:
    """Another process holds ``path`` exclusively locked inside the block.

    ``journal="delete"``: a rollback-journal DB in an exclusive transaction (readers wait on it).
    ``journal="wal"``: a WAL DB held in exclusive locking mode after a write.
    """
    script = textwrap.dedent(
        """
        import sqlite3, sys
        db = sqlite3.connect(sys.argv[1], isolation_level=None)
        if sys.argv[2] == "delete":
            db.execute("PRAGMA journal_mode = DELETE")
        else:
            db.execute("PRAGMA locking_mode = EXCLUSIVE")
        db.execute("BEGIN EXCLUSIVE")
        db.execute("UPDATE winners SET trial_count = trial_count")
        print("locked", flush=True)
        sys.stdin.read()
        """
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(path), journal], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)


def test_silent_postgres_host_costs_the_first_dispatch_the_bound_and_one_warning(
    silent_postgres: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tritune")
    with settings.override(db_url=silent_postgres):
        config, _ = within(BOUND + SLACK, served)
        assert config == PORTABLE
        assert served() == PORTABLE
    messages = warnings(caplog)
    assert len(messages) == 1, messages
    assert "not used" in messages[0] and f"within {BOUND:g} s" in messages[0]
    assert "secret" not in messages[0]


def test_silent_postgres_read_gives_up_within_its_timeout(silent_postgres: str) -> None:
    with pytest.raises(StoreError, match=r"no answer from postgresql\+psycopg://tritune:\*\*\*@127\.0\.0\.1"):
        within(BOUND + SLACK, lambda: read_winners(silent_postgres, CPU.slug, timeout_s=BOUND))


@pytest.mark.parametrize("journal", ["delete", "wal"])
def test_sqlite_locked_by_another_process_costs_the_bound_and_one_warning(
    journal: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tritune")
    path = good_db(tmp_path / "configs.sqlite")
    with settings.override(db_url=str(path)):
        with locked_by_another_process(path, journal):
            config, _ = within(BOUND + SLACK, served)
            assert config == PORTABLE
        messages = warnings(caplog)
        assert len(messages) == 1, messages
        assert "not used" in messages[0] and "locked" in messages[0]
        # Once the lock is gone, reloading serves the DB's winner.
        dispatcher.reload_configs()
        assert served() == TUNED


def test_a_pinned_call_on_another_thread_does_not_wait_for_a_stalled_read(silent_postgres: str) -> None:
    started = threading.Event()
    with settings.override(db_url=silent_postgres):
        first = threading.Thread(target=lambda: (started.set(), served()), daemon=True)
        first.start()
        started.wait()
        time.sleep(0.2)  # the first call is now inside the stalled read

        def pinned() -> dict[str, Any]:
            with use_config("toy_scale", {"BLOCK": 16}):
                return served(300)

        config, elapsed = within(BOUND + SLACK, pinned)
        assert config["BLOCK"] == 16
        assert elapsed < BOUND / 2, f"the pinned call waited {elapsed:.2f} s for another call's DB read"
        first.join(BOUND + SLACK)
        assert not first.is_alive()


def test_another_devices_table_does_not_wait_for_a_stalled_read(monkeypatch: pytest.MonkeyPatch) -> None:
    other = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
    release = threading.Event()

    def read(url: str, gpu: str, **options: Any) -> list[WinnerRecord]:
        if gpu == CPU.slug:
            release.wait(60)  # this device's DB read stalls until the test lets it go
        return []

    monkeypatch.setattr(store, "read_winners", read)
    first = threading.Thread(target=lambda: DISPATCHER.table(CPU), daemon=True)
    first.start()
    time.sleep(0.2)
    try:
        table, _ = within(SLACK, lambda: DISPATCHER.table(other))
        assert len(table) == 0
    finally:
        release.set()
        first.join(10)


# ---- a DB the process may not write ------------------------------------------------------------

READER = textwrap.dedent(
    """
    import sys
    from tritune.configs_db.store import read_winners
    print(len(read_winners(sys.argv[1], sys.argv[2])))
    """
)


def _drop_file_mode_override() -> None:
    """Runs in the child before exec: drop CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER from
    the bounding set, so root's child honours file modes like any other user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2, 3):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def read_as_unprivileged(path: Path) -> int:
    """``read_winners`` in a child process that file modes apply to; the number of winners it read."""
    preexec = _drop_file_mode_override if os.geteuid() == 0 else None
    result = subprocess.run(
        [sys.executable, "-c", READER, f"sqlite:///{path}", CPU.slug],
        preexec_fn=preexec,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0 and "prctl(PR_CAPBSET_DROP)" in result.stderr:
        pytest.skip("running as root without CAP_SETPCAP: file modes cannot be made to apply to a child")
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.strip())


@contextlib.contextmanager
def modes(path: Path, *, file_mode: int, dir_mode: int) -> Iterator[None]:
    folder = path.parent
    files = list(folder.iterdir())
    try:
        for each in files:
            each.chmod(file_mode)
        folder.chmod(dir_mode)
        yield
    finally:
        folder.chmod(0o755)
        for each in files:
            each.chmod(0o644)


@pytest.mark.parametrize(
    "file_mode, dir_mode",
    [(0o444, 0o755), (0o644, 0o555), (0o444, 0o555)],
    ids=["read-only-file", "read-only-folder", "both"],
)
def test_a_read_only_db_is_served_and_left_as_found(file_mode: int, dir_mode: int, tmp_path: Path) -> None:
    path = good_db(tmp_path / "db" / "configs.sqlite", winner(128), winner(512))
    assert side_files(path) == []
    before = fingerprint(path)
    with modes(path, file_mode=file_mode, dir_mode=dir_mode):
        assert read_as_unprivileged(path) == 2
    assert fingerprint(path) == before
    assert side_files(path) == []


def _killed_tuner(path: Path) -> None:
    """A tuner that wrote a winner to the WAL and died before folding it into the main file."""
    script = textwrap.dedent(
        """
        import os, sqlite3, sys
        db = sqlite3.connect(sys.argv[1], isolation_level=None)
        db.execute("PRAGMA wal_autocheckpoint = 0")
        db.execute("UPDATE winners SET time_ms = 0.05, speedup = 4.0")
        db.execute("INSERT INTO winners (gpu, kernel, kernel_version, key_json, config_json, time_ms, portable_ms,"
                   " speedup, environment_id, created_at, updated_at, trial_count)"
                   " SELECT gpu, kernel, kernel_version, replace(key_json, '128', '256'),"
                   " config_json, time_ms, portable_ms, speedup, environment_id, created_at, updated_at, trial_count"
                   " FROM winners")
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=60)


def test_winners_left_in_the_wal_by_a_killed_tuner_are_read_from_a_read_only_folder(tmp_path: Path) -> None:
    path = good_db(tmp_path / "db" / "configs.sqlite")
    _killed_tuner(path)
    assert side_files(path) == ["configs.sqlite-shm", "configs.sqlite-wal"]
    before = {p.name: p.read_bytes() for p in path.parent.iterdir()}
    with modes(path, file_mode=0o444, dir_mode=0o555):
        assert read_as_unprivileged(path) == 2
    assert {p.name: p.read_bytes() for p in path.parent.iterdir() if p.name != "configs.sqlite-shm"} == {
        name: data for name, data in before.items() if name != "configs.sqlite-shm"
    }


def test_reading_never_changes_or_adds_a_file(tmp_path: Path) -> None:
    """Whatever the process may write: no side file appears, the DB's bytes and mtime stay."""
    path = good_db(tmp_path / "configs.sqlite")
    before = fingerprint(path)
    for _ in range(2):
        assert len(read_winners(f"sqlite:///{path}", CPU.slug)) == 1
        assert side_files(path) == []
    assert fingerprint(path) == before


def test_reading_while_a_tuner_holds_uncheckpointed_writes_leaves_the_main_file(tmp_path: Path) -> None:
    path = good_db(tmp_path / "configs.sqlite")
    with closing(sqlite3.connect(path, isolation_level=None)) as tuner:
        tuner.execute("PRAGMA wal_autocheckpoint = 0")
        tuner.execute("UPDATE winners SET time_ms = 0.05, speedup = 4.0")
        before = fingerprint(path)
        (found,) = read_winners(f"sqlite:///{path}", CPU.slug)
        assert found.speedup == 4.0
        assert fingerprint(path) == before


def test_a_tuner_opening_the_file_during_an_immutable_read_makes_it_read_again_with_locks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tritune.configs_db import reader

    path = good_db(tmp_path / "configs.sqlite")
    assert storage.is_quiet_wal_file(path)
    opened: list[bool] = []
    make_engine = storage.make_engine
    tuner = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    def engine_for(url: str, **options: Any) -> Any:
        opened.append(options.get("immutable", False))
        if len(opened) == 1:
            # The tuner starts while the immutable read is under way.
            tuner.execute("PRAGMA wal_autocheckpoint = 0")
            tuner.execute("UPDATE winners SET time_ms = 0.05, speedup = 4.0")
        return make_engine(url, **options)

    monkeypatch.setattr(storage, "make_engine", engine_for)
    try:
        (found,) = reader.read_winners(f"sqlite:///{path}", CPU.slug)
    finally:
        tuner.close()
    assert opened == [True, False]
    assert found.speedup == 4.0


def test_a_linked_db_is_read_through_the_wal_beside_its_target(tmp_path: Path) -> None:
    """As a ConfigMap mounts a file: a link to ``..data/configs.sqlite``, its side files beside the target."""
    target = good_db(tmp_path / "..data" / "configs.sqlite")
    link = tmp_path / "configs.sqlite"
    link.symlink_to(target)
    with closing(sqlite3.connect(target, isolation_level=None)) as tuner:
        tuner.execute("PRAGMA wal_autocheckpoint = 0")
        tuner.execute("UPDATE winners SET time_ms = 0.05, speedup = 4.0")
        (found,) = read_winners(f"sqlite:///{link}", CPU.slug)
        assert found.speedup == 4.0


def test_the_db_named_in_a_warning_is_escaped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tritune")
    path = tmp_path / "configs\n2026-01-01 CRITICAL forged\x1b[2J.sqlite"
    path.write_bytes(b"not a database" * 100)
    with settings.override(db_url=str(path)):
        assert served() == PORTABLE
    (message,) = warnings(caplog)
    assert message.isprintable()
    assert "configs\\n2026-01-01 CRITICAL forged\\x1b[2J.sqlite" in message


def test_old_schema_file_is_refused_with_its_reason_and_never_written() -> None:
    old = Path(__file__).parent / "data" / "configs_v0001.sqlite"
    before = fingerprint(old)
    siblings = sorted(p.name for p in old.parent.iterdir())
    with pytest.raises(StoreError, match=r"schema revision 0001 is older than this tritune's"):
        read_winners(f"sqlite:///{old}", "nvidia-h200-sm90-132sm")
    assert fingerprint(old) == before
    assert sorted(p.name for p in old.parent.iterdir()) == siblings
    assert storage.SCHEMA_HEAD != "0001"
