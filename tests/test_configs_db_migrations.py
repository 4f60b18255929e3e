"""Schema migrations: the committed revision-0001 database upgrades to head with its rows intact.

``tests/data/configs_v0001.sqlite`` was made by :func:`make_v0001_db` (run this file as a script
with the output path) and committed; it must never be regenerated with newer code, since its
point is to be what an old tritune wrote.
"""

from __future__ import annotations

import shutil
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine

from tritune.configs_db import storage
from tritune.configs_db.models import Base
from tritune.configs_db.store import ConfigStore, StoreError, read_winners

V0001_DB = Path(__file__).parent / "data" / "configs_v0001.sqlite"
GPU = "nvidia-h200-sm90-132sm"
KEY_A = '{"arch":"sm90","head_dim":128,"seqlen":1024,"sm_count":132}'
KEY_B = '{"arch":"sm90","head_dim":64,"seqlen":4096,"sm_count":132}'


@contextmanager
def _sqlite(path: Path, **options: Any) -> Iterator[sqlite3.Connection]:
    """A plain sqlite3 connection that commits and closes (sqlite3's own ``with`` only commits)."""
    db = sqlite3.connect(path, **options)
    try:
        with db:
            yield db
    finally:
        db.close()


def make_v0001_db(path: Path) -> None:
    """Build the revision-0001 fixture: one environment, three trials at key A, winners at A and B."""
    path.unlink(missing_ok=True)
    storage.upgrade(f"sqlite:///{path}", revision="0001")
    with _sqlite(path) as db:
        db.execute(
            "INSERT INTO environments VALUES"
            " (1, ?, 'NVIDIA H200', '9.0', 132, '570.86', '12.8', '2.7.0', '3.3.0', '0.0.1')",
            (GPU,),
        )
        trials = [
            (1, '{"BLOCK_M":128,"BLOCK_N":64}', "ok", 0.21),
            (2, '{"BLOCK_M":64,"BLOCK_N":64}', "ok", 0.25),
            (3, '{"BLOCK_M":256,"BLOCK_N":128}', "failed-compile", None),
        ]
        for trial_id, config, status, time_ms in trials:
            db.execute(
                "INSERT INTO trials VALUES (?, 1, 'tma_prefill', 'abc123', ?, ?, ?, ?, '2025-01-02 03:04:05')",
                (trial_id, KEY_A, config, status, time_ms),
            )
        winners = [
            (1, KEY_A, '{"BLOCK_M":128,"BLOCK_N":64}', 0.21, 0.30, 0.30 / 0.21),
            (2, KEY_B, '{"BLOCK_M":64,"BLOCK_N":32}', 0.50, 0.55, 1.1),
        ]
        for winner_id, key, config, time_ms, portable_ms, speedup in winners:
            db.execute(
                "INSERT INTO winners VALUES (?, ?, 'tma_prefill', 'abc123', ?, ?, ?, ?, ?, 1,"
                " '2025-01-02 03:04:05', '2025-01-02 03:04:05')",
                (winner_id, GPU, key, config, time_ms, portable_ms, speedup),
            )
    # A self-contained single file: no WAL side files to commit alongside it.
    with _sqlite(path, isolation_level=None) as db:
        db.execute("PRAGMA journal_mode = DELETE")
        db.execute("VACUUM")


@pytest.fixture
def old_db(tmp_path: Path) -> Path:
    copy = tmp_path / "old.sqlite"
    shutil.copyfile(V0001_DB, copy)
    return copy


def _revision(path: Path) -> str:
    with _sqlite(path) as db:
        return str(db.execute("SELECT version_num FROM alembic_version").fetchone()[0])


def test_committed_fixture_is_at_revision_0001() -> None:
    assert _revision(V0001_DB) == "0001"


def test_runtime_refuses_old_revision_and_says_how_to_upgrade(old_db: Path) -> None:
    with pytest.raises(StoreError, match="older than this tritune"):
        read_winners(f"sqlite:///{old_db}", GPU)
    assert _revision(old_db) == "0001", "the runtime must not upgrade (write) the DB"


