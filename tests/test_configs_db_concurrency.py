"""Several tuner processes on one SQLite file, and a tuner killed mid-run.

Workers are started with the ``spawn`` method (a fresh interpreter, as two ``tune`` commands
would be), so nothing is shared with the test process but the database file.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import signal
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from db_samples import ENV, GPU

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore

KEYS = [{"arch": "sm90", "sm_count": 132, "seqlen": 256 << i} for i in range(4)]
CONFIGS = [{"BLOCK_M": m, "BLOCK_N": n} for m in (32, 64, 128, 256) for n in (32, 64)]
WORKERS = 2


def offered_time(worker: int, key_index: int, config_index: int) -> float:
    """Distinct times for every (worker, key, config): a per-key shuffle, so either worker may hold the best."""
    slots = list(range(WORKERS * len(CONFIGS)))
    random.Random(key_index).shuffle(slots)
    return 0.1 + slots[worker * len(CONFIGS) + config_index] / 100


def record_for(key_index: int, config_index: int, time_ms: float) -> WinnerRecord:
    return WinnerRecord(
        kernel="tma_prefill",
        kernel_version="abc123",
        gpu=GPU,
        key=KEYS[key_index],
        config=CONFIGS[config_index],
        time_ms=time_ms,
        portable_ms=1.0,
        speedup=1.0 / time_ms,
        trials=1,
        triton_version=ENV["triton_version"],
        torch_version=ENV["torch_version"],
        tritune_version=ENV["tritune_version"],
    )


def hammer(url: str, worker: int, start: Any, results: Any) -> None:
    """One tuner: open (and upgrade) the DB, then record every trial and offer every winner."""
    # Both workers pass the barrier together, after their (slow, unequal) interpreter start-up.
    start.wait(timeout=60)
    inserted = 0
    with ConfigStore(url) as store:
        env_id = store.environment(**ENV)
        order = [(k, c) for k in range(len(KEYS)) for c in range(len(CONFIGS))]
        random.Random(worker).shuffle(order)
        for key_index, config_index in order:
            time_ms = offered_time(worker, key_index, config_index)
            if store.record_trial(
                env_id, "tma_prefill", "abc123", KEYS[key_index], CONFIGS[config_index], "ok", time_ms
            ):
                inserted += 1
            store.offer_winner(record_for(key_index, config_index, time_ms), env_id)
    results.put((worker, env_id, inserted))


def test_two_writers_at_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.sqlite'}"
    context = multiprocessing.get_context("spawn")
    # Both open the fresh file (WAL switch and schema creation included) at the same moment.
    start = context.Barrier(WORKERS)
    results = context.Queue()
    workers = [context.Process(target=hammer, args=(url, w, start, results)) for w in range(WORKERS)]
    for process in workers:
        process.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for process in workers:
        process.join(timeout=60)
        assert process.exitcode == 0

    assert len({env_id for _, env_id, _ in outcomes}) == 1, "both found the same environment row"
    assert sum(inserted for _, _, inserted in outcomes) == len(KEYS) * len(CONFIGS), "each trial stored once"
    with ConfigStore(url) as store:
        env_id = outcomes[0][1]
        for key in KEYS:
            trials = store.measured_trials(env_id, "tma_prefill", "abc123", key)
            assert sorted(t.config["BLOCK_M"] * 1000 + t.config["BLOCK_N"] for t in trials) == sorted(
                c["BLOCK_M"] * 1000 + c["BLOCK_N"] for c in CONFIGS
            )
        winners = {w.key["seqlen"]: w for w in store.winners()}
        assert len(store.winners()) == len(KEYS)
        for key_index, key in enumerate(KEYS):
            offers = {offered_time(w, key_index, c): CONFIGS[c] for w in range(WORKERS) for c in range(len(CONFIGS))}
            best = min(offers)
            assert winners[key["seqlen"]].time_ms == best
            assert winners[key["seqlen"]].config == offers[best]


def open_fresh_files(urls: list[str], start: Any, results: Any) -> None:
    """Open each new file at the same moment as the other worker; report what failed."""
    failures = []
    jitter = random.Random(os.getpid())
    for url in urls:
        start.wait(timeout=60)
        # Sweep the interleavings: the lost race needs one worker a little behind the other.
        time.sleep(jitter.uniform(0, 0.006))
        try:
            with ConfigStore(url) as store:
                store.environment(**ENV)
        except Exception as exc:  # reported to the test, which names it
            failures.append(f"{url}: {exc!r}")
    results.put(failures)


def test_tuners_opening_a_new_file_together(tmp_path: Path) -> None:
    # Switching a new file to WAL races between processes (SQLite answers "locked" there without
    # waiting); many rounds in two long-lived workers make a lost race near certain to show.
    urls = [f"sqlite:///{tmp_path / f'new{i}.sqlite'}" for i in range(80)]
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(WORKERS)
    results = context.Queue()
    workers = [context.Process(target=open_fresh_files, args=(urls, start, results)) for _ in range(WORKERS)]
    for process in workers:
        process.start()
    failures = [f for _ in workers for f in results.get(timeout=120)]
    for process in workers:
        process.join(timeout=60)
    assert failures == []


def measure_forever(url: str, confirmed: Any) -> None:
    """A tune that never ends: records trials one by one and reports each after it returns."""
    with ConfigStore(url) as store:
        env_id = store.environment(**ENV)
        index = 0
        while True:
            config = {"BLOCK_M": 16 * (index + 1)}
            store.record_trial(env_id, "tma_prefill", "abc123", KEYS[0], config, "ok", 1.0 + index)
            confirmed.put(index)
            index += 1


def test_killed_tune_loses_nothing_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "killed.sqlite"
    url = f"sqlite:///{path}"
    context = multiprocessing.get_context("spawn")
    confirmed = context.Queue()
    process = context.Process(target=measure_forever, args=(url, confirmed))
    process.start()
    seen = -1
    try:
        while seen < 25:
            seen = confirmed.get(timeout=60)
    finally:
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=30)
    while True:
        try:
            seen = confirmed.get(timeout=0.5)
        except queue.Empty:
            break

    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with ConfigStore(url) as store:
        env_id = store.environment(**ENV)
        stored = store.measured_trials(env_id, "tma_prefill", "abc123", KEYS[0])
        assert len(stored) >= seen + 1, "every trial reported as recorded survived the kill"
        # Resume: re-running the planned configs stores only those not yet measured.
        planned = [{"BLOCK_M": 16 * (i + 1)} for i in range(len(stored) + 5)]
        added = [store.record_trial(env_id, "tma_prefill", "abc123", KEYS[0], c, "ok", 9.0) for c in planned]
        assert added == [False] * len(stored) + [True] * 5
        assert len(store.measured_trials(env_id, "tma_prefill", "abc123", KEYS[0])) == len(planned)
