"""Shared studies on a real PostgreSQL server: three ``tune --worker`` processes, one killed mid-trial.

The server comes from ``TRITUNE_TEST_POSTGRES_URL`` (``bash .ci/run`` starts one on loopback and
sets it): a role allowed to create databases. Each test gets two fresh databases on it, one for
Optuna's storage and one for the config DB (their tables would collide in one), dropped afterwards.
Without the variable these tests skip, saying so; in CI (``CI=true``) they fail instead, so that CI
cannot pass without running them.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import storage_race
import test_distributed as dist
import toy_kernel
from sqlalchemy import text
from test_configs_db_store import ENV, winner

from tritune.configs_db.store import ConfigStore, read_winners
from tritune.kernels import registry
from tritune.tuner import timing
from tritune.tuner.cli import app
from tritune.tuner.studies import FAILED_TRIAL_ATTR, OUTCOME_ATTR, WORKER_ATTR, StudyStorage, summaries

URL_VARIABLE = "TRITUNE_TEST_POSTGRES_URL"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _unavailable(reason: str) -> None:
    if _in_ci():
        pytest.fail(f"{reason}: CI must run the PostgreSQL tests (.ci/run starts a server and sets {URL_VARIABLE})")
    pytest.skip(f"{reason} (bash .ci/run starts a server on loopback and sets it)")


@pytest.fixture
def postgres() -> Iterator[dict[str, str]]:
    """Two fresh databases on the test server: ``{"optuna": url, "config": url}``."""
    url = os.environ.get(URL_VARIABLE)
    if not url:
        _unavailable(f"{URL_VARIABLE} is not set")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _unavailable("psycopg is not installed (pip install 'psycopg[binary]')")
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    names = {role: f"tritune_test_{role}_{uuid.uuid4().hex[:12]}" for role in ("optuna", "config")}
    with admin.connect() as connection:
        for name in names.values():
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield {
            role: make_url(url).set(database=name).render_as_string(hide_password=False) for role, name in names.items()
        }
    finally:
        with admin.connect() as connection:
            for name in names.values():
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_config_store_on_postgres(postgres):
    """The config DB's race-safe writes on PostgreSQL: a trial stored once, the faster winner kept."""
    url = postgres["config"]
    with ConfigStore(url) as store:
        env_id = store.environment(**ENV)
        key, config = {"arch": "sm90", "seqlen": 1024}, {"BLOCK_M": 64}
        assert store.record_trial(env_id, "tma_prefill", "abc123", key, config, "ok", 1.0) is True
        assert store.record_trial(env_id, "tma_prefill", "abc123", key, config, "ok", 2.0) is False
        assert [row.time_ms for row in store.measured_trials(env_id, "tma_prefill", "abc123", key)] == [1.0]
        assert store.offer_winner(winner(1.0), env_id) is True
        assert store.offer_winner(winner(1.5), env_id) is False
        assert store.offer_winner(winner(0.5), env_id) is True
    assert [w.time_ms for w in read_winners(url, ENV["gpu"])] == [0.5]


@pytest.mark.timeout(300)
def test_workers_opening_a_fresh_postgres_storage_together_all_start(postgres):
    """Optuna creates its tables and stamps their version when a storage is first opened: workers that
    open a fresh database at once raced on it (``UniqueViolation``) and all but one died."""
    # Without the lock, four processes failed every time (measured 2026-12-04, 4 of 4 tries).
    for attempt in range(2):
        if attempt:
            with _admin_engine(postgres["optuna"]).connect() as connection:
                connection.execute(text("DROP SCHEMA public CASCADE"))
                connection.execute(text("CREATE SCHEMA public"))
        assert storage_race.open_together(StudyStorage(postgres["optuna"])) == ([0, 0, 0, 0], [])


def _admin_engine(url: str) -> Any:
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    return create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")


