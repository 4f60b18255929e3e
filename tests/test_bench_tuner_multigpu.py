"""The ``multigpu`` part of ``scripts/bench_tuner.py`` and its ``gpu_suite.sh`` stage, on the CPU.

The part is meant for a host with two GPUs, which the CPU tier never has; these tests make sure
that a run on such a host does not fail on the script itself: the smoke run goes
end to end through the real ``tune`` command (``--device cpu`` against ``--device cpu --workers 2``),
the winners' re-timing runs on a pair of configs that differ, the utilization sampler and its
verdict are driven by a fake NVML, and the shell stage is checked for the command it runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


@pytest.fixture
def multigpu(monkeypatch):
    """The part's module, imported from ``scripts/`` as ``bench_tuner.py`` imports it."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import _tuner_multigpu

    return _tuner_multigpu


def _nvml_opens() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.slow
def test_smoke_run_reports_wall_times_utilization_and_winners(tmp_path):
    out, data_path = tmp_path / "report.md", tmp_path / "report.json"
    command = [
        sys.executable, str(SCRIPTS / "bench_tuner.py"), "--smoke", "--work", str(tmp_path / "work"),
        "--out", str(out), "--json", str(data_path), "multigpu",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    part = json.loads(data_path.read_text())["parts"]["multigpu"]
    failed = [c for c in part["data"].get("checks", []) if c["passed"] is False]
    assert done.returncode == 0, (failed, done.stderr[-3000:])
    assert part["status"] == "completed"
    data = part["data"]
    runs = data["runs"]
    assert [runs[label]["workers"] for label in ("one", "all")] == [1, 2]
    for label in ("one", "all"):
        assert runs[label]["exit_code"] == 0 and not runs[label]["timed_out"]
        assert runs[label]["wall_s"] > 0 and runs[label]["tune_done_s"] > 0
        # Each run compiles from its own empty Triton cache.
        assert runs[label]["triton_cache"] == str(tmp_path / "work" / f"multigpu-{label}" / "triton-cache")
    # Two interpreter workers shared the studies: the journal shows trials measured by both.
    assert len(runs["all"]["measured_by"]) == 2, runs["all"]["measured_by"]
    report = out.read_text()
    for label, device in (("one", "--device cpu --kernel"), ("all", "--device cpu --workers 2")):
        row = re.search(rf"^\| {label} \| `tune {device}[^`]*` \| \d \| ([0-9.]+) \| ([0-9.]+) \| 0 \|$", report, re.M)
        assert row is not None, report
        assert float(row.group(1)) == pytest.approx(runs[label]["wall_s"], abs=0.06)
    assert "GPU utilization (NVML" in report
    checks = {c["name"]: c for c in data["checks"]}
    busy = next(c for name, c in checks.items() if name.startswith("every GPU busy"))
    if _nvml_opens():
        assert "| run | GPU | name | samples |" in report
    else:
        assert report.count("NVML unavailable") >= 2
        assert busy["passed"] is None and busy["detail"].startswith("NVML unavailable")
    # One winner row and one verdict per planned key, none failed.
    keys = data["keys"]
    assert len(keys) == 3
    agree = [c for name, c in checks.items() if ": winners agree" in name]
    assert len(agree) == len(keys)
    assert all(c["passed"] is not False for c in agree), agree
    for item in keys:
        assert f"| {item['kernel']} | " in report
    assert checks["no key measured fewer configs with all GPUs"]["passed"] is True
    # Smoke times mean nothing: the speed-up is reported, not judged.
    speed = next(c for name, c in checks.items() if name.startswith("wall time with all GPUs"))
    assert speed["passed"] is None
    assert "Speed-up of all GPUs over one:" in report


def test_differing_winners_are_retimed_together(multigpu, tmp_path):
    from _tuner_common import Context

    from tritune.kernels.device import device_info
    from tritune.kernels.registry import get_spec
    from tritune.tuner.timing import timer_for

    spec = get_spec("splitk_decode")
    first, second = spec.default_keys(device_info(torch.device("cpu")), head_dims=[64], lkv=[64, 128])
    default = spec.space.to_dict(spec.default_config(first))
    other = {**default, "TARGET_WAVES": 4}
    args = argparse.Namespace(rounds=1, retime_seed=100, tolerance=0.02, trial_timeout=120.0, batch=None)
    ctx = Context(smoke=True, work=tmp_path, deadline=time.monotonic() + 300, args=args)
    t1, t2 = multigpu.tag(spec.name, first.to_dict()), multigpu.tag(spec.name, second.to_dict())
    data: dict[str, Any] = {
        "runs": {
            "one": {"winners": {t1: {"config": default, "ms": 1.0}, t2: {"config": default, "ms": 1.0}}},
            "all": {"winners": {t1: {"config": other, "ms": 1.0}}},
        }
    }
    checks = multigpu.winner_checks(ctx, [(spec, first), (spec, second)], data, timer_for(torch.device("cpu")))
    assert [c["passed"] for c in checks] == [None, False]
    assert "% apart" in checks[0]["detail"] and "not judged in smoke mode" in checks[0]["detail"]
    assert checks[1]["detail"] == "a winner is missing"
    times = data["compare"][t1]["retimed_ms"]
    assert len(times) == 2 and all(t > 0 for t in times)


def test_work_check_allows_the_budget_race_but_not_less_work(multigpu):
    a, b = multigpu.tag("k", {"x": 1}), multigpu.tag("k", {"x": 2})
    one = {"configs": {a: {"ok": 4}, b: {"ok": 3, "failed": 1}}}
    more = {"configs": {a: {"ok": 5}, b: {"ok": 4}}}
    verdict = multigpu.work_check(one, more, [a, b])
    assert verdict["passed"] is True
    assert verdict["detail"] == "8 configs with one GPU, 9 with all; differing: k x=1: 4 vs 5"
    less = {"configs": {a: {"ok": 4}, b: {"ok": 2}}}
    assert multigpu.work_check(one, less, [a, b])["passed"] is False
    assert multigpu.work_check(one, {"configs": {a: {"ok": 4}}}, [a, b])["passed"] is False


class FakeNvml(types.ModuleType):
    """pynvml with two GPUs at fixed utilizations."""

    def __init__(self, utilization: list[int]) -> None:
        super().__init__("pynvml")
        self.utilization = utilization
        self.open = 0

    def nvmlInit(self) -> None:
        self.open += 1

    def nvmlShutdown(self) -> None:
        self.open -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.utilization)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "Fake GPU"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return types.SimpleNamespace(gpu=self.utilization[handle], memory=0)


