"""Shared studies after a crash: a killed coordinator, a dead worker, a corrupt journal, racing workers.

A coordinator killed with SIGKILL leaves trials RUNNING in its journal and, without ``--storage``,
its temporary studies folder behind: the next run must release those trials and remove that
folder. Workers that open a fresh RDB storage together must all start, and a worker that dies must
make the command fail. A journal that is not one must be refused with a message that names it.

The process tests drive the real ``tune`` command as ``test_distributed`` does (toy kernel,
:class:`toy_kernel.CostTimer`, ``--no-isolate``); every wait has a limit, so a regression fails
instead of hanging.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import storage_race
import test_distributed as dist
import toy_kernel
from optuna.trial import TrialState
from test_reliability_processes import _session_members

from tritune.configs_db.store import ConfigStore
from tritune.kernels import registry
from tritune.tuner import journal
from tritune.tuner.fleet import SCRATCH_OWNER, SCRATCH_PREFIX, ScratchStudies, remove_abandoned
from tritune.tuner.studies import (
    FAILED_TRIAL_ATTR,
    WORKER_ATTR,
    Heartbeat,
    StudyStorage,
    StudyStorageError,
    summaries,
)
from tritune.tuner.study import TuneOptions

#: A rerun of the toy tune takes well under a minute; a hang is caught at this limit.
RERUN_LIMIT_S = 150.0


def _common(db: Path, *extra: str) -> list[str]:
    return ["--device", "cpu", "--workers", "2", "--no-isolate", "--trials", "40", "--db", str(db), *extra]


def _run(tmp_path: Path, name: str, args: list[str], limit_s: float, **env: str) -> tuple[int, str]:
    """Run ``tune`` to its end (killed, and the test failed, past ``limit_s``); its exit status and output."""
    process, log = dist.start(tmp_path, name, *args, **env)
    try:
        code = process.wait(limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        pytest.fail(f"tune did not finish in {limit_s:g} s:\n{log.read_text()}")
    return code, log.read_text()


def _kill_coordinator_mid_trial(tmp_path: Path, args: list[str], journal: Path, db: Path, **env: str) -> list[dict]:
    """Start a two-worker tune whose workers hang in their third trial, SIGKILL its coordinator, and wait
    until its workers have exited by themselves. Returns the trial each worker hung in."""
    process, log = dist.start(tmp_path, "killed", *args, TOY_HOLD_AFTER="2", TOY_TRIAL_JOURNAL=str(journal), **env)

    def stored() -> set[tuple[int, tuple[Any, ...]]]:
        assert process.poll() is None, log.read_text()
        return {dist.ident(k, c) for k, c, *_ in dist._sqlite_rows(db)}

    try:
        held = [dist.wait_until_held(journal, worker, stored) for worker in ("0", "1")]
        os.kill(process.pid, signal.SIGKILL)
        process.wait(30)
        deadline = time.monotonic() + 60
        while _session_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _session_members(process.pid) == [], "a worker outlived its killed coordinator"
    finally:
        for pid in _session_members(process.pid):
            os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
            process.wait(30)
    return held


def _check_rerun(journal: Path, db: Path, held: list[dict]) -> None:
    """Every config stored once, the winners right, and nothing measured twice but the held trials."""
    dist.check_trials_once(dist._sqlite_rows(db))
    started = collections.Counter(dist.ident(line["key"], line["config"]) for line in dist.journal_lines(journal))
    again = {pair for pair, count in started.items() if count > 1}
    assert again <= {dist.ident(line["key"], line["config"]) for line in held}, "a stored trial was measured again"
    assert all(count <= 2 for count in started.values())
    winners = ConfigStore(f"sqlite:///{db}").winners()
    assert sorted(w.key["n_bucket"] for w in winners) == [64, 256]
    assert all(w.config == dist.BEST for w in winners)


# ---- a killed coordinator ------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_a_rerun_releases_the_trials_a_killed_coordinator_left_running(tmp_path):
    db, studies, journal = tmp_path / "tune.sqlite", tmp_path / "studies.log", tmp_path / "trials.jsonl"
    args = _common(db, "--storage", str(studies))
    held = _kill_coordinator_mid_trial(tmp_path, args, journal, db)
    left = {row.key["n_bucket"]: row.counts["running"] for row in summaries(StudyStorage(str(studies)))}
    assert sum(left.values()) >= 2, "the killed run left its held trials running"

    code, output = _run(tmp_path, "rerun", args, RERUN_LIMIT_S, TOY_TRIAL_JOURNAL=str(journal))
    assert code == 0, output
    _check_rerun(journal, db, held)
    rows = summaries(StudyStorage(str(studies)))
    assert all(row.finalized is not None and row.counts["running"] == 0 for row in rows)
    assert sum(row.counts["lost"] for row in rows) >= 2


@pytest.mark.timeout(600)
def test_a_killed_coordinators_temporary_studies_are_removed_by_the_next_run(tmp_path):
    db, journal, scratch = tmp_path / "tune.sqlite", tmp_path / "trials.jsonl", tmp_path / "tmp"
    scratch.mkdir()
    held = _kill_coordinator_mid_trial(tmp_path, _common(db), journal, db, TMPDIR=str(scratch))
    assert [p.name.startswith("tritune-studies-") for p in scratch.iterdir()] == [True]

    code, output = _run(tmp_path, "rerun", _common(db), RERUN_LIMIT_S, TOY_TRIAL_JOURNAL=str(journal),
                        TMPDIR=str(scratch))  # fmt: skip
    assert code == 0, output
    assert list(scratch.iterdir()) == [], "a temporary studies folder was left behind"
    _check_rerun(journal, db, held)


# ---- telling dead workers from live ones, in one process --------------------------------------------------


def test_a_journal_worker_releases_the_trials_of_workers_that_are_gone(tmp_path):
    """On a journal, the running trials of a worker that holds no presence lock are failed and queued again;
    so are those signed with this worker's own name that it does not hold (a dead process whose pid it
    reuses), and unsigned ones older than the grace period."""
    where = StudyStorage(str(tmp_path / "studies.log"), heartbeat_interval_s=1, grace_period_s=2)
    storage = where.open()
    study = optuna.create_study(study_name="tritune:toy", storage=storage)
    study_id = storage.get_study_id_from_name(study.study_name)
    me, other = Heartbeat(storage, where, "host:1:cpu"), Heartbeat(storage, where, "host:2:cpu")

    def running(worker: str | None, holder: Heartbeat | None = None) -> int:
        trial = study.ask({"x": optuna.distributions.FloatDistribution(0.0, 1.0)})
        if holder is not None:
            holder.hold(storage.get_trial_id_from_study_id_trial_number(study_id, trial.number), study.study_name,
                        trial.number)  # fmt: skip
        if worker is not None:
            trial.set_user_attr(WORKER_ATTR, worker)
        return trial.number

    unsigned_old = running(None)
    time.sleep(2.5)
    kept = [running("host:1:cpu", me), running("host:2:cpu", other), running(None)]
    lost = [unsigned_old, running("host:1:cpu"), running("host:3:cpu"), running("host:4:cpu")]
    # A presence file nobody holds: its worker died.
    unlocked = journal._presence_path(Path(where.location), "host:4:cpu")
    unlocked.write_text("host:4:cpu\n")

    assert where.fail_stale(study, me) == len(lost)
    states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    assert [states[n] for n in kept] == [TrialState.RUNNING] * len(kept)
    assert [states[n] for n in lost] == [TrialState.FAIL] * len(lost)
    assert sum(state == TrialState.WAITING for state in states.values()) == len(lost), "each lost trial is retried"
    assert not unlocked.exists()
    assert where.fail_stale(study, me) == 0

    other.close()
    assert where.fail_stale(study, me) == 1, "a worker that closed its presence is gone"
    me.close()


def test_a_retried_trial_is_not_released_again_before_its_new_worker_signs_it(tmp_path):
    """A retry must not carry the dead worker's name: a worker that has just taken it (asked, not signed yet)
    would lose it to another worker's check of that name, and die on signing it."""
    where = StudyStorage(str(tmp_path / "studies.log"))
    storage = where.open()
    study = optuna.create_study(study_name="tritune:toy", storage=storage)
    distributions = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    lost = study.ask(distributions)
    lost.set_user_attr(WORKER_ATTR, "host:9:cpu")
    me = Heartbeat(storage, where, "host:1:cpu")
    assert where.fail_stale(study, me) == 1
    taken = study.ask(distributions)
    assert FAILED_TRIAL_ATTR in study.trials[taken.number].system_attrs, "the retry was taken"
    assert WORKER_ATTR not in study.trials[taken.number].user_attrs
    assert where.fail_stale(study, me) == 0
    taken.set_user_attr(WORKER_ATTR, "host:2:cpu")
    me.close()


