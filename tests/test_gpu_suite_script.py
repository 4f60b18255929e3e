"""``scripts/gpu_suite.sh``'s stages, driven by a stand-in ``python`` (nothing real runs).

The ``tests`` stage shards the attention files and then ``tests/test_q4k.py`` by the test ids that
collection lists. When collection lists none (an import error, hidden by its ``2>/dev/null``), a
shard must not become a bare ``pytest``, which would run the whole tests folder many times at once
on the GPU host: the files run whole instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_suite.sh"

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >>"$FAKE_PYTHON_CALLS"
if [[ "$*" == *--collect-only* ]]; then
  if [[ "$*" == *test_q4k.py* && "$*" != *--ignore=tests/test_q4k.py* ]]; then
    printf '%s' "$FAKE_COLLECTED"
  else
    printf '%s' "$FAKE_COLLECTED_OTHER"
  fi
fi
exit 0
"""

pytestmark = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ("bash", "timeout", "xargs", "awk", "tar")),
    reason="needs bash, coreutils timeout, xargs, awk and tar",
)


def _run_stage(
    tmp_path: Path, stage: str, collected: str = "", check: bool = False, other: str = "", **env_extra: str
) -> list[str]:
    """Run one stage of the script with the stand-in python; the command lines it was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_PYTHON_CALLS": str(calls),
        "FAKE_COLLECTED": collected,
        "FAKE_COLLECTED_OTHER": other,
        "TRITUNE_SUITE_WORK": str(tmp_path / "work"),
        "TRITUNE_SUITE_OUT": str(tmp_path / "out"),
        "TRITUNE_SUITE_RESUME": str(tmp_path / "resume"),
        **env_extra,
    }
    # ``check``: the stage must succeed. A tune stage cannot here: the stand-in writes no DB, which the
    # stage reports as a failure, so for those only the commands it ran are looked at.
    subprocess.run(["bash", str(SCRIPT), stage], env=env, cwd=ROOT, check=check, capture_output=True, timeout=60)
    return calls.read_text().splitlines() if calls.exists() else []


def _run_tests_stage(tmp_path: Path, collected: str, other: str = "") -> list[str]:
    runs = _run_stage(tmp_path, "tests:60", collected, check=True, other=other)
    return [line for line in runs if "-m pytest" in line and "--collect-only" not in line]


def test_kernel_files_are_sharded_by_the_collected_ids(tmp_path):
    ids = "".join(f"tests/test_q4k.py::test_{i}[a-b]\n" for i in range(10))
    other = "".join(f"tests/test_prefill.py::test_{i}\n" for i in range(3))
    runs = _run_tests_stage(tmp_path, ids + "10 tests collected\n", other + "3 tests collected\n")
    q4k = [r for r in runs if "tests/test_q4k.py" in r]
    assert sorted(r.count("::") for r in q4k) == [1, 1, 1, 1, 1, 1, 2, 2]
    # Three attention ids over ten shards: three runs, none of them empty.
    attention = [r for r in runs if "tests/test_prefill.py" in r]
    assert len(attention) == 3 and len(runs) == 11


def test_nothing_collected_runs_the_files_whole_not_the_whole_folder(tmp_path):
    runs = _run_tests_stage(tmp_path, "")
    # The attention files and test_q4k.py, each group once; never a pytest without a file or test id.
    assert len(runs) == 2
    assert all(r.split()[-1].startswith("tests/test_") for r in runs), runs
    assert runs[-1].split()[-1] == "tests/test_q4k.py"
    assert "tests/test_prefill.py" in runs[0] and "tests/test_varlen_contract.py" in runs[0]


def test_gpu_tests_stage_runs_the_gpu_tier_with_q4k_sharded(tmp_path):
    ids = "".join(f"tests/test_q4k.py::test_gpu_{i}\n" for i in range(5))
    other = "".join(f"tests/test_jit.py::test_gpu_{i}\n" for i in range(4))
    calls = _run_stage(tmp_path, "gpu-tests:60", ids, check=True, other=other)
    runs = [r for r in calls if "-m pytest" in r and "--collect-only" not in r]
    # The attention files in three processes, each of the GPU tier and each file in exactly one.
    files = ("tests/test_prefill.py", "tests/test_decode", "tests/test_varlen.py")
    attention = [r for r in runs if "::" not in r and any(f in r for f in files)]
    assert len(attention) == 3 and all("-m gpu" in r for r in attention)
    for name in ("test_prefill.py", "test_decode.py", "test_decode_spec.py", "test_varlen.py"):
        assert sum(f"tests/{name}" in r.split() for r in attention) == 1, name
    # Every other GPU test: collected from the whole folder less the files the other runs take,
    # then sharded by id like the Q4_K file's.
    collect = [r for r in calls if "--collect-only" in r and "--ignore=tests/test_q4k.py" in r]
    assert len(collect) == 1 and "-m gpu" in collect[0] and " tests " in collect[0]
    for name in ("test_prefill.py", "test_decode.py", "test_varlen.py"):
        assert f"--ignore=tests/{name}" in collect[0]
    rest = [r for r in runs if " tests/test_jit.py::" in r]
    assert sorted(r.count("::") for r in rest) == [1, 1, 2]
    q4k = [r for r in runs if " tests/test_q4k.py::" in r]
    assert sorted(r.count("::") for r in q4k) == [1, 2, 2]
    assert all("-rf" in r and "--tb=short" in r for r in runs)


def test_gpu_tests_stage_fails_when_q4k_collects_nothing(tmp_path):
    with pytest.raises(subprocess.CalledProcessError):
        _run_stage(tmp_path, "gpu-tests:60", "", check=True)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    runs = [r for r in calls if "-m pytest" in r and "--collect-only" not in r]
    # The attention files ran, and the rest (whose collection listed nothing too) whole, so its log
    # says why; no shard ran without a test id.
    assert len(runs) == 4 and not any("::" in r for r in runs)
    assert sorted(r.split()[-1] for r in runs) == [
        "--ignore=tests/test_q4k.py", "tests/test_decode_spec.py", "tests/test_prefill.py", "tests/test_varlen.py"
    ]  # fmt: skip


def test_defaults_stage_tunes_each_kernel_over_its_default_keys(tmp_path):
    calls = _run_stage(tmp_path, "defaults:120", DEFAULTS_KERNELS="splitk_decode varlen_sdpa")
    tunes = [line for line in calls if "--kernel" in line and "export" not in line]
    assert [t.split("--kernel ")[1].split()[0] for t in tunes] == ["splitk_decode", "varlen_sdpa"]
    for tune in tunes:
        # No key options: the kernel's default keys; the default trial and time options.
        assert "--trials 16 --time-budget 8" in tune and "--head-dim" not in tune and "--batch" not in tune
        assert tune.split("--db ")[1].endswith("-defaults.sqlite")


@pytest.mark.parametrize(
    ("stage", "script", "kernel"),
    [
        ("bench-decode", "bench_decode.py", "splitk_decode"),
        ("bench-varlen", "bench_varlen.py", "varlen_sdpa"),
        ("bench-q4k", "bench_q4k.py", "q4k_fp8_gemm"),
    ],
)
def test_bench_stages_read_the_defaults_db(tmp_path, stage, script, kernel):
    work = tmp_path / "work"
    work.mkdir()
    (work / f"{kernel}-defaults.sqlite").write_bytes(b"")
    calls = _run_stage(tmp_path, f"{stage}:60", check=True)
    benches = [line for line in calls if f"scripts/{script}" in line]
    assert len(benches) == 1
    assert f"--db {work}/{kernel}-defaults.sqlite" in benches[0]


def test_results_are_packed_into_the_output_folder(tmp_path):
    _run_stage(tmp_path, "pytest:30", check=True, PYTEST_GPU_ARGS="tests/test_prefill.py")
    out = tmp_path / "out"
    assert sorted(path.name for path in out.iterdir()) == ["suite.tgz", "summary.log"]
    with tarfile.open(out / "suite.tgz") as archive:
        names = archive.getnames()
    assert "./pytest.log" in names and "./machine.log" in names


def test_defaults_stage_resumes_a_db_from_the_resume_folder(tmp_path):
    resume = tmp_path / "resume"
    resume.mkdir()
    (resume / "varlen_sdpa-defaults.sqlite").write_bytes(b"resumed")
    _run_stage(tmp_path, "defaults:60", DEFAULTS_KERNELS="varlen_sdpa")
    assert (tmp_path / "work" / "varlen_sdpa-defaults.sqlite").read_bytes() == b"resumed"


def test_sweep_stage_runs_one_sweep_per_entry(tmp_path):
    sweeps = (
        'q4k_fp8_gemm|q4k-a|{"m_bucket":16}|path=portable BLOCK_K=256|7;splitk_decode|decode-b|{"lkv_bucket":4096}||3'
    )
    calls = _run_stage(tmp_path, "sweep:60", check=True, SWEEPS=sweeps)
    runs = [line for line in calls if "scripts/sweep_configs.py" in line]
    assert len(runs) == 2
    first, second = runs
    assert "--kernel q4k_fp8_gemm" in first and "--where path=portable --where BLOCK_K=256" in first
    assert "--limit 7" in first and "-sweep-q4k-a-" in first
    assert "--kernel splitk_decode" in second and "--where" not in second and "-sweep-decode-b-" in second


def test_retune_stage_tunes_the_bundles_keys_then_compares(tmp_path):
    resume = tmp_path / "resume"
    resume.mkdir()
    (resume / "retune.sqlite").write_bytes(b"resumed")
    calls = _run_stage(tmp_path, "retune:200", RETUNE_KERNELS="splitk_decode tma_prefill")
    tunes = [line for line in calls if "--bundled" in line]
    assert [t.split("--kernel ")[1].split()[0] for t in tunes] == ["splitk_decode", "tma_prefill"]
    assert all("--trials 5 --time-budget 3" in t and t.endswith(f"--db {tmp_path}/work/retune.sqlite") for t in tunes)
    assert (tmp_path / "work" / "retune.sqlite").read_bytes() == b"resumed"
    # The DB exists (resumed), so its winners are exported and compared with the shipped bundle.
    [compare] = [line for line in calls if "scripts/compare_bundles.py" in line]
    assert compare.startswith("scripts/compare_bundles.py configs_db/bundles/") and "bundle-compare-" in compare
