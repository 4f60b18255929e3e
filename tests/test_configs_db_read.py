"""``read_winners``: what the runtime does with whatever it finds at the configured DB URL."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from db_samples import ENV, GPU
from sqlalchemy.engine import make_url

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore, StoreError, read_winners
from tritune.configs_db.urls import sqlite_file


def record(seqlen: int, time_ms: float = 1.0, gpu: str = GPU) -> WinnerRecord:
    return WinnerRecord(
        kernel="tma_prefill",
        kernel_version="abc123",
        gpu=gpu,
        key={"arch": "sm90", "sm_count": 132, "seqlen": seqlen},
        config={"BLOCK_M": 128},
        time_ms=time_ms,
        portable_ms=2.0,
        speedup=2.0 / time_ms,
        trials=7,
        triton_version="3.6.0",
        torch_version="2.13.0",
        tritune_version="0.1.0",
    )


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """A head-revision DB with winners at three keys for GPU and one for another GPU."""
    path = tmp_path / "configs.sqlite"
    with ConfigStore(f"sqlite:///{path}") as store:
        env_id = store.environment(**ENV)
        a100 = store.environment(**{**ENV, "gpu": "nvidia-a100-sm80-108sm"})
        for seqlen in (512, 1024, 2048):
            store.offer_winner(record(seqlen), env_id)
        store.offer_winner(record(512, gpu="nvidia-a100-sm80-108sm"), a100)
    return path


def execute(path: Path, sql: str) -> None:
    with closing(sqlite3.connect(path)) as db, db:
        db.execute(sql)


def test_reads_the_gpus_winners_with_provenance(db_path: Path) -> None:
    url = f"sqlite:///{db_path}"
    winners = read_winners(url, GPU)
    assert [w.key["seqlen"] for w in winners] == [1024, 2048, 512]  # ordered by canonical key text
    first = winners[0]
    assert first == replace(record(1024), source=f"db:{url}", extra=first.extra)
    assert first.extra == {
        "gpu_name": "NVIDIA H200",
        "capability": "9.0",
        "sm_count": 132,
        "driver": "570.86",
        "cuda": "12.8",
    }
    assert read_winners(url, "cpu-interpreter") == []


def test_missing_file_gives_nothing_and_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "not" / "there" / "configs.sqlite"
    assert read_winners(f"sqlite:///{path}", GPU) == []
    assert not (tmp_path / "not").exists()


def test_reading_leaves_the_file_and_folder_as_found(db_path: Path) -> None:
    before = {p.name: p.read_bytes() for p in db_path.parent.iterdir()}
    assert len(read_winners(f"sqlite:///{db_path}", GPU)) == 3
    assert {p.name: p.read_bytes() for p in db_path.parent.iterdir()} == before


def test_reads_while_a_tuner_holds_the_db_open(db_path: Path) -> None:
    with ConfigStore(f"sqlite:///{db_path}") as store:
        env_id = store.environment(**ENV)
        store.offer_winner(record(4096), env_id)
        assert len(read_winners(f"sqlite:///{db_path}", GPU)) == 4
        store.offer_winner(record(8192), env_id)
        assert len(read_winners(f"sqlite:///{db_path}", GPU)) == 5


def test_empty_file_holds_no_winners(tmp_path: Path) -> None:
    path = tmp_path / "empty.sqlite"
    path.touch()
    assert read_winners(f"sqlite:///{path}", GPU) == []
    assert path.stat().st_size == 0


def test_in_memory_url_holds_no_winners() -> None:
    assert read_winners("sqlite://", GPU) == []


def test_corrupt_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.sqlite"
    garbage = bytes(range(256)) * 64
    path.write_bytes(garbage)
    with pytest.raises(StoreError, match="file is not a database"):
        read_winners(f"sqlite:///{path}", GPU)
    assert path.read_bytes() == garbage


def test_truncated_file_is_refused(db_path: Path) -> None:
    with closing(sqlite3.connect(db_path, isolation_level=None)) as db:
        db.execute("PRAGMA journal_mode = DELETE")
    data = db_path.read_bytes()
    db_path.write_bytes(data[:100] + os.urandom(len(data) - 100))
    with pytest.raises(StoreError):
        read_winners(f"sqlite:///{db_path}", GPU)


def test_somebody_elses_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.sqlite"
    execute(path, "CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    with pytest.raises(StoreError, match="not a tritune config DB"):
        read_winners(f"sqlite:///{path}", GPU)


def test_future_schema_revision_is_refused(db_path: Path) -> None:
    execute(db_path, "UPDATE alembic_version SET version_num = '0042_from_the_future'")
    with pytest.raises(StoreError, match=r"unknown schema revision '0042_from_the_future'.*newer tritune"):
        read_winners(f"sqlite:///{db_path}", GPU)


def test_rows_with_malformed_json_are_skipped_one_warning_each(db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    execute(db_path, "UPDATE winners SET key_json = '{\"seqlen\": ' WHERE key_json LIKE '%\"seqlen\":512%'")
    execute(db_path, "UPDATE winners SET config_json = '[1, 2]' WHERE key_json LIKE '%\"seqlen\":2048%'")
    with caplog.at_level(logging.WARNING, logger="tritune.configs_db"):
        winners = read_winners(f"sqlite:///{db_path}", GPU)
    assert [w.key["seqlen"] for w in winners] == [1024]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert all("skipping winners row" in r.getMessage() for r in warnings)


def test_a_garbled_timestamp_or_a_null_number_costs_only_its_own_row(db_path: Path) -> None:
    """Timestamps are not read, and a NULL where a number belongs skips its row: neither drops the
    other winners of the DB (which the runtime would then serve without)."""
    execute(db_path, "UPDATE winners SET created_at = 'garbage', updated_at = 'x' WHERE key_json LIKE '%512%'")
    with closing(sqlite3.connect(db_path)) as db, db:
        db.execute("PRAGMA writable_schema=ON")
        db.execute(
            "UPDATE sqlite_master SET sql = replace(sql, 'trial_count INTEGER DEFAULT ''1'' NOT NULL', "
            "'trial_count INTEGER') WHERE name = 'winners'"
        )
    execute(db_path, "UPDATE winners SET trial_count = NULL WHERE key_json LIKE '%2048%'")
    winners = read_winners(f"sqlite:///{db_path}", GPU)
    assert sorted(w.key["seqlen"] for w in winners) == [512, 1024]


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///relative/configs.sqlite",
        "sqlite:////abs/configs.sqlite",
        "sqlite:////abs/with%20space.sqlite",
        "sqlite:////abs/configs.sqlite?timeout=5",
        "sqlite+pysqlite:////abs/configs.sqlite",
        "sqlite://",
        "sqlite:///:memory:",
        "postgresql://user:pw@host/db",
    ],
)
def test_sqlite_file_parses_like_sqlalchemy(url: str) -> None:
    parsed = make_url(url)
    expected = None
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        expected = Path(parsed.database)
    assert sqlite_file(url) == expected


def test_runtime_path_imports_neither_sqlalchemy_nor_optuna(tmp_path: Path) -> None:
    script = f"""
