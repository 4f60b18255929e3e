"""A winner names the portable default its speedup was measured against, and serves only under it.

A kernel's default can change while its version (its Triton code and search space) stays the same;
a winner's speedup then says nothing about the default that would serve in its place, which may be
the faster of the two. Each winner stores that default (DB, bundle, online-tuning reports); the
dispatcher refuses one whose default is not the running code's at its key, ``tune`` and online
tuning measure such a key again, and a fresh measurement replaces it in the DB even where its
stored time was lower. Records that predate the field serve as before.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import triton
from toy_records import CPU, SPEC, TUNED, offer, toy_key, toy_record

from tritune.configs_db.bundles import read_bundle, write_bundle
from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import settings
from tritune.kernels.dispatcher import dispatch_config
from tritune.kernels.jit_background import record_from_plain
from tritune.kernels.winners import OTHER_DEFAULT, against_other_default
from tritune.tuner.jit import plain_winner
from tritune.tuner.study import KeyTuner, TuneOptions, environment_id
from tritune.tuner.timing import FakeTimer

#: A toy config that is not the toy's default at any key (its default is 32-wide, 4 warps).
OTHER = {"BLOCK": 16, "BROKEN": False, "num_warps": 4}


pytestmark = pytest.mark.usefixtures("toy_dispatch")


def _default(n_bucket: int) -> dict:
    return SPEC.space.to_dict(SPEC.default_config(toy_key(n_bucket)))


def _winner(n_bucket: int = 128, **changes) -> WinnerRecord:
    return toy_record(n_bucket, **changes)


def _provenance() -> dict[str, str]:
    return {"cuda": "", "driver": "", "torch": torch.__version__, "triton": triton.__version__, "tritune": "test"}


def _served(n: int) -> dict:
    x = torch.randn(n)
    return SPEC.space.to_dict(dispatch_config("toy_scale", "cpu", -1, tuple(SPEC.facts(x))))


@pytest.mark.parametrize(
    ("portable", "served"),
    [("running", TUNED), (None, TUNED), ("other", "default")],
    ids=["the-running-default", "not-recorded", "another-default"],
)
def test_a_winner_serves_only_against_the_running_default(portable, served, caplog):
    caplog.set_level(logging.WARNING, logger="tritune.dispatch")
    recorded = {"running": _default(128), "other": OTHER, None: None}[portable]
    store = ConfigStore(settings.settings().db_url)
    record = _winner(portable_config=recorded)
    assert offer(store, record)
    assert _served(100) == (_default(128) if served == "default" else served)
    refused = [r.getMessage() for r in caplog.records if OTHER_DEFAULT in r.getMessage()]
    assert len(refused) == (1 if portable == "other" else 0), refused
    assert against_other_default(record) is (portable == "other")


def test_a_refused_winner_lends_nothing_to_its_neighbours():
    """A neighbour's speedup is against its own key's default: timed against another, it lends nothing."""
    store = ConfigStore(settings.settings().db_url)
    record = _winner(256, portable_config=OTHER)
    assert offer(store, record)
    assert _served(100) == _default(128)


def test_against_other_default_leaves_unreadable_records_to_the_admission_checks():
    assert not against_other_default(_winner(kernel="gone_kernel", portable_config=OTHER))
    assert not against_other_default(_winner(key={"arch": "cpu-interpreter"}, portable_config=OTHER))


def test_the_bundle_carries_the_portable_default(tmp_path: Path):
    path = tmp_path / f"{CPU.slug}.json"
    provenance = _provenance()
    records = [_winner(64, portable_config=_default(64)), _winner(128)]
    write_bundle(records, path, CPU.slug, CPU.name, provenance)
    entries = {e["key"]["n_bucket"]: e for e in json.loads(path.read_text())["winners"]}
    assert entries[64]["portable_config"] == _default(64)
    assert "portable_config" not in entries[128], "an unrecorded default is left out, not written as null"
    read, rejected = read_bundle(path, CPU.slug)
    assert rejected == []
    assert {r.key["n_bucket"]: r.portable_config for r in read} == {64: _default(64), 128: None}


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({}, "empty object"),
        ([32], "expected an object"),
        ({"BLOCK": [32]}, "portable_config.BLOCK"),
        ({"BLOCK": "\x1b[2J"}, "portable_config.BLOCK"),
    ],
    ids=["empty", "a-list", "nested", "control-character"],
)
def test_a_malformed_portable_default_refuses_its_bundle_entry(tmp_path: Path, value, reason):
    path = tmp_path / f"{CPU.slug}.json"
    provenance = _provenance()
    write_bundle([_winner(64), _winner(128)], path, CPU.slug, CPU.name, provenance)
    document = json.loads(path.read_text())
    (entry,) = [e for e in document["winners"] if e["key"]["n_bucket"] == 64]
    entry["portable_config"] = value
    path.write_text(json.dumps(document))
    read, rejected = read_bundle(path, CPU.slug)
    assert [r.key["n_bucket"] for r in read] == [128]
    assert len(rejected) == 1 and reason in rejected[0].reason, rejected


def test_a_null_portable_default_in_a_bundle_reads_as_not_recorded(tmp_path: Path):
    path = tmp_path / f"{CPU.slug}.json"
    provenance = _provenance()
    write_bundle([_winner(64)], path, CPU.slug, CPU.name, provenance)
    document = json.loads(path.read_text())
    document["winners"][0]["portable_config"] = None
    path.write_text(json.dumps(document))
    read, rejected = read_bundle(path, CPU.slug)
    assert rejected == [] and read[0].portable_config is None


def test_the_store_refuses_a_malformed_portable_default(tmp_path: Path):
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    record = _winner(portable_config={"BLOCK": float("nan")})
    with pytest.raises(ValueError, match=r"portable_config\.BLOCK"):
        offer(store, record)


def test_a_measurement_against_another_default_replaces_a_faster_stored_winner(tmp_path: Path):
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    old = _winner(time_ms=0.5, portable_ms=0.75, portable_config=OTHER)
    assert offer(store, old)
    fresh = _winner(config=_default(128), time_ms=0.8, portable_ms=0.8, speedup=1.0, portable_config=_default(128))
    assert offer(store, fresh), "the stored speedup says nothing about the running default"
    slower = dataclasses.replace(fresh, config=TUNED, time_ms=0.9, portable_ms=0.9, speedup=1.0)
    assert not offer(store, slower), "against the same default the faster winner stays"
    (stored,) = store.winners()
    assert (stored.config, stored.time_ms, stored.portable_config) == (_default(128), 0.8, _default(128))


def test_a_winner_that_names_no_default_is_replaced_by_time_alone(tmp_path: Path):
    """Written before the field was stored, it serves as before, and so it stays until beaten."""
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    old = _winner(time_ms=0.5, portable_ms=0.75)
    assert offer(store, old)
    assert not offer(store, _winner(time_ms=0.8, portable_ms=1.2, portable_config=_default(128)))
    assert offer(store, _winner(time_ms=0.4, portable_ms=0.6, portable_config=_default(128)))
    (stored,) = store.winners()
    assert (stored.time_ms, stored.portable_config) == (0.4, _default(128))


def test_an_import_replaces_by_time_alone(tmp_path: Path):
    """An imported record was measured elsewhere, against whatever default it names: it never
    displaces a faster stored winner for naming another one."""
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    fresh = _winner(time_ms=0.5, portable_ms=0.75, portable_config=_default(128))
    assert offer(store, fresh)
    assert store.import_records([_winner(time_ms=0.8, portable_ms=1.2, portable_config=OTHER)]) == (0, 1)
    assert store.import_records([_winner(time_ms=0.4, portable_ms=0.6, portable_config=OTHER)]) == (1, 0)
    (stored,) = store.winners()
    assert (stored.time_ms, stored.portable_config) == (0.4, OTHER)


def test_online_tuning_reports_carry_the_portable_default():
    record = _winner(portable_config=_default(128))
    plain = json.loads(json.dumps(plain_winner(record)))
    assert record_from_plain(plain, "jit").portable_config == _default(128)
    assert record_from_plain({**plain, "portable_config": None}, "jit").portable_config is None
    with pytest.raises(ValueError, match="portable_config"):
        record_from_plain({**plain, "portable_config": {"BLOCK": [1]}}, "jit")


def test_a_tune_stores_the_default_it_timed(tmp_path: Path):
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    key = SPEC.default_keys(CPU, n=[256])[0]
    options = TuneOptions(trials=6, seed=1, batch=3, final_rounds=1)
    timer = FakeTimer(lambda c: 10.0 / c.BLOCK + (0.0 if c.num_warps == 2 else 0.05))
    KeyTuner(SPEC, key, CPU, torch.device("cpu"), store, environment_id(store, CPU), timer, options).run()
    (stored,) = store.winners()
    assert stored.portable_config == SPEC.space.to_dict(SPEC.default_config(key))
    assert not against_other_default(stored)
