"""The ``tune`` CLI through its entry function, on the toy kernel and on the real prefill kernel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import toy_kernel
from typer.testing import CliRunner

from tritune.configs_db.store import ConfigStore
from tritune.kernels import registry
from tritune.tuner.cli import app

runner = CliRunner(env={"COLUMNS": "250"})


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")


def _run(*args: str):
    result = runner.invoke(app, list(args), catch_exceptions=False)
    return result


def test_tune_show_export_import_round_trip(toy, tmp_path):
    db = f"sqlite:///{tmp_path / 'a.sqlite'}"
    result = _run("--device", "cpu", "--kernel", "toy_scale", "--trials", "8", "--db", db)
    assert result.exit_code == 0, result.output
    assert "Triton interpreter" in result.output
    assert "tuning summary" in result.output
    winners = ConfigStore(db).winners(gpu="cpu-interpreter", kernel="toy_scale")
    assert {w.key["n_bucket"] for w in winners} == {64, 256}

    shown = _run("show", "--db", db)
    assert shown.exit_code == 0 and "toy_scale" in shown.output

    bundle = tmp_path / "cpu-interpreter.json"
    exported = _run("export", "--gpu", "cpu-interpreter", "--db", db, "--out", str(bundle))
    assert exported.exit_code == 0, exported.output
    doc = json.loads(bundle.read_text())
    assert doc["gpu"] == "cpu-interpreter" and len(doc["winners"]) == 2

    other = f"sqlite:///{tmp_path / 'b.sqlite'}"
    imported = _run("import", str(bundle), "--db", other)
    assert imported.exit_code == 0, imported.output
    assert sorted((w.key["n_bucket"], tuple(w.config.items())) for w in ConfigStore(other).winners()) == sorted(
        (w.key["n_bucket"], tuple(w.config.items())) for w in winners
    )


def test_import_refuses_entries_outside_the_space(toy, tmp_path):
    db = f"sqlite:///{tmp_path / 'a.sqlite'}"
    assert _run("--device", "cpu", "--kernel", "toy_scale", "--trials", "4", "--db", db).exit_code == 0
    bundle = tmp_path / "b.json"
    assert _run("export", "--gpu", "cpu-interpreter", "--db", db, "--out", str(bundle)).exit_code == 0
    doc = json.loads(bundle.read_text())
    doc["winners"][0]["config"]["BLOCK"] = 48
    bundle.write_text(json.dumps(doc))
    other = f"sqlite:///{tmp_path / 'b.sqlite'}"
    result = _run("import", str(bundle), "--db", other)
    assert result.exit_code == 0
    assert "BLOCK=48 is not in the space" in result.output
    assert len(ConfigStore(other).winners()) == 1


def test_list_shows_spaces(toy):
    result = _run("list")
    assert result.exit_code == 0, result.output
    assert "toy_scale" in result.output and "BLOCK" in result.output


def test_list_shows_version_protocol_and_the_key_fields(toy):
    output = " ".join(_run("list").output.split())
    spec = toy_kernel.SPEC
    assert f"toy_scale (version {spec.version}, protocol 1, 24 configs before pruning)" in output
    assert "key: dtype (str), n_bucket (int); aliases: n -> n_bucket" in output
    assert "declared at toy_kernel:SPEC" in output


def test_list_shows_the_paths_of_a_space_of_paths(monkeypatch):
    monkeypatch.setitem(registry._SPECS, "toy_paths", f"{toy_kernel.__name__}:PATHS")
    output = _run("list").output
    table = output[output.index("toy_paths (version") :]
    rows = {line.split("│")[1].strip(): line for line in table.splitlines() if line.count("│") == 5}
    assert "narrow, wide" in rows["BLOCK"] and rows["BROKEN"].rstrip(" │").endswith("wide")


def test_key_option_tunes_the_keys_it_names(toy, tmp_path):
    db = f"sqlite:///{tmp_path / 'k.sqlite'}"
    args = ["--device", "cpu", "--kernel", "toy_scale", "--key", "n=100", "--trials", "3", "--no-isolate", "--db", db]
    result = _run(*args)
    assert result.exit_code == 0, result.output
    assert [w.key["n_bucket"] for w in ConfigStore(db).winners(kernel="toy_scale")] == [128]


def test_a_bad_key_option_is_a_usage_error_and_creates_no_db(toy, tmp_path):
    db = tmp_path / "k.sqlite"
    result = runner.invoke(app, ["--device", "cpu", "--kernel", "toy_scale", "--key", "n_bucket=x", "--db", str(db)])
    assert result.exit_code == 2
    assert "'x' is not an int" in " ".join(result.output.replace("│", " ").split())
    assert not db.exists()


def test_unknown_kernel_is_a_usage_error(tmp_path):
    result = runner.invoke(app, ["--device", "cpu", "--kernel", "nope", "--db", str(tmp_path / "x.sqlite")])
    assert result.exit_code == 2
    assert "nope" in result.output
    assert "path/to/file.py:NAME" in " ".join(result.output.replace("│", " ").split())


@pytest.mark.parametrize(
    ("target", "message"),
    [("missing/kernel.py:KERNEL", "no such file missing/kernel.py"), ("toy_kernel:NOTHING", "no kernel declaration")],
)
def test_a_declaration_that_is_not_there_is_a_usage_error(target, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["--device", "cpu", "--kernel", target, "--db", str(tmp_path / "x.sqlite")])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.replace("│", " ").split())


def test_option_that_does_not_apply(toy, tmp_path):
    result = runner.invoke(app, ["--device", "cpu", "--kernel", "toy_scale", "--lq", "64", "--db", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "--lq does not apply to kernel toy_scale" in result.output


def test_export_with_nothing_stored(tmp_path):
    ConfigStore(f"sqlite:///{tmp_path / 'x.sqlite'}").close()
    result = runner.invoke(app, ["export", "--gpu", "cpu-interpreter", "--db", str(tmp_path / "x.sqlite")])
    assert result.exit_code == 2
    assert "no winners" in result.output


@pytest.mark.slow
def test_full_tune_of_prefill_on_the_interpreter(tmp_path):
    """Tuning a real kernel end to end on the interpreter, into a temporary DB."""
    db = f"sqlite:///{tmp_path / 'p.sqlite'}"
    result = _run("--device", "cpu", "--kernel", "tma_prefill", "--trials", "4", "--db", db)
    assert result.exit_code == 0, result.output
    winners = ConfigStore(db).winners(gpu="cpu-interpreter", kernel="tma_prefill")
    assert winners and all(w.trials >= 1 and w.portable_ms > 0 for w in winners)


def test_a_kernel_the_keys_leave_nothing_valid_is_left_out_when_others_are_tuned(monkeypatch, tmp_path):
    """``--key dtype=int8``: the toy kernel accepts no such key; the space-of-paths toy, here without a
    ``valid_key`` rule, is tuned alone. With the toy kernel alone it is a usage error."""
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")
    monkeypatch.setitem(registry._SPECS, "toy_paths", f"{toy_kernel.__name__}:PATHS")
    monkeypatch.setattr(toy_kernel.PathsSpec, "valid_key", lambda self, key: True)
    db = f"sqlite:///{tmp_path / 'k.sqlite'}"
    common = ["--device", "cpu", "--key", "dtype=int8", "--key", "n_bucket=64", "--trials", "2", "--no-isolate"]
    both = _run(*common, "--kernel", "toy_scale", "--kernel", "toy_paths", "--db", db)
    assert both.exit_code == 0, both.output
    shown = " ".join(both.output.split())
    assert "no key of toy_scale remains valid with these values (dtype: the default keys hold float" in shown
    assert "): toy_scale is left out" in shown
    assert [w.kernel for w in ConfigStore(db).winners()] == ["toy_paths"]
    alone = runner.invoke(app, [*common, "--kernel", "toy_scale", "--db", db])
    assert alone.exit_code == 2 and "no key of toy_scale remains valid" in " ".join(alone.output.split())


# ---- the peer: timed by tune, stored, shown and benchmarked ----------------------------------------


@pytest.fixture
def peered(monkeypatch):
    """The toy kernel with ``torch.mul`` as its peer (declared in test_peer_tuner)."""
    monkeypatch.setitem(registry._SPECS, "toy_peered", "test_peer_tuner:PEERED")


def _table_rows(output: str, first: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in output.splitlines() if f"│ {first}" in line]


def test_bench_times_ours_and_the_peer_side_by_side(peered, toy):
    result = _run("bench", "--device", "cpu", "--kernel", "toy_peered", "--kernel", "toy_scale")
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "served config" in line)
    columns = [cell.strip() for cell in header.split("┃")[1:-1]]
    assert columns == [
        "kernel", "key", "served config", "portable ms", "ours ms", "peer", "peer ms", "vs peer",
        "host us", "eager vs peer",
    ]  # fmt: skip
    rows = _table_rows(result.output, "toy_peered")
    assert [row[1] for row in rows] == ["dtype=float32 n_bucket=64", "dtype=float32 n_bucket=256"]
    for row in rows:
        ours, peer_ms = float(row[4]), float(row[6])
        assert row[5] == "torch.mul" and peer_ms > 0
        assert row[7] == f"{peer_ms / ours:.2f}x"
        assert row[8:] == ["-", "-"], "no host timing on the interpreter"
    # A kernel that names no peer: its cells say so.
    assert all(row[5:] == ["-"] * 5 for row in _table_rows(result.output, "toy_scale"))


def test_show_prints_the_stored_peer_time_and_ratio(peered, tmp_path):
    db = f"sqlite:///{tmp_path / 'p.sqlite'}"
    result = _run("--device", "cpu", "--kernel", "toy_peered", "--key", "n=100", "--trials", "3", "--db", db)
    assert result.exit_code == 0, result.output
    (winner,) = ConfigStore(db).winners(kernel="toy_peered")
    assert winner.peer_name == "torch.mul" and winner.peer_ms > 0
    shown = _run("show", "--db", db, "--device", "cpu")
    assert shown.exit_code == 0, shown.output
    header = next(line for line in shown.output.splitlines() if "served here" in line)
    columns = [cell.strip() for cell in header.split("┃")[1:-1]]
    assert columns[-4:] == ["peer", "peer ms", "vs peer", "served here"]
    (row,) = _table_rows(shown.output, "cpu-interpreter")
    assert row[-4:-1] == ["torch.mul", f"{winner.peer_ms:.4g}", f"{winner.peer_ms / winner.time_ms:.2f}x"]


def test_bench_key_compares_eager_calls_with_the_host_time_of_each_side(peered):
    """Host times go into the eager ratio as ``max(GPU, host)`` per side, and their cells read in us."""
    import torch
    from test_peer_tuner import PEERED

    from tritune.kernels.device import device_info
    from tritune.tuner.tables import bench_cells, bench_key
    from tritune.tuner.timing import InterpreterTimer

    info = device_info("cpu")
    key = PEERED.default_keys(info)[0]
    timed = []

    def host(fn):
        fn()  # the callable really runs (a broken one would raise here)
        timed.append(fn)
        return 40.0  # ms: above both GPU times, so it decides both sides' eager cost

    row = bench_key(PEERED, key, info, torch.device("cpu"), InterpreterTimer(reps=1), 0, host)
    assert len(timed) == 2 and row.ours_host_ms == row.peer_host_ms == 40.0
    assert row.eager_ratio() == max(row.peer_ms, 40.0) / max(row.ours_ms, 40.0)
    assert bench_cells(row)[-2:] == ["40000.0 / 40000.0", f"{row.eager_ratio():.2f}x"]
    # Without host timings (the interpreter's CLI run) both cells are dashes.
    plain = bench_key(PEERED, key, info, torch.device("cpu"), InterpreterTimer(reps=1), 0)
    assert plain.eager_ratio() is None and bench_cells(plain)[-2:] == ["-", "-"]


def test_bench_times_a_public_call_that_neither_tunes_nor_logs_a_miss(monkeypatch, tmp_path):
    """tune bench calls a declared kernel as users do; with online tuning and the miss log on, that
    call must leave the DB as it was."""
    import sys

    import torch

    from tritune.kernels import misses, settings
    from tritune.kernels.device import device_info
    from tritune.tuner.tables import bench_key
    from tritune.tuner.timing import InterpreterTimer

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "examples"))
    rmsnorm = __import__("rmsnorm")
    fresh = misses.MissLog()
    monkeypatch.setattr(fresh, "_start", lambda: None)
    monkeypatch.setattr(misses, "MISSES", fresh)
    info = device_info("cpu")
    key = rmsnorm.RMSNORM.default_keys(info)[0]
    calls = []

    def host(fn):
        fn()
        calls.append(settings.settings().jit)
        return 1.0

    db = f"sqlite:///{tmp_path / 'bench.sqlite'}"
    with settings.override(jit="sync", miss_log=True, db_url=db):
        row = bench_key(rmsnorm.RMSNORM, key, info, torch.device("cpu"), InterpreterTimer(reps=1), 0, host)
        assert settings.settings().jit == "sync", "the override ends with the timing"
    assert calls == ["off"] and row.ours_host_ms == 1.0 and row.peer_host_ms is None
    assert not misses.pending() and not (tmp_path / "bench.sqlite").exists()
    sys.modules.pop("rmsnorm", None)


def test_bench_key_times_the_eager_alternative_that_eager_calls_get(peered, monkeypatch):
    """Where the winner has an eager alternative, the eager ratio uses that config's GPU time."""
    import torch
    from test_peer_tuner import PEERED

    from tritune.kernels.device import device_info
    from tritune.kernels.dispatcher import DISPATCHER, EagerChoice
    from tritune.tuner.tables import bench_key
    from tritune.tuner.timing import FakeTimer

    info = device_info("cpu")
    key = PEERED.default_keys(info)[0]
    winner = PEERED.space.parse({"BLOCK": 64, "BROKEN": False, "num_warps": 2})
    alternative = PEERED.space.parse({"BLOCK": 16, "BROKEN": False, "num_warps": 1})
    monkeypatch.setattr(DISPATCHER, "choose", lambda *a, **k: EagerChoice(winner, alternative))
    cost = {winner: 1.0, alternative: 3.0}
    timer = FakeTimer(lambda config: cost.get(config, 0.5))
    row = bench_key(PEERED, key, info, torch.device("cpu"), timer, 0, lambda fn: 2.0)
    assert row.ours_ms == 1.0 and row.ours_eager_ms == 3.0
    assert row.eager_ratio() == max(row.peer_ms, 2.0) / 3.0


