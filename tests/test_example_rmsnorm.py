"""``examples/rmsnorm.py`` end to end, as its docstring runs it: tuned into a DB by ``tune --kernel
examples/rmsnorm.py:RMSNORM``, served that winner by a fresh process, exported as a bundle, imported
into another DB (which names the declaration) and served from there.

The tune runs in this process on a fake timer that makes one config four times as fast as the
portable default, so the stored winner clears the serving margin whatever the interpreter's timings.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from tritune.configs_db.store import ConfigStore
from tritune.tuner import timing
from tritune.tuner.cli import app
from tritune.tuner.timing import FakeTimer

ROOT = Path(__file__).resolve().parent.parent
TARGET = "examples/rmsnorm.py:RMSNORM"
FASTEST = {"BLOCK_N": 64, "num_warps": 1}
runner = CliRunner(env={"COLUMNS": "250"})

#: A fresh process that imports the example as its docstring has users do, calls ``rms_norm`` and says what
#: served the call.
SERVE = """
import json, sys
import torch
sys.path.insert(0, "examples")
from rmsnorm import RMSNORM, rms_norm
from tritune.kernels.dispatcher import dispatch_config

x, weight = torch.randn(3, 64), torch.rand(64)
config = dispatch_config("example_rmsnorm", "cpu", -1, tuple(RMSNORM.facts(x, weight)))
error = float((rms_norm(x, weight).double() - RMSNORM.reference(x, weight, 1e-6)).abs().max())
print(json.dumps({"config": RMSNORM.space.to_dict(config), "error": error}))
"""


def fake_time(config: Any) -> float:
    """Four times faster at BLOCK_N=64 with one warp than the portable default (BLOCK_N=256, four warps)."""
    return 1.0 + abs(math.log2(config.BLOCK_N / 64)) + (config.num_warps != 1)


def fresh(*args: str, db: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "TRITON_INTERPRET": "1", "TRITUNE_DISABLE_BUNDLES": "1", "TRITUNE_DB": str(db)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300
    )


def served(db: Path) -> dict[str, Any]:
    child = fresh("-c", SERVE, db=db)
    assert child.returncode == 0, child.stderr[-3000:]
    result: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return result


def test_the_example_is_tuned_served_exported_and_imported(tmp_path, monkeypatch):
    tuned, imported, bundle = tmp_path / "tuned.sqlite", tmp_path / "imported.sqlite", tmp_path / "bundle.json"
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(timing, "timer_for", lambda device: FakeTimer(fake_time))
    # 24 trials cover the 24 configs: the sweep is exhaustive, so the fastest is found.
    args = ["--device", "cpu", "--kernel", TARGET, "--trials", "24", "--no-isolate", "--db", str(tuned)]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    winners = {w.key["n_bucket"]: w for w in ConfigStore(f"sqlite:///{tuned}").winners(kernel="example_rmsnorm")}
    assert sorted(winners) == [64, 256] and winners[64].config == FASTEST and winners[64].speedup > 3

    serving = served(tuned)
    assert serving["config"] == FASTEST and serving["error"] < 1e-5, serving

    exported = runner.invoke(app, ["export", "--gpu", "cpu-interpreter", "--db", str(tuned), "--out", str(bundle)])
    assert exported.exit_code == 0, exported.output
    assert {entry["kernel"] for entry in json.loads(bundle.read_text())["winners"]} == {"example_rmsnorm"}

    # A fresh process knows no such kernel until the declaration is named.
    tune = ["-c", "from tritune.tuner.entry import main; main()", "import", str(bundle), "--db", str(imported)]
    refused = fresh(*tune, db=imported)
    assert refused.returncode == 1 and "example_rmsnorm: unknown kernel (declare it: tune import --kernel" in (
        " ".join(refused.stdout.split())
    ), refused.stdout + refused.stderr
    accepted = fresh(*tune, "--kernel", TARGET, db=imported)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "imported 2 winner(s)" in accepted.stdout
    serving = served(imported)
    assert serving["config"] == FASTEST and serving["error"] < 1e-5, serving


def test_layouts_the_example_kernel_cannot_read_are_refused_by_name(monkeypatch):
    """The kernel reads ``weight`` and each row of ``out`` with stride 1: the declaration says so,
    so a strided weight or a transposed out is an error naming it, never a wrong result."""
    import pytest
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from rmsnorm import rms_norm

    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=r"^weight: the last dim must be contiguous"):
        rms_norm(x, torch.rand(128)[::2])
    with pytest.raises(ValueError, match=r"^out: expected a contiguous tensor"):
        rms_norm(x, torch.rand(64), out=torch.empty(64, 3).t())
    weight = torch.rand(64)
    expected = x.double() * torch.rsqrt(x.double().square().mean(-1, True) + 1e-6) * weight
    torch.testing.assert_close(rms_norm(x[:, :], weight).double(), expected, rtol=1e-5, atol=1e-5)


OPCHECK_FIRST = """
import sys, torch
sys.path.insert(0, "examples")
from rmsnorm import RMSNORM
x, weight = torch.randn(3, 64), torch.rand(64)
torch.library.opcheck(RMSNORM.op, (x, weight, 1e-6, torch.empty_like(x)), {"BLOCK_N": 64, "num_warps": 4})
print("opcheck ok")
"""


def test_the_op_runs_on_the_interpreter_before_any_eager_call():
    """The op's body readies the interpreter itself: ``opcheck`` (or a compiled graph) may be the
    process's first launch of the kernel."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", OPCHECK_FIRST], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "opcheck ok" in done.stdout, done.stderr[-2000:]
