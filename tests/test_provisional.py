"""Winners tuned under another Triton or torch serve provisionally until a tune replaces them."""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import pytest
import torch
import triton
from toy_records import CPU, SPEC, TUNED, ship
from toy_records import toy_key as key
from toy_records import toy_record as record
from typer.testing import CliRunner

from tritune.configs_db import bundles
from tritune.configs_db.bundles import shipped_records
from tritune.configs_db.records import Rejection, WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import settings
from tritune.kernels.device import DeviceInfo
from tritune.kernels.dispatcher import DISPATCHER, dispatch_config
from tritune.kernels.winners import admit, build_table
from tritune.tuner.cli import app
from tritune.tuner.provisional import provisional_first
from tritune.tuner.study import KeyTuner, TuneOptions, environment_id
from tritune.tuner.timing import FakeTimer

H200 = DeviceInfo("NVIDIA H200", "nvidia", (9, 0), 132, "sm90")
OLD_TRITON = "3.5.0"


pytestmark = pytest.mark.usefixtures("toy_dispatch")


def store(*records: WinnerRecord) -> str:
    url = settings.settings().db_url
    with ConfigStore(url) as db:
        for r in records:
            env = db.environment(
                gpu=r.gpu,
                torch_version=r.torch_version,
                triton_version=r.triton_version,
                tritune_version=r.tritune_version,
            )
            assert db.offer_winner(r, env)
    return url


def served(n: int) -> dict:
    config = dispatch_config("toy_scale", "cpu", -1, tuple(SPEC.facts(torch.randn(n))))
    return SPEC.space.to_dict(config)


# ---- the shipped bundle under a newer Triton ----------------------------------------------------


def test_shipped_bundle_under_a_newer_triton_serves_provisionally(monkeypatch):
    records, rejections = shipped_records(H200.slug)
    assert rejections == [] and len(records) >= 20
    current = [admit(r, H200) for r in records]
    monkeypatch.setattr(triton, "__version__", "9.9.0")
    upgraded = [admit(r, H200) for r in records]
    # Nothing the running code admits is refused after the upgrade (a kernel whose source changed
    # since the bundle was tuned is refused either way, for its kernel version).
    assert [o.reason for o in upgraded if isinstance(o, Rejection)] == [
        o.reason for o in current if isinstance(o, Rejection)
    ]
    admitted = [o for o in upgraded if not isinstance(o, Rejection)]
    assert len(admitted) >= 20
    for kernel, _key, entry in admitted:
        assert entry.provisional, kernel
        assert entry.tuned_under.startswith("Triton 3.6.0, torch "), entry.tuned_under


def test_shipped_bundle_of_another_kernel_version_is_refused(monkeypatch):
    records, _ = shipped_records(H200.slug)
    monkeypatch.setattr(triton, "__version__", "9.9.0")
    for r in records[:5]:
        outcome = admit(dataclasses.replace(r, kernel_version="0123456789abcdef"), H200)
        assert isinstance(outcome, Rejection) and "stale kernel version 0123456789abcdef" in outcome.reason


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"gpu": "nvidia-h100-80gb-hbm3-sm90-132sm"}, "recorded for GPU"),
        ({"config": {"BLOCK": 48, "BROKEN": False, "num_warps": 2}}, "outside the search space"),
        ({"config": {"BLOCK": 128, "BROKEN": False, "num_warps": 1}}, "infeasible"),
        ({"key": {"arch": "cpu-interpreter", "n_bucket": 128}}, "malformed key"),
    ],
    ids=["foreign-gpu", "outside-space", "infeasible", "malformed-key"],
)
def test_hard_refusals_stay_under_another_triton(changes, reason):
    outcome = admit(record(128, triton_version=OLD_TRITON, **changes), CPU)
    assert isinstance(outcome, Rejection) and reason in outcome.reason


def test_one_line_per_kernel_says_how_many_and_under_what(caplog):
    caplog.set_level(logging.INFO, logger="tritune.dispatch")
    records = [record(n, triton_version=OLD_TRITON) for n in (64, 128, 256)]
    table = build_table([records], CPU)
    assert len(table) == 3
    lines = [r.getMessage() for r in caplog.records if "provisionally" in r.getMessage()]
    assert lines == [
        f"toy_scale: 3 stored config(s) serve provisionally, tuned under Triton {OLD_TRITON}, torch "
        f"{torch.__version__} (3) (running Triton {triton.__version__}, torch {torch.__version__}); "
        "`tune --kernel toy_scale` re-measures them"
    ]


# ---- serving, precedence, and replacement by a fresh tune --------------------------------------


def test_provisional_serves_and_a_fresh_tune_replaces_it():
    url = store(record(128, triton_version=OLD_TRITON))
    assert served(100) == TUNED
    entry = DISPATCHER.table(CPU).exact[("toy_scale", key(128))]
    assert entry.provisional and entry.tuned_under == f"Triton {OLD_TRITON}, torch {torch.__version__}"
    shown = CliRunner().invoke(app, ["show", "--db", url, "--device", "cpu"], catch_exceptions=False)
    assert "(provisional)" in shown.output
    assert f"tuned under Triton {OLD_TRITON}" in " ".join(shown.output.split())
    args = ["--device", "cpu", "--kernel", "toy_scale", "--key", "n=100", "--trials", "3", "--no-isolate", "--db", url]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    [winner] = ConfigStore(url).winners(kernel="toy_scale")
    assert winner.triton_version == triton.__version__
    DISPATCHER.clear()
    DISPATCHER.table(CPU)
    assert not DISPATCHER.table(CPU).exact[("toy_scale", key(128))].provisional


