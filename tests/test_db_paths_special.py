"""A DB path that names no regular file, or lies where no DB can be: refused at once, saying why.

A FIFO, socket, device or folder given as the config DB is refused before SQLite opens it: opening
a FIFO blocks until something writes to it, and SQLite reports a folder as "disk I/O error". The
``tune`` commands say "<path> is a FIFO, not a config DB file"; a serving process warns once with
that reason and serves the portable defaults without waiting. A DB path whose folder lies under a
file is refused by the CLI naming that file.

Every test that would block on a FIFO if its fix regressed runs under a timeout, and opens the
FIFO's writing end at teardown so that no thread stays blocked on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
import toy_kernel
from test_runtime_db_read import served, warnings
from typer.testing import CliRunner, Result

from tritune.configs_db import misses as miss_store
from tritune.configs_db import storage
from tritune.configs_db.store import StoreError, read_winners
from tritune.configs_db.urls import blocking_ancestor, not_a_db_file
from tritune.kernels import registry, settings
from tritune.kernels.dispatcher import DISPATCHER
from tritune.tuner.cli import app

runner = CliRunner(env={"COLUMNS": "250"})
PORTABLE = {"BLOCK": 32, "BROKEN": False, "num_warps": 4}
#: Seconds a refusal may take on a busy machine: far below any read or lock bound.
PROMPT_S = 2.0


@pytest.fixture(autouse=True)
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")
    monkeypatch.setenv("TRITUNE_DB_READ_TIMEOUT", "5")
    settings.reload()
    DISPATCHER.clear()
    yield
    DISPATCHER.clear()


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    """A FIFO named like a DB; at teardown its writing end is opened once, releasing a blocked reader."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    path = tmp_path / "fifo.sqlite"
    os.mkfifo(path)
    yield path
    with contextlib.suppress(OSError):  # ENXIO: nobody is reading, nothing to release
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "sock.sqlite"
    if not hasattr(socket, "AF_UNIX"):
        pytest.skip("no Unix sockets on this platform")
    with socket.socket(socket.AF_UNIX) as listening:
        try:
            listening.bind(str(path))
        except OSError as exc:  # a tmp path longer than sun_path
            pytest.skip(f"cannot bind a Unix socket at {path}: {exc}")
        yield path


def url_of(path: Path) -> str:
    return f"sqlite:///{path}"


def miss_row() -> miss_store.MissRecord:
    now = datetime.now(timezone.utc)
    return miss_store.MissRecord(
        gpu="cpu-interpreter",
        kernel="toy_scale",
        kernel_version="v",
        key_json='{"n_bucket":64}',
        triton_version="t",
        torch_version="t",
        count=1,
        first_seen=now,
        last_seen=now,
    )


