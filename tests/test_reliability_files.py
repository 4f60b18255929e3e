"""Hostile files: each bad bundle refused for its own reason, bad DB files skipped, the portable path serving.

Bundles come from the committed corpus in ``tests/data/bad_bundles`` (plus a few generated here:
oversized, not UTF-8, nested too deeply). Each is installed as the shipped bundle of the
``cpu-interpreter`` pseudo-device in a temporary folder, and the toy kernel is dispatched: the
portable default must serve and exactly one warning must give the file's reason. The same files go
through ``tune import``, which must refuse them (exit status 1) without creating the DB.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
import torch
import toy_kernel
import triton
from typer.testing import CliRunner

from tritune.configs_db import bundles
from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import settings
from tritune.kernels.device import device_info
from tritune.kernels.dispatcher import dispatch_config
from tritune.tuner.cli import app

pytestmark = pytest.mark.usefixtures("toy_dispatch")

CORPUS = Path(__file__).resolve().parent / "data" / "bad_bundles"
CPU = device_info("cpu")
PORTABLE = {"BLOCK": 32, "BROKEN": False, "num_warps": 4}
TUNED = {"BLOCK": 128, "BROKEN": False, "num_warps": 2}

#: Corpus file -> the reason it must be refused with (a part of the one logged message).
REASONS = {
    "absurd_speedup": "speedup is 5000000.0, more than 1000 is a measurement error",
    "broken_json": "broken JSON (Invalid control character",
    "config_int_for_bool": "config outside the search space (toy_scale: BROKEN=0 is not in the space",
    "config_outside_space": "config outside the search space (toy_scale: BLOCK=48 is not in the space",
    "config_unknown_field": "unknown config field(s) ['EVAL']",
    "duplicate_field": "broken JSON (duplicate key 'gpu' in one object)",
    "foreign_gpu": "bundle is for GPU nvidia-h100-80gb-hbm3-sm90-132sm, expected cpu-interpreter",
    "foreign_key": "key is for sm90/132 SMs, not this GPU",
    "kernel_not_a_string": "winners[0]: kernel is a number, expected a non-empty string",
    "key_missing_field": "malformed key (ToyKey: fields ['arch', 'dtype', 'sm_count'] differ",
    "key_nested_value": "key.n_bucket is an object, expected a number, string or boolean",
    "missing_provenance": "missing field(s) provenance",
    "nan_time": "time_ms is NaN (not a finite number), expected a number",
    "negative_time": "time_ms is -0.1, expected a positive number",
    "not_a_bundle": "schema is None, expected 'tritune-bundle'",
    "schema_version_bool": "unknown schema_version True (this tritune reads 1)",
    "stale_kernel_version": "stale kernel version 0123456789abcdef (running",
    "stale_triton": "tuned with Triton 2.1.0, running",
    "time_as_string": "time_ms is a string, expected a number",
    "top_level_list": "top level is a list, expected an object",
    "unknown_kernel": "flash_attn_9: unknown kernel",
    "unknown_schema_version": "unknown schema_version 2 (this tritune reads 1)",
    "unknown_top_level_field": "unknown field(s) exec",
    "winners_not_a_list": "winners is an object, expected a list",
    "zero_trials": "trials is 0, expected at least 1",
}
#: Generated here rather than committed: name -> (bytes writer, reason).
GENERATED = {
    "oversized": f"over the limit of {bundles.MAX_BUNDLE_BYTES} bytes for a bundle",
    "not_utf8": "not UTF-8 text (invalid start byte at byte 9)",
    "nested_too_deeply": "broken JSON (nested too deeply)",
}
#: ``tune import`` fills a DB that may hold many GPUs, so it keeps records of another GPU (the
#: dispatcher never serves them there); everything else it refuses as the dispatcher does.
IMPORT_KEEPS = {"foreign_gpu", "foreign_key"}
#: Tuned under another Triton: the dispatcher serves it provisionally (tests/test_provisional.py); import refuses it.
DISPATCHER_SERVES = {"stale_triton"}


def corpus_text(name: str) -> str:
    text = (CORPUS / f"{name}.json").read_text()
    return text.replace("@TOY_VERSION@", toy_kernel.SPEC.version).replace("@TRITON@", triton.__version__)


def good_text() -> str:
    """The corpus's base document with nothing wrong, as a positive control."""
    doc = json.loads(corpus_text("negative_time"))
    doc["winners"][0]["time_ms"] = 0.1
    return json.dumps(doc)


def write_bad(name: str, path: Path) -> Path:
    if name == "oversized":
        # A sparse file: refused on its size before a byte is read.
        with path.open("wb") as fh:
            fh.truncate(bundles.MAX_BUNDLE_BYTES + 1)
    elif name == "not_utf8":
        path.write_bytes(b'{"gpu": "\xff\xfe"}')
    elif name == "nested_too_deeply":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        path.write_text(corpus_text(name))
    return path