def test_a_worker_whose_fresh_trial_was_released_asks_another(tmp_path, monkeypatch):
    """A trial failed by another process between this worker's ask and its signature is not this worker's:
    it asks again instead of dying."""
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")
    with ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        (tuner,) = dist._shared_tuners(tmp_path, store, TuneOptions(trials=8, final_rounds=1), ("a",))
        study = tuner._join(toy_kernel.SPEC.default_config(tuner.key))
        storage, ask = tuner.where.open(), study.ask

        def ask_then_lose(*args: Any, **kwargs: Any) -> Any:
            trial = ask(*args, **kwargs)
            if trial.number == 0:
                study_id = storage.get_study_id_from_name(study.study_name)
                trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, 0)
                storage.set_trial_state_values(trial_id, TrialState.FAIL)
            return trial

        monkeypatch.setattr(study, "ask", ask_then_lose)
        trial, _ = tuner._ask(study)
        tuner.heartbeat.close()
    assert trial.number == 1
    assert study.trials[1].state == TrialState.RUNNING and study.trials[1].user_attrs[WORKER_ATTR] == "test:a"


def test_only_the_temporary_studies_of_dead_coordinators_are_removed(tmp_path):
    live = ScratchStudies(tmp_path)
    dead = tmp_path / f"{SCRATCH_PREFIX}dead"
    dead.mkdir()
    (dead / SCRATCH_OWNER).write_text("12345\n")
    (dead / "studies.log").write_text("")
    # Its coordinator made the owner file but has not locked it yet; another kind of folder.
    starting, unrelated = tmp_path / f"{SCRATCH_PREFIX}starting", tmp_path / f"{SCRATCH_PREFIX}unrelated"
    starting.mkdir()
    (starting / SCRATCH_OWNER).touch()
    unrelated.mkdir()
    assert remove_abandoned(tmp_path) == [dead]
    assert live.folder.is_dir() and starting.is_dir() and unrelated.is_dir()
    assert (live.folder / SCRATCH_OWNER).read_text() == f"{os.getpid()}\n"
    live.remove()
    assert not live.folder.exists()
    assert remove_abandoned(tmp_path) == []


