"""Ordinary failures of every ``tune`` command: one or two lines saying what is wrong, exit status 1
(2 for a bad option), and never a traceback unless ``--debug`` (or ``TRITUNE_LOG_LEVEL=DEBUG``) asks.

Most cases run through the app's entry function with typer's ``CliRunner``; the traceback switch and
a read-only DB (where root must be made to honour file modes) run the real ``tune`` entry point in a
child process.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
import toy_kernel
import triton
from typer.testing import CliRunner, Result

from tritune.configs_db import bundles, storage
from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore, StoreError
from tritune.kernels import registry, settings
from tritune.kernels.device import device_info
from tritune.tuner import commands
from tritune.tuner.cli import app

runner = CliRunner(env={"COLUMNS": "250"})
CPU = device_info("cpu")
VERSIONS = {"torch_version": torch.__version__, "triton_version": triton.__version__, "tritune_version": "test"}
#: The real ``tune`` entry point, as the console script runs it, with the toy kernel registered.
ENTRY = [
    sys.executable,
    "-c",
    f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    "from tritune.kernels import registry; registry._SPECS['toy_scale'] = 'toy_kernel:SPEC'; "
    "from tritune.tuner.cli import main; main()",
]


@pytest.fixture(autouse=True)
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")


def run(*args: str) -> Result:
    return runner.invoke(app, list(args))


def failed(result: Result, status: int, *parts: str, max_lines: int = 2) -> str:
    """Assert a clean failure: the exit status, each part in the output, no traceback, few lines."""
    output = result.output
    assert result.exit_code == status, output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output
    for part in parts:
        assert part in output, output
    if status == 1:
        error = output[output.index("error: ") :]
        assert 1 <= len(error.strip().splitlines()) <= max_lines, output
    return output


def toy_record(n_bucket: int = 128, **changes: Any) -> WinnerRecord:
    base = {
        "kernel": "toy_scale",
        "kernel_version": toy_kernel.SPEC.version,
        "gpu": CPU.slug,
        "key": toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", n_bucket).to_dict(),
        "config": {"BLOCK": 128, "BROKEN": False, "num_warps": 2},
        "time_ms": 0.1,
        "portable_ms": 0.2,
        "speedup": 2.0,
        "trials": 12,
        **VERSIONS,
    }
    base.update(changes)
    return WinnerRecord(**base)


def make_db(path: Path, *records: WinnerRecord) -> str:
    url = f"sqlite:///{path}"
    with ConfigStore(url) as store:
        for record in records or (toy_record(),):
            env = store.environment(
                gpu=record.gpu,
                torch_version=record.torch_version,
                triton_version=record.triton_version,
                tritune_version=record.tritune_version,
            )
            assert store.offer_winner(record, env)
    return url


def good_bundle(path: Path) -> Path:
    bundles.write_bundle(
        [toy_record()],
        path,
        gpu=CPU.slug,
        gpu_name=CPU.slug,
        provenance={
            "cuda": "",
            "driver": "",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "tritune": "test",
        },
    )
    return path


def corrupt(path: Path) -> Path:
    path.write_bytes(b"SQLite format 2\x00" + bytes(range(256)) * 64)
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# ---- the config DB file -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["show"],
        ["export", "--gpu", "cpu-interpreter"],
        ["import", "BUNDLE"],
        ["--device", "cpu", "--kernel", "toy_scale", "--trials", "1", "--no-isolate"],
    ],
    ids=["show", "export", "import", "tune"],
)
def test_corrupt_db_file(args: list[str], tmp_path: Path) -> None:
    db = corrupt(tmp_path / "configs.sqlite")
    args = [str(good_bundle(tmp_path / "b.json")) if a == "BUNDLE" else a for a in args]
    failed(run(*args, "--db", str(db)), 1, "file is not a database", "not a SQLite file", max_lines=2)


def test_newer_schema_db(tmp_path: Path) -> None:
    path = tmp_path / "configs.sqlite"
    make_db(path)
    with closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("UPDATE alembic_version SET version_num = '0099'")
    failed(run("show", "--db", str(path)), 1, "unknown schema revision '0099'")
    failed(run("import", str(good_bundle(tmp_path / "b.json")), "--db", str(path)), 1, "'0099'")


def test_locked_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "configs.sqlite"
    make_db(path)
    monkeypatch.setattr(storage, "BUSY_TIMEOUT_MS", 200)
    with closing(sqlite3.connect(path, isolation_level=None)) as holder:
        holder.execute("BEGIN EXCLUSIVE")
        result = run("import", str(good_bundle(tmp_path / "b.json")), "--db", str(path))
        holder.execute("ROLLBACK")
    failed(result, 1, "database is locked", "another process holds the database's write lock")


@pytest.mark.parametrize("command", [["show"], ["export", "--gpu", "cpu-interpreter"]])
def test_missing_db_is_named_and_not_created(command: list[str], tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "configs.sqlite"
    failed(run(*command, "--db", str(path)), 1, f"no config DB at {path}")
    assert not path.parent.exists()


@pytest.mark.parametrize(
    "command",
    [["show"], ["import", "BUNDLE"], ["--device", "cpu", "--kernel", "toy_scale"]],
    ids=["show", "import", "tune"],
)
def test_db_path_that_is_a_folder(command: list[str], tmp_path: Path) -> None:
    command = [str(good_bundle(tmp_path / "b.json")) if a == "BUNDLE" else a for a in command]
    folder = tmp_path / "db"
    folder.mkdir()
    failed(run(*command, "--db", str(folder)), 1, f"{folder} is a directory, not a config DB file")


def test_unknown_database_url() -> None:
    failed(run("show", "--db", "nosuchdb://host/x"), 1, "Can't load plugin", "name a database SQLAlchemy knows")


def test_full_disk_while_writing_the_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = make_db(tmp_path / "configs.sqlite")
    out = tmp_path / "out.json"

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out))

    monkeypatch.setattr(bundles, "write_bundle", full)
    failed(run("export", "--gpu", CPU.slug, "--db", db, "--out", str(out)), 1, f"no space left on the device: {out}")


def test_full_disk_while_writing_the_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.exc import OperationalError

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("INSERT INTO winners ...", {}, sqlite3.OperationalError("database or disk is full"))

    monkeypatch.setattr(ConfigStore, "import_records", full)
    failed(
        run("import", str(good_bundle(tmp_path / "b.json")), "--db", str(tmp_path / "c.sqlite")),
        1,
        "database error: database or disk is full",
        "free some space",
    )


def _unprivileged() -> None:
    """Drop the capabilities that let root ignore file modes (runs in the child before exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_entry(
    *args: str, env: dict[str, str] | None = None, unprivileged: bool = False
) -> subprocess.CompletedProcess[str]:
    """The real ``tune`` entry point in a child process."""
    result = subprocess.run(
        [*ENTRY, *args],
        env={**os.environ, "COLUMNS": "250", **(env or {})},
        preexec_fn=_unprivileged if unprivileged and os.geteuid() == 0 else None,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "prctl(PR_CAPBSET_DROP)" in result.stderr:
        pytest.skip("running as root without CAP_SETPCAP: file modes cannot be made to apply to a child")
    return result


def test_read_only_db_refuses_an_import_in_two_lines(tmp_path: Path) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    db = make_db(folder / "configs.sqlite")
    bundle = good_bundle(tmp_path / "b.json")
    before = snapshot(folder)
    for each in folder.iterdir():
        each.chmod(0o444)
    folder.chmod(0o555)
    try:
        result = run_entry("import", str(bundle), "--db", db, unprivileged=True)
    finally:
        folder.chmod(0o755)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "readonly database" in result.stderr or "unable to open" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 2, result.stderr
    assert snapshot(folder) == before


# ---- PostgreSQL -------------------------------------------------------------------------------


def test_unreachable_postgres(tmp_path: Path) -> None:
    with closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql+psycopg://tritune:secret@127.0.0.1:{port}/configs"
    output = failed(run("show", "--db", url), 1, "Connection refused", "check that the server is running")
    assert "secret" not in output
    failed(run("status", "--storage", url), 1, "Connection refused")


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A TCP server that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for each in held:
            each.close()
        server.close()


@pytest.mark.parametrize("command", [["show"], ["import", "BUNDLE"]])
def test_silent_postgres_fails_after_the_connect_timeout(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commands, "READ_TIMEOUT_S", 2.0)
    monkeypatch.setattr(storage, "CONNECT_TIMEOUT_S", 2)
    command = [str(good_bundle(tmp_path / "b.json")) if a == "BUNDLE" else a for a in command]
    with silent_server() as port:
        result = run(*command, "--db", f"postgresql+psycopg://tritune@127.0.0.1:{port}/configs")
    failed(result, 1, "timeout expired", "check that the server is running")


# ---- the environment and the installation ------------------------------------------------------


@pytest.mark.parametrize(
    "name, value",
    [("TRITUNE_MARGIN", "lots"), ("TRITUNE_DISABLE_BUNDLES", "maybe"), ("TRITUNE_LOG_LEVEL", "LOUD")],
)
@pytest.mark.parametrize("command", [["list"], ["show"], ["--device", "cpu", "--kernel", "toy_scale"]])
def test_bad_setting(name: str, value: str, command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    failed(run(*command), 1, f"{name}='{value}': expected", "fix or unset the variable")


def test_missing_optuna(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)
    for name in [name for name in sys.modules if name.startswith("tritune.tuner.") and "stud" in name]:
        monkeypatch.delitem(sys.modules, name)
    result = run("--device", "cpu", "--kernel", "toy_scale", "--db", str(tmp_path / "c.sqlite"))
    failed(result, 1, "optuna is not installed", "pip install")


def test_missing_postgres_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)
    failed(run("show", "--db", "postgresql+psycopg://tritune@127.0.0.1/configs"), 1, "psycopg is not installed")


def test_corrupt_journal(tmp_path: Path) -> None:
    journal = tmp_path / "studies.log"
    journal.write_text('{"op_code": 0, "worker_id": "x"\nnot json\n')
    output = failed(run("status", "--storage", str(journal)), 1, f"study journal {journal}", max_lines=1)
    # The storage's own message names the file and the fix: printed as is, not as an unforeseen error.
    assert "StudyStorageError" not in output and "--debug" not in output


def test_unforeseen_error_is_one_line_with_its_type(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise RuntimeError("registry\nexploded [bold]")

    monkeypatch.setattr(registry, "kernel_names", broken)
    output = failed(run("list"), 1, "RuntimeError: registry exploded [bold]", "run with --debug", max_lines=1)
    assert "\x1b" not in output


# ---- usage errors (status 2) -------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value",
    [
        ("--time-budget", "0"),
        ("--time-budget", "-5"),
        ("--time-budget", "nan"),
        ("--trials", "0"),
        ("--trials", "-3"),
        ("--trial-timeout", "nan"),
        ("--seed", "-1"),
        ("--lq", "0"),
    ],
)
def test_bad_option_value_is_a_usage_error(option: str, value: str, tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    result = runner.invoke(app, ["--device", "cpu", "--kernel", "toy_scale", option, value, "--db", str(db)])
    failed(result, 2, option)
    assert not db.exists()


def test_bad_gpu_slug_for_export(tmp_path: Path) -> None:
    failed(run("export", "--gpu", "../../etc/passwd", "--db", make_db(tmp_path / "c.sqlite")), 2, "not a GPU slug")


# ---- --debug ----------------------------------------------------------------------------------


def test_real_entry_point_prints_two_lines_and_no_traceback(tmp_path: Path) -> None:
    result = run_entry("show", "--db", str(corrupt(tmp_path / "c.sqlite")))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.splitlines()[0].startswith("error: cannot read"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 2, result.stderr


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = run_entry("show", "--db", str(corrupt(tmp_path / "c.sqlite")), "--debug")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "StoreError" in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("how", ["flag-before-the-command", "log-level"])
def test_debug_lets_the_exception_through(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = str(corrupt(tmp_path / "c.sqlite"))
    if how == "log-level":
        monkeypatch.setenv("TRITUNE_LOG_LEVEL", "DEBUG")
        settings.reload()
        result = run("show", "--db", db)
    else:
        result = run("--debug", "show", "--db", db)
    assert isinstance(result.exception, StoreError), result.output


def test_debug_after_double_dash_is_an_argument(tmp_path: Path) -> None:
    result = run("import", "--db", str(tmp_path / "c.sqlite"), "--", "--debug")
    failed(result, 1, "--debug: cannot read")


# ---- tune import ------------------------------------------------------------------------------


def test_import_of_a_missing_file(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    failed(
        run("import", str(tmp_path / "nope.json"), "--db", str(db)),
        1,
        "cannot read (No such file",
        "nothing was imported",
    )
    assert not db.exists()


def test_import_of_a_folder(tmp_path: Path) -> None:
    failed(run("import", str(tmp_path), "--db", str(tmp_path / "c.sqlite")), 1, "is a directory, not a regular file")


def test_import_that_refuses_every_entry_fails(tmp_path: Path) -> None:
    path = good_bundle(tmp_path / "b.json")
    doc = json.loads(path.read_text())
    doc["winners"][0]["kernel_version"] = "0123456789abcdef"
    path.write_text(json.dumps(doc))
    db = tmp_path / "c.sqlite"
    output = failed(run("import", str(path), "--db", str(db)), 1, "every entry was refused (1)", max_lines=1)
    assert "stale kernel version 0123456789abcdef" in output
    assert not db.exists()


def test_import_counts_what_it_took_and_refused(tmp_path: Path) -> None:
    path = good_bundle(tmp_path / "b.json")
    doc = json.loads(path.read_text())
    doc["winners"].append({**doc["winners"][0], "key": {**doc["winners"][0]["key"], "n_bucket": 256}, "trials": 0})
    path.write_text(json.dumps(doc))
    result = run("import", str(path), "--db", str(tmp_path / "c.sqlite"))
    assert result.exit_code == 0, result.output
    assert "winners[1] (toy_scale): trials is 0, expected at least 1" in result.output
    assert "imported 1 winner(s), kept 0 existing better one(s), refused 1 entry" in result.output


def test_import_that_fails_part_way_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.exc import OperationalError

    from tritune.configs_db import upserts

    path = good_bundle(tmp_path / "b.json")
    doc = json.loads(path.read_text())
    doc["winners"].append({**doc["winners"][0], "key": {**doc["winners"][0]["key"], "n_bucket": 256}})
    path.write_text(json.dumps(doc))
    real = upserts.offer_winner
    offered: list[Any] = []

    def full_on_the_second(session: Any, values: Any, triton_version: str, torch_version: str, **options: Any) -> bool:
        offered.append(values)
        if len(offered) == 2:
            raise OperationalError("INSERT INTO winners ...", {}, sqlite3.OperationalError("database or disk is full"))
        return bool(real(session, values, triton_version, torch_version, **options))

    monkeypatch.setattr(upserts, "offer_winner", full_on_the_second)
    db = f"sqlite:///{tmp_path / 'c.sqlite'}"
    failed(run("import", str(path), "--db", db), 1, "database or disk is full")
    assert len(offered) == 2
    assert ConfigStore(db).winners() == []


# ---- tune export ------------------------------------------------------------------------------


def test_export_without_out_writes_to_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = make_db(tmp_path / "c.sqlite")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    shipped = sorted(p.name for p in bundles.shipped_bundle_dir().iterdir())
    result = run("export", "--gpu", CPU.slug, "--db", db)
    assert result.exit_code == 0, result.output
    assert [p.name for p in work.iterdir()] == [f"{CPU.slug}.json"]
    assert sorted(p.name for p in bundles.shipped_bundle_dir().iterdir()) == shipped


def test_export_into_a_folder(tmp_path: Path) -> None:
    db = make_db(tmp_path / "c.sqlite")
    out = tmp_path / "out"
    out.mkdir()
    assert run("export", "--gpu", CPU.slug, "--db", db, "--out", str(out)).exit_code == 0
    assert (out / f"{CPU.slug}.json").is_file()


def test_export_into_a_folder_to_create_written_with_a_trailing_slash(tmp_path: Path) -> None:
    db = make_db(tmp_path / "c.sqlite")
    result = run("export", "--gpu", CPU.slug, "--db", db, "--out", f"{tmp_path / 'new' / 'dir'}/")
    assert result.exit_code == 0, result.output
    assert [p.name for p in (tmp_path / "new" / "dir").iterdir()] == [f"{CPU.slug}.json"]


def test_export_refuses_a_missing_path_that_is_no_json_file(tmp_path: Path) -> None:
    db = make_db(tmp_path / "c.sqlite")
    out = tmp_path / "nodir"
    result = run("export", "--gpu", CPU.slug, "--db", db, "--out", str(out))
    failed(result, 2, "no such folder, and a bundle file's name ends in .json (end a folder to create with /)")
    assert not out.exists()
    assert run("export", "--gpu", CPU.slug, "--db", db, "--out", str(tmp_path / "b.json")).exit_code == 0
    assert (tmp_path / "b.json").is_file()


# ---- tune show --------------------------------------------------------------------------------


def test_show_never_migrates_an_old_db(tmp_path: Path) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    old = folder / "configs.sqlite"
    old.write_bytes((Path(__file__).parent / "data" / "configs_v0001.sqlite").read_bytes())
    before = snapshot(folder)
    failed(run("show", "--db", str(old)), 1, "schema revision 0001 is older", "tune import with this --db upgrades it")
    assert snapshot(folder) == before


def test_show_reads_without_writing(tmp_path: Path) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    db = make_db(folder / "configs.sqlite")
    # The tuner's last connection checkpointed the WAL away: only the main file is left.
    before = snapshot(folder)
    result = run("show", "--db", db, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert snapshot(folder) == before


def test_show_marks_what_the_runtime_would_refuse(tmp_path: Path) -> None:
    h100 = "nvidia-h100-80gb-hbm3-sm90-132sm"
    db = make_db(
        tmp_path / "c.sqlite",
        toy_record(64),
        toy_record(128, kernel_version="0123456789abcdef"),
        toy_record(256, triton_version="2.1.0"),
        toy_record(512, gpu=h100),
        toy_record(1024, time_ms=0.199, speedup=0.2 / 0.199),
    )
    result = run("show", "--db", db, "--device", "cpu")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("not served on cpu-interpreter: ")]
    assert len(notes) == 3, result.output
    n_buckets = [int(note.split("n_bucket=")[1].split(":")[0]) for note in notes]
    reasons = dict(zip(n_buckets, notes, strict=True))
    assert "stale kernel version 0123456789abcdef" in reasons[128]
    # Tuned under another Triton: served, provisionally, until re-tuned.
    provisional = "provisional on cpu-interpreter: cpu-interpreter toy_scale dtype=float32 n_bucket=256"
    assert f"{provisional}: tuned under Triton 2.1.0" in " ".join(result.output.split())
    assert f"recorded for GPU {h100}, this is cpu-interpreter" in reasons[512]
    assert "only 1.005x the portable default" in reasons[1024]