import sys
from tritune.configs_db import bundles, store
assert store.read_winners("sqlite:///{tmp_path / "missing.sqlite"}", "{GPU}") == []
assert bundles.shipped_records("test-gpu-without-a-bundle") == ([], [])
leaked = sorted(m for m in ("sqlalchemy", "alembic", "optuna", "torch") if m in sys.modules)
assert not leaked, leaked
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


def test_missing_table_is_refused(db_path: Path) -> None:
    # A DB that claims the head revision but lacks its tables is not trusted either.
    execute(db_path, "DROP TABLE winners")
    with pytest.raises(StoreError, match="no such table"):
        read_winners(f"sqlite:///{db_path}", GPU)


def test_passing_lock_conflicts_are_retried(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.exc import OperationalError

    from tritune.configs_db import reader

    real = reader._read_once
    calls = []

    def flaky(url: str, *args: Any) -> list[WinnerRecord]:
        calls.append(url)
        if len(calls) < 3:
            raise OperationalError("SELECT 1", {}, sqlite3.OperationalError("database is locked"))
        return real(url, *args)

    monkeypatch.setattr(reader, "_read_once", flaky)
    assert len(read_winners(f"sqlite:///{db_path}", GPU)) == 3
    assert len(calls) == 3


def test_lasting_lock_conflicts_are_refused_at_the_timeout(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.exc import OperationalError

    from tritune.configs_db import reader

    def locked(*args: Any) -> list[WinnerRecord]:
        raise OperationalError("SELECT 1", {}, sqlite3.OperationalError("database is locked"))

    monkeypatch.setattr(reader, "_read_once", locked)
    start = time.monotonic()
    with pytest.raises(StoreError, match="database is locked"):
        read_winners(f"sqlite:///{db_path}", GPU, timeout_s=0.3)
    assert 0.2 < time.monotonic() - start < 2.0


def test_all_gpus_and_one_kernel(db_path: Path) -> None:
    url = f"sqlite:///{db_path}"
    assert len(read_winners(url)) == 4
    assert len(read_winners(url, kernel="tma_prefill")) == 4
    assert read_winners(url, kernel="decode") == []
    assert [w.gpu for w in read_winners(url, "nvidia-a100-sm80-108sm", kernel="tma_prefill")] == [
        "nvidia-a100-sm80-108sm"
    ]


def test_a_malformed_rows_warning_is_one_escaped_line(db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    forged = '{"seqlen": \n2025-01-01 CRITICAL forged line \x1b[31m'
    with closing(sqlite3.connect(db_path)) as db, db:
        db.execute("UPDATE winners SET key_json = ?, kernel = ? WHERE key_json LIKE '%512%'", (forged, "k\nk"))
    with caplog.at_level(logging.WARNING, logger="tritune.configs_db"):
        read_winners(f"sqlite:///{db_path}")
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2
    for message in messages:
        assert "\n" not in message and "\x1b" not in message
        assert "k\\nk" in message


def test_an_import_replaces_a_winner_of_the_running_versions_only_with_a_faster_one(tmp_path: Path) -> None:
    """A bundle tuned under an older torch does not overwrite a faster winner measured under the
    running versions (stale, to the running code, is the bundle's record); a faster record does."""
    running = ("3.6.0", "2.13.0")
    current = replace(record(512, time_ms=0.1), triton_version=running[0], torch_version=running[1])
    with ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        store.offer_winner(
            current, store.environment(**{**ENV, "triton_version": running[0], "torch_version": running[1]})
        )
        older = replace(record(512, time_ms=0.19), torch_version="2.10.0", config={"BLOCK_M": 64})
        assert store.import_records([older], current=running) == (0, 1)
        assert [w.time_ms for w in store.winners()] == [0.1]
        faster = replace(older, time_ms=0.05, speedup=2.0 / 0.05)
        assert store.import_records([faster], current=running) == (1, 0)
        assert [(w.time_ms, w.torch_version) for w in store.winners()] == [(0.05, "2.10.0")]
