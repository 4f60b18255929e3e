"""Real ``tune`` processes on one SQLite file: killed with SIGKILL and resumed, and three at once.

Each process runs :func:`drive`: the ``tune`` command line with the toy kernel registered and
:class:`toy_kernel.CostTimer` as its timer (deterministic times, no wall clock). Candidates run in
the command's worker process, as they do for a user. Nothing is shared with the test process but
the database file and a journal of the trials a run asked for.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest
import toy_kernel

from tritune.kernels.device import device_info

TESTS = Path(__file__).resolve().parent
CPU = device_info("cpu")
FEASIBLE = {tuple(toy_kernel.SPEC.space.to_dict(c).values()) for c in toy_kernel.SPEC.space.feasible(None, None)}
BEST = {"BLOCK": 128, "BROKEN": False, "num_warps": 2}
#: Generous bounds on how long a CPU tune of the toy kernel may take: only reached on failure.
RUN_LIMIT_S = 300.0


def drive() -> None:
    """Entry point of the ``tune`` processes below (``python -c "import ...; drive()" ARGS``).

    TOY_TIME_SCALE scales the fake times, TOY_HOLD_AFTER makes the worker hang after that many
    measurements (until the process is killed), TOY_TRIAL_JOURNAL names a file that receives one
    line per trial the command runs (in its worker or in-process), written before the trial runs.
    """
    from tritune.kernels import registry
    from tritune.tuner import cli, local_bench, timing, worker

    registry._SPECS["toy_scale"] = f"{toy_kernel.__name__}:SPEC"
    hold = os.environ.get("TOY_HOLD_AFTER")
    timer = toy_kernel.CostTimer(float(os.environ.get("TOY_TIME_SCALE", "1")), int(hold) if hold else None)
    # The command picks its timer when it runs: replace the interpreter's wall clock.
    timing.timer_for = lambda device: timer
    journal = os.environ.get("TOY_TRIAL_JOURNAL")
    if journal:
        for bench in (worker.Worker, local_bench.LocalBench):
            _journal_trials(bench, journal)
    sys.argv = ["tune", *sys.argv[1:]]
    cli.main()


def _journal_trials(bench: type, journal: str) -> None:
    trial, open_key = bench.trial, bench.open

    def opened(self, spec, key, seed, default):
        self.journal_key = key.to_dict()
        return open_key(self, spec, key, seed, default)

    def journaled(self, config, compiled):
        with open(journal, "a") as fh:
            fh.write(json.dumps({"key": self.journal_key, "config": config}) + "\n")
        return trial(self, config, compiled)

    bench.open, bench.trial = opened, journaled


def _start(tmp_path: Path, name: str, db: Path, *options: str, **env: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{name}.log"
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "TRITUNE_DISABLE_BUNDLES": "1",
        "TRITUNE_LOG_LEVEL": "INFO",
        **env,
    }
    command = [
        sys.executable, "-c", f"import {__name__} as t; t.drive()",
        "--device", "cpu", "--kernel", "toy_scale", "--trials", "40", "--db", str(db), "--trial-timeout", "600",
        *options,
    ]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(
            command, env=environment, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return process, log


def _finish(process: subprocess.Popen, log: Path) -> None:
    try:
        code = process.wait(RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"tune did not finish in {RUN_LIMIT_S} s:\n{log.read_text()}")
    assert code == 0, log.read_text()


def _rows(db: Path) -> list[tuple[dict, dict, str, float | None, str | None]]:
    with closing(sqlite3.connect(db)) as connection:
        query = "SELECT key_json, config_json, status, time_ms, error FROM trials ORDER BY id"
        return [(json.loads(k), json.loads(c), s, t, e) for k, c, s, t, e in connection.execute(query)]


def _ok_count(db: Path) -> int:
    if not db.exists():
        # Not created yet (and connecting would create it).
        return 0
    try:
        with closing(sqlite3.connect(db, timeout=30)) as connection:
            return int(connection.execute("SELECT count(*) FROM trials WHERE status = 'ok'").fetchone()[0])
    except sqlite3.OperationalError:
        # Its schema is not written yet.
        return 0


def _session_members(session: int) -> list[int]:
    """Live (not zombie) processes of a session: the killed command and any worker it left."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        state, session_id = fields[0], int(fields[3])
        if session_id == session and state != "Z":
            members.append(int(entry.name))
    return members