@pytest.fixture
def bundle_dir(tmp_path, monkeypatch):
    """Bundles on, read from a temporary folder instead of the package's."""
    folder = tmp_path / "bundles"
    folder.mkdir()
    monkeypatch.setattr(bundles, "shipped_bundle_dir", lambda: folder)
    monkeypatch.setenv("TRITUNE_DISABLE_BUNDLES", "0")
    settings.reload()
    return folder


def served() -> dict:
    spec = toy_kernel.SPEC
    config = dispatch_config("toy_scale", "cpu", -1, tuple(spec.facts(torch.randn(100))))
    return spec.space.to_dict(config)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_every_corpus_file_has_a_reason():
    assert sorted(p.stem for p in CORPUS.glob("*.json")) == sorted(REASONS)


def test_a_good_bundle_is_served(bundle_dir, caplog):
    (bundle_dir / "cpu-interpreter.json").write_text(good_text())
    assert served() == TUNED
    assert warnings(caplog) == []


@pytest.mark.parametrize("name", sorted(set(REASONS) - DISPATCHER_SERVES) + sorted(GENERATED))
def test_dispatcher_refuses_bad_bundle_with_its_reason(name, bundle_dir, caplog):
    caplog.set_level(logging.WARNING, logger="tritune")
    write_bad(name, bundle_dir / "cpu-interpreter.json")
    assert served() == PORTABLE
    messages = warnings(caplog)
    assert len(messages) == 1, messages
    assert {**REASONS, **GENERATED}[name] in messages[0]


@pytest.mark.parametrize("name", sorted(REASONS) + sorted(GENERATED))
def test_tune_import_refuses_bad_bundle(name, tmp_path):
    path = write_bad(name, tmp_path / f"{name}.json")
    db = f"sqlite:///{tmp_path / 'imported.sqlite'}"
    result = CliRunner().invoke(app, ["import", str(path), "--db", db], catch_exceptions=False)
    output = " ".join(result.output.split())
    if name in IMPORT_KEEPS:
        assert result.exit_code == 0, result.output
        assert "imported 1 winner(s)" in output
        # Stored under its own GPU or key; the dispatcher still serves the portable default here.
        with settings.override(db_url=db):
            assert served() == PORTABLE
        return
    # Nothing taken is a failed import (status 1), and the DB is not even created.
    assert result.exit_code == 1, result.output
    assert "nothing was imported" in output
    assert {**REASONS, **GENERATED}[name] in output
    assert not (tmp_path / "imported.sqlite").exists()


# ---- the config DB file ----------------------------------------------------------------------


def _good_db(path: Path) -> None:
    """A config DB holding one good winner of the toy kernel at the key :func:`served` asks for."""
    with ConfigStore(f"sqlite:///{path}") as store:
        versions = {"torch_version": torch.__version__, "triton_version": triton.__version__, "tritune_version": "test"}
        env = store.environment(gpu=CPU.slug, **versions)
        key = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", 128)
        record = WinnerRecord(
            kernel="toy_scale",
            kernel_version=toy_kernel.SPEC.version,
            gpu=CPU.slug,
            key=key.to_dict(),
            config=TUNED,
            time_ms=0.1,
            portable_ms=0.2,
            speedup=2.0,
            trials=12,
            **versions,
        )
        assert store.offer_winner(record, env)


def _newer_schema(path: Path) -> None:
    _good_db(path)
    with closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("UPDATE alembic_version SET version_num = '0099'")


def _someone_elses(path: Path) -> None:
    with closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")


def _truncated(path: Path) -> None:
    _good_db(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def _garbage(path: Path) -> None:
    path.write_bytes(b"SQLite format 2\x00" + bytes(range(256)) * 64)


def _malformed_row(path: Path) -> None:
    _good_db(path)
    with closing(sqlite3.connect(path)) as connection, connection:
        connection.execute("""UPDATE winners SET config_json = '{"BLOCK": [128]}'""")


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_garbage, "file is not a database"),
        (_truncated, "database disk image is malformed"),
        (_newer_schema, "unknown schema revision '0099'"),
        (_someone_elses, "not a tritune config DB (no alembic_version table; it holds users)"),
        (_malformed_row, "value.BLOCK is a list, expected a number, string or boolean"),
    ],
    ids=["garbage", "truncated", "newer-schema", "someone-elses", "malformed-row"],
)
def test_bad_db_file_is_logged_and_portable_serves(damage, reason, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tritune")
    path = tmp_path / "configs.sqlite"
    damage(path)
    with settings.override(db_url=str(path)):
        assert served() == PORTABLE
        assert served() == PORTABLE
    messages = warnings(caplog)
    assert len(messages) == 1, messages
    assert reason in messages[0]


def test_good_db_file_is_served(tmp_path):
    path = tmp_path / "configs.sqlite"
    _good_db(path)
    with settings.override(db_url=str(path)):
        assert served() == TUNED