def test_bench_key_takes_no_public_host_time_where_the_settings_resolve_another_key(monkeypatch):
    """With ``TRITUNE_Q4K_FP8=1`` a Q4_K problem of an accurate key resolves the opt-in key: its
    public call would time another config, so the host cell stays empty and a note says why."""
    import torch

    from tritune.kernels import settings
    from tritune.kernels.device import device_info
    from tritune.kernels.registry import get_spec
    from tritune.tuner.tables import bench_key
    from tritune.tuner.timing import FakeTimer

    spec, info = get_spec("q4k_fp8_gemm"), device_info("cpu")
    (key,) = spec.default_keys(info)
    assert key.fp8 is False
    with settings.override(q4k_fp8=True):
        row = bench_key(spec, key, info, torch.device("cpu"), FakeTimer(lambda config: 1.0), 0, lambda fn: 2.0)
    assert row.ours_host_ms is None and row.note is not None and "another key (fp8=True)" in row.note
    row = bench_key(spec, key, info, torch.device("cpu"), FakeTimer(lambda config: 1.0), 0, lambda fn: 2.0)
    assert row.ours_host_ms == 2.0 and row.note is None


def test_export_leaves_out_winners_of_other_kernel_versions_and_prefers_the_running_versions(toy, tmp_path):
    """Stale winners (another kernel version: never served) are not exported, however many; among
    the rest the group tuned under the running Triton and torch is the bundle's provenance."""
    import dataclasses

    import torch
    import triton

    from tritune.configs_db.records import WinnerRecord

    spec = toy_kernel.SPEC
    db = f"sqlite:///{tmp_path / 'e.sqlite'}"

    def winner(n_bucket, version=spec.version, triton_version=triton.__version__):
        return WinnerRecord(kernel=spec.name, kernel_version=version, gpu="cpu-interpreter",
                            key={"arch": "cpu-interpreter", "sm_count": 1, "dtype": "float32", "n_bucket": n_bucket},
                            config={"BLOCK": 64, "BROKEN": False, "num_warps": 2}, time_ms=1.0, portable_ms=2.0,
                            speedup=2.0, trials=3, triton_version=triton_version, torch_version=torch.__version__,
                            tritune_version="t")  # fmt: skip

    stale = [winner(n, version="0ld0ld0ld0ld0ld0") for n in (1, 2, 4)]
    current = [winner(8), winner(16)]
    older_triton = [dataclasses.replace(winner(n), triton_version="3.5.0") for n in (32, 64, 128)]
    with ConfigStore(db) as store:
        for record in [*stale, *current, *older_triton]:
            env = store.environment(gpu=record.gpu, torch_version=record.torch_version,
                                    triton_version=record.triton_version, tritune_version="t")  # fmt: skip
            assert store.offer_winner(record, env)
    bundle = tmp_path / "cpu-interpreter.json"
    exported = _run("export", "--gpu", "cpu-interpreter", "--db", db, "--out", str(bundle))
    assert exported.exit_code == 0, exported.output
    assert "left out 3 winner(s) of kernel versions" in " ".join(exported.output.split())
    doc = json.loads(bundle.read_text())
    assert sorted(w["key"]["n_bucket"] for w in doc["winners"]) == [8, 16]
    assert doc["provenance"]["triton"] == triton.__version__
