"""Candidates run in a worker process: one that crashes, hangs, runs out of memory or poisons the
CUDA context is a failed trial, and the study goes on.

The toy kernel's ``toy_misbehaving`` spec does each of those on purpose (inside a worker only).
The study must record each with its reason, replace the worker where it died or can no longer run
GPU work, and still finish with the right winner.
"""

from __future__ import annotations

import pickle
import time

import pytest
import torch
import toy_kernel

from tritune.configs_db.store import ConfigStore
from tritune.kernels import registry
from tritune.kernels.device import device_info
from tritune.tuner.candidates import BenchError
from tritune.tuner.study import KeyTuner, TuneOptions, environment_id
from tritune.tuner.worker import EXIT_CONTEXT_LOST, STOP_GRACE_S, Worker, death_reason

CPU = device_info("cpu")
#: A hung candidate is killed after this long. Every other trial of the toy kernel takes about 10 ms
#: on the interpreter (the worker's start-up is not part of a trial), so this only fires for the hang.
HANG_TIMEOUT_S = 3.0


@pytest.fixture(autouse=True)
def misbehaving_registered(monkeypatch):
    monkeypatch.setitem(registry._SPECS, "toy_misbehaving", f"{toy_kernel.__name__}:MISBEHAVING")


def test_misbehaving_candidates_are_failed_trials_and_the_study_goes_on(tmp_path):
    spec = toy_kernel.MISBEHAVING
    store = ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    env = environment_id(store, CPU)
    key = spec.default_keys(CPU, n=[64])[0]
    timer = toy_kernel.CostTimer()
    options = TuneOptions(trials=20, batch=3, final_rounds=1, seed=0, isolate=True)
    with Worker("cpu", timer, trial_timeout_s=HANG_TIMEOUT_S) as worker:
        result = KeyTuner(spec, key, CPU, torch.device("cpu"), store, env, timer, options, bench=worker).run()
        starts = worker.starts

    rows = {
        row.config["ACTION"]: row
        for row in store.measured_trials(env, spec.name, spec.version, key.to_dict())
        if row.config["BLOCK"] == 64
    }
    assert rows["segfault"].status == "failed-runtime"
    assert rows["segfault"].error == "worker died with exit code -11 (SIGSEGV)"
    assert rows["hang"].status == "failed-runtime"
    assert rows["hang"].error == "timed out after 3 s"
    # Out of memory is an ordinary exception: a failed trial, and the worker stays.
    assert rows["oom"].status == "failed-runtime"
    assert rows["oom"].error.startswith("OutOfMemoryError: CUDA out of memory")
    # A poisoned CUDA context: the worker reports the trial, then exits rather than fail every later one.
    assert rows["illegal_access"].status == "failed-runtime"
    assert rows["illegal_access"].error.startswith("RuntimeError: CUDA error: an illegal memory access")
    assert rows["none"].status == "ok"
    # One start, then one restart after each of the two deaths and the lost context.
    assert starts == 4
    assert result.config == {"BLOCK": 64, "ACTION": "none"}
    assert result.failed == 4 and result.measured == 2
    winners = store.winners(gpu=CPU.slug, kernel=spec.name)
    assert [w.config for w in winners] == [{"BLOCK": 64, "ACTION": "none"}]


def test_a_stopped_worker_ends_at_once():
    """``Worker.close`` does not wait for the worker's interpreter to exit: a thread left behind there (as a
    compile pool's may be) held the close for the whole grace period, then the worker was killed."""
    spec = toy_kernel.SPEC
    key = spec.default_keys(CPU, n=[64])[0]
    worker = Worker("cpu", toy_kernel.LingeringTimer())
    try:
        worker.open(spec, key, 0, spec.space.to_dict(spec.default_config(key)))
        started = time.monotonic()
        worker.close()
        closing = time.monotonic() - started
    finally:
        worker.close()
    assert closing < STOP_GRACE_S / 4, f"closing the worker took {closing:.1f} s"


def test_misbehaviour_refuses_to_run_in_the_test_process():
    with pytest.raises(RuntimeError, match="only inside a worker process"):
        toy_kernel.misbehave("segfault")


def test_a_timer_that_cannot_travel_is_refused_before_any_process_starts():
    with pytest.raises(BenchError, match="cannot be sent to a worker process"):
        Worker("cpu", lambda fn, **_: 1.0)


def test_cost_timer_pickles():
    timer = pickle.loads(pickle.dumps(toy_kernel.CostTimer(scale=2.0)))
    assert timer.scale == 2.0


@pytest.mark.parametrize(
    "exitcode, reason",
    [
        (-11, "worker died with exit code -11 (SIGSEGV)"),
        (-9, "worker died with exit code -9 (SIGKILL)"),
        (3, "worker died with exit code 3"),
        (EXIT_CONTEXT_LOST, f"worker died with exit code {EXIT_CONTEXT_LOST} (CUDA context lost)"),
        (None, "worker stopped answering"),
    ],
    ids=["segv", "kill", "exit", "context-lost", "unknown"],
)
def test_death_reasons(exitcode, reason):
    assert death_reason(exitcode) == reason
