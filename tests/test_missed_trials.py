"""``tune --missed`` and winners of truncated tunes: a key whose winner came of fewer trials than the
run's ``--trials`` (an online tune's short budget) is tuned again, and the plan says so."""

from __future__ import annotations

import json

import torch
import toy_kernel
import triton
from test_missed_undeclared import CPU, row

from tritune.configs_db.records import WinnerRecord
from tritune.tuner.missed import missed_plan

SPEC = toy_kernel.SPEC


def winner(n_bucket: int, trials: int) -> WinnerRecord:
    key = json.loads(row(SPEC.name, n_bucket, SPEC.version).key_json)
    return WinnerRecord(
        kernel=SPEC.name, kernel_version=SPEC.version, gpu=CPU.slug, key=key,
        config={"BLOCK": 64, "BROKEN": False, "num_warps": 4}, time_ms=1.0, portable_ms=2.0, speedup=2.0,
        trials=trials, triton_version=triton.__version__, torch_version=torch.__version__, tritune_version="0",
    )  # fmt: skip


def test_a_winner_of_fewer_trials_than_the_runs_budget_is_planned_again():
    rows = [row(SPEC.name, n, SPEC.version) for n in (256, 512, 1024)]
    winners = [winner(256, 1), winner(512, 40)]
    found = missed_plan([SPEC], CPU, rows, winners, declared=lambda name: True, trials=40)
    assert [key.n_bucket for _, key in found.plan] == [256, 1024]
    assert "1 logged key(s) already tuned under this Triton and torch left out" in found.notes
    assert "1 logged key(s) whose winner came of fewer than 40 trials (an online tune's) tuned again" in found.notes


def test_without_a_budget_every_current_winner_counts_as_complete():
    rows = [row(SPEC.name, n, SPEC.version) for n in (256, 1024)]
    found = missed_plan([SPEC], CPU, rows, [winner(256, 1)], declared=lambda name: True)
    assert [key.n_bucket for _, key in found.plan] == [1024]