def failed(result: Result, *parts: str) -> list[str]:
    """Assert ``tune`` failed with status 1 in one or two lines holding ``parts``; those lines."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.output[result.output.index("error: ") :].strip().splitlines()
    assert 1 <= len(lines) <= 2, result.output
    for part in parts:
        assert part in result.output, result.output
    return lines


# ---- a FIFO, socket, device or folder as the DB ---------------------------------------------------


def test_the_kinds_of_path_that_are_no_db_file(tmp_path: Path, fifo: Path) -> None:
    regular = tmp_path / "c.sqlite"
    regular.write_bytes(b"")
    assert not_a_db_file(regular) is None
    assert not_a_db_file(tmp_path / "missing.sqlite") is None
    assert not_a_db_file(tmp_path) == f"{tmp_path} is a directory, not a config DB file"
    assert not_a_db_file(fifo) == f"{fifo} is a FIFO, not a config DB file"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", [["show"], ["missed"], ["--device", "cpu", "--kernel", "toy_scale"]])
def test_tune_refuses_a_fifo_at_once(command: list[str], fifo: Path) -> None:
    start = time.monotonic()
    lines = failed(runner.invoke(app, [*command, "--db", str(fifo)]))
    assert time.monotonic() - start < PROMPT_S + 3  # the tuning command imports the toy kernel first
    assert lines[0] == f"error: {fifo} is a FIFO, not a config DB file"
    assert lines[1:] == ["give the path of a file with --db"]


@pytest.mark.timeout(30)
def test_tune_refuses_a_socket(unix_socket: Path) -> None:
    failed(runner.invoke(app, ["show", "--db", str(unix_socket)]), f"{unix_socket} is a socket, not a config DB file")


@pytest.mark.timeout(30)
@pytest.mark.skipif(not Path("/dev/null").is_char_device(), reason="no /dev/null")
def test_tune_refuses_dev_null() -> None:
    failed(runner.invoke(app, ["show", "--db", "/dev/null"]), "/dev/null is a character device, not a config DB file")


@pytest.mark.timeout(30)
def test_runtime_read_refuses_a_fifo_at_once(fifo: Path) -> None:
    start = time.monotonic()
    with pytest.raises(StoreError, match="is a FIFO, not a config DB file"):
        read_winners(url_of(fifo), timeout_s=20)
    assert time.monotonic() - start < PROMPT_S


@pytest.mark.timeout(30)
def test_runtime_read_refuses_a_folder_saying_so(tmp_path: Path) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    with pytest.raises(StoreError) as raised:
        read_winners(url_of(folder), timeout_s=20)
    assert str(raised.value) == f"{folder} is a directory, not a config DB file"


@pytest.mark.timeout(30)
@pytest.mark.skipif(not Path("/dev/null").is_char_device(), reason="no /dev/null")
def test_runtime_read_refuses_dev_null() -> None:
    with pytest.raises(StoreError, match=r"^/dev/null is a character device, not a config DB file$"):
        read_winners("sqlite:////dev/null", timeout_s=20)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_serving_warns_once_and_serves_the_portable_default_at_once(
    kind: str, fifo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = fifo if kind == "fifo" else tmp_path / "db"
    if kind == "directory":
        path.mkdir()
    caplog.set_level(logging.WARNING, logger="tritune")
    with settings.override(db_url=str(path)):
        start = time.monotonic()
        assert served() == PORTABLE
        assert time.monotonic() - start < PROMPT_S
        assert served(300) == PORTABLE
    (message,) = warnings(caplog)
    what = "a FIFO" if kind == "fifo" else "a directory"
    assert f"{path} is {what}, not a config DB file" in message
    assert "no answer" not in message and "disk I/O" not in message


@pytest.mark.timeout(30)
def test_quiet_wal_check_does_not_block_on_a_fifo(fifo: Path) -> None:
    start = time.monotonic()
    assert not storage.is_quiet_wal_file(fifo)
    assert time.monotonic() - start < PROMPT_S


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_the_miss_log_refuses_a_fifo_or_folder_at_once(kind: str, fifo: Path, tmp_path: Path) -> None:
    path = fifo if kind == "fifo" else tmp_path / "db"
    if kind == "directory":
        path.mkdir()
    start = time.monotonic()
    with pytest.raises(StoreError, match="not a config DB file"):
        miss_store.write_misses(url_of(path), [miss_row()], timeout_s=20)
    assert time.monotonic() - start < PROMPT_S
    assert stat.S_ISFIFO(path.stat().st_mode) if kind == "fifo" else not any(path.iterdir())


# ---- a DB path under a file -----------------------------------------------------------------------


@pytest.mark.parametrize("under", ["sub/c.sqlite", "c.sqlite"], ids=["deeper", "direct"])
def test_tune_names_the_file_a_db_folder_would_lie_under(under: str, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    command = ["--device", "cpu", "--kernel", "toy_scale", "--trials", "1", "--no-isolate"]
    lines = failed(runner.invoke(app, [*command, "--db", str(blocker / under)]))
    assert lines[0] == f"error: {blocker} is a file, so the DB's folder cannot be created"
    assert lines[1:] == ["give --db the path of a file in a folder (missing folders are created)"]
    assert blocker.read_text() == "x"


def test_the_blocking_ancestor_is_the_nearest_existing_one(tmp_path: Path, fifo: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert blocking_ancestor(blocker / "a" / "b" / "c.sqlite") == (blocker, "a file")
    assert blocking_ancestor(fifo / "c.sqlite") == (fifo, "a FIFO")
    assert blocking_ancestor(tmp_path / "new" / "c.sqlite") is None
    assert blocking_ancestor(tmp_path / "c.sqlite") is None


def test_a_store_opened_under_a_file_says_which_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError) as raised:
        storage.make_engine(url_of(blocker / "sub" / "c.sqlite"))
    assert str(raised.value) == f"{blocker} is a file, so the DB's folder cannot be created"


# ---- a DB path that names nothing yet ------------------------------------------------------------


def test_the_miss_log_never_creates_a_missing_folder(tmp_path: Path) -> None:
    folder = tmp_path / "typo" / "deeper"
    with pytest.raises(StoreError) as raised:
        miss_store.write_misses(url_of(folder / "c.sqlite"), [miss_row()], timeout_s=10)
    assert str(raised.value) == (
        f"the config DB's folder {folder} does not exist, and a serving process creates no folder (tune does)"
    )
    assert not (tmp_path / "typo").exists()


def test_the_miss_log_creates_the_file_in_a_folder_that_exists(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    assert miss_store.write_misses(url_of(path), [miss_row()], timeout_s=10) == 1
    assert [row.count for row in miss_store.read_misses(url_of(path), timeout_s=10)] == [1]


def test_a_serving_process_skips_its_miss_log_for_a_missing_folder_with_one_info_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tritune.kernels import misses

    folder = tmp_path / "typo"
    monkeypatch.setenv("TRITUNE_MISS_LOG", "1")
    monkeypatch.setenv("TRITUNE_DB", str(folder / "c.sqlite"))
    settings.reload()
    log = misses.MissLog()
    monkeypatch.setattr(log, "_start", lambda: None)  # no writer thread: the test flushes
    monkeypatch.setattr(misses, "MISSES", log)
    caplog.set_level(logging.INFO, logger="tritune.misses")
    assert served() == PORTABLE
    assert log.flush(timeout_s=10) == 0
    assert log.flush(timeout_s=10) == 0
    (line,) = [r.getMessage() for r in caplog.records if r.name == "tritune.misses"]
    assert "does not exist, and a serving process creates no folder" in line
    assert not folder.exists()
    assert log.pending(), "the keys stay in memory"


def test_a_missing_db_file_is_said_once_at_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "typo.sqlite"
    caplog.set_level(logging.INFO, logger="tritune.configs_db")
    assert read_winners(url_of(path)) == []
    assert read_winners(url_of(path)) == []
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        f"no config DB at {path}: serving without it; tune creates it there, and so does a serving "
        "process's miss log (TRITUNE_MISS_LOG=0 turns that off)"
    )
    assert not path.exists()


def test_a_missing_db_folder_is_said_at_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "typo" / "c.sqlite"
    caplog.set_level(logging.INFO, logger="tritune.configs_db")
    assert read_winners(url_of(path)) == []
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        f"no config DB at {path}, nor its folder: serving without it (check TRITUNE_DB); tune creates "
        "both, a serving process's miss log neither"
    )
    assert not path.parent.exists()


@pytest.fixture
def default_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default DB moved under ``tmp_path`` (its folder not there yet) and in force."""
    path = tmp_path / "data" / "tritune" / "configs.sqlite"
    monkeypatch.setattr(settings, "default_db_url", lambda: f"sqlite:///{path}")
    monkeypatch.delenv("TRITUNE_DB")
    settings.reload()
    assert settings.settings().db_url == url_of(path)
    return path


def test_the_miss_log_creates_the_default_dbs_own_folder(default_db: Path) -> None:
    assert miss_store.write_misses(url_of(default_db), [miss_row()], timeout_s=20) == 1
    assert default_db.is_file()


def test_a_missing_default_db_is_not_said(default_db: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tritune.configs_db")
    assert read_winners(url_of(default_db)) == []
    assert caplog.records == []
