"""A worker killed from outside (SIGKILL, as the OOM killer sends) is no verdict on its candidate.

The candidate is tried once more in a fresh worker; one that kills its worker twice fails with both
deaths in its reason. A worker's own fault (SIGSEGV) fails its candidate at once, as before. A death
by an external signal stored without that second try (by older versions) is measured again by a
later search, as a stored timeout shorter than the search's is.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import toy_kernel

from tritune.configs_db.store import ConfigStore
from tritune.kernels.device import device_info
from tritune.tuner.candidates import FAILED_RUNTIME, OK
from tritune.tuner.study import KeyTuner, TuneOptions, TuningError, environment_id
from tritune.tuner.worker import Worker, external_death, killed_from_outside

CPU = device_info("cpu")
SPEC = toy_kernel.SPEC
KEY = SPEC.default_keys(CPU, n=[64])[0]
DEFAULT = SPEC.space.to_dict(SPEC.default_config(KEY))
#: The candidate whose worker is killed (the portable default, BLOCK=32, is timed unharmed).
VICTIM = {"BLOCK": 128, "BROKEN": False, "num_warps": 1}
KILLED = "worker died with exit code -9 (SIGKILL)"


class SignalTimer(toy_kernel.CostTimer):
    """Times as :class:`toy_kernel.CostTimer`, but sends its worker ``signum`` while timing :data:`VICTIM`:
    every time, or (with ``once``, a file marking that it happened) the first time only."""

    def __init__(self, signum: int, once: str | None = None) -> None:
        super().__init__()
        self.signum, self.once = signum, once

    def __call__(self, fn: Any, *, config: object, flush_l2: bool, launch_bound: bool) -> float:
        if getattr(config, "BLOCK", None) == VICTIM["BLOCK"] and not (self.once and os.path.exists(self.once)):
            if multiprocessing.parent_process() is None:
                raise RuntimeError("SignalTimer signals only inside a worker process")
            if self.once:
                Path(self.once).touch()
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.kill(os.getpid(), self.signum)
            time.sleep(30)
        return super().__call__(fn, config=config, flush_l2=flush_l2, launch_bound=launch_bound)


def _worker(timer: SignalTimer) -> Worker:
    worker = Worker("cpu", timer, trial_timeout_s=20)
    worker.open(SPEC, KEY, 0, DEFAULT)
    return worker


def test_a_candidate_killed_from_outside_once_is_measured_in_a_fresh_worker(tmp_path):
    with _worker(SignalTimer(signal.SIGKILL, once=str(tmp_path / "killed"))) as worker:
        result = worker.trial(VICTIM, compiled=False)
        assert worker.starts == 2
    assert (tmp_path / "killed").exists()
    assert result["status"] == OK and result["ms"] is not None, result


def test_a_candidate_that_kills_its_worker_twice_fails_naming_both_deaths():
    with _worker(SignalTimer(signal.SIGKILL)) as worker:
        result = worker.trial(VICTIM, compiled=False)
        assert result["status"] == FAILED_RUNTIME
        assert result["error"] == f"{KILLED}; tried again in a fresh worker: {KILLED}"
        assert worker.starts == 2
        # The next candidate gets a fresh worker, as after any death.
        assert worker.trial(DEFAULT, compiled=False)["status"] == OK
        assert worker.starts == 3
    assert not external_death(result["error"]), "a candidate killed twice is a verdict"


def test_a_worker_that_faults_fails_its_candidate_without_a_second_try():
    with _worker(SignalTimer(signal.SIGSEGV)) as worker:
        result = worker.trial(VICTIM, compiled=False)
        assert worker.starts == 1
    assert result["status"] == FAILED_RUNTIME
    assert result["error"] == "worker died with exit code -11 (SIGSEGV)"


def test_external_signals_are_told_from_a_workers_own_faults():
    assert killed_from_outside(-signal.SIGKILL) and killed_from_outside(-signal.SIGTERM)
    assert not killed_from_outside(-signal.SIGSEGV) and not killed_from_outside(-signal.SIGABRT)
    assert not killed_from_outside(None) and not killed_from_outside(1)
    assert external_death(KILLED)
    assert external_death("worker died with exit code -15 (SIGTERM)")
    assert not external_death("worker died with exit code -11 (SIGSEGV)")
    assert not external_death("timed out after 120 s")
    assert not external_death(f"{KILLED}; tried again in a fresh worker: {KILLED}")


def _tune_with_stored_default(tmp_path: Path, error: str) -> tuple[ConfigStore, int]:
    """A search of the toy key whose portable default is stored as ``failed-runtime`` with ``error``."""
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    env = environment_id(store, CPU)
    store.record_trial(env, SPEC.name, SPEC.version, KEY.to_dict(), DEFAULT, FAILED_RUNTIME, None, error)
    options = TuneOptions(trials=4, final_rounds=1)
    KeyTuner(SPEC, KEY, CPU, torch.device("cpu"), store, env, toy_kernel.CostTimer(), options).run()
    return store, env


def _stored_default(store: ConfigStore, env: int) -> Any:
    rows = [r for r in store.measured_trials(env, SPEC.name, SPEC.version, KEY.to_dict()) if r.config == DEFAULT]
    assert len(rows) == 1
    return rows[0]


def test_a_stored_death_by_an_external_signal_is_measured_again(tmp_path):
    store, env = _tune_with_stored_default(tmp_path, KILLED)
    row = _stored_default(store, env)
    assert row.status == OK and row.time_ms is not None and row.error is None


@pytest.mark.parametrize(
    "error",
    ["worker died with exit code -11 (SIGSEGV)", f"{KILLED}; tried again in a fresh worker: {KILLED}"],
    ids=["fault", "killed-twice"],
)
def test_a_stored_fault_or_double_kill_stays_a_failure(tmp_path, error):
    with pytest.raises(TuningError, match="the portable default failed"):
        _tune_with_stored_default(tmp_path, error)