def test_upgrade_from_0001_keeps_rows(old_db: Path) -> None:
    url = f"sqlite:///{old_db}"
    with ConfigStore(url) as store:
        winners = {w.key["seqlen"]: w for w in store.winners()}
        env_id = store.environment(
            gpu=GPU,
            gpu_name="NVIDIA H200",
            capability="9.0",
            sm_count=132,
            driver="570.86",
            cuda="12.8",
            torch_version="2.7.0",
            triton_version="3.3.0",
            tritune_version="0.0.1",
        )
        trials = store.measured_trials(env_id, "tma_prefill", "abc123", winners[1024].key)
        added = store.record_trial(
            env_id,
            "tma_prefill",
            "abc123",
            winners[1024].key,
            {"BLOCK_M": 32, "BLOCK_N": 32},
            "failed-runtime",
            error="illegal memory access",
        )
    assert _revision(old_db) == storage.SCHEMA_HEAD
    assert env_id == 1, "the old environment row is found again, not duplicated"
    assert sorted(winners) == [1024, 4096]
    assert winners[1024].config == {"BLOCK_M": 128, "BLOCK_N": 64}
    assert winners[1024].time_ms == pytest.approx(0.21)
    assert winners[1024].triton_version == "3.3.0"
    assert winners[1024].extra["driver"] == "570.86"
    # trial_count is backfilled from the trials at the winner's key (at least 1).
    assert winners[1024].trials == 3
    assert winners[4096].trials == 1
    assert [(t.status, t.time_ms, t.error) for t in trials] == [
        ("ok", 0.21, None),
        ("ok", 0.25, None),
        ("failed-compile", None, None),
    ]
    assert added
    assert len(read_winners(url, GPU)) == 2


def _schema_diff(url: str) -> list[object]:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection)
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_migrations_build_what_the_models_describe(tmp_path: Path, old_db: Path) -> None:
    fresh = f"sqlite:///{tmp_path / 'fresh.sqlite'}"
    storage.upgrade(fresh)
    assert _schema_diff(fresh) == []
    storage.upgrade(f"sqlite:///{old_db}")
    assert _schema_diff(f"sqlite:///{old_db}") == []


def test_known_revisions_match_the_migration_scripts() -> None:
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(storage.alembic_config())
    assert scripts.get_current_head() == storage.SCHEMA_HEAD
    chain = [revision.revision for revision in scripts.walk_revisions()]
    assert tuple(reversed(chain)) == storage.SCHEMA_REVISIONS


def test_upgrade_does_not_depend_on_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert storage.upgrade("sqlite:///relative/db.sqlite") == storage.SCHEMA_HEAD
    assert storage.upgrade("sqlite:///relative/db.sqlite") == storage.SCHEMA_HEAD
    assert _revision(tmp_path / "relative" / "db.sqlite") == storage.SCHEMA_HEAD


def test_upgrade_refuses_a_future_revision(tmp_path: Path) -> None:
    path = tmp_path / "future.sqlite"
    storage.upgrade(f"sqlite:///{path}")
    with _sqlite(path) as db:
        db.execute("UPDATE alembic_version SET version_num = '0099'")
    with pytest.raises(StoreError, match="unknown schema revision '0099'"):
        storage.upgrade(f"sqlite:///{path}")
    with pytest.raises(StoreError, match="newer tritune"):
        ConfigStore(f"sqlite:///{path}")
    assert _revision(path) == "0099", "a DB from a newer tritune is never touched"


def test_upgrade_refuses_somebody_elses_database(tmp_path: Path) -> None:
    path = tmp_path / "other.sqlite"
    with _sqlite(path) as db:
        db.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    with pytest.raises(StoreError, match=r"not a tritune config DB.*invoices"):
        ConfigStore(f"sqlite:///{path}")


if __name__ == "__main__":
    make_v0001_db(Path(sys.argv[1]))


def test_runtime_reads_a_revision_0002_db_without_writing_it(old_db: Path) -> None:
    """A DB one revision behind (no peer columns) still serves its winners; only a tuner upgrades it."""
    storage.upgrade(f"sqlite:///{old_db}", revision="0002")
    before = old_db.read_bytes()
    winners = read_winners(f"sqlite:///{old_db}", GPU)
    assert sorted(w.key["seqlen"] for w in winners) == [1024, 4096]
    assert all(w.peer_ms is None and w.peer_name is None for w in winners)
    assert _revision(old_db) == "0002"
    assert old_db.read_bytes() == before


def test_upgrade_to_head_adds_peer_columns_and_the_miss_log(old_db: Path) -> None:
    storage.upgrade(f"sqlite:///{old_db}")
    with _sqlite(old_db) as db:
        winner_columns = {row[1] for row in db.execute("PRAGMA table_info(winners)")}
        miss_columns = {row[1] for row in db.execute("PRAGMA table_info(misses)")}
    assert {"peer_ms", "peer_name"} <= winner_columns
    assert {"gpu", "kernel", "kernel_version", "key_json", "count", "first_seen", "last_seen"} <= miss_columns
    assert all(w.peer_ms is None for w in read_winners(f"sqlite:///{old_db}", GPU))


