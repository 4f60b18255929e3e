"""``scripts/compare_bundles.py``: two bundles of one GPU compared key by key."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from tritune.configs_db.bundles import write_bundle
from tritune.configs_db.records import WinnerRecord

GPU = "nvidia-h200-sm90-132sm"
PROVENANCE = {"cuda": "13.0", "driver": "1", "torch": "2.11.0", "triton": "3.6.0", "tritune": "t"}
OLD = {"BLOCK": 64, "num_warps": 4}
NEW = {"BLOCK": 128, "num_warps": 8}


@pytest.fixture
def compare_bundles(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    import compare_bundles

    yield compare_bundles
    sys.modules.pop("compare_bundles", None)


def record(n: int, time_ms: float, config: dict) -> WinnerRecord:
    return WinnerRecord(
        kernel="toy_scale",
        kernel_version="0123456789abcdef",
        gpu=GPU,
        key={"arch": "sm90", "sm_count": 132, "dtype": "float32", "n_bucket": n},
        config=config,
        time_ms=time_ms,
        portable_ms=2.0,
        speedup=2.0 / time_ms,
        trials=4,
        triton_version="3.6.0",
        torch_version="2.11.0",
        tritune_version="t",
    )


def bundle(path: Path, *records: WinnerRecord) -> str:
    write_bundle(records, path, GPU, "NVIDIA H200", PROVENANCE)
    return str(path)


def test_moves_beyond_the_noise_are_listed(compare_bundles, tmp_path, capsys):
    before = bundle(tmp_path / "before.json", record(64, 1.0, OLD), record(128, 1.0, OLD), record(256, 1.0, OLD))
    after = bundle(
        tmp_path / "after.json",
        record(64, 1.02, OLD),  # within 3%: noise
        record(128, 1.05, OLD),  # same config, 5% slower
        record(256, 0.80, NEW),  # a new winner, 20% faster
        record(512, 0.50, NEW),  # a key only the re-tune holds
    )
    assert compare_bundles.main([before, after]) == 0
    out = capsys.readouterr().out
    assert "3 keys in both; 2 moved by more than 3%; 0 only before, 1 only after." in out
    assert "- toy_scale dtype=float32 n_bucket=128: 1.050 (same config)" in out
    assert "- toy_scale dtype=float32 n_bucket=256: 0.800 (new config)" in out
    assert "n_bucket=64:" not in out
    row = next(line for line in out.splitlines() if "n_bucket=256 |" in line)
    assert "BLOCK=128 num_warps=8" in row and row.endswith("| 0.800 | changed |")


def test_a_file_that_cannot_be_read_ends_the_script(compare_bundles, tmp_path, capsys):
    before = bundle(tmp_path / "before.json", record(64, 1.0, OLD))
    with pytest.raises(SystemExit) as stop:
        compare_bundles.main([before, str(tmp_path / "missing.json")])
    assert stop.value.code == 1
    assert "missing.json: cannot read" in capsys.readouterr().err


def test_noise_must_be_a_fraction(compare_bundles, tmp_path):
    before = bundle(tmp_path / "before.json", record(64, 1.0, OLD))
    with pytest.raises(SystemExit) as stop:
        compare_bundles.main([before, before, "--noise", "3"])
    assert stop.value.code == 2


def test_bundles_of_two_gpus_are_refused(compare_bundles, tmp_path, capsys):
    before = bundle(tmp_path / "before.json", record(64, 1.0, OLD))
    other = record(64, 1.0, OLD)
    h100 = "nvidia-h100-80gb-hbm3-sm90-132sm"
    after = tmp_path / "after.json"
    write_bundle([dataclasses.replace(other, gpu=h100)], after, h100, "NVIDIA H100", PROVENANCE)
    with pytest.raises(SystemExit) as stop:
        compare_bundles.main([before, str(after)])
    assert stop.value.code == 1
    assert "the bundles are of two GPUs" in capsys.readouterr().err
