"""Several workers on shared studies: the local coordinator, GPU models kept apart, resume, CLI checks.

Process tests run the real ``tune`` command through :func:`drive` (toy kernel registered, the
deterministic :class:`toy_kernel.CostTimer` as timer, candidates in-process with ``--no-isolate``
to save interpreter start-ups) and share nothing with the test process but files: the config DB,
the study storage and a journal of every trial a worker started. The PostgreSQL tests
(``test_distributed_postgres.py``) drive the same command.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
import toy_kernel
from optuna.trial import TrialState
from typer.testing import CliRunner

from tritune.configs_db.store import ConfigStore
from tritune.kernels import registry
from tritune.kernels.device import DeviceInfo, interpreter_device
from tritune.tuner import timing
from tritune.tuner.candidates import BenchError
from tritune.tuner.cli import app
from tritune.tuner.local_bench import LocalBench
from tritune.tuner.plan import KeySource
from tritune.tuner.shared import KeyBench, SharedKeyTuner, run_worker
from tritune.tuner.studies import Heartbeat, StudyStorage, summaries
from tritune.tuner.study import KeyTuner, TuneOptions, TuningError, environment_id

TESTS = Path(__file__).resolve().parent
FEASIBLE = sorted(tuple(toy_kernel.SPEC.space.to_dict(c).values()) for c in toy_kernel.SPEC.space.feasible(None, None))
BEST = {"BLOCK": 128, "BROKEN": False, "num_warps": 2}
#: Generous bound on one tune of the toy kernel: only reached on failure.
RUN_LIMIT_S = 300.0
runner = CliRunner(env={"COLUMNS": "250"})


# ---- what runs in the tune processes --------------------------------------------------------------


def drive() -> None:
    """Entry point of the ``tune`` processes (``python -c "import test_distributed as t; t.drive()" ARGS``).

    TOY_HOLD_AFTER: this process's timer hangs after that many measurements (until killed).
    TOY_VICTIM, TOY_VICTIM_HOLD: in a coordinator run, worker number TOY_VICTIM hangs after
    TOY_VICTIM_HOLD measurements. TOY_CRASH_WORKER: worker number TOY_CRASH_WORKER raises as it
    starts. TOY_TRIAL_JOURNAL: a file receiving one line per trial any
    process of the command starts, written before the trial runs.
    """
    from tritune.tuner import cli, fleet

    registry._SPECS["toy_scale"] = f"{toy_kernel.__name__}:SPEC"
    hold = os.environ.get("TOY_HOLD_AFTER")
    timer = toy_kernel.CostTimer(1.0, int(hold) if hold else None)
    # The command picks its timer when it runs (and hands it to its workers).
    timing.timer_for = lambda device: timer
    fleet.worker_process_main = worker_main
    _journal_trials("main")
    sys.argv = ["tune", *sys.argv[1:]]
    cli.main()


def worker_main(job: Any) -> None:
    """A coordinator's worker process: journaled, and the victim's timer hangs."""
    from tritune.tuner.fleet import worker_process_main

    if os.environ.get("TOY_CRASH_WORKER") == str(job.index):
        raise RuntimeError(f"worker {job.index} crashes as it starts (TOY_CRASH_WORKER)")
    victim = os.environ.get("TOY_VICTIM")
    if str(job.index) == victim:
        job = dataclasses.replace(job, timer=toy_kernel.CostTimer(1.0, int(os.environ["TOY_VICTIM_HOLD"])))
    elif victim is not None and os.environ.get("TOY_TRIAL_JOURNAL"):
        job = dataclasses.replace(job, timer=AfterVictimTimer(job.timer, os.environ["TOY_TRIAL_JOURNAL"], victim))
    _journal_trials(str(job.index))
    worker_process_main(job)


def lingering_worker(job: Any) -> None:
    """A coordinator's worker process that leaves a thread behind, as a compile pool may."""
    from tritune.tuner.fleet import worker_process_main

    toy_kernel.linger()
    worker_process_main(job)


class AfterVictimTimer:
    """The other workers' timer: it measures nothing before the victim has started a trial.

    Otherwise, on a loaded machine, the other workers can sweep both toy keys before the victim's
    process is up, and the victim never gets to hang in a trial.
    """

    def __init__(self, timer: Any, journal: str, victim: str) -> None:
        self.timer, self.journal, self.victim = timer, Path(journal), victim
        self.released = False

    def __call__(self, fn: Any, **kwargs: Any) -> float:
        deadline = time.monotonic() + RUN_LIMIT_S
        while not self.released and time.monotonic() < deadline:
            self.released = any(line["worker"] == self.victim for line in journal_lines(self.journal))
            if not self.released:
                time.sleep(0.1)
        return self.timer(fn, **kwargs)