def test_runtime_reads_a_revision_0003_db_without_eager_alternatives(old_db: Path) -> None:
    """A DB one revision behind (no eager_json) serves its winners and peer times; only a tuner upgrades it."""
    storage.upgrade(f"sqlite:///{old_db}", revision="0003")
    with _sqlite(old_db) as db:
        db.execute("UPDATE winners SET peer_ms = 0.4, peer_name = 'SDPA flash' WHERE key_json = ?", (KEY_A,))
    before = old_db.read_bytes()
    winners = {w.key["seqlen"]: w for w in read_winners(f"sqlite:///{old_db}", GPU)}
    assert {seqlen: (w.peer_ms, w.eager) for seqlen, w in winners.items()} == {1024: (0.4, None), 4096: (None, None)}
    assert _revision(old_db) == "0003"
    assert old_db.read_bytes() == before
    with ConfigStore(f"sqlite:///{old_db}") as store:
        upgraded = {w.key["seqlen"]: (w.peer_ms, w.eager) for w in store.winners()}
    assert _revision(old_db) == storage.SCHEMA_HEAD
    assert upgraded == {1024: (0.4, None), 4096: (None, None)}


def test_revision_0004_adds_eager_json_and_downgrades_without_it(old_db: Path) -> None:
    from alembic import command

    url = f"sqlite:///{old_db}"
    storage.upgrade(url)
    with _sqlite(old_db) as db:
        assert "eager_json" in {row[1] for row in db.execute("PRAGMA table_info(winners)")}
        assert [row[0] for row in db.execute("SELECT eager_json FROM winners")] == [None, None]
        eager = '{"config":{"BLOCK_M":64},"ms":0.1,"winner_ms":0.2}'
        db.execute("UPDATE winners SET eager_json = ?, peer_ms = 0.4, peer_name = 'SDPA' WHERE key_json = ?",
                   (eager, KEY_A))  # fmt: skip
    assert {w.key["seqlen"]: w.eager is not None for w in read_winners(url, GPU)} == {1024: True, 4096: False}
    engine = storage.make_engine(url)
    try:
        with engine.begin() as connection:
            config = storage.alembic_config()
            config.attributes["connection"] = connection
            command.downgrade(config, "0003")
    finally:
        engine.dispose()
    assert _revision(old_db) == "0003"
    with _sqlite(old_db) as db:
        assert "eager_json" not in {row[1] for row in db.execute("PRAGMA table_info(winners)")}
    winners = {w.key["seqlen"]: (w.time_ms, w.peer_ms, w.eager) for w in read_winners(url, GPU)}
    assert winners == {1024: (0.21, 0.4, None), 4096: (0.5, None, None)}
    assert storage.upgrade(url) == storage.SCHEMA_HEAD
    assert _schema_diff(url) == []


def test_runtime_reads_a_revision_0004_db_without_portable_configs(old_db: Path) -> None:
    """A DB one revision behind (no portable_config_json) serves its winners, eager alternatives
    included, none naming a default; only a tuner upgrades it."""
    url = f"sqlite:///{old_db}"
    storage.upgrade(url, revision="0004")
    eager = '{"config":{"BLOCK_M":64},"ms":0.1,"winner_ms":0.2}'
    with _sqlite(old_db) as db:
        db.execute("UPDATE winners SET eager_json = ? WHERE key_json = ?", (eager, KEY_A))
    before = old_db.read_bytes()
    winners = {w.key["seqlen"]: (w.eager is not None, w.portable_config) for w in read_winners(url, GPU)}
    assert winners == {1024: (True, None), 4096: (False, None)}
    assert _revision(old_db) == "0004"
    assert old_db.read_bytes() == before


def test_revision_0005_adds_portable_config_json_and_downgrades_without_it(old_db: Path) -> None:
    from alembic import command

    url = f"sqlite:///{old_db}"
    storage.upgrade(url)
    with _sqlite(old_db) as db:
        assert [row[0] for row in db.execute("SELECT portable_config_json FROM winners")] == [None, None]
        db.execute("UPDATE winners SET portable_config_json = ? WHERE key_json = ?", ('{"BLOCK_M":32}', KEY_A))
    assert {w.key["seqlen"]: w.portable_config for w in read_winners(url, GPU)} == {1024: {"BLOCK_M": 32}, 4096: None}
    engine = storage.make_engine(url)
    try:
        with engine.begin() as connection:
            config = storage.alembic_config()
            config.attributes["connection"] = connection
            command.downgrade(config, "0004")
    finally:
        engine.dispose()
    with _sqlite(old_db) as db:
        assert "portable_config_json" not in {row[1] for row in db.execute("PRAGMA table_info(winners)")}
    assert {w.key["seqlen"]: w.portable_config for w in read_winners(url, GPU)} == {1024: None, 4096: None}
    assert storage.upgrade(url) == "0005"
    assert _schema_diff(url) == []


def test_a_malformed_portable_config_skips_its_row(old_db: Path) -> None:
    """A winner whose stored default cannot be read cannot be checked against the running default:
    its row is skipped (with a warning), the others served."""
    url = f"sqlite:///{old_db}"
    storage.upgrade(url)
    with _sqlite(old_db) as db:
        db.execute("UPDATE winners SET portable_config_json = ? WHERE key_json = ?", ('{"BLOCK_M":[1]}', KEY_A))
    assert [w.key["seqlen"] for w in read_winners(url, GPU)] == [4096]