def _sampled(multigpu, monkeypatch, utilization: list[int]) -> dict[str, Any]:
    fake = FakeNvml(utilization)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with multigpu.UtilizationSampler(0.01) as sampler:
        time.sleep(0.15)
    assert fake.open == 0
    return sampler.summary()


def test_sampler_summarizes_every_gpu_and_the_busy_check_judges_them(multigpu, monkeypatch):
    alone = _sampled(multigpu, monkeypatch, [80, 0])
    assert alone["available"] and [g["gpu"] for g in alone["gpus"]] == ["nvml:0", "nvml:1"]
    first, second = alone["gpus"]
    assert first["samples"] >= 3 and first["mean"] == 80 and first["busy_share"] == 1.0
    assert second["mean"] == 0 and second["busy_share"] == 0.0
    both = _sampled(multigpu, monkeypatch, [70, 60])
    assert multigpu.busy_check(alone, both)["passed"] is True
    # One GPU idle while the other tunes: not what --device all promises.
    lopsided = _sampled(multigpu, monkeypatch, [90, 20])
    verdict = multigpu.busy_check(alone, lopsided)
    assert verdict["passed"] is False and "nvml:1 20%" in verdict["detail"]
    missing = {"available": False, "error": "NVMLError_LibraryNotFound"}
    assert multigpu.busy_check(missing, both)["passed"] is None


def test_sampler_without_nvml_reports_why(multigpu, monkeypatch):
    broken = types.ModuleType("pynvml")

    def fail() -> None:
        raise RuntimeError("no driver")

    broken.nvmlInit = fail  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    with multigpu.UtilizationSampler(0.01) as sampler:
        pass
    assert sampler.summary() == {"available": False, "error": "RuntimeError: no driver"}


FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >>"$FAKE_PYTHON_CALLS"
exit 0
"""


@pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ("bash", "timeout", "tar")), reason="needs bash, timeout and tar"
)
def test_gpu_suite_stage_runs_the_part_within_its_budget(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_PYTHON_CALLS": str(calls),
        "TRITUNE_SUITE_WORK": str(tmp_path / "work"),
        "TRITUNE_SUITE_OUT": str(tmp_path / "out"),
        "MULTIGPU_ARGS": "--multigpu-trials 30",
    }
    script = SCRIPTS / "gpu_suite.sh"
    subprocess.run(
        ["bash", str(script), "multigpu:300"], env=env, cwd=ROOT, check=True, capture_output=True, timeout=60
    )
    runs = [line.split() for line in calls.read_text().splitlines() if "bench_tuner.py" in line]
    assert len(runs) == 1
    argv = runs[0]
    assert argv[-1] == "multigpu"
    assert argv[argv.index("--budget") + 1] == "285" and argv[argv.index("--multigpu-cap") + 1] == "275"
    assert argv[argv.index("--multigpu-trials") + 1] == "30"
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = Path(argv[argv.index("--out") + 1])
    assert out.name == f"{today}-multigpu-unknown-gpu.md"
    assert Path(argv[argv.index("--json") + 1]).name == f"{today}-multigpu-unknown-gpu.json"
