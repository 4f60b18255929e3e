"""Online tuning's time caps: the trial timeout is tune's own (a short budget never stores a kill
as a failure, and a stored short timeout is retried), a locked DB and the key's seconds bound a
sync call, a batch stops at the deadline (the portable default measured whatever the seconds left,
a batch already compiled in parallel measured on up to three times the budget), a failed portable
default ends the tune at once."""

from __future__ import annotations

import contextlib
import sqlite3
import time

import pytest
import torch
import toy_kernel
from test_jit import CPU, PORTABLE, SPEC, _key, _served, _trials, _winner, online  # noqa: F401

from tritune.configs_db.storage import sqlite_file
from tritune.configs_db.store import ConfigStore
from tritune.kernels import settings
from tritune.tuner import jit as tuner_jit
from tritune.tuner.candidates import FAILED_RUNTIME, OK
from tritune.tuner.options import TuneOptions
from tritune.tuner.study import KeyTuner, environment_id
from tritune.tuner.timing import FakeTimer


def _store_trial(n_bucket: int, config: dict, status: str, error: str | None) -> None:
    with ConfigStore(settings.settings().db_url) as store:
        env = environment_id(store, CPU)
        store.record_trial(env, SPEC.name, SPEC.version, _key(n_bucket).to_dict(), config, status, None, error)


def test_a_timeout_is_read_from_its_stored_error():
    from tritune.tuner.known import timed_out_after

    assert timed_out_after(FAILED_RUNTIME, "timed out after 5 s") == 5.0
    assert timed_out_after(FAILED_RUNTIME, "timed out after 0.25 s") == 0.25
    assert timed_out_after(FAILED_RUNTIME, "worker died with exit code -11 (SIGSEGV)") is None
    assert timed_out_after("failed-compile", "timed out after 5 s") is None


def test_online_tuning_uses_tunes_trial_timeout_not_the_keys_seconds(monkeypatch):
    seen = []
    make = tuner_jit._bench

    def recording(device, timer, options):
        seen.append(options.trial_timeout_s)
        return make(device, timer, options)

    monkeypatch.setattr(tuner_jit, "_bench", recording)
    with settings.override(jit="sync", jit_trials=2, jit_key_seconds=1.0):
        _served(200)
    assert seen == [TuneOptions().trial_timeout_s]


@pytest.mark.interpreter
def test_a_default_stored_as_timed_out_under_a_shorter_timeout_is_measured_again():
    _store_trial(256, PORTABLE, FAILED_RUNTIME, "timed out after 1 s")
    with settings.override(jit="sync", jit_trials=3):
        assert _served(200) != PORTABLE
    assert _winner(256) is not None
    rows = {tuple(sorted(r.config.items())): r for r in _trials(256)}
    assert rows[tuple(sorted(PORTABLE.items()))].status == OK, "the stored timeout is replaced by the new result"


@pytest.mark.interpreter
def test_a_timeout_as_long_as_the_running_one_stays_a_failure():
    _store_trial(256, PORTABLE, FAILED_RUNTIME, f"timed out after {TuneOptions().trial_timeout_s:g} s")
    with settings.override(jit="sync", jit_trials=3):
        assert _served(200) == PORTABLE
    assert _winner(256) is None


def test_a_locked_db_holds_a_sync_call_no_longer_than_the_keys_seconds():
    url = settings.settings().db_url
    ConfigStore(url).close()
    locker = sqlite3.connect(str(sqlite_file(url)), isolation_level=None, check_same_thread=False)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        with settings.override(jit="sync", jit_trials=3, jit_key_seconds=0.5):
            started = time.monotonic()
            assert _served(200) == PORTABLE
            spent = time.monotonic() - started
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert spent < 5, f"the call waited {spent:.1f} s on the locked DB"


class _SlowCost(toy_kernel.CostTimer):
    pause_s = 0.2

    def __call__(self, fn, *, config, flush_l2, launch_bound):
        time.sleep(self.pause_s)
        return super().__call__(fn, config=config, flush_l2=flush_l2, launch_bound=launch_bound)


@pytest.mark.interpreter
def test_a_batch_stops_at_the_time_budget(tmp_path):
    key = _key(256)
    options = TuneOptions(trials=12, batch=12, time_budget_s=0.3, final_rounds=1)
    with ConfigStore(f"sqlite:///{tmp_path / 'batch.sqlite'}") as store:
        env = environment_id(store, CPU)
        tuner = KeyTuner(SPEC, key, CPU, torch.device("cpu"), store, env, _SlowCost(), options)
        result = tuner.run()
        measured = [r for r in store.measured_trials(env, SPEC.name, SPEC.version, key.to_dict()) if r.status == OK]
    assert result.config is not None
    assert 1 <= len(measured) <= 3, f"{len(measured)} trials measured past a 0.3 s budget of 0.2 s trials"


