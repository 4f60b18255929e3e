"""``tune --missed`` without ``--kernel``: logged keys of a user's kernel, not declared in this process,
are counted and named with what declares it, instead of being taken for no misses at all."""

from __future__ import annotations

from datetime import datetime, timezone

import torch
import toy_kernel
import triton
from typer.testing import CliRunner

from tritune.configs_db import misses as miss_store
from tritune.configs_db.store import ConfigStore
from tritune.kernels.device import interpreter_device
from tritune.tuner.cli import app
from tritune.tuner.missed import missed_plan

CPU = interpreter_device()


def row(kernel: str, n_bucket: int, version: str = "v1") -> miss_store.MissRecord:
    now = datetime.now(timezone.utc)
    key = f'{{"arch":"{CPU.arch}","dtype":"float32","n_bucket":{n_bucket},"sm_count":{CPU.sm_count}}}'
    return miss_store.MissRecord(
        gpu=CPU.slug,
        kernel=kernel,
        kernel_version=version,
        key_json=key,
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        count=3,
        first_seen=now,
        last_seen=now,
    )


def test_the_plan_counts_the_rows_of_kernels_not_declared_here():
    spec = toy_kernel.SPEC
    rows = [row(spec.name, 512, spec.version), row("user_softmax_x", 128), row("user_softmax_x", 256)]
    found = missed_plan([spec], CPU, rows, [], declared=lambda name: name == spec.name)
    assert [key.n_bucket for _, key in found.plan] == [512]
    assert found.undeclared == {"user_softmax_x": 2}
    assert (
        "2 logged key(s) of user_softmax_x, a kernel not declared here: add --kernel package.module:NAME "
        "(or path/to/file.py:NAME)" in found.notes
    )


def test_tune_missed_without_kernel_names_the_undeclared_kernels_logged(tmp_path):
    db = f"sqlite:///{tmp_path / 'm.sqlite'}"
    ConfigStore(db).close()
    assert miss_store.write_misses(db, [row("user_softmax_x", 128), row("user_softmax_x", 256)], timeout_s=10) == 2
    result = CliRunner().invoke(app, ["--device", "cpu", "--missed", "--db", db])
    assert result.exit_code == 1, result.output
    output = " ".join(result.output.split())
    assert "2 logged key(s) of user_softmax_x, a kernel not declared here: add --kernel package.module:NAME" in output
    assert "only of kernels not declared here (user_softmax_x)" in output