def _journal_trials(worker: str) -> None:
    from tritune.tuner.local_bench import LocalBench

    journal = os.environ.get("TOY_TRIAL_JOURNAL")
    if not journal:
        return
    trial, open_key = LocalBench.trial, LocalBench.open

    def opened(self, spec, key, seed, default):
        self.journal_key = key.to_dict()
        return open_key(self, spec, key, seed, default)

    def journaled(self, config, compiled):
        line = {"worker": worker, "pid": os.getpid(), "key": self.journal_key, "config": config}
        with open(journal, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        return trial(self, config, compiled)

    LocalBench.open, LocalBench.trial = opened, journaled


# ---- helpers of the process tests (also used by the PostgreSQL tests) ----------------------------------


def start(tmp_path: Path, name: str, *args: str, **env: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{name}.log"
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "TRITUNE_DISABLE_BUNDLES": "1",
        "TRITUNE_LOG_LEVEL": "INFO",
        **env,
    }
    command = [sys.executable, "-c", f"import {__name__} as t; t.drive()", "--kernel", "toy_scale", *args]
    with log.open("w") as out:
        process = subprocess.Popen(
            command, env=environment, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return process, log


def finish(process: subprocess.Popen, log: Path, expected: int = 0) -> str:
    """Wait for a ``tune`` process (killed, and the test failed, past the limit); its output. Its exit
    status must be ``expected``."""
    try:
        code = process.wait(RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"tune did not finish in {RUN_LIMIT_S} s:\n{log.read_text()}")
    output = log.read_text()
    assert code == expected, output
    return output


def journal_lines(journal: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []


def ident(key: dict[str, Any], config: dict[str, Any]) -> tuple[int, tuple[Any, ...]]:
    return key["n_bucket"], tuple(config[name] for name in toy_kernel.SPEC.space.dimensions)


def wait_until_held(
    journal: Path, worker: str, measured: Callable[[], set[tuple[int, tuple[Any, ...]]]]
) -> dict[str, Any]:
    """The trial ``worker`` hangs in: its last journaled trial, still not stored after a while.

    ``measured()`` returns the (n_bucket, config) pairs stored so far.
    """
    deadline = time.monotonic() + RUN_LIMIT_S
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        mine = [line for line in journal_lines(journal) if line["worker"] == worker]
        if mine and mine[-1] != last:
            last, since = mine[-1], time.monotonic()
        elif (
            last is not None and time.monotonic() - since > 1.5 and ident(last["key"], last["config"]) not in measured()
        ):
            return last
        time.sleep(0.2)
    pytest.fail(f"worker {worker} never hung in a trial")


def check_trials_once(rows: list[tuple[dict[str, Any], dict[str, Any], str, float | None]]) -> None:
    """Every feasible config of both keys stored once, with the status its config calls for."""
    infeasible = {"BLOCK": 128, "num_warps": 1}
    assert all(config.items() >= infeasible.items() for _, config, status, _ in rows if status == "pruned")
    for n_bucket in (64, 256):
        at_key = [row for row in rows if row[0]["n_bucket"] == n_bucket and row[2] != "pruned"]
        assert sorted(ident(key, config)[1] for key, config, *_ in at_key) == FEASIBLE
        for _, config, status, time_ms in at_key:
            if config["BROKEN"]:
                assert status == "failed-correctness"
            else:
                assert status == "ok" and time_ms == pytest.approx(toy_kernel.toy_cost(toy_kernel.ToyConfig(**config)))


def check_measured_once(lines: list[dict[str, Any]], held: dict[str, Any]) -> None:
    """Each trial started once by the workers, but the held one: once more, by another worker."""
    started = collections.Counter(ident(line["key"], line["config"]) for line in lines)
    retried = ident(held["key"], held["config"])
    assert {pair: count for pair, count in started.items() if count != 1} == {retried: 2}
    again = [line for line in lines if ident(line["key"], line["config"]) == retried and line != held]
    assert again and again[0]["pid"] != held["pid"]


def _sqlite_rows(db: Path) -> list[tuple[dict[str, Any], dict[str, Any], str, float | None]]:
    if not db.exists():
        return []
    try:
        with closing(sqlite3.connect(db, timeout=30)) as connection:
            query = "SELECT key_json, config_json, status, time_ms FROM trials ORDER BY id"
            return [(json.loads(k), json.loads(c), s, t) for k, c, s, t in connection.execute(query)]
    except sqlite3.OperationalError:
        # Its schema is not written yet.
        return []


# ---- the local coordinator ------------------------------------------------------------------------


def test_three_local_workers_share_the_studies_and_retry_a_killed_one(tmp_path):
    db, studies, journal = tmp_path / "tune.sqlite", tmp_path / "studies.log", tmp_path / "trials.jsonl"
    process, log = start(
        tmp_path, "fleet",
        "--device", "cpu", "--workers", "3", "--no-isolate", "--trials", "40",
        "--db", str(db), "--storage", str(studies),
        TOY_VICTIM="0", TOY_VICTIM_HOLD="1", TOY_TRIAL_JOURNAL=str(journal),
    )  # fmt: skip
    try:
        held = wait_until_held(journal, "0", lambda: {ident(k, c) for k, c, *_ in _sqlite_rows(db)})
        os.kill(held["pid"], signal.SIGKILL)
        # The other workers finish its keys, but a worker died: the command fails.
        output = finish(process, log, expected=1)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    assert f"worker cpu#0 (pid {held['pid']}) exited with code -9" in output
    assert "handed to the other workers" in output
    assert "1 worker(s) died" in output and "not finalized" not in output
    check_measured_once(journal_lines(journal), held)
    check_trials_once(_sqlite_rows(db))
    winners = ConfigStore(f"sqlite:///{db}").winners()
    assert sorted(w.key["n_bucket"] for w in winners) == [64, 256]
    assert all(w.config == BEST and w.gpu == "cpu-interpreter" for w in winners)

    rows = {row.key["n_bucket"]: row for row in summaries(StudyStorage(str(studies)))}
    held_key = held["key"]["n_bucket"]
    assert rows[held_key].counts["lost"] >= 1 and rows[held_key].counts["retried"] >= 1
    assert all(row.finalized is not None and row.finalized["config"] == BEST for row in rows.values())
    assert all(row.counts["running"] == 0 for row in rows.values())
    shown = runner.invoke(app, ["status", "--storage", str(studies)])
    assert shown.exit_code == 0, shown.output
    assert "n_bucket=64" in shown.output and "n_bucket=256" in shown.output


def test_a_worker_process_ends_as_soon_as_its_work_is_done(tmp_path, monkeypatch):
    """The coordinator waits for its workers' processes to end: a worker must not wait for its interpreter's
    exit, which joins the threads left behind (here one that sleeps for a minute and a half)."""
    from tritune.tuner import fleet

    monkeypatch.setattr(fleet, "worker_process_main", lingering_worker)
    job = fleet.WorkerJob(
        label="cpu#0", index=0, count=1, device="cpu", targets={}, keys=[],
        db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", where=StudyStorage(str(tmp_path / "studies.log")),
        options=TuneOptions(), timer=toy_kernel.CostTimer(),
    )  # fmt: skip
    started = time.monotonic()
    exits = fleet.run_fleet([job], [])
    elapsed = time.monotonic() - started
    assert [ended.exitcode for ended in exits] == [0]
    # Start-up (a fresh interpreter importing torch) is most of it.
    assert elapsed < toy_kernel.LINGER_S / 3, f"the worker process took {elapsed:.1f} s"
    assert (tmp_path / "db.sqlite").exists(), "the worker did its work"


# ---- in-process: GPU models, resume, options ---------------------------------------------------------


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")
    monkeypatch.setattr(timing, "timer_for", lambda device: toy_kernel.CostTimer())


def _fake_h200() -> DeviceInfo:
    return DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")


def test_gpu_models_are_tuned_in_their_own_studies(toy, tmp_path):
    import torch

    where = StudyStorage(str(tmp_path / "studies.log"))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    options = TuneOptions(trials=40, final_rounds=1)
    with ConfigStore(url) as store:
        # Two GPU models' workers on one storage and one DB (both run here on the interpreter).
        for device in (interpreter_device(), _fake_h200()):
            plan = [(toy_kernel.SPEC, key) for key in toy_kernel.SPEC.default_keys(device)]
            report = run_worker(
                plan,
                device=device,
                torch_device=torch.device("cpu"),
                store=store,
                env_id=environment_id(store, device),
                timer=toy_kernel.CostTimer(),
                options=options,
                where=where,
                worker=f"test:{device.slug}",
            )
            assert len(report.results) == 2 and not report.errors
        winners = store.winners()
    slugs = ("cpu-interpreter", "nvidia-h200-sm90-132sm")
    assert sorted((w.gpu, w.key["n_bucket"]) for w in winners) == [(s, n) for s in slugs for n in (64, 256)]
    assert all(w.key["arch"] == ("sm90" if w.gpu == slugs[1] else "cpu-interpreter") for w in winners)
    studied = summaries(where)
    assert sorted((row.gpu, row.key["n_bucket"]) for row in studied) == sorted(
        (w.gpu, w.key["n_bucket"]) for w in winners
    )
    assert all(row.name.split(":")[3] == row.gpu for row in studied)
    assert [row.gpu for row in summaries(where, gpu=slugs[1])] == [slugs[1], slugs[1]]
    # Each GPU exports its own bundle.
    for slug in slugs:
        bundle = tmp_path / f"{slug}.json"
        exported = runner.invoke(app, ["export", "--gpu", slug, "--db", url, "--out", str(bundle)])
        assert exported.exit_code == 0, exported.output
        document = json.loads(bundle.read_text())
        assert document["gpu"] == slug and len(document["winners"]) == 2


def test_two_gpus_of_one_model_count_each_shared_study_once(toy, tmp_path, monkeypatch, capsys):
    """``tune --device 0,1`` on two GPUs of one model: both plan the same keys, so both workers join the same
    studies. The coordinator counted each study once per GPU and reported half of them as not finalized
    (the first two-H200 run: "10 key(s) were not finalized" with all 10 winners stored)."""
    import torch

    from tritune.kernels import device as device_module
    from tritune.tuner import cli, fleet

    h200 = _fake_h200()
    monkeypatch.setattr(device_module, "device_info", lambda torch_device: h200)

    released_from: list[list[str]] = []

    def run_here(jobs, study_names):
        """The fleet's workers one after the other in this process, each on the interpreter as an H200."""
        released_from.append(list(study_names))
        exits = []
        for job in jobs:
            plan = [(toy_kernel.SPEC, toy_kernel.SPEC.key_type.from_dict(key)) for _, key in job.keys]
            with ConfigStore(job.db_url) as store:
                run_worker(
                    plan, device=h200, torch_device=torch.device("cpu"), store=store,
                    env_id=environment_id(store, h200), timer=job.timer, options=job.options,
                    where=job.where, worker=f"test:{job.label}",
                )  # fmt: skip
            exits.append(fleet.WorkerExit(job, os.getpid(), 0))
        return exits

    monkeypatch.setattr(fleet, "run_fleet", run_here)
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    where = StudyStorage(str(tmp_path / "studies.log"))
    # Without an exception: the command exits 0.
    cli._tune_fleet(["0", "1"], ["toy_scale"], KeySource(), url, TuneOptions(trials=40, final_rounds=1), where, 10)

    output = " ".join(capsys.readouterr().out.split())
    assert [len(names) for names in released_from] == [2]
    assert "tuning 2 key(s) with 2 workers (cuda:0, cuda:1)" in output
    assert "not finalized" not in output
    assert sorted(w.key["n_bucket"] for w in ConfigStore(url).winners(gpu=h200.slug)) == [64, 256]


def test_shared_study_resumes_from_the_trials_table_and_finishes_once(toy, tmp_path):
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    studies = str(tmp_path / "studies.log")
    common = ["--device", "cpu", "--kernel", "toy_scale", "--trials", "40", "--db", db, "--no-isolate"]
    alone = runner.invoke(app, common, catch_exceptions=False)
    assert alone.exit_code == 0, alone.output
    stored = ConfigStore(db).study_trials(environment_id(ConfigStore(db), interpreter_device()), "toy_scale",
                                          toy_kernel.SPEC.version)  # fmt: skip

    # A shared study created after the fact starts from everything the trials table holds.
    shared = runner.invoke(app, [*common, "--storage", studies], catch_exceptions=False)
    assert shared.exit_code == 0, shared.output
    rows = summaries(StudyStorage(studies))
    assert len(rows) == 2
    for row in rows:
        assert row.counts["measured"] == 0 and row.counts["failed"] == 0, "a stored trial was measured again"
        assert row.counts["reused"] >= 11 and row.finalized is not None and row.finalized["config"] == BEST
    assert len(ConfigStore(db).study_trials(environment_id(ConfigStore(db), interpreter_device()), "toy_scale",
                                            toy_kernel.SPEC.version)) == len(stored)  # fmt: skip

    # Joining a finalized study again costs nothing.
    again = runner.invoke(app, [*common, "--storage", studies], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert "2 key(s) were already finalized" in again.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cpu,0"], "cannot share one run"),
        (["--device", "0", "--workers", "2"], "--workers N is for --device cpu"),
        (["--device", "cpu", "--worker"], "--worker joins shared studies"),
        (["--device", "cpu", "--worker", "--storage", "studies.log"], "a journal file has no heartbeats"),
        (["--device", "cpu,cpu", "--worker", "--storage", "sqlite:///s.db"], "--worker is one worker"),
        (["--device", "cpu", "--storage", "mysql://u@h/optuna"], "PostgreSQL, SQLite or a journal file"),
        (["--device", "cpu", "--storage", "sqlite:///same.db", "--db", "sqlite:///same.db"], "same database"),
        (["--device", "cpu", "--storage", "s.log", "--heartbeat-interval", "5", "--grace-period", "5"],
         "grace period must be longer"),
    ],
    ids=["mixed-devices", "workers-on-gpu", "worker-without-storage", "worker-on-journal", "worker-two-devices",
         "mysql", "storage-is-db", "grace-too-short"],
)  # fmt: skip
def test_options_that_do_not_fit_together(toy, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["--kernel", "toy_scale", *args])
    assert result.exit_code == 2, result.output
    # The message as one line, without the frame rich draws around it.
    assert message in " ".join(result.output.replace("│", " ").split()), result.output


def test_device_all_needs_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("GPUs are visible here")
    result = runner.invoke(app, ["--device", "all", "--db", str(tmp_path / "x.sqlite")])
    assert result.exit_code == 2
    assert "no CUDA GPU is visible" in " ".join(result.output.replace("│", " ").split())


def test_two_workers_racing_for_the_last_budget_slot_measure_one(toy, tmp_path):
    """Two workers that read the same spare budget and each ask a trial: the older trial keeps the
    slot and the newer is told as a duplicate, so the key's budget is never overshot by the race."""
    import torch

    device = interpreter_device()
    where = StudyStorage(str(tmp_path / "studies.log"))
    key = toy_kernel.SPEC.default_keys(device)[0]
    with ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        env = environment_id(store, device)
        # Nothing is measured yet: a budget of one trial is the single slot both workers ask for.
        tuners = [
            SharedKeyTuner(
                toy_kernel.SPEC, key, device, torch.device("cpu"), store, env, toy_kernel.CostTimer(),
                TuneOptions(trials=1, final_rounds=1), where=where,
                heartbeat=Heartbeat(where.open(), where, f"test:{name}"), worker=f"test:{name}",
            )
            for name in ("a", "b")
        ]  # fmt: skip
        default = toy_kernel.SPEC.default_config(key)
        studies = [tuner._join(default) for tuner in tuners]
        for tuner, study in zip(tuners, studies, strict=True):
            tuner.study = study
        asked = [tuner._ask(study) for tuner, study in zip(tuners, studies, strict=True)]
        trials = studies[0].get_trials(deepcopy=False)
        kept = [
            tuner._within_budget(study, trials, [(item, tuner.space.parse(item[0].params))], 1)
            for tuner, study, item in zip(tuners, studies, asked, strict=True)
        ]
    assert [len(k) for k in kept] == [1, 0], "the older trial keeps the single slot, the newer backs off"
    states = {t.number: t.state for t in studies[0].get_trials(deepcopy=False)}
    assert states[asked[1][0].number] == TrialState.PRUNED
    assert states[asked[0][0].number] == TrialState.RUNNING


# ---- a shared study samples as a lone tuner does --------------------------------------------------


class RecordingBench(LocalBench):
    """The in-process bench, remembering the configs it measured (in order) and calling ``during`` at the first."""

    def __init__(self, during: Callable[[], None] | None = None) -> None:
        super().__init__(torch.device("cpu"), toy_kernel.CostTimer())
        self.measured: list[dict[str, Any]] = []
        self.during = during

    def trial(self, config: dict[str, Any], compiled: bool) -> Any:
        if self.during is not None:
            during, self.during = self.during, None
            during()
        self.measured.append(config)
        return super().trial(config, compiled)


def _shared_tuners(tmp_path: Path, store: ConfigStore, options: TuneOptions, names: tuple[str, ...]) -> list[Any]:
    device = interpreter_device()
    where = StudyStorage(str(tmp_path / "studies.log"))
    key = toy_kernel.SPEC.default_keys(device)[0]
    return [
        SharedKeyTuner(
            toy_kernel.SPEC, key, device, torch.device("cpu"), store, environment_id(store, device),
            toy_kernel.CostTimer(), options, where=where, heartbeat=Heartbeat(where.open(), where, f"test:{name}"),
            worker=f"test:{name}",
        )
        for name in names
    ]  # fmt: skip


def test_a_shared_study_starts_from_the_configs_a_lone_tuner_measures_first(toy, tmp_path, monkeypatch):
    """Portable default, the spec's starting configs and the seeded sample of feasible configs, in order."""
    start = [toy_kernel.ToyConfig(BLOCK=64, BROKEN=False, num_warps=1), toy_kernel.ToyConfig(16, False, 2)]
    monkeypatch.setattr(toy_kernel.SPEC, "starting_configs", lambda key, device: start)
    device = interpreter_device()
    key = toy_kernel.SPEC.default_keys(device)[0]
    options = TuneOptions(trials=9, batch=3, final_rounds=1)
    with ConfigStore(f"sqlite:///{tmp_path / 'alone.sqlite'}") as store:
        alone = RecordingBench()
        env = environment_id(store, device)
        KeyTuner(toy_kernel.SPEC, key, device, torch.device("cpu"), store, env, toy_kernel.CostTimer(), options,
                 bench=alone).run()  # fmt: skip
    with ConfigStore(f"sqlite:///{tmp_path / 'shared.sqlite'}") as store:
        (tuner,) = _shared_tuners(tmp_path, store, options, ("a",))
        study = tuner._join(toy_kernel.SPEC.default_config(key))
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    queued = [trial.system_attrs["fixed_params"] for trial in waiting]
    assert queued[:3] == [toy_kernel.SPEC.space.to_dict(c) for c in (toy_kernel.SPEC.default_config(key), *start)]
    # Then trials // 3 sampled feasible configs (those not queued already).
    assert len(queued) > 3 and alone.measured[: len(queued)] == queued


def test_a_worker_joining_later_adds_no_seeds_of_its_own(toy, tmp_path):
    """The seeds are fixed by the first worker: a nearest bucket's winner stored after it joined is not
    enqueued by a worker joining later (its seed would be asked before the climb's configs)."""
    import triton

    from tritune.configs_db.records import WinnerRecord
    from tritune.tuner.study import tritune_version

    options = TuneOptions(trials=9, batch=3, final_rounds=1)
    with ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        a, b = _shared_tuners(tmp_path, store, options, ("a", "b"))
        default = toy_kernel.SPEC.default_config(a.key)
        study = a._join(default)
        queued = [t.system_attrs["fixed_params"] for t in study.get_trials(states=(TrialState.WAITING,))]
        neighbour = toy_kernel.ToyKey(a.key.arch, a.key.sm_count, a.key.dtype, a.key.n_bucket * 2)
        chosen = {"BLOCK": 16, "BROKEN": False, "num_warps": 1}
        store.offer_winner(
            WinnerRecord(
                kernel=toy_kernel.SPEC.name, kernel_version=toy_kernel.SPEC.version, gpu=a.device.slug,
                key=neighbour.to_dict(), config=chosen, time_ms=1.0, portable_ms=2.0, speedup=2.0, trials=5,
                triton_version=triton.__version__, torch_version=torch.__version__,
                tritune_version=tritune_version(),
            ),
            a.env_id,
        )  # fmt: skip
        assert b.strategy.neighbour_winners(store.winners(kernel=toy_kernel.SPEC.name)) == [chosen]
        joined = b._join(default)
        after = [t.system_attrs["fixed_params"] for t in joined.get_trials(states=(TrialState.WAITING,))]
    assert after == queued


def _one_step(config: dict[str, Any], best: dict[str, Any]) -> bool:
    """Whether ``config`` is ``best`` with one field moved to the next choice."""
    moved = [name for name in best if config[name] != best[name]]
    if len(moved) != 1:
        return False
    options = list(toy_kernel.SPEC.space.dimensions[moved[0]])
    return abs(options.index(config[moved[0]]) - options.index(best[moved[0]])) == 1


def test_the_climb_keeps_its_share_when_another_worker_joins_mid_batch(toy, tmp_path):
    """Worker b joins while a's first batch runs. The exploration must stop at the polish share for all workers
    together, and the climb start, as in a lone tuner, once that many results are in, from the best of them.
    (Counting a's running trials as results instead, b spends the rest of the budget on TPE's proposals and the
    climb from the best config never runs.)"""
    options = TuneOptions(trials=8, batch=4, polish=0.5, final_rounds=1)
    with ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        a, b = _shared_tuners(tmp_path, store, options, ("a", "b"))
        visits = []
        bench_b = KeyBench(RecordingBench())
        bench_a = KeyBench(RecordingBench(during=lambda: visits.append(b.visit(bench_b))))
        first = a.visit(bench_a)
        again = b.visit(bench_b)
        rows = [row for row in store.measured_trials(a.env_id, "toy_scale", toy_kernel.SPEC.version, a.key_dict)
                if row.status != "pruned"]  # fmt: skip
    assert first.done and first.result is not None and again.done and again.finalized is not None
    assert len(rows) == 8, "the budget is spent"
    explored, climbed = rows[:4], rows[4:]
    best = min((row for row in explored if row.time_ms is not None), key=lambda row: row.time_ms).config
    assert all(_one_step(row.config, best) for row in climbed), [row.config for row in climbed]


def test_of_two_workers_holding_one_config_exactly_one_measures_it(toy, tmp_path):
    """Two workers' running trials of one config (a seed, and a proposal of the same config), each worker
    looking at the study before the other tells its trial. If each left the config to the other, nobody would
    measure it, and for the portable default the key would fail ("the portable default failed (None)"; about
    once in a hundred simulated two-worker tunes of tma_prefill without the start-time rule)."""
    options = TuneOptions(trials=8, batch=4, final_rounds=1)
    with ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        a, b = _shared_tuners(tmp_path, store, options, ("a", "b"))
        default = toy_kernel.SPEC.default_config(a.key)
        a.study = a._join(default)
        b.study = b._join(default)
        seeds = a.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        held = [a._ask(a.study) for _ in seeds]
        # The default was the first seed; b's trial of it comes from the queue too (as a stand-in would).
        assert held[0][0].params == toy_kernel.SPEC.space.to_dict(default)
        b.study.enqueue_trial(toy_kernel.SPEC.space.to_dict(default))
        copy = b._ask(b.study)
        measured_b = []
        refresh = a.known.refresh

        def b_looks_meanwhile() -> None:
            # Called by a's _sort_out right after it read the study: b reads it before a tells anything.
            refresh()
            if not measured_b:
                measured_b.append(b._sort_out(b.study, [copy], options.trials)[0])

        a.known.refresh = b_looks_meanwhile
        measured_a, _ = a._sort_out(a.study, held[:1], options.trials)
    assert [len(measured_a), len(measured_b[0])] == [1, 0], "the trial that started first keeps the config"


def test_workers_share_the_study_of_a_space_of_paths(toy, tmp_path):
    """A ``UnionSpace`` kernel on a shared study: each worker's proposals, claims and the stored trials name
    their path's fields only; the budget is spent once over both workers and one winner is offered."""
    spec = toy_kernel.PATHS
    device = interpreter_device()
    where = StudyStorage(str(tmp_path / "studies.log"))
    key = spec.default_keys(device)[0]
    options = TuneOptions(trials=8, batch=2, final_rounds=1)
    with ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        env = environment_id(store, device)
        a, b = (
            SharedKeyTuner(
                spec, key, device, torch.device("cpu"), store, env, toy_kernel.CostTimer(), options, where=where,
                heartbeat=Heartbeat(where.open(), where, f"test:{name}"), worker=f"test:{name}",
            )
            for name in ("a", "b")
        )  # fmt: skip
        visits = []
        bench_b = KeyBench(RecordingBench())
        bench_a = KeyBench(RecordingBench(during=lambda: visits.append(b.visit(bench_b))))
        first = a.visit(bench_a)
        again = b.visit(bench_b)
        stored = store.measured_trials(env, spec.name, spec.version, a.key_dict)
        rows = [row for row in stored if row.status != "pruned"]
        winners = store.winners(kernel=spec.name)
    assert first.done and again.done and (first.result is None) != (again.result is None)
    assert len(rows) == 8 and len({str(sorted(row.config.items())) for row in rows}) == 8
    assert all(spec.space.to_dict(spec.space.parse(row.config)) == row.config for row in rows)
    assert len(bench_a.bench.measured) + len(bench_b.bench.measured) == 8, "a config measured twice"
    assert len(winners) == 1 and spec.space.parse(winners[0].config) is not None


class SlowCostTimer(toy_kernel.CostTimer):
    """The toy's fake times, each taking a tenth of a second to measure."""

    def __call__(self, fn: Any, **kwargs: Any) -> float:
        time.sleep(0.1)
        return super().__call__(fn, **kwargs)


def test_a_shared_keys_time_budget_counts_over_all_its_visits(toy, tmp_path):
    """A worker that stops on the time budget while another worker's trial still runs comes back to
    the key; it then only waits for that trial, measuring nothing more (the budget is the key's)."""
    from tritune.tuner import journal
    from tritune.tuner.studies import WORKER_ATTR

    options = TuneOptions(trials=15, time_budget_s=0.4, batch=2, final_rounds=1, time_peer=False, compile_workers=1)
    with ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        (tuner,) = _shared_tuners(tmp_path, store, options, ("a",))
        tuner.timer = SlowCostTimer()
        default = toy_kernel.SPEC.default_config(tuner.key)
        tuner.study = tuner._join(default)
        other = journal.Presence(tmp_path / "studies.log", "test:b")  # another worker, alive
        running = tuner.study.ask(tuner.known.distributions)
        running.set_user_attr(WORKER_ATTR, "test:b")  # its trial, never finished here
        bench = KeyBench(LocalBench(torch.device("cpu"), tuner.timer))
        first = tuner.visit(bench)
        # 0.1 s a trial against 0.4 s: the budget stops the visit (the portable default is the
        # other worker's, running, so nothing waits on it here); the exploration share would be 10.
        assert not first.done and 0 < first.measured <= 6
        again = tuner.visit(bench)
        assert not again.done and again.measured == 0
        del other


def test_an_rdb_shared_trial_never_signed_is_released_after_the_grace_period(toy, tmp_path):
    """A worker killed between asking a trial and signing it leaves a running trial with no
    heartbeat: once older than the grace period it is released, and the key finishes."""
    device = interpreter_device()
    where = StudyStorage(f"sqlite:///{tmp_path / 'studies.sqlite'}", heartbeat_interval_s=1, grace_period_s=2)
    options = TuneOptions(trials=4, batch=2, final_rounds=1, time_peer=False, compile_workers=1)
    with ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        key = toy_kernel.SPEC.default_keys(device)[0]

        def tuner(name: str) -> Any:
            return SharedKeyTuner(
                toy_kernel.SPEC, key, device, torch.device("cpu"), store, environment_id(store, device),
                toy_kernel.CostTimer(), options, where=where, heartbeat=Heartbeat(where.open(), where, name),
                worker=name,
            )  # fmt: skip

        dead = tuner("test:dead")
        dead.study = dead._join(toy_kernel.SPEC.default_config(key))
        dead.study.ask(dead.known.distributions)  # asked, then the worker is gone before signing it
        time.sleep(2.5)
        visit = tuner("test:live").visit(KeyBench(LocalBench(torch.device("cpu"), toy_kernel.CostTimer())))
        assert visit.done


class FailingSetupBench(RecordingBench):
    """A worker's bench that measures, then cannot set the problem up again (say, its GPU ran out of memory)."""

    def open(self, *args: Any, **kwargs: Any) -> None:
        if self.measured:
            raise BenchError("out of memory")
        super().open(*args, **kwargs)


def test_a_workers_own_setup_failure_while_finalizing_does_not_fail_the_key_for_the_others(toy, tmp_path):
    """Only outcomes of the study (the portable default failed) are written as its error; a worker that
    cannot rebuild the problem itself fails alone, and the next worker finalizes the key."""
    options = TuneOptions(trials=4, batch=2, final_rounds=1, time_peer=False, compile_workers=1)
    with ConfigStore(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        a, b = _shared_tuners(tmp_path, store, options, ("a", "b"))
        bench_a = KeyBench(FailingSetupBench())
        # Another key opened in between makes the finalize rebuild this key's problem.
        bench_a._open = None
        real_explore = a._explore

        def explore_then_forget(*args: Any) -> Any:
            outcome = real_explore(*args)
            bench_a._open = None
            return outcome

        a._explore = explore_then_forget
        with pytest.raises(TuningError, match="cannot set up the problem"):
            a.visit(bench_a)
        assert bench_a.bench.measured, "worker a measured nothing before finalizing"
        visit = b.visit(KeyBench(RecordingBench()))
        winners = store.winners(kernel=toy_kernel.SPEC.name)
    assert visit.done and visit.result is not None
    assert len(winners) == 1
