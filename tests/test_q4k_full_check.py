"""The Q4_K gate at the timed size: past the reference check's 256 rows, each candidate is held to
its path's accuracy against the portable output, not only to the tuner's 5%-of-max|out| check."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import toy_kernel

from tritune.kernels import registry
from tritune.kernels.device import interpreter_device
from tritune.kernels.q4k.reference import check_against_portable
from tritune.tuner.candidates import consistency_problem
from tritune.tuner.local_bench import LocalBench


def _portable(rows: int = 512, cols: int = 256) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))


def _rows_off(portable: torch.Tensor, start: int, factor: float) -> torch.Tensor:
    """``portable`` with its rows from ``start`` on scaled by ``factor``: a tile bug past the check's rows."""
    out = portable.clone()
    out[start:] *= factor
    return out


def test_the_portable_output_and_a_close_one_pass():
    portable = _portable()
    noisy = portable + 0.005 * torch.randn_like(portable)
    for path in ("portable", "gemv", "dequant", "fp8", "staged"):
        assert check_against_portable(portable, portable, path) is None
        assert check_against_portable(noisy, portable, path) is None


def test_rows_past_the_check_that_drift_fail_an_accurate_path_the_generic_check_lets_through():
    portable = _portable()
    drifted = _rows_off(portable, 300, 1.04)
    assert consistency_problem(drifted, portable) is None
    assert "ggml" in check_against_portable(drifted, portable, "dequant")


def test_a_lossy_path_is_held_to_its_floor_less_one_db():
    portable = _portable()
    noise = torch.randn_like(portable) * portable.std()
    assert check_against_portable(portable + 0.03 * noise, portable, "fp8") is None  # about 30 dB
    assert "below the fp8 path" in check_against_portable(portable + 0.1 * noise, portable, "fp8")  # 20 dB


def test_nan_fails():
    portable = _portable()
    broken = portable.clone()
    broken[400, 3] = float("nan")
    assert check_against_portable(broken, portable, "portable") == "output contains NaN"


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")


def test_the_tuner_asks_the_kernels_check_at_the_timed_size(toy, monkeypatch):
    """A candidate that passes the reference check and the generic check still fails where the
    kernel's own check at the timed size refuses it."""
    spec = toy_kernel.SPEC
    device = interpreter_device()
    key = spec.default_keys(device)[0]
    default = spec.space.to_dict(spec.default_config(key))
    bench = LocalBench(torch.device("cpu"), toy_kernel.CostTimer())
    bench.open(spec, key, 0, default)
    candidate = {**default, "BLOCK": 64}
    assert bench.trial(candidate, compiled=False)["status"] == "ok"
    seen = []

    def refuse(out, portable, config):
        seen.append((tuple(out.shape), config))
        return "too far from the portable output"

    monkeypatch.setattr(spec, "check_full", refuse)
    outcome = bench.trial(candidate, compiled=False)
    bench.close()
    assert outcome["status"] != "ok" and "too far" in outcome["error"]
    assert seen and dataclasses.asdict(seen[0][1])["BLOCK"] == 64