class _BatchBench:
    """A bench whose batch takes ``compile_s`` to compile in parallel; records what it measures."""

    def __init__(self, compile_s: float) -> None:
        self.compile_s = compile_s
        self.measured: list[tuple[dict, bool]] = []

    def precompile(self, configs):
        time.sleep(self.compile_s)
        return [None] * len(configs)

    def trial(self, values, compiled):
        self.measured.append((values, compiled))
        return {"status": OK, "ms": 1.0, "error": None, "fatal": False}


@pytest.mark.parametrize(
    ("workers", "spent_s", "compile_s", "measured", "compiled"),
    [
        (1, 0.7, 0.0, 1, False),  # compiled one by one: the budget is spent before the batch
        # Measured batches end well inside three times the budget (1.5 s), so that a loaded CI host's
        # slower trials still finish before it.
        (4, 0.0, 0.9, 4, True),  # the parallel compiles outlast the budget, not three times it
        (4, 0.0, 1.7, 1, True),  # ... and three times it: only the owed default
        (4, 0.6, 0.3, 4, True),  # the budget went on start-up: the late batch is compiled and measured
        (4, 1.6, 0.2, 1, False),  # start-up took three times the budget: the default alone, compiled by itself
    ],
)
def test_a_batch_compiled_in_parallel_is_measured_past_the_time_budget(
    tmp_path, workers, spent_s, compile_s, measured, compiled
):
    """Once a batch's compiles are paid, its check and timing cost little: all of it is measured
    though the compiles outlast the budget, up to three times the budget, and a batch asked after the
    budget went on start-up is still compiled in parallel, which costs the default's compile alone.
    Compiled one by one, each trial past the budget is skipped; either way the owed portable
    default is measured."""
    key = _key(256)
    options = TuneOptions(trials=12, batch=4, time_budget_s=0.5, final_rounds=1, compile_workers=workers)
    with ConfigStore(f"sqlite:///{tmp_path / 'compiled.sqlite'}") as store:
        env = environment_id(store, CPU)
        tuner = KeyTuner(SPEC, key, CPU, torch.device("cpu"), store, env, _SlowCost(), options)
        tuner.torch_device = torch.device("cuda")  # a GPU's parallel compile, which the bench fakes
        configs = [c for c in tuner.strategy.feasible if SPEC.space.to_dict(c) != PORTABLE][:3]
        configs.append(SPEC.space.parse(PORTABLE))
        bench = _BatchBench(compile_s=compile_s)
        tuner.started = time.monotonic() - spent_s
        tuner._measure_batch(bench, configs)
    assert len(bench.measured) == measured
    assert bench.measured[-1][0] == PORTABLE
    assert all(flag == compiled for _, flag in bench.measured)


class _DefaultFails(FakeTimer):
    """The portable default fails at run time; every other config measures."""

    def __call__(self, fn, *, config, flush_l2, launch_bound):
        if SPEC.space.to_dict(config) == PORTABLE:
            raise RuntimeError("the default cannot run here")
        return super().__call__(fn, config=config, flush_l2=flush_l2, launch_bound=launch_bound)


@pytest.mark.interpreter
def test_a_failed_portable_default_ends_the_online_tune_at_once(monkeypatch):
    monkeypatch.setattr(tuner_jit, "TIMER", _DefaultFails(toy_kernel.toy_cost))
    result = tuner_jit.tune_one_key(SPEC, "cpu", _key(256), trials=8, seconds=30, db_url=settings.settings().db_url)
    assert result.outcome == tuner_jit.FAILED and "portable default failed" in result.detail
    assert "cannot run here" in result.detail
    assert [r.status for r in _trials(256) if r.status != "pruned"] == [FAILED_RUNTIME]


def test_a_sync_tune_interrupted_gives_its_reservation_back(monkeypatch):
    from tritune.kernels import jit

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tuner_jit, "tune_one_key", interrupted)
    with settings.override(jit="sync", jit_trials=2):
        with pytest.raises(KeyboardInterrupt):
            _served(200)
        assert jit.ONLINE._reserved == {}
        assert not getattr(jit.ONLINE._local, "tuning", False)


