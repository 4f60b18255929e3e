"""Online tuning (TRITUNE_JIT) on the toy kernel: sync and background tunes of a missed key, what
stops them (capture, tracing, budgets, a missing tuner), two processes, a crashing candidate; on a
GPU, a decode key tuned online against the same key tuned offline."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import toy_kernel

from tritune.configs_db.store import ConfigStore
from tritune.kernels import jit, jit_background, misses, registry, settings
from tritune.kernels.device import device_info
from tritune.kernels.dispatcher import DISPATCHER, dispatch_config, reload_configs
from tritune.kernels.pins import use_config
from tritune.search_spaces.base import SearchSpace, choice
from tritune.tuner import jit as tuner_jit
from tritune.tuner.candidates import FAILED_RUNTIME
from tritune.tuner.study import environment_id
from tritune.tuner.timing import FakeTimer

CPU = device_info("cpu")
SPEC = toy_kernel.SPEC
PORTABLE = {"BLOCK": 32, "BROKEN": False, "num_warps": 4}
TESTS = Path(__file__).resolve().parent


class SlowTimer(toy_kernel.CostTimer):
    """``toy_cost`` after a pause: a tune that takes long enough to be seen not to block."""

    pause_s = 0.3

    def __call__(self, fn, *, config, flush_l2, launch_bound):
        time.sleep(self.pause_s)
        return super().__call__(fn, config=config, flush_l2=flush_l2, launch_bound=launch_bound)


# ---- a kernel one of whose configs kills the process that runs it -----------------------------


@dataclass(frozen=True)
class CrashConfig:
    BLOCK: int = choice(32, (32, 64))
    ACTION: str = choice("none", ("none", "segfault"))


class CrashingSpec(toy_kernel.MisbehavingSpec):
    name = "toy_jit_crash"
    space = SearchSpace("toy_jit_crash", CrashConfig, feasibility=toy_kernel._misbehaving_feasible)


CRASHING = CrashingSpec()


@pytest.fixture(autouse=True)
def online(monkeypatch):
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")
    monkeypatch.setitem(registry._SPECS, "toy_jit_crash", f"{__name__}:CRASHING")
    monkeypatch.setattr(tuner_jit, "TIMER", FakeTimer(toy_kernel.toy_cost))
    monkeypatch.setattr(tuner_jit, "ISOLATE", False)
    jit.ONLINE.reset()
    DISPATCHER.clear()
    yield
    jit.ONLINE.reset()
    tuner_jit.close_benches()
    DISPATCHER.clear()


def _served(n: int, spec=SPEC) -> dict:
    x = torch.randn(n)
    return spec.space.to_dict(dispatch_config(spec.name, "cpu", -1, tuple(spec.facts(x))))


def _key(n_bucket: int, spec=SPEC):
    return toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", n_bucket)


def _trials(n_bucket: int, spec=SPEC) -> list:
    with ConfigStore(settings.settings().db_url) as store:
        env = environment_id(store, CPU)
        return store.measured_trials(env, spec.name, spec.version, _key(n_bucket, spec).to_dict())


def _winner(n_bucket: int, spec=SPEC):
    with ConfigStore(settings.settings().db_url) as store:
        found = [w for w in store.winners(gpu=CPU.slug, kernel=spec.name) if w.key == _key(n_bucket, spec).to_dict()]
    return found[0] if found else None


def _environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TRITON_INTERPRET="1",
        TRITUNE_DB=settings.settings().db_url,
        TRITUNE_DISABLE_BUNDLES="1",
        TRITUNE_MISS_LOG="0",
        PYTHONPATH=os.pathsep.join([str(TESTS), *(p for p in sys.path if p)]),
    )
    env.update(extra)
    return env


#: A process that calls the toy kernel at n=200 and prints what served it, as JSON.
CALLER = textwrap.dedent(
    """
    import json, sys, time
    from tritune.kernels._interpreter import fix_interpreter_index
    fix_interpreter_index()
    import torch, toy_kernel
    from tritune.kernels import registry
    from tritune.kernels.dispatcher import dispatch_config
    registry._SPECS["toy_scale"] = "toy_kernel:SPEC"
    facts = tuple(toy_kernel.SPEC.facts(torch.randn(200)))
    """
)


@pytest.mark.interpreter
def test_sync_tunes_a_missed_key_on_its_first_call_and_a_fresh_process_serves_it():
    with settings.override(jit="sync", jit_trials=6):
        served = _served(200)
        calls = tuner_jit.TIMER.calls
        assert _served(200) == served and tuner_jit.TIMER.calls == calls, "tuned once, then served"
    winner = _winner(256)
    assert winner is not None and winner.config == served != PORTABLE
    rows = _trials(256)
    assert len([r for r in rows if r.status != "pruned"]) == 6
    assert {r.status for r in rows} >= {"ok", "failed-correctness"}, "the broken config met the correctness gate"

    script = CALLER + textwrap.dedent(
        """
        config = dispatch_config("toy_scale", "cpu", -1, facts)
        print(json.dumps({"served": toy_kernel.SPEC.space.to_dict(config),
                          "imported": sorted(m for m in ("tritune.kernels.jit", "tritune.kernels.jit_background",
                                                         "tritune.tuner", "optuna") if m in sys.modules)}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=_environment(TRITUNE_JIT="sync"), capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    assert fresh == {"served": served, "imported": []}, "the stored winner serves; nothing tunes or imports the tuner"


@pytest.mark.interpreter
def test_background_serves_at_once_and_the_winner_takes_effect_when_the_worker_reports(monkeypatch):
    monkeypatch.setattr(jit_background, "WORKER_ARGS", ["--timer", f"{__name__}:SlowTimer", "--no-isolate"])
    with settings.override(jit="background", jit_trials=6, jit_key_seconds=60.0):
        started = time.monotonic()
        first = _served(200)
        call_s = time.monotonic() - started
        assert first == PORTABLE
        # The worker's start-up alone takes seconds, and its tune six pauses of 0.3 s.
        assert call_s < 1.0
        deadline = time.monotonic() + 120
        while (served := _served(200)) == PORTABLE and time.monotonic() < deadline:
            time.sleep(0.1)
        tuned_s = time.monotonic() - started
    winner = _winner(256)
    assert winner is not None and served == winner.config != PORTABLE
    assert tuned_s > 6 * SlowTimer.pause_s > call_s
    assert len([r for r in _trials(256) if r.status != "pruned"]) == 6


@pytest.mark.interpreter
@pytest.mark.parametrize("context", ["graph capture", "compile tracing"])
def test_nothing_is_tuned_under_capture_or_tracing_only_the_miss_is_noted(monkeypatch, context):
    misses.MISSES.clear()
    try:
        # One settings block throughout: leaving it would drop the dispatcher's memo and hide a
        # choice remembered from the captured call.
        with settings.override(jit="sync", jit_trials=4, miss_log=True):
            with monkeypatch.context() as patched:
                if context == "graph capture":
                    patched.setattr(torch.cuda, "is_initialized", lambda: True)
                    patched.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
                else:
                    patched.setattr(torch.compiler, "is_compiling", lambda: True)
                assert _served(200) == PORTABLE
                noted = [ident for ident in misses.pending() if ident[2] == SPEC.name]
                assert tuner_jit.TIMER.calls == 0 and not jit.ONLINE.attempted
                assert not Path(settings.settings().db_url.removeprefix("sqlite:///")).exists(), "nothing was written"
            # The key was not spent, nor its portable choice remembered: its first eager call tunes it.
            assert _served(200) != PORTABLE
    finally:
        misses.MISSES.clear()
    assert [ident[4] for ident in noted] == [_key(256)]
    assert tuner_jit.TIMER.calls > 0


@pytest.mark.interpreter
def test_two_processes_missing_one_key_tune_it_once(tmp_path):
    go = tmp_path / "go"
    script = CALLER + textwrap.dedent(
        f"""
        import os, pathlib
        from tritune.tuner import jit
        import test_jit
        jit.TIMER, jit.ISOLATE = test_jit.SlowTimer(), False
        pathlib.Path(sys.argv[1]).touch()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        first = toy_kernel.SPEC.space.to_dict(dispatch_config("toy_scale", "cpu", -1, facts))
        deadline = time.monotonic() + 90
        while True:
            served = toy_kernel.SPEC.space.to_dict(dispatch_config("toy_scale", "cpu", -1, facts))
            if served != first or time.monotonic() > deadline or jit.TIMER.calls:
                break
            time.sleep(0.05)
        print(json.dumps({{"measured": jit.TIMER.calls, "served": served}}))
        """
    )
    env = _environment(TRITUNE_JIT="sync", TRITUNE_JIT_TRIALS="5", TRITUNE_JIT_KEY_SECONDS="60")
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    processes = [
        subprocess.Popen([sys.executable, "-c", script, str(path)], env=env, stdout=subprocess.PIPE, text=True)
        for path in ready
    ]
    deadline = time.monotonic() + 120
    while not all(path.exists() for path in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    results = [json.loads(p.communicate(timeout=180)[0].strip().splitlines()[-1]) for p in processes]
    winner = _winner(256)
    assert winner is not None
    assert sorted(r["measured"] > 0 for r in results) == [False, True], results
    assert all(r["served"] == winner.config for r in results), "the other process took the stored winner"
    rows = _trials(256)
    assert len(rows) == len({tuple(r.config.items()) for r in rows}) <= 5 + 1


@pytest.mark.interpreter
def test_a_crashing_candidate_is_a_failed_trial_of_its_own(monkeypatch):
    monkeypatch.setattr(tuner_jit, "TIMER", toy_kernel.CostTimer())
    monkeypatch.setattr(tuner_jit, "ISOLATE", True)
    with settings.override(jit="sync", jit_trials=4, jit_key_seconds=60.0):
        served = _served(200, CRASHING)
    rows = {r.config["ACTION"]: r for r in _trials(256, CRASHING) if r.config["BLOCK"] == 64}
    assert rows["segfault"].status == FAILED_RUNTIME
    assert rows["segfault"].error == "worker died with exit code -11 (SIGSEGV)"
    assert served == _winner(256, CRASHING).config == {"BLOCK": 64, "ACTION": "none"}


@pytest.mark.interpreter
@pytest.mark.parametrize("other", ["torch_version", "triton_version"])
def test_a_winner_stored_under_another_torch_or_triton_is_tuned_again(other):
    """Online tuning follows the rule every reader follows (``winners.is_current``): such a winner
    serves only provisionally, so it does not stop a tune of its key."""
    import triton

    versions = {"torch_version": torch.__version__, "triton_version": triton.__version__, "tritune_version": "t"}
    versions[other] = "0.0.1"
    with ConfigStore(settings.settings().db_url) as store:
        env = store.environment(gpu=CPU.slug, **versions)
        stale = tuner_jit.WinnerRecord(kernel=SPEC.name, kernel_version=SPEC.version, gpu=CPU.slug,
                                       key=_key(256).to_dict(), config=PORTABLE, time_ms=9.0, portable_ms=9.0,
                                       speedup=1.0, trials=1, **versions)  # fmt: skip
        assert store.offer_winner(stale, env)
    result = tuner_jit.tune_one_key(SPEC, "cpu", _key(256), trials=3, seconds=30.0, db_url=settings.settings().db_url)
    assert result.outcome == tuner_jit.TUNED and result.measured > 0
    assert result.winner is not None and result.winner.torch_version == torch.__version__


@pytest.mark.interpreter
def test_the_trial_budget_bounds_a_key():
    with settings.override(jit="sync", jit_trials=3):
        _served(200)
    assert len([r for r in _trials(256) if r.status != "pruned"]) == 3


@pytest.mark.interpreter
def test_the_seconds_budget_bounds_a_key(monkeypatch):
    monkeypatch.setattr(tuner_jit, "TIMER", SlowTimer())
    with settings.override(jit="sync", jit_trials=20, jit_key_seconds=0.5):
        started = time.monotonic()
        _served(200)
        spent = time.monotonic() - started
    measured = [r for r in _trials(256) if r.status != "pruned"]
    assert 1 <= len(measured) < 8 and spent < 10


@pytest.mark.interpreter
def test_the_process_budget_stops_online_tuning(caplog):
    with settings.override(jit="sync", jit_trials=3):
        assert _served(200) != PORTABLE
    # What that key took is more than the process's budget now.
    budget = settings.override(jit="sync", jit_trials=3, jit_total_seconds=0.01)
    with budget, caplog.at_level(logging.INFO, logger="tritune.jit"):
        # Far from the tuned bucket (no borrowing): the portable default.
        assert _served(4000) == PORTABLE
        assert _served(8000) == PORTABLE
    assert _trials(4096) == [] and _trials(8192) == []
    assert len([r for r in caplog.records if "budget" in r.getMessage()]) == 1


@pytest.mark.interpreter
def test_a_spent_budget_closes_the_bench():
    with settings.override(jit="sync", jit_trials=3):
        assert _served(200) != PORTABLE
    assert tuner_jit._benches != {}
    with settings.override(jit="sync", jit_trials=3, jit_total_seconds=0.01):
        _served(4000)
    assert tuner_jit._benches == {}, "nothing more is tuned: the bench is closed"


@pytest.mark.interpreter
def test_concurrent_misses_never_hand_out_more_than_the_total(monkeypatch):
    """A key's seconds are reserved when it is handed out: a miss while another key is tuned gets
    what the reservation leaves, and none once it leaves nothing."""
    entered, release = threading.Event(), threading.Event()
    attempts = []

    def tune(spec, device, key, *, seconds, **budget):
        attempts.append((key.n_bucket, seconds))
        if key.n_bucket == 256:
            entered.set()
            release.wait(10)
        return tuner_jit.JitResult(tuner_jit.FAILED, None, seconds, detail="fake")

    monkeypatch.setattr(tuner_jit, "tune_one_key", tune)
    with settings.override(jit="sync", jit_key_seconds=1.0, jit_total_seconds=1.5):
        first = threading.Thread(target=_served, args=(200,))
        first.start()
        try:
            assert entered.wait(10)
            _served(4000)
            _served(9000)
        finally:
            release.set()
            first.join(10)
    assert attempts == [(256, 1.0), (4096, 0.5)]


@pytest.mark.interpreter
def test_a_miss_refused_while_other_keys_hold_the_budget_is_tried_once_seconds_free(monkeypatch):
    """A key refused only because another key's reservation holds what is left of the total is not
    remembered: its next call, after that key settled with seconds to spare, tunes it."""
    entered, release = threading.Event(), threading.Event()
    attempts = []

    def tune(spec, device, key, *, seconds, **budget):
        attempts.append(key.n_bucket)
        if key.n_bucket == 256:
            entered.set()
            release.wait(10)
        return tuner_jit.JitResult(tuner_jit.FAILED, None, 0.1, detail="fake")  # settles 0.1 s spent

    monkeypatch.setattr(tuner_jit, "tune_one_key", tune)
    with settings.override(jit="sync", jit_key_seconds=1.0, jit_total_seconds=1.0):
        first = threading.Thread(target=_served, args=(200,))
        first.start()
        try:
            assert entered.wait(10)
            _served(4000)  # bucket 4096: the whole total is reserved for 256
        finally:
            release.set()
            first.join(10)
        assert attempts == [256]
        _served(4000)  # 0.9 s free now
    assert attempts == [256, 4096]


def _store_stale_winner(n_bucket: int, config: dict) -> None:
    """A winner for the toy key ``n_bucket`` stored under another Triton: it serves provisionally."""
    import triton

    versions = {"torch_version": torch.__version__, "triton_version": triton.__version__, "tritune_version": "t"}
    versions["triton_version"] = "0.0.1"
    with ConfigStore(settings.settings().db_url) as store:
        env = store.environment(gpu=CPU.slug, **versions)
        stale = tuner_jit.WinnerRecord(kernel=SPEC.name, kernel_version=SPEC.version, gpu=CPU.slug,
                                       key=_key(n_bucket).to_dict(), config=config, time_ms=1.0, portable_ms=2.0,
                                       speedup=2.0, trials=1, **versions)  # fmt: skip
        assert store.offer_winner(stale, env)


@pytest.mark.interpreter
def test_a_provisional_exact_winner_serves_and_is_still_noted_and_tuned_online(monkeypatch):
    """A key whose only winner is provisional is re-measured as ``tune`` would: the miss log notes
    it, online tuning tunes it, and until then (or with online tuning off) the provisional winner serves."""
    stale = {"BLOCK": 64, "BROKEN": False, "num_warps": 2}
    _store_stale_winner(256, stale)
    noted = []
    monkeypatch.setattr(misses, "note", lambda spec, device, key: noted.append(key.n_bucket))
    reload_configs()
    assert _served(200) == stale and noted == [256], "jit off: the provisional winner serves, the key is noted"
    tuned = []

    def tune(spec, device, key, *, seconds, **budget):
        tuned.append(key.n_bucket)
        return tuner_jit.JitResult(tuner_jit.FAILED, None, 0.1, detail="fake")

    monkeypatch.setattr(tuner_jit, "tune_one_key", tune)
    reload_configs()
    with settings.override(jit="sync"):
        assert _served(200) == stale, "a failed online tune leaves the provisional winner serving"
    assert tuned == [256]


@pytest.mark.interpreter
def test_a_key_the_worker_cannot_import_gives_its_seconds_back(monkeypatch):
    monkeypatch.setattr(registry, "target_of", lambda spec: None)
    with settings.override(jit="background"):
        assert _served(200) == PORTABLE
        deadline = time.monotonic() + 10
        while jit.ONLINE._reserved and time.monotonic() < deadline:
            time.sleep(0.02)
    assert jit.ONLINE._reserved == {} and jit.ONLINE.spent_s == 0.0


def test_the_worker_returns_once_its_total_is_spent(monkeypatch):
    from tritune.tuner import jit_worker

    spent = tuner_jit.JitResult(tuner_jit.FAILED, None, 2.0, detail="fake")
    monkeypatch.setattr(tuner_jit, "tune_one_key", lambda *args, **kwargs: spent)
    request = {"kernel": SPEC.name, "target": f"{toy_kernel.__name__}:SPEC", "device": "cpu",
               "key": _key(256).to_dict(), "trials": 2, "seconds": 5.0, "wait_s": 0.0,
               "db_url": settings.settings().db_url}  # fmt: skip

    def requests():
        yield json.dumps(request) + "\n"
        raise AssertionError("a request read after the budget was spent")

    reports = io.StringIO()
    jit_worker.serve(requests(), reports, total_s=1.0)
    assert [json.loads(line)["seconds"] for line in reports.getvalue().splitlines()] == [2.0]


def test_a_worker_that_ends_on_its_spent_budget_is_no_death(caplog):
    with caplog.at_level(logging.INFO, logger="tritune.jit"):
        jit.ONLINE._worker_ended(0, "(pid 1) exited with code 0")
    assert jit.ONLINE.stopped is not None
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "budget" in caplog.records[0].getMessage()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_online_tuning_afresh(monkeypatch):
    """Locks another thread held at the fork, the parent's worker, benches and claim files: none
    reaches the child, and nothing of the parent's is closed there."""
    closed = []

    class Closable:
        def close(self):
            closed.append(os.getpid())

    monkeypatch.setattr(jit.ONLINE, "_worker", Closable())
    jit.ONLINE.attempted.add((SPEC.name, CPU.slug, _key(256)))
    monkeypatch.setitem(tuner_jit._benches, ("cpu", 0, False), Closable())
    monkeypatch.setitem(tuner_jit._claim_files, Path("/nonexistent.lock"), -1)
    holding, release = threading.Event(), threading.Event()

    def hold():
        with jit.ONLINE._lock, tuner_jit._benches_lock, tuner_jit._claim_guard:
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        try:
            locks = (jit.ONLINE._lock, tuner_jit._benches_lock, tuner_jit._claim_guard)
            state = {
                "locks": [lock.acquire(timeout=1) for lock in locks],
                "worker": jit.ONLINE._worker is None,
                "attempted": len(jit.ONLINE.attempted),
                "benches": len(tuner_jit._benches),
                "claims": len(tuner_jit._claim_files),
                "closed": closed,
            }
            os.write(write, json.dumps(state).encode())
        finally:
            os._exit(0)
    release.set()
    holder.join(10)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        state = json.loads(pipe.read())
    monkeypatch.setattr(jit.ONLINE, "_worker", None)
    assert state == {"locks": [True, True, True], "worker": True, "attempted": 0, "benches": 0, "claims": 0,
                     "closed": []}  # fmt: skip


@pytest.mark.interpreter
def test_a_key_is_attempted_once_per_process(monkeypatch):
    attempts = []

    def failing(spec, device, key, **budget):
        attempts.append(key)
        return tuner_jit.JitResult(tuner_jit.FAILED, None, 0.1, detail="the portable default failed")

    monkeypatch.setattr(tuner_jit, "tune_one_key", failing)
    with settings.override(jit="sync"):
        assert _served(200) == PORTABLE
        reload_configs()
        assert _served(200) == PORTABLE
    assert attempts == [_key(256)]


@pytest.mark.interpreter
def test_a_failure_inside_online_tuning_never_reaches_the_call(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise AttributeError("module 'torch._C' has no attribute '_moved_api'")

    monkeypatch.setattr(jit.ONLINE, "_sync", broken)
    with settings.override(jit="sync"), caplog.at_level(logging.WARNING, logger="tritune.jit"):
        assert _served(200) == PORTABLE
        assert _served(4000) == PORTABLE
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "online tuning failed unexpectedly" in warnings[0] and "_moved_api" in warnings[0]


@pytest.mark.interpreter
def test_a_missing_tuner_warns_once_and_serves_on(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tritune.tuner.jit", None)
    with settings.override(jit="sync"), caplog.at_level(logging.WARNING, logger="tritune.jit"):
        assert _served(200) == PORTABLE
        assert _served(1000) == PORTABLE
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pip install 'tritune[tune]'" in warnings[0]


@pytest.mark.interpreter
def test_background_without_the_tuner_warns_once_and_starts_no_worker(monkeypatch, caplog):
    monkeypatch.setattr(jit, "_tuner_missing", lambda: ["optuna"])
    monkeypatch.setattr(jit, "BackgroundWorker", None)
    with settings.override(jit="background"), caplog.at_level(logging.WARNING, logger="tritune.jit"):
        assert _served(200) == PORTABLE
        assert _served(1000) == PORTABLE
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pip install 'tritune[tune]'" in warnings[0]


@pytest.mark.interpreter
def test_the_runtime_without_optuna_serves_off_and_warns_once_when_on():
    """A fresh process where Optuna cannot be imported: off imports nothing of online tuning; sync
    says once what to install and serves on."""
    script = (
        "import sys\nsys.modules['optuna'] = None\n"
        + CALLER
        + textwrap.dedent(
            """
        import logging
        from tritune.kernels import settings
        dispatch_config("toy_scale", "cpu", -1, facts)
        online = ("tritune.kernels.jit", "tritune.kernels.jit_background", "tritune.tuner.jit")
        off = sorted(m for m in online if m in sys.modules)
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("tritune.jit").addHandler(handler)
        with settings.override(jit="sync"):
            for n in (4000, 9000):
                config = dispatch_config("toy_scale", "cpu", -1, tuple(toy_kernel.SPEC.facts(torch.randn(n))))
        print(json.dumps({"off": off, "served": toy_kernel.SPEC.space.to_dict(config),
                          "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING]}))
        """
        )
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=_environment(TRITUNE_JIT="off"), capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["off"] == [] and result["served"] == PORTABLE
    assert len(result["warnings"]) == 1 and "pip install 'tritune[tune]'" in result["warnings"][0]


@pytest.mark.interpreter
def test_an_online_winner_is_admitted_for_the_kernels_other_keys_too():
    """Admitted in memory: the kernel's near buckets borrow it without a reload of the DB."""
    # Bucket 512 is not tuned itself.
    jit.ONLINE.attempted.add((SPEC.name, CPU.slug, _key(512)))
    with settings.override(jit="sync", jit_trials=6):
        portable_nearby = _served(300)
        tuned = _served(200)
        # Bucket 512 resolved before the tune; one bucket away, it now borrows the online winner.
        assert _served(300) == tuned != portable_nearby == PORTABLE
        assert DISPATCHER.table(CPU).exact[(SPEC.name, _key(256))].config == SPEC.space.parse(tuned)


@pytest.mark.interpreter
def test_online_tunes_of_one_process_share_one_bench(monkeypatch):
    """The device's own timer and bench are made once: a worker process is started once per process."""
    monkeypatch.setattr(tuner_jit, "TIMER", None)
    with settings.override(jit="sync", jit_trials=2):
        _served(200)
        _served(2000)
    assert len(_trials(256)) >= 2 and len(_trials(2048)) >= 2
    assert len(tuner_jit._benches) == 1


# ---- GPU tier ------------------------------------------------------------------------------------


def _decode_case(lmax: int, batch: int = 1):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, 8, lmax, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, 8, lmax, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, torch.full((batch,), lmax, device="cuda", dtype=torch.int32)


def _decode_key(q, k, v, kv_len) -> tuple:
    from tritune.kernels.decode.kernel import KERNEL

    return KERNEL, KERNEL.key_for(device_info(q.device), tuple(KERNEL.facts(q, k, v, kv_len)))


@pytest.mark.gpu
def test_gpu_capture_never_tunes_and_the_next_eager_call_does(monkeypatch):
    from tritune.kernels import decode_attention

    monkeypatch.setattr(tuner_jit, "TIMER", None)
    monkeypatch.setattr(tuner_jit, "ISOLATE", True)
    q, k, v, kv_len = _decode_case(4096)
    kernel, key = _decode_key(q, k, v, kv_len)
    out = torch.empty_like(q)
    with settings.override(jit="sync", jit_trials=4, jit_key_seconds=30.0):
        # Compiled outside the capture; pinned, so this call is no miss.
        with use_config(kernel.name, kernel.space.to_dict(kernel.default_config(key))):
            decode_attention(q, k, v, kv_len, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_attention(q, k, v, kv_len, out=out)
        graph.replay()
        torch.cuda.synchronize()
        assert not jit.ONLINE.attempted and _winner_of(kernel, key) is None
        decode_attention(q, k, v, kv_len, out=out)
    assert (kernel.name, device_info(q.device).slug, key) in jit.ONLINE.attempted
    assert _winner_of(kernel, key) is not None


def _winner_of(spec, key):
    with ConfigStore(settings.settings().db_url) as store:
        found = [w for w in store.winners(kernel=spec.name) if w.key == key.to_dict()]
    return found[0] if found else None


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize(("lmax", "batch"), [(16384, 1), (32768, 8)], ids=["B1-16K", "B8-32K"])
def test_gpu_online_tune_against_offline_tune(tmp_path, monkeypatch, lmax, batch):
    """The evidence run: seconds one online tune of a decode key takes with the default budget, and the
    speedup it reaches against ``tune``'s default 40 trials on the same key (printed; ``-s`` shows it)."""
    from tritune.kernels import decode_attention
    from tritune.tuner.study import KeyTuner, TuneOptions
    from tritune.tuner.timing import GpuTimer

    monkeypatch.setattr(tuner_jit, "TIMER", None)
    monkeypatch.setattr(tuner_jit, "ISOLATE", True)
    q, k, v, kv_len = _decode_case(lmax, batch)
    kernel, key = _decode_key(q, k, v, kv_len)
    with settings.override(jit="sync"):
        current = settings.settings()
        started = time.monotonic()
        decode_attention(q, k, v, kv_len)
        online_s = time.monotonic() - started
        online = _winner_of(kernel, key)
    assert online is not None
    offline_url = f"sqlite:///{tmp_path / 'offline.sqlite'}"
    info = device_info(q.device)
    with ConfigStore(offline_url) as store:
        started = time.monotonic()
        offline = KeyTuner(kernel, key, info, q.device, store, environment_id(store, info), GpuTimer(),
                           TuneOptions(trials=40, isolate=True)).run()  # fmt: skip
        offline_s = time.monotonic() - started
    print(
        f"\n{kernel.name} B={batch} L={lmax}: online {online.speedup:.3f}x in {online_s:.1f} s "
        f"({online.trials} trials, budget {current.jit_trials} trials / {current.jit_key_seconds:g} s); "
        f"offline {offline.speedup:.3f}x in {offline_s:.1f} s ({offline.measured + offline.reused} trials)"
    )
    # Both gated and timed the same way: neither may be slower than the portable default.
    assert online.speedup >= 1.0 and offline.speedup >= 1.0


@pytest.mark.interpreter
def test_a_dead_worker_is_reported_once_and_no_more_keys_are_handed_out(monkeypatch, caplog):
    monkeypatch.setattr(jit_background, "WORKER_ARGS", ["--no-such-option"])
    with settings.override(jit="background"), caplog.at_level(logging.WARNING, logger="tritune.jit"):
        assert _served(200) == PORTABLE
        deadline = time.monotonic() + 60
        while jit.ONLINE.stopped is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _served(4000) == PORTABLE
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "exited with code 2" in warnings[0], warnings
    assert jit.ONLINE.attempted == {(SPEC.name, CPU.slug, _key(256))}


@pytest.mark.interpreter
def test_two_keys_tuned_online_at_once_each_time_their_own_problem(monkeypatch):
    """Sync misses of two threads share the process's bench; each tune holds it whole, so no trial
    of one key runs on the other key's open problem."""
    from tritune.tuner import candidates

    wrong: list[int] = []
    trial = candidates.CandidateBench.trial

    def checked(self, config, compiled):
        if self.key.n_bucket != threading.current_thread().wanted:
            wrong.append(threading.current_thread().wanted)
        time.sleep(0.005)  # let the other thread in, where nothing holds it out
        return trial(self, config, compiled)

    monkeypatch.setattr(candidates.CandidateBench, "trial", checked)
    results = {}

    def tune(n_bucket):
        threading.current_thread().wanted = n_bucket
        results[n_bucket] = tuner_jit.tune_one_key(
            SPEC, "cpu", _key(n_bucket), trials=4, seconds=60.0, db_url=settings.settings().db_url
        )

    threads = [threading.Thread(target=tune, args=(n,)) for n in (64, 1024)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert {n: r.outcome for n, r in results.items()} == {64: tuner_jit.TUNED, 1024: tuner_jit.TUNED}
    assert wrong == []
