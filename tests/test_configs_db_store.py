"""The ConfigStore contract, run on an in-memory and on a file database alike."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from db_samples import ENV, GPU, stores
from sqlalchemy import create_engine, func, select
from sqlalchemy.exc import IntegrityError

from tritune.configs_db import storage
from tritune.configs_db.models import Environment, Trial, Winner
from tritune.configs_db.records import EagerAlternative, WinnerRecord
from tritune.configs_db.store import MAX_ERROR_CHARS, ConfigStore, display_url
from tritune.configs_db.upserts import WinnerValues, insert_trial_portable, offer_portable

KEY = {"arch": "sm90", "sm_count": 132, "head_dim": 128, "seqlen": 1024}
OTHER_KEY = {**KEY, "seqlen": 2048}
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}


def winner(time_ms: float = 1.0, config: dict[str, Any] | None = None, **changes: Any) -> WinnerRecord:
    record = WinnerRecord(
        kernel="tma_prefill",
        kernel_version="abc123",
        gpu=GPU,
        key=dict(KEY),
        config=dict(config or CONFIG),
        time_ms=time_ms,
        portable_ms=2.0,
        speedup=2.0 / time_ms,
        trials=10,
        triton_version=ENV["triton_version"],
        torch_version=ENV["torch_version"],
        tritune_version=ENV["tritune_version"],
    )
    return replace(record, **changes)


store = pytest.fixture(params=["memory", "file"], name="store")(stores)


@pytest.fixture
def env_id(store: ConfigStore) -> int:
    return store.environment(**ENV)


def count(store: ConfigStore, model: type[Any]) -> int:
    with storage.session_scope(store.engine) as session:
        return int(session.scalar(select(func.count()).select_from(model)) or 0)


# ---- environments ---------------------------------------------------------------------------


def test_environment_is_found_again(store: ConfigStore, env_id: int) -> None:
    assert store.environment(**ENV) == env_id
    other = store.environment(**{**ENV, "triton_version": "3.7.0"})
    assert other != env_id
    assert count(store, Environment) == 2


def test_environment_values_are_unique_in_the_schema(store: ConfigStore, env_id: int) -> None:
    with pytest.raises(IntegrityError), storage.session_scope(store.engine) as session:
        session.add(Environment(**ENV))


def test_get_or_create_wants_every_value(store: ConfigStore) -> None:
    with pytest.raises(TypeError, match=r"missing \['tritune_version'\]"), storage.session_scope(store.engine) as s:
        Environment.get_or_create(s, **{k: v for k, v in ENV.items() if k != "tritune_version"})
    with pytest.raises(TypeError, match="sm_count='132'"), storage.session_scope(store.engine) as s:
        Environment.get_or_create(s, **{**ENV, "sm_count": "132"})


# ---- trials ---------------------------------------------------------------------------------


def test_record_trial_stores_once(store: ConfigStore, env_id: int) -> None:
    assert store.record_trial(env_id, "tma_prefill", "abc123", KEY, CONFIG, "ok", 0.5)
    # The same config again, even reported differently or with its fields reordered, is a duplicate.
    reordered = dict(reversed(list(CONFIG.items())))
    assert not store.record_trial(env_id, "tma_prefill", "abc123", KEY, reordered, "ok", 0.4)
    assert not store.record_trial(env_id, "tma_prefill", "abc123", KEY, CONFIG, "failed-runtime", error="x")
    assert count(store, Trial) == 1
    [row] = store.measured_trials(env_id, "tma_prefill", "abc123", KEY)
    assert (row.status, row.time_ms, row.config) == ("ok", 0.5, CONFIG)


def test_trials_are_unique_in_the_schema(store: ConfigStore, env_id: int) -> None:
    store.record_trial(env_id, "tma_prefill", "abc123", KEY, CONFIG, "pruned")
    with pytest.raises(IntegrityError), storage.session_scope(store.engine) as session:
        session.add(
            Trial(
                environment_id=env_id,
                kernel="tma_prefill",
                kernel_version="abc123",
                key_json=storage_key(KEY),
                config_json=storage_key(CONFIG),
                status="pruned",
            )
        )


def storage_key(value: dict[str, Any]) -> str:
    from tritune.configs_db.values import canonical_json

    return canonical_json(value)


def test_measured_trials_are_per_key_and_in_order(store: ConfigStore, env_id: int) -> None:
    configs = [{**CONFIG, "BLOCK_M": m} for m in (16, 32, 64)]
    for config in configs:
        store.record_trial(env_id, "tma_prefill", "abc123", KEY, config, "ok", 1.0)
    store.record_trial(env_id, "tma_prefill", "abc123", OTHER_KEY, CONFIG, "failed-compile", error="boom")
    store.record_trial(env_id, "tma_prefill", "other", KEY, CONFIG, "ok", 1.0)
    rows = store.measured_trials(env_id, "tma_prefill", "abc123", KEY)
    assert [r.config for r in rows] == configs
    assert all(r.created_at.tzinfo is not None for r in rows)
    other = store.measured_trials(env_id, "tma_prefill", "abc123", OTHER_KEY)
    assert [(r.status, r.time_ms, r.error) for r in other] == [("failed-compile", None, "boom")]
    assert len(store.study_trials(env_id, "tma_prefill", "abc123")) == 4


def test_record_trial_checks_what_it_stores(store: ConfigStore, env_id: int) -> None:
    with pytest.raises(ValueError, match="trial status 'crashed'"):
        store.record_trial(env_id, "tma_prefill", "abc123", KEY, CONFIG, "crashed")
    with pytest.raises(ValueError, match="needs its time_ms"):
        store.record_trial(env_id, "tma_prefill", "abc123", KEY, CONFIG, "ok")
    with pytest.raises(ValueError, match="not a finite number"):
        store.record_trial(env_id, "tma_prefill", "abc123", KEY, {"BLOCK_M": math.nan}, "pruned")
    with pytest.raises(ValueError, match="time_ms is nan"):
        store.record_trial(env_id, "tma_prefill", "abc123", KEY, CONFIG, "ok", math.nan)
    with pytest.raises(ValueError, match=r"time_ms is -2\.0"):
        store.record_trial(env_id, "tma_prefill", "abc123", KEY, CONFIG, "ok", -2.0)
    with pytest.raises(IntegrityError):
        store.record_trial(env_id + 99, "tma_prefill", "abc123", KEY, CONFIG, "pruned")
    assert count(store, Trial) == 0


def test_long_errors_are_cut(store: ConfigStore, env_id: int) -> None:
    store.record_trial(env_id, "tma_prefill", "abc123", KEY, CONFIG, "failed-compile", error="x" * 100_000)
    [row] = store.measured_trials(env_id, "tma_prefill", "abc123", KEY)
    assert row.error is not None and len(row.error) < MAX_ERROR_CHARS + 100
    assert row.error.endswith("[... truncated]")


# ---- winners --------------------------------------------------------------------------------


def test_offer_winner_keeps_the_best(store: ConfigStore, env_id: int) -> None:
    assert store.offer_winner(winner(1.0), env_id)
    assert not store.offer_winner(winner(1.5, {**CONFIG, "BLOCK_M": 64}), env_id)
    assert not store.offer_winner(winner(1.0, {**CONFIG, "BLOCK_M": 32}), env_id), "a tie keeps the stored one"
    assert store.offer_winner(winner(0.8, {**CONFIG, "BLOCK_M": 256}, trials=30), env_id)
    assert count(store, Winner) == 1
    [stored] = store.winners()
    assert stored.config == {**CONFIG, "BLOCK_M": 256}
    assert (stored.time_ms, stored.speedup, stored.trials) == (0.8, 2.5, 30)
    assert stored.source == f"db:{store.url}"
    assert stored.extra["gpu_name"] == "NVIDIA H200"


def test_a_kept_winner_of_the_offered_config_takes_its_eager_alternative(store: ConfigStore, env_id: int) -> None:
    """With ``refresh_eager``, a kept winner found again gets the alternative timed in this run
    (``None`` clears the old one); a stored winner of another config or at another key, or an
    offer without it, leaves the stored one alone."""
    old = EagerAlternative(config={**CONFIG, "BLOCK_M": 32}, ms=0.05, winner_ms=0.06)
    new = EagerAlternative(config={**CONFIG, "BLOCK_M": 64}, ms=0.04, winner_ms=0.07, replayed=True)
    other_key = {**KEY, "seqlen": 2048}
    assert store.offer_winner(winner(1.0, eager=old), env_id)
    assert store.offer_winner(winner(1.0, key=other_key, eager=old), env_id)
    assert not store.offer_winner(winner(1.2, eager=new), env_id)
    assert not store.offer_winner(winner(1.2, {**CONFIG, "BLOCK_M": 256}, eager=new), env_id, refresh_eager=True)
    assert [w.eager for w in store.winners()] == [old, old]
    assert not store.offer_winner(winner(1.2, eager=new), env_id, refresh_eager=True)
    by_key = {w.key["seqlen"]: w for w in store.winners()}
    assert (by_key[KEY["seqlen"]].time_ms, by_key[KEY["seqlen"]].eager) == (1.0, new), "the faster time stays"
    assert by_key[other_key["seqlen"]].eager == old, "another key's winner is left alone"
    assert not store.offer_winner(winner(1.2), env_id, refresh_eager=True)
    by_key = {w.key["seqlen"]: w for w in store.winners()}
    assert by_key[KEY["seqlen"]].eager is None and by_key[other_key["seqlen"]].eager == old


def test_winners_are_unique_in_the_schema(store: ConfigStore, env_id: int) -> None:
    store.offer_winner(winner(1.0), env_id)
    with pytest.raises(IntegrityError), storage.session_scope(store.engine) as session:
        session.add(
            Winner(
                gpu=GPU,
                kernel="tma_prefill",
                kernel_version="abc123",
                key_json=storage_key(KEY),
                config_json=storage_key(CONFIG),
                time_ms=0.5,
                portable_ms=1.0,
                speedup=2.0,
                trial_count=1,
                environment_id=env_id,
            )
        )


def test_a_winner_from_another_triton_is_replaced(store: ConfigStore, env_id: int) -> None:
    store.offer_winner(winner(0.5), env_id)
    newer = store.environment(**{**ENV, "triton_version": "3.7.0"})
    assert store.offer_winner(winner(0.9, triton_version="3.7.0"), newer)
    assert not store.offer_winner(winner(0.95, triton_version="3.7.0"), newer)
    [stored] = store.winners()
    assert (stored.time_ms, stored.triton_version) == (0.9, "3.7.0")


def test_a_winner_from_another_torch_is_replaced(store: ConfigStore, env_id: int) -> None:
    """A winner that serves only provisionally (another torch) does not survive a fresh tune."""
    store.offer_winner(winner(0.5), env_id)
    newer = store.environment(**{**ENV, "torch_version": "9.9.0"})
    assert store.offer_winner(winner(0.9, torch_version="9.9.0"), newer)
    [stored] = store.winners()
    assert (stored.time_ms, stored.torch_version) == (0.9, "9.9.0")


@pytest.mark.parametrize(
    "changes, reason",
    [
        pytest.param({"speedup": math.nan}, "speedup is nan", id="nan-speedup"),
        pytest.param({"time_ms": -1.0}, "time_ms is -1.0", id="negative-time"),
        pytest.param({"gpu": "nvidia-a100-sm80-108sm"}, "gpu", id="other-gpu"),
        pytest.param({"triton_version": "3.5.0"}, "triton_version", id="other-triton"),
    ],
)
def test_offer_winner_refuses_inconsistent_records(
    store: ConfigStore, env_id: int, changes: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        store.offer_winner(replace(winner(1.0), **changes), env_id)
    assert count(store, Winner) == 0


def test_winners_filter_by_gpu_and_kernel(store: ConfigStore, env_id: int) -> None:
    a100 = store.environment(**{**ENV, "gpu": "nvidia-a100-sm80-108sm"})
    store.offer_winner(winner(1.0), env_id)
    store.offer_winner(winner(1.0, kernel="decode"), env_id)
    store.offer_winner(winner(1.0, gpu="nvidia-a100-sm80-108sm"), a100)
    assert len(store.winners()) == 3
    assert {w.kernel for w in store.winners(gpu=GPU)} == {"tma_prefill", "decode"}
    assert [w.gpu for w in store.winners(kernel="tma_prefill")] == ["nvidia-a100-sm80-108sm", GPU]
    assert len(store.winners(gpu=GPU, kernel="decode")) == 1


def test_import_records(store: ConfigStore, caplog: pytest.LogCaptureFixture) -> None:
    extra = {"gpu_name": "NVIDIA H200", "capability": "9.0", "sm_count": 132, "driver": "570.86", "cuda": "12.8"}
    records = [
        winner(1.0, extra=extra),
        winner(2.0, key={**KEY, "seqlen": 4096}, extra=extra),
        winner(2.0, key={**KEY, "seqlen": 8192}, speedup=0.0, extra=extra),
    ]
    with caplog.at_level(logging.WARNING, logger="tritune.configs_db"):
        assert store.import_records(records) == (2, 1)
    assert "speedup is 0.0" in caplog.text
    assert store.import_records(records[:2]) == (0, 2)
    assert store.environment(**ENV) == 1, "the imported records' environment is the one ENV describes"
    assert {w.key["seqlen"] for w in store.winners()} == {1024, 4096}


# ---- portable fallbacks (databases without ON CONFLICT) -------------------------------------


def test_portable_trial_insert_absorbs_duplicates(store: ConfigStore, env_id: int) -> None:
    values = {
        "environment_id": env_id,
        "kernel": "tma_prefill",
        "kernel_version": "abc123",
        "key_json": storage_key(KEY),
        "config_json": storage_key(CONFIG),
        "status": "ok",
        "time_ms": 1.0,
        "error": None,
    }
    with storage.session_scope(store.engine) as session:
        assert insert_trial_portable(session, values)
    with storage.session_scope(store.engine) as session:
        assert not insert_trial_portable(session, {**values, "time_ms": 0.5})
    with pytest.raises(IntegrityError), storage.session_scope(store.engine) as session:
        insert_trial_portable(session, {**values, "environment_id": env_id + 99})
    assert count(store, Trial) == 1


def test_portable_offer_keeps_the_best(store: ConfigStore, env_id: int) -> None:
    def offer(
        time_ms: float, block_m: int, env: int = env_id, triton: str = "3.6.0", torch_: str | None = None
    ) -> bool:
        values = WinnerValues(
            gpu=GPU,
            kernel="tma_prefill",
            kernel_version="abc123",
            key_json=storage_key(KEY),
            config_json=storage_key({**CONFIG, "BLOCK_M": block_m}),
            time_ms=time_ms,
            portable_ms=2.0,
            speedup=2.0 / time_ms,
            trial_count=5,
            environment_id=env,
        )
        with storage.session_scope(store.engine) as session:
            return offer_portable(session, values, triton, torch_ or ENV["torch_version"])

    assert offer(1.0, 64)
    assert not offer(1.2, 32)
    assert offer(0.7, 16)
    newer = store.environment(**{**ENV, "triton_version": "3.7.0"})
    assert offer(0.9, 128, newer, "3.7.0"), "a winner from another Triton is stale"
    [stored] = store.winners()
    assert (stored.time_ms, stored.config["BLOCK_M"], stored.triton_version) == (0.9, 128, "3.7.0")
    newest_torch = store.environment(**{**ENV, "triton_version": "3.7.0", "torch_version": "9.9.0"})
    assert offer(0.95, 64, newest_torch, "3.7.0", "9.9.0"), "a winner from another torch is stale"


@pytest.mark.parametrize("measured_here", [True, False], ids=["measured", "imported"])
def test_portable_offer_against_another_default(store: ConfigStore, env_id: int, measured_here: bool) -> None:
    """The fallback for databases without ON CONFLICT applies the upsert's rule: a fresh measurement
    against another portable default replaces a faster winner; an import replaces by time alone."""

    def offer(time_ms: float, default_block_m: int | None) -> bool:
        default = None if default_block_m is None else storage_key({**CONFIG, "BLOCK_M": default_block_m})
        values = WinnerValues(
            gpu=GPU,
            kernel="tma_prefill",
            kernel_version="abc123",
            key_json=storage_key(KEY),
            config_json=storage_key(CONFIG),
            time_ms=time_ms,
            portable_ms=2.0,
            speedup=2.0 / time_ms,
            trial_count=5,
            environment_id=env_id,
            portable_config_json=default,
        )
        with storage.session_scope(store.engine) as session:
            return offer_portable(session, values, "3.6.0", ENV["torch_version"], measured_here=measured_here)

    assert offer(1.0, None)
    assert not offer(1.1, 32), "a stored winner naming no default is replaced by time alone"
    assert offer(0.9, 32)
    assert not offer(1.2, 32), "against the same default the faster winner stays"
    assert offer(1.2, 64) is measured_here
    assert not offer(1.3, None), "an offer naming no default replaces by time alone"
    [stored] = store.winners()
    assert (stored.time_ms, stored.portable_config["BLOCK_M"]) == ((1.2, 64) if measured_here else (0.9, 32))


# ---- durability and misc --------------------------------------------------------------------


def test_every_write_is_committed_at_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'live.sqlite'}"
    with ConfigStore(url) as store:
        env_id = store.environment(**ENV)
        store.record_trial(env_id, "tma_prefill", "abc123", KEY, CONFIG, "ok", 1.0)
        store.offer_winner(winner(1.0), env_id)
        # Another connection sees both while the store is still open.
        engine = create_engine(url)
        try:
            with engine.connect() as connection:
                assert connection.scalar(select(func.count()).select_from(Trial)) == 1
                assert connection.scalar(select(func.count()).select_from(Winner)) == 1
        finally:
            engine.dispose()


def test_file_database_uses_wal_busy_timeout_and_foreign_keys(tmp_path: Path) -> None:
    engine = storage.make_engine(f"sqlite:///{tmp_path / 'nested' / 'dir' / 'db.sqlite'}")
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == storage.BUSY_TIMEOUT_MS
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        engine.dispose()


def test_session_scope_rolls_back_on_error(store: ConfigStore) -> None:
    with pytest.raises(RuntimeError), storage.session_scope(store.engine) as session:
        session.add(Environment(**ENV))
        session.flush()
        raise RuntimeError("abandon")
    assert count(store, Environment) == 0


def test_display_url_hides_passwords() -> None:
    assert display_url("postgresql://tuner:secret@db.example/tritune") == "postgresql://tuner:***@db.example/tritune"
    assert display_url("sqlite:////tmp/x.sqlite") == "sqlite:////tmp/x.sqlite"