@pytest.mark.interpreter
def test_seconds_spent_before_the_first_trial_still_leave_the_key_its_portable_default(monkeypatch):
    """A start-up that outlasts the key's seconds (a cold bench, compiles on a busy GPU) measures the
    baseline anyway, and no other config: the key stores a winner instead of nothing."""
    make = tuner_jit._bench

    def slow_start(device, timer, options):
        time.sleep(0.4)
        return make(device, timer, options)

    monkeypatch.setattr(tuner_jit, "_bench", slow_start)
    result = tuner_jit.tune_one_key(SPEC, "cpu", _key(256), trials=8, seconds=0.2, db_url=settings.settings().db_url)
    assert result.outcome == tuner_jit.TUNED, result.detail
    measured = [r for r in _trials(256) if r.status == OK]
    assert [r.config for r in measured] == [PORTABLE]
    assert _winner(256) is not None


@pytest.mark.interpreter
def test_an_offline_time_budget_spent_before_the_search_still_measures_the_default(tmp_path):
    key = _key(256)
    options = TuneOptions(trials=12, batch=12, time_budget_s=1e-6, final_rounds=1)
    with ConfigStore(f"sqlite:///{tmp_path / 'late.sqlite'}") as store:
        env = environment_id(store, CPU)
        result = KeyTuner(SPEC, key, CPU, torch.device("cpu"), store, env, _SlowCost(), options).run()
        measured = [r for r in store.measured_trials(env, SPEC.name, SPEC.version, key.to_dict()) if r.status == OK]
    assert result.config is not None
    assert [r.config for r in measured] == [PORTABLE]


@pytest.mark.interpreter
def test_the_workers_start_up_does_not_count_against_the_keys_seconds(monkeypatch):
    """The worker process starts once per process (a process, torch, a device): a key whose
    seconds it would have spent still gets its trials, and the result's seconds still count it."""
    from tritune.tuner import worker

    spawn = worker.Worker._spawn

    def slow_spawn(self):
        time.sleep(6.0)
        spawn(self)

    monkeypatch.setattr(worker.Worker, "_spawn", slow_spawn)
    monkeypatch.setattr(tuner_jit, "ISOLATE", True)
    monkeypatch.setattr(tuner_jit, "TIMER", FakeTimer(toy_kernel.toy_cost))
    tuner_jit.close_benches()
    try:
        result = tuner_jit.tune_one_key(SPEC, "cpu", _key(256), trials=3, seconds=4.0,
                                        db_url=settings.settings().db_url)  # fmt: skip
    finally:
        tuner_jit.close_benches()
    assert result.outcome == tuner_jit.TUNED, result.detail
    measured = [(r.config, r.status) for r in _trials(256) if r.status != "pruned"]
    assert len(measured) == 3, measured
    assert result.seconds >= 6.0


def test_a_worker_started_after_a_dead_one_opens_no_earlier_keys_problems(monkeypatch):
    from tritune.tuner import worker

    bench = worker.Worker("cpu", FakeTimer(toy_kernel.toy_cost))
    bench._opened = {"op": "open", "kernel": "toy", "key": {}}
    spawned, set_up = [], []
    monkeypatch.setattr(bench, "_alive", lambda: False)
    monkeypatch.setattr(bench, "_spawn", lambda: spawned.append(True))
    monkeypatch.setattr(bench, "_setup", lambda message: set_up.append(message))
    bench.start()
    assert spawned == [True] and set_up == [] and bench._opened is None


@pytest.mark.interpreter
def test_a_winner_stored_while_the_claim_was_awaited_is_found_past_the_keys_seconds(monkeypatch):
    """A process that waited on another's claim longer than the key's seconds reads the winner that
    process stored, rather than reporting the key late."""
    with settings.override(jit="sync", jit_trials=3):
        _served(200)
    stored = _winner(256)
    assert stored is not None
    claim = tuner_jit._claim

    @contextlib.contextmanager
    def slow_claim(db_url, name, wait_s):
        time.sleep(0.3)
        with claim(db_url, name, wait_s) as held:
            yield held

    monkeypatch.setattr(tuner_jit, "_claim", slow_claim)
    result = tuner_jit.tune_one_key(SPEC, "cpu", _key(256), trials=3, seconds=0.1, db_url=settings.settings().db_url,
                                    wait_s=5.0)  # fmt: skip
    assert result.outcome == tuner_jit.FOUND and result.winner.config == stored.config
