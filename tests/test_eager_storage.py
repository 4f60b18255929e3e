"""A winner's eager alternative in storage: the DB's ``winners.eager_json`` and a bundle entry's ``eager``.

It is written with its winner and replaced with it, read back as it was written, carried by
``tune export`` and ``tune import``, and checked for shape wherever it enters: a malformed one
refuses its bundle entry (and a write), and one found malformed in a DB is ignored on read while
its winner is still served.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import toy_kernel
import triton
from db_samples import ENV, GPU, stores
from typer.testing import CliRunner

from tritune.configs_db import storage
from tritune.configs_db.bundles import read_bundle, write_bundle
from tritune.configs_db.records import EagerAlternative, WinnerRecord
from tritune.configs_db.store import ConfigStore, eager_json, read_winners
from tritune.configs_db.upserts import WinnerValues, offer_portable
from tritune.configs_db.values import canonical_json
from tritune.configs_db.winner_fields import eager_problem
from tritune.kernels import registry
from tritune.tuner.cli import app

KEY = {"arch": "sm90", "sm_count": 132, "head_dim": 64, "seqlen": 128}
PROVENANCE = {"torch": "2.13.0", "triton": "3.6.0", "cuda": "12.8", "driver": "570.86", "tritune": "0.1.0"}
CREATED = "2025-06-01T12:00:00+00:00"
EAGER = EagerAlternative(config={"BLOCK_M": 64, "num_warps": 4, "path": "portable"}, ms=0.011, winner_ms=0.019)
OTHER_EAGER = EagerAlternative(config={"BLOCK_M": 32, "num_warps": 2, "path": "portable"}, ms=0.009, winner_ms=0.02)


def winner(time_ms: float = 0.01, seqlen: int = 128, **changes: Any) -> WinnerRecord:
    record = WinnerRecord(
        kernel="tma_prefill",
        kernel_version="abc123",
        gpu=GPU,
        key={**KEY, "seqlen": seqlen},
        config={"BLOCK_M": 128, "num_warps": 8, "path": "tma"},
        time_ms=time_ms,
        portable_ms=0.02,
        speedup=0.02 / time_ms,
        trials=30,
        triton_version=ENV["triton_version"],
        torch_version=ENV["torch_version"],
        tritune_version=ENV["tritune_version"],
    )
    return replace(record, **changes)


store = pytest.fixture(params=["memory", "file"], name="store")(stores)


def eagers(records: list[WinnerRecord]) -> dict[int, EagerAlternative | None]:
    return {r.key["seqlen"]: r.eager for r in records}


def execute(path: Path, sql: str, *parameters: Any) -> None:
    with closing(sqlite3.connect(path)) as db, db:
        db.execute(sql, parameters)


# ---- the DB ---------------------------------------------------------------------------------------


def test_a_winner_and_its_eager_alternative_are_read_back_as_written(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.sqlite'}"
    with ConfigStore(url) as store:
        env_id = store.environment(**ENV)
        assert store.offer_winner(winner(seqlen=128, eager=EAGER), env_id)
        assert store.offer_winner(winner(seqlen=4096), env_id)
        stored = eagers(store.winners())
    assert stored == {128: EAGER, 4096: None}
    assert eagers(read_winners(url, GPU)) == stored, "the runtime reads what the tuner does"
    with closing(sqlite3.connect(tmp_path / "c.sqlite")) as db:
        rows = dict(db.execute("SELECT key_json, eager_json FROM winners"))
    assert rows == {
        canonical_json(KEY): '{"config":{"BLOCK_M":64,"num_warps":4,"path":"portable"},"ms":0.011,"winner_ms":0.019}',
        canonical_json({**KEY, "seqlen": 4096}): None,
    }


def test_a_better_offer_brings_its_own_eager_alternative(store: ConfigStore) -> None:
    env_id = store.environment(**ENV)
    assert store.offer_winner(winner(0.010, eager=EAGER), env_id)
    assert not store.offer_winner(winner(0.012, eager=OTHER_EAGER), env_id), "a slower offer changes nothing"
    assert eagers(store.winners()) == {128: EAGER}
    assert store.offer_winner(winner(0.009, eager=OTHER_EAGER), env_id)
    assert eagers(store.winners()) == {128: OTHER_EAGER}
    assert store.offer_winner(winner(0.008), env_id)
    assert eagers(store.winners()) == {128: None}, "the replaced winner's alternative goes with it"
    assert not store.offer_winner(winner(0.0085, eager=EAGER), env_id)
    assert eagers(store.winners()) == {128: None}


def test_the_portable_offer_replaces_the_eager_alternative_too(store: ConfigStore) -> None:
    env_id = store.environment(**ENV)
    base = winner(0.010)

    def offer(time_ms: float, eager: EagerAlternative | None) -> bool:
        values = WinnerValues(
            gpu=GPU,
            kernel=base.kernel,
            kernel_version=base.kernel_version,
            key_json=canonical_json(base.key),
            config_json=canonical_json(base.config),
            time_ms=time_ms,
            portable_ms=0.02,
            speedup=0.02 / time_ms,
            trial_count=5,
            environment_id=env_id,
            eager_json=None if eager is None else eager_json(eager),
        )
        with storage.session_scope(store.engine) as session:
            return offer_portable(session, values, ENV["triton_version"], ENV["torch_version"])

    assert offer(0.010, EAGER)
    assert eagers(store.winners()) == {128: EAGER}
    assert offer(0.009, None)
    assert eagers(store.winners()) == {128: None}
    assert offer(0.008, OTHER_EAGER)
    assert not offer(0.0085, EAGER)
    assert eagers(store.winners()) == {128: OTHER_EAGER}


@pytest.mark.parametrize(
    "eager, reason",
    [
        pytest.param(EagerAlternative({}, 0.01, 0.02), "eager.config is an empty object", id="empty-config"),
        pytest.param(EagerAlternative({"B": [1]}, 0.01, 0.02), "eager.config.B is a list", id="nested-config"),
        pytest.param(EagerAlternative({"B": 1}, float("nan"), 0.02), "eager.ms is nan", id="nan-ms"),
        pytest.param(EagerAlternative({"B": 1}, 0.01, -0.02), "eager.winner_ms is -0.02", id="negative-winner-ms"),
        pytest.param(EagerAlternative({"B": 1}, 0.03, 0.02), "eager.ms 0.03 is not below", id="not-faster"),
    ],
)
def test_a_malformed_eager_alternative_is_never_written(
    store: ConfigStore, eager: EagerAlternative, reason: str, tmp_path: Path
) -> None:
    env_id = store.environment(**ENV)
    with pytest.raises(ValueError, match=reason):
        store.offer_winner(winner(eager=eager), env_id)
    assert store.winners() == []
    with pytest.raises(ValueError, match=reason):
        write_bundle([winner(eager=eager)], tmp_path / "b.json", GPU, "NVIDIA H200", PROVENANCE, created=CREATED)
    assert not (tmp_path / "b.json").exists()


#: name -> (what a damaged row's eager_json holds, the reason its warning gives).
DAMAGED_ROWS = {
    "not-json": ('{"config": ', "Expecting value"),
    "a-list": ("[1, 2]", "eager is a list, expected an object"),
    "missing-winner-ms": ('{"config": {"B": 1}, "ms": 0.01}', "eager is missing field(s) winner_ms"),
    "extra-field": ('{"config": {"B": 1}, "ms": 0.01, "winner_ms": 0.02, "x": 1}', "unknown field(s) x"),
    "nan-ms": ('{"config": {"B": 1}, "ms": NaN, "winner_ms": 0.02}', "eager.ms is NaN (not a finite number)"),
    "zero-ms": ('{"config": {"B": 1}, "ms": 0, "winner_ms": 0.02}', "eager.ms is 0, expected a positive number"),
    "boolean-ms": ('{"config": {"B": 1}, "ms": true, "winner_ms": 0.02}', "eager.ms is a boolean"),
    "config-a-string": ('{"config": "B=1", "ms": 0.01, "winner_ms": 0.02}', "eager.config is a string"),
    "forged-line": ('{"config": {"B": "\\n\\u001b[31m"}, "ms": 0.01, "winner_ms": 0.02}', "eager.config.B is '"),
}


@pytest.mark.parametrize("name", sorted(DAMAGED_ROWS))
def test_a_damaged_eager_alternative_is_ignored_and_its_winner_served(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c.sqlite"
    with ConfigStore(f"sqlite:///{path}") as store:
        env_id = store.environment(**ENV)
        store.offer_winner(winner(seqlen=128, eager=EAGER), env_id)
        store.offer_winner(winner(seqlen=4096, eager=OTHER_EAGER), env_id)
    damaged, reason = DAMAGED_ROWS[name]
    execute(path, "UPDATE winners SET eager_json = ? WHERE key_json LIKE '%\"seqlen\":128%'", damaged)
    with caplog.at_level(logging.WARNING, logger="tritune.configs_db"):
        read = read_winners(f"sqlite:///{path}", GPU)
    assert eagers(read) == {128: None, 4096: OTHER_EAGER}
    assert {r.key["seqlen"]: r.config for r in read}[128] == winner().config
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(messages) == 1, messages
    assert "ignoring its eager alternative" in messages[0] and reason in messages[0]
    assert messages[0].isprintable(), messages[0]
    with ConfigStore(f"sqlite:///{path}") as store:
        assert eagers(store.winners()) == {128: None, 4096: OTHER_EAGER}, "the tuner's read agrees"


# ---- bundles --------------------------------------------------------------------------------------


def test_bundle_round_trip_keeps_the_eager_alternative_and_leaves_out_a_missing_one(tmp_path: Path) -> None:
    records = [winner(seqlen=128, eager=EAGER), winner(seqlen=4096)]
    path = write_bundle(records, tmp_path / f"{GPU}.json", GPU, "NVIDIA H200", PROVENANCE, created=CREATED)
    entries = {w["key"]["seqlen"]: w for w in json.loads(path.read_text())["winners"]}
    assert entries[128]["eager"] == {"config": EAGER.config, "ms": 0.011, "winner_ms": 0.019}
    assert "eager" not in entries[4096]
    read, rejections = read_bundle(path, expected_gpu=GPU)
    assert rejections == []
    assert eagers(read) == {128: EAGER, 4096: None}
    assert all(type(r.eager.ms) is float for r in read if r.eager is not None)


def entry(seqlen: int, **changes: Any) -> dict[str, Any]:
    return {
        "kernel": "tma_prefill",
        "kernel_version": "abc123",
        "key": {**KEY, "seqlen": seqlen},
        "config": {"BLOCK_M": 128},
        "time_ms": 0.01,
        "portable_ms": 0.02,
        "speedup": 2.0,
        "trials": 12,
        **changes,
    }


def bundle(path: Path, *entries: dict[str, Any], literal: str = "") -> Path:
    doc = {
        "schema": "tritune-bundle",
        "schema_version": 1,
        "gpu": GPU,
        "gpu_name": "NVIDIA H200",
        "created": CREATED,
        "provenance": PROVENANCE,
        "winners": list(entries),
    }
    # "@LITERAL@" stands for a number json.dumps cannot write (a 4000-digit integer).
    path.write_text(json.dumps(doc).replace('"@LITERAL@"', literal))
    return path


GOOD = {"config": {"BLOCK_M": 64}, "ms": 0.01, "winner_ms": 0.02}

#: name -> (the entry's eager value, the reason the entry is refused with).
MALFORMED_EAGER: dict[str, tuple[Any, str]] = {
    "a-list": ([GOOD], "eager is a list, expected an object with the fields config, ms, winner_ms"),
    "a-string": ("fast", "eager is a string, expected an object"),
    "a-number": (0.01, "eager is a number, expected an object"),
    "empty": ({}, "eager is missing field(s) config, ms, winner_ms"),
    "missing-config": ({"ms": 0.01, "winner_ms": 0.02}, "eager is missing field(s) config"),
    "missing-ms": ({"config": {"BLOCK_M": 64}, "winner_ms": 0.02}, "eager is missing field(s) ms"),
    "missing-winner-ms": ({"config": {"BLOCK_M": 64}, "ms": 0.01}, "eager is missing field(s) winner_ms"),
    "extra-field": ({**GOOD, "speedup": 2.0}, "eager has unknown field(s) speedup, expected only config, ms,"),
    "replayed-false": ({**GOOD, "replayed": False}, "eager.replayed is false, expected true (or no such field)"),
    "replayed-string": ({**GOOD, "replayed": "yes"}, "eager.replayed is a string, expected true"),
    "nan-ms": ({**GOOD, "ms": float("nan")}, "eager.ms is NaN (not a finite number), expected a number"),
    "infinite-ms": ({**GOOD, "ms": float("inf")}, "eager.ms is Infinity (not a finite number), expected a number"),
    "huge-ms": ({**GOOD, "ms": "@LITERAL@"}, "eager.ms is an integer of 4000 digits (outside the 64-bit range)"),
    "negative-ms": ({**GOOD, "ms": -0.01}, "eager.ms is -0.01, expected a positive number"),
    "zero-winner-ms": ({**GOOD, "winner_ms": 0}, "eager.winner_ms is 0, expected a positive number"),
    "boolean-ms": ({**GOOD, "ms": True}, "eager.ms is a boolean, expected a number"),
    "string-winner-ms": ({**GOOD, "winner_ms": "0.02"}, "eager.winner_ms is a string, expected a number"),
    "null-ms": ({**GOOD, "ms": None}, "eager.ms is null, expected a number"),
    "not-faster": ({**GOOD, "ms": 0.02}, "eager.ms 0.02 is not below eager.winner_ms 0.02"),
    "config-a-list": ({**GOOD, "config": [64]}, "eager.config is a list, expected an object"),
    "config-null": ({**GOOD, "config": None}, "eager.config is null, expected an object"),
    "config-empty": ({**GOOD, "config": {}}, "eager.config is an empty object, expected a config's fields"),
    "config-nested": ({**GOOD, "config": {"BLOCK_M": {"x": 1}}}, "eager.config.BLOCK_M is an object, expected a"),
    "config-null-value": ({**GOOD, "config": {"BLOCK_M": None}}, "eager.config.BLOCK_M is null, expected a"),
    "config-empty-name": ({**GOOD, "config": {"": 64}}, "eager.config has a field name '' that is not a non-empty"),
    "config-forged-value": (
        {**GOOD, "config": {"path": "tma\nWARNING all good"}},
        "eager.config.path is 'tma\\nWARNING all good', which holds a control character",
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED_EAGER))
def test_a_malformed_eager_value_refuses_its_entry_and_keeps_its_neighbour(name: str, tmp_path: Path) -> None:
    value, reason = MALFORMED_EAGER[name]
    path = bundle(tmp_path / "b.json", entry(128, eager=GOOD), entry(4096, eager=value), literal="1" * 4000)
    (kept,), (rejection,) = read_bundle(path)
    assert (kept.key["seqlen"], kept.eager) == (128, EagerAlternative({"BLOCK_M": 64}, 0.01, 0.02))
    assert "winners[1] (tma_prefill): " in rejection.reason
    assert reason in rejection.reason
    assert rejection.reason.isprintable()


def test_eager_problem_names_the_field_and_what_was_expected() -> None:
    assert eager_problem(None) is None
    assert eager_problem(GOOD) is None
    assert eager_problem({**GOOD, "config": {"BLOCK_M": 64, "FUSED": True, "scale": 0.5}}) is None
    assert eager_problem({**GOOD, "winner_ms": 1}) is None, "a whole number of ms is a number"
    assert eager_problem({**GOOD, "ms": False}) == "eager.ms is a boolean, expected a number"
    assert eager_problem({"config": {"B": 1}, "ms": 0.01}) == "eager is missing field(s) winner_ms"


def test_an_entry_with_a_null_eager_has_none(tmp_path: Path) -> None:
    path = bundle(tmp_path / "b.json", entry(128, eager=None))
    (only,), rejections = read_bundle(path)
    assert rejections == [] and only.eager is None


# ---- tune export and tune import ----------------------------------------------------------------


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")


def test_export_and_import_carry_the_eager_alternative(toy: None, tmp_path: Path) -> None:
    versions = {"triton_version": triton.__version__, "torch_version": torch.__version__, "tritune_version": "0"}
    eager = EagerAlternative({"BLOCK": 32, "BROKEN": False, "num_warps": 1}, 0.004, 0.006)
    records = [
        WinnerRecord(
            kernel="toy_scale",
            kernel_version=toy_kernel.SPEC.version,
            gpu="cpu-interpreter",
            key={"arch": "cpu-interpreter", "sm_count": 1, "dtype": "float32", "n_bucket": n_bucket},
            config={"BLOCK": 128, "BROKEN": False, "num_warps": 2},
            time_ms=0.005,
            portable_ms=0.01,
            speedup=2.0,
            trials=8,
            eager=eager if n_bucket == 64 else None,
            **versions,
        )
        for n_bucket in (64, 256)
    ]
    source, target = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    with ConfigStore(f"sqlite:///{source}") as store:
        env_id = store.environment(gpu="cpu-interpreter", **versions)
        assert all(store.offer_winner(record, env_id) for record in records)
    runner = CliRunner()
    path = tmp_path / "cpu-interpreter.json"
    exported = runner.invoke(app, ["export", "--gpu", "cpu-interpreter", "--db", str(source), "--out", str(path)])
    assert exported.exit_code == 0, exported.output
    entries = {w["key"]["n_bucket"]: w for w in json.loads(path.read_text())["winners"]}
    assert entries[64]["eager"] == {"config": eager.config, "ms": 0.004, "winner_ms": 0.006}
    assert "eager" not in entries[256]
    imported = runner.invoke(app, ["import", str(path), "--db", str(target)])
    assert imported.exit_code == 0, imported.output
    assert "imported 2 winner(s)" in imported.output
    with ConfigStore(f"sqlite:///{target}") as store:
        assert {w.key["n_bucket"]: w.eager for w in store.winners()} == {64: eager, 256: None}


def test_import_refuses_an_eager_config_outside_the_space(toy: None, tmp_path: Path) -> None:
    versions = {"triton_version": triton.__version__, "torch_version": torch.__version__, "tritune_version": "0"}
    doc = {
        "schema": "tritune-bundle",
        "schema_version": 1,
        "gpu": "cpu-interpreter",
        "gpu_name": "cpu",
        "created": "2026-12-05T00:00:00+00:00",
        "provenance": {
            "cuda": "",
            "driver": "",
            "torch": versions["torch_version"],
            "triton": versions["triton_version"],
            "tritune": "0",
        },
        "winners": [
            {
                "kernel": "toy_scale",
                "kernel_version": toy_kernel.SPEC.version,
                "key": {"arch": "cpu-interpreter", "sm_count": 1, "dtype": "float32", "n_bucket": 64},
                "config": {"BLOCK": 128, "BROKEN": False, "num_warps": 2},
                "time_ms": 0.005,
                "portable_ms": 0.01,
                "speedup": 2.0,
                "trials": 8,
                "eager": {"config": {"BLOCK": 48}, "ms": 0.004, "winner_ms": 0.006},
            }
        ],
    }
    path = tmp_path / "cpu-interpreter.json"
    path.write_text(json.dumps(doc))
    target = tmp_path / "b.sqlite"
    imported = CliRunner().invoke(app, ["import", str(path), "--db", str(target)])
    assert imported.exit_code != 0
    assert "eager config outside the search space" in imported.output


def test_an_alternative_timed_with_eager_replay_says_so_in_the_db_and_the_bundle(tmp_path: Path) -> None:
    """``replayed`` travels as an optional ``true`` (an older alternative has no such field)."""
    replayed = replace(EAGER, replayed=True)
    url = f"sqlite:///{tmp_path / 'c.sqlite'}"
    with ConfigStore(url) as store:
        env_id = store.environment(**ENV)
        assert store.offer_winner(winner(seqlen=128, eager=replayed), env_id)
        assert store.offer_winner(winner(seqlen=4096, eager=EAGER), env_id)
        records = store.winners()
    assert eagers(records) == {128: replayed, 4096: EAGER}
    assert eagers(read_winners(url, GPU)) == {128: replayed, 4096: EAGER}
    path = write_bundle(records, tmp_path / f"{GPU}.json", GPU, "NVIDIA H200", PROVENANCE, created=CREATED)
    entries = {w["key"]["seqlen"]: w for w in json.loads(path.read_text())["winners"]}
    assert entries[128]["eager"]["replayed"] is True
    assert "replayed" not in entries[4096]["eager"]
    read, rejections = read_bundle(path, expected_gpu=GPU)
    assert rejections == [] and eagers(read) == {128: replayed, 4096: EAGER}