# ---- racing and dying workers --------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_workers_opening_a_fresh_sqlite_storage_together_all_start(tmp_path):
    # Without the lock, three processes fail every time (measured 2026-12-04, 4 of 4 tries).
    for attempt in range(2):
        where = StudyStorage(f"sqlite:///{tmp_path / f'studies{attempt}.db'}")
        assert storage_race.open_together(where, 3) == ([0, 0, 0], [])


@pytest.mark.timeout(300)
def test_a_worker_that_dies_fails_the_command(tmp_path):
    db = tmp_path / "tune.sqlite"
    code, output = _run(tmp_path, "crash", _common(db, "--storage", str(tmp_path / "studies.log")), RERUN_LIMIT_S,
                        TOY_CRASH_WORKER="1")  # fmt: skip
    assert code != 0, output
    assert "worker cpu#1" in output and "exited with code 1" in output
    # The other worker finished the keys.
    assert sorted(w.key["n_bucket"] for w in ConfigStore(f"sqlite:///{db}").winners()) == [64, 256]


# ---- a corrupt journal -----------------------------------------------------------------------------------


def _journal_with_a_study(path: Path) -> bytes:
    import optuna

    optuna.create_study(study_name="tritune:x", storage=StudyStorage(str(path)).open())
    return path.read_bytes()


@pytest.mark.parametrize(
    "content",
    ["garbage", "truncated", "not-a-journal", "unreplayable", "sqlite", "folder"],
)
def test_a_corrupt_journal_is_refused_with_its_name_and_what_to_do(tmp_path, content):
    good = _journal_with_a_study(tmp_path / "good.log")
    path = tmp_path / "studies.log"
    if content == "folder":
        path.mkdir()
    else:
        path.write_bytes(
            {
                "garbage": b"\x00\x01 this is not a journal\n" + good,
                "truncated": good + good[: len(good) // 2],
                "not-a-journal": b'{"hello": "world"}\n',
                # A record of the right form that Optuna cannot apply (a study without a name).
                "unreplayable": b'{"op_code": 0, "worker_id": "w"}\n',
                "sqlite": b"SQLite format 3\x00" + bytes(200),
            }[content]
        )
    with pytest.raises(StudyStorageError) as raised:
        StudyStorage(str(path)).open()
    message = str(raised.value)
    assert str(path) in message
    assert isinstance(raised.value, ValueError)
    assert len(message.splitlines()) <= 2


def test_a_truncated_journal_fails_the_command_before_any_worker_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")
    path, db = tmp_path / "studies.log", tmp_path / "db.sqlite"
    good = _journal_with_a_study(tmp_path / "good.log")
    path.write_bytes(good + good[:10])
    for workers in ("1", "2"):
        result = dist.runner.invoke(
            dist.app,
            ["--device", "cpu", "--workers", workers, "--kernel", "toy_scale", "--no-isolate", "--db", str(db),
             "--storage", str(path)],
        )  # fmt: skip
        # Printed by the command's error handler, or raised to the caller where there is none.
        shown = " ".join(f"{result.output} {result.exception}".split())
        assert result.exit_code != 0, result.output
        assert f"{path} ends in the middle of a record" in shown, shown
        assert "exited with code" not in shown
        assert dist._sqlite_rows(db) == [], "a trial was measured"
    assert path.read_bytes() == good + good[:10], "the journal was written to"