def test_three_workers_on_one_postgres_study(postgres, tmp_path, monkeypatch):
    optuna_url, config_url = postgres["optuna"], postgres["config"]
    journal = tmp_path / "trials.jsonl"
    common = [
        "--device", "cpu", "--worker", "--no-isolate", "--trials", "40",
        "--storage", optuna_url, "--db", config_url, "--heartbeat-interval", "1", "--grace-period", "3",
    ]  # fmt: skip
    with ConfigStore(config_url) as store:

        def stored() -> set[tuple[int, tuple[Any, ...]]]:
            env_id = store.environment(**_cpu_environment())
            rows = store.study_trials(env_id, "toy_scale", toy_kernel.SPEC.version)
            return {dist.ident(row.key, row.config) for row in rows}

        # The victim starts alone and hangs in its third measurement, holding its batch of trials.
        victim, victim_log = dist.start(tmp_path, "victim", *common, TOY_HOLD_AFTER="2", TOY_TRIAL_JOURNAL=str(journal))
        others: list[Any] = []
        try:
            held = dist.wait_until_held(journal, "main", stored)
            assert held["pid"] == victim.pid
            others = [dist.start(tmp_path, f"worker{i}", *common, TOY_TRIAL_JOURNAL=str(journal)) for i in (1, 2)]
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            for process, log in others:
                dist.finish(process, log)
        finally:
            for process, _ in [(victim, victim_log), *others]:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        rows = store.study_trials(store.environment(**_cpu_environment()), "toy_scale", toy_kernel.SPEC.version)
        winners = store.winners()

    # Every trial measured once, but the one the victim died in: retried by another worker.
    dist.check_measured_once(dist.journal_lines(journal), held)
    dist.check_trials_once([(row.key, row.config, row.status, row.time_ms) for row in rows])
    assert sorted(w.key["n_bucket"] for w in winners) == [64, 256]
    assert all(w.config == dist.BEST and w.gpu == "cpu-interpreter" for w in winners)

    # In Optuna's study: the held trial failed by a heartbeat check, and its retry finished by a survivor.
    where = StudyStorage(optuna_url)
    study = next(s for s in summaries(where) if s.key["n_bucket"] == held["key"]["n_bucket"])
    trials = where.load(study.name).get_trials(deepcopy=False)
    config = held["config"]
    lost = [t for t in trials if t.params == config and t.state == optuna.trial.TrialState.FAIL
            and OUTCOME_ATTR not in t.user_attrs]  # fmt: skip
    retries = [t for t in trials if t.params == config and t.system_attrs.get(FAILED_TRIAL_ATTR) is not None
               and t.state.is_finished() and OUTCOME_ATTR in t.user_attrs]  # fmt: skip
    assert len(lost) == 1 and str(victim.pid) in lost[0].user_attrs[WORKER_ATTR]
    assert len(retries) == 1 and str(victim.pid) not in retries[0].user_attrs[WORKER_ATTR]
    assert all(s.finalized is not None and s.counts["running"] == 0 for s in summaries(where))

    shown = dist.runner.invoke(app, ["status", "--storage", optuna_url])
    assert shown.exit_code == 0, shown.output
    assert "n_bucket=64" in shown.output and "n_bucket=256" in shown.output and "***" not in optuna_url

    # The shared run's bundle is the bundle of one process tuning alone on the same (fake) timings.
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")
    monkeypatch.setattr(timing, "timer_for", lambda device: toy_kernel.CostTimer())
    alone = f"sqlite:///{tmp_path / 'alone.sqlite'}"
    tuned = dist.runner.invoke(
        app, ["--device", "cpu", "--kernel", "toy_scale", "--trials", "40", "--no-isolate", "--db", alone]
    )
    assert tuned.exit_code == 0, tuned.output
    assert _bundle(tmp_path / "shared.json", config_url) == _bundle(tmp_path / "alone.json", alone)


def _cpu_environment() -> dict[str, Any]:
    """The environment the workers stored their trials under (the same interpreter as this process)."""
    import torch
    import triton

    from tritune.kernels.device import interpreter_device
    from tritune.tuner.study import tritune_version

    device = interpreter_device()
    return {
        "gpu": device.slug,
        "gpu_name": device.name,
        "capability": "0.0",
        "sm_count": device.sm_count,
        "driver": device.driver,
        "cuda": device.cuda,
        "torch_version": torch.__version__,
        "triton_version": triton.__version__,
        "tritune_version": tritune_version(),
    }


def _bundle(path: Path, db: str) -> list[dict[str, Any]]:
    """The winners of an exported bundle, without what differs between any two runs (provenance, counts)."""
    exported = dist.runner.invoke(app, ["export", "--gpu", "cpu-interpreter", "--db", db, "--out", str(path)])
    assert exported.exit_code == 0, exported.output
    entries = json.loads(path.read_text())["winners"]
    assert entries
    compared = ("kernel", "kernel_version", "key", "config", "time_ms", "portable_ms", "speedup")
    kept = [{name: entry[name] for name in compared} for entry in entries]
    return sorted(kept, key=lambda entry: json.dumps(entry["key"], sort_keys=True))