def _ident(config: dict) -> tuple:
    return tuple(config[name] for name in toy_kernel.SPEC.space.dimensions)


def test_kill_9_mid_study_then_resume(tmp_path):
    db = tmp_path / "tune.sqlite"
    held_after = 5
    first, first_log = _start(tmp_path, "first", db, TOY_HOLD_AFTER=str(held_after))
    try:
        # The worker hangs in its sixth measurement, so the study cannot end before the kill.
        deadline = time.monotonic() + RUN_LIMIT_S
        while _ok_count(db) < held_after:
            assert first.poll() is None, first_log.read_text()
            assert time.monotonic() < deadline, first_log.read_text()
            time.sleep(0.2)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        # The orphaned worker notices its parent is gone and exits by itself.
        deadline = time.monotonic() + 60
        while _session_members(first.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _session_members(first.pid) == [], "the worker outlived the killed tune"
    finally:
        for pid in _session_members(first.pid):
            os.kill(pid, signal.SIGKILL)

    with closing(sqlite3.connect(db)) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    before = _rows(db)
    measured = [row for row in before if row[2] == "ok"]
    assert len(measured) == held_after
    assert all(time_ms == toy_kernel.toy_cost(toy_kernel.ToyConfig(**config)) for _, config, _, time_ms, _ in measured)

    # The resumed run may tune in-process: resuming is the tuner's business, and it saves a worker start-up.
    second, second_log = _start(
        tmp_path, "second", db, "--no-isolate", TOY_TRIAL_JOURNAL=str(tmp_path / "second.jsonl")
    )
    _finish(second, second_log)

    after = _rows(db)
    assert after[: len(before)] == before, "a stored trial changed"
    recorded = {(json.dumps(key, sort_keys=True), _ident(config)) for key, config, *_ in before}
    asked = [json.loads(line) for line in (tmp_path / "second.jsonl").read_text().splitlines()]
    assert asked, "the resumed tune measured nothing"
    again = [a for a in asked if (json.dumps(a["key"], sort_keys=True), _ident(a["config"])) in recorded]
    assert again == [], "the resumed tune measured a stored trial again"
    # The study completed: every feasible config of both keys stored once, one winner each.
    for n_bucket in (64, 256):
        configs = [_ident(config) for key, config, *_ in after if key["n_bucket"] == n_bucket]
        assert sorted(configs) == sorted(FEASIBLE)
    with closing(sqlite3.connect(db)) as connection:
        winners = [json.loads(c) for (c,) in connection.execute("SELECT config_json FROM winners")]
    assert winners == [BEST, BEST]


def test_three_tuners_on_one_database_lose_and_duplicate_nothing(tmp_path):
    db = tmp_path / "tune.sqlite"
    scales = (1.0, 1.25, 1.5)
    # In-process candidates: the database is the point here, and three fewer worker start-ups save CPU.
    runs = [
        _start(tmp_path, f"tuner{i}", db, "--no-isolate", TOY_TIME_SCALE=str(scale)) for i, scale in enumerate(scales)
    ]
    for process, log in runs:
        _finish(process, log)

    rows = _rows(db)
    for n_bucket in (64, 256):
        at_key = [row for row in rows if row[0]["n_bucket"] == n_bucket]
        configs = [_ident(config) for _, config, *_ in at_key]
        # Every feasible config once: none lost, none stored twice.
        assert sorted(configs) == sorted(FEASIBLE)
        for _, config, status, time_ms, _ in at_key:
            if status == "ok":
                cost = toy_kernel.toy_cost(toy_kernel.ToyConfig(**config))
                assert any(time_ms == pytest.approx(cost * scale) for scale in scales)
            else:
                assert status == "failed-correctness" and config["BROKEN"]
    with closing(sqlite3.connect(db)) as connection:
        winners = list(connection.execute("SELECT key_json, config_json, time_ms FROM winners ORDER BY key_json"))
    assert sorted(json.loads(k)["n_bucket"] for k, _, _ in winners) == [64, 256]
    for _, config, time_ms in winners:
        # Each tuner offered the best config at its own scale; the fastest offer stands.
        assert json.loads(config) == BEST
        assert time_ms == pytest.approx(toy_kernel.toy_cost(toy_kernel.ToyConfig(**BEST)) * min(scales))
