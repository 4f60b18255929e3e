"""The tune summary shows the winner the DB keeps: where a faster winner was stored before, the DB keeps
it and the summary says so, rather than naming this run's config as the stored winner."""

from __future__ import annotations

import pytest
import torch
import toy_kernel
import triton
from typer.testing import CliRunner

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import registry
from tritune.kernels.device import device_info
from tritune.tuner.cli import app
from tritune.tuner.study import KeyTuner, TuneOptions, environment_id

CPU = device_info("cpu")
runner = CliRunner(env={"COLUMNS": "250"})
#: Faster than anything the toy kernel's cost model gives: no run beats it.
STORED = {"BLOCK": 16, "BROKEN": False, "num_warps": 1}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")


def _seed_fast_winner(url: str, n_bucket: int) -> dict[str, object]:
    key = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", n_bucket).to_dict()
    with ConfigStore(url) as store:
        record = WinnerRecord(
            kernel="toy_scale",
            kernel_version=toy_kernel.SPEC.version,
            gpu=CPU.slug,
            key=key,
            config=STORED,
            time_ms=0.01,
            portable_ms=0.5,
            speedup=50.0,
            trials=3,
            torch_version=torch.__version__,
            triton_version=triton.__version__,
            tritune_version="0",
        )
        env = store.environment(
            gpu=CPU.slug, torch_version=torch.__version__, triton_version=triton.__version__, tritune_version="0"
        )
        assert store.offer_winner(record, env)
    return key


def test_the_summary_shows_the_faster_winner_the_db_kept(toy, tmp_path):
    url = f"sqlite:///{tmp_path / 'c.sqlite'}"
    _seed_fast_winner(url, 64)
    result = runner.invoke(
        app, ["--device", "cpu", "--kernel", "toy_scale", "--trials", "4", "--no-isolate", "--db", url]
    )
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[2].strip(): line for line in result.output.splitlines() if "│ toy_scale" in line}
    kept = rows["dtype=float32 n_bucket=64"]
    # (The winner cell may wrap: its first line is checked.)
    assert "│ kept stored: BLOCK=16 " in kept
    assert "│ 0.01 (this run " in kept and "│ 0.5 " in kept and "│ 50.000x " in kept
    # The other key stored this run's winner, shown as before.
    assert "kept stored" not in rows["dtype=float32 n_bucket=256"]
    last = result.output.strip().splitlines()[-1]
    assert "winners of 1 key(s) stored in" in last
    assert last.endswith("; 1 key(s) kept a faster stored winner")
    winners = {w.key["n_bucket"]: w for w in ConfigStore(url).winners(gpu=CPU.slug, kernel="toy_scale")}
    assert winners[64].config == STORED and winners[64].time_ms == 0.01


def test_the_key_result_says_whether_the_offer_was_stored(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.sqlite'}"
    key_dict = _seed_fast_winner(url, 64)
    spec = toy_kernel.SPEC
    key = next(k for k in spec.default_keys(CPU) if k.to_dict() == key_dict)
    other = next(k for k in spec.default_keys(CPU) if k.to_dict() != key_dict)
    timer = toy_kernel.CostTimer()
    options = TuneOptions(trials=4, final_rounds=1)
    with ConfigStore(url) as store:
        env = environment_id(store, CPU)
        lost = KeyTuner(spec, key, CPU, torch.device("cpu"), store, env, timer, options).run()
        won = KeyTuner(spec, other, CPU, torch.device("cpu"), store, env, timer, options).run()
    assert not lost.stored
    assert lost.kept is not None and lost.kept.config == STORED and lost.kept.time_ms == 0.01
    assert won.stored and won.kept is None


def test_a_fleets_last_line_counts_the_keys_that_kept_a_faster_stored_winner(toy, tmp_path):
    url = f"sqlite:///{tmp_path / 'c.sqlite'}"
    _seed_fast_winner(url, 64)
    args = ["--device", "cpu", "--workers", "2", "--no-isolate", "--kernel", "toy_scale", "--trials", "3"]
    result = runner.invoke(app, [*args, "--db", url], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    last = result.output.strip().splitlines()[-1]
    assert "winners of 1 key(s) stored in" in last
    assert last.endswith("; 1 key(s) kept a faster stored winner")