def test_a_provisional_entry_never_replaces_a_current_one(tmp_path, monkeypatch):
    ship(tmp_path / "bundles", monkeypatch, record(128))
    other = {"BLOCK": 16, "BROKEN": False, "num_warps": 1}
    store(record(128, config=other, triton_version=OLD_TRITON), record(256, config=other, triton_version=OLD_TRITON))
    # The bundle's current winner beats the DB's provisional one at its key; elsewhere the DB's serves.
    assert served(100) == TUNED
    assert served(200) == other


def test_tune_takes_keys_with_provisional_winners_first(tmp_path):
    url = store(record(256, triton_version=OLD_TRITON), record(1024))
    plan = [(SPEC, key(n)) for n in (64, 128, 256, 1024)]
    with ConfigStore(url) as db:
        ordered = provisional_first(plan, db, CPU)
    assert [k.n_bucket for _spec, k in ordered] == [256, 64, 128, 1024]


def _first_seeds(tmp_path, monkeypatch, shipped: WinnerRecord, triton_version: str, on: bool = True) -> list[dict]:
    """The first two seeds of a tune of key 256 into an empty DB, with ``shipped`` the one entry
    of this GPU's shipped bundle (tuned under ``triton_version``; bundles disabled unless ``on``)."""
    ship(tmp_path / "bundles", monkeypatch, shipped, triton_version=triton_version)
    if not on:
        monkeypatch.setenv("TRITUNE_DISABLE_BUNDLES", "1")
        settings.reload()
    db = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    options = TuneOptions(trials=4, seed=0, batch=2, final_rounds=1)
    tuner = KeyTuner(
        SPEC, key(256), CPU, torch.device("cpu"), db, environment_id(db, CPU), FakeTimer(lambda c: 1.0), options
    )
    feasible = SPEC.space.feasible(key(256), tuner.limits)
    return tuner.strategy.seeds(SPEC.space.default(), feasible, False, random.Random(0))[:2]


def test_a_provisional_bundle_winner_seeds_the_search(tmp_path, monkeypatch):
    old = record(256, config={"BLOCK": 16, "BROKEN": False, "num_warps": 1}, triton_version=OLD_TRITON)
    assert _first_seeds(tmp_path, monkeypatch, old, OLD_TRITON) == [
        SPEC.space.to_dict(SPEC.space.default()),
        old.config,
    ]


def test_a_bundle_winner_of_a_neighbouring_bucket_seeds_a_first_tune(tmp_path, monkeypatch):
    """A tune into an empty DB starts from the shipped bundle's nearest buckets too, as it would
    from the DB's: the bundle's winner at bucket 512 is among the seeds of key 256."""
    lender = record(512, config={"BLOCK": 16, "BROKEN": False, "num_warps": 1})
    seeds = _first_seeds(tmp_path, monkeypatch, lender, triton.__version__)
    assert seeds == [SPEC.space.to_dict(SPEC.space.default()), lender.config]
    assert lender.config not in _first_seeds(tmp_path / "off", monkeypatch, lender, triton.__version__, on=False)


def test_bench_marks_a_provisional_served_config():
    url = store(record(64, triton_version=OLD_TRITON), record(256))
    result = CliRunner().invoke(
        app, ["bench", "--device", "cpu", "--kernel", "toy_scale", "--db", url], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    # A row's cells may wrap onto the next line: each row is read with the line after it.
    lines = result.output.splitlines()
    rows = {
        b: " ".join(lines[i : i + 2]) for i, line in enumerate(lines) for b in (64, 256) if f"n_bucket={b} " in line
    }
    assert "(provisional)" in rows[64], result.output
    assert "(provisional)" not in rows[256], result.output


def test_shipped_bundle_file_is_untouched():
    assert Path(bundles.shipped_bundle_dir(), f"{H200.slug}.json").is_file()


def test_seeds_are_each_queued_once_and_only_where_feasible(tmp_path):
    """The key's own winner equal to the portable default, another own winner infeasible at the
    key, and an earlier version's winner equal to the default: none of them takes a second or an
    infeasible place among the seeds, which the sample fills instead."""
    default = SPEC.space.to_dict(SPEC.space.default())
    infeasible = {"BLOCK": 128, "BROKEN": False, "num_warps": 1}
    db = ConfigStore(store(record(256, config=default), record(256, config=default, kernel_version="0ld0ld0ld0ld0ld0")))
    env = environment_id(db, CPU)
    tuner = KeyTuner(SPEC, key(256), CPU, torch.device("cpu"), db, env, FakeTimer(lambda c: 1.0),
                     TuneOptions(trials=10, seed=0, batch=2, final_rounds=1))  # fmt: skip
    stored = db.winners()  # and an infeasible own winner, as a DB may hold:
    extra = dataclasses.replace(record(256, config=infeasible), time_ms=0.5, speedup=3.0)
    tuner.strategy.store.winners = lambda gpu=None, kernel=None: [*stored, extra]
    feasible = SPEC.space.feasible(key(256), tuner.limits)
    seeds = tuner.strategy.seeds(SPEC.space.default(), feasible, False, random.Random(0))
    assert seeds[0] == default and len(seeds) == len({tuple(sorted(s.items())) for s in seeds})
    assert all(SPEC.space.infeasible_reason(SPEC.space.parse(s), key(256), tuner.limits) is None for s in seeds)
    assert len(seeds) > 2, "the sample fills the places duplicates held"
