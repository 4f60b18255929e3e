"""The GPU benchmark scripts (``scripts/bench_*.py``): their ``--smoke`` runs and the report rules a CPU can check.

Each benchmark's numbers go to ``docs/perf``; the smoke run is the same code on the Triton
interpreter at tiny shapes, so a script that breaks, mislabels a peer or loses one of our rows to
an exception is caught before GPU time is spent on it. What only a GPU shows (which cuDNN kernel
ran, the eager and graph times) is recorded in the rows' notes for the GPU run to read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"

#: Each benchmark's smoke arguments, trimmed where its default smoke grid is longer than this test needs.
SMOKE_ARGS = {
    "bench_prefill.py": [],
    "bench_decode.py": ["--batch", "3"],
    "bench_varlen.py": [],
    "bench_q4k.py": ["--shape", "256x64", "--m", "1", "--m", "33"],
}


def _ours(row: dict) -> bool:
    """Whether a JSON row is one of tritune's (varlen rows say so by kind, the others by name)."""
    if "kind" in row:
        return row["kind"] in ("varlen", "ours")
    return "tritune" in row["impl"].lower()


@pytest.fixture(scope="module")
def smoke_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict]]:
    """Every benchmark run once with ``--smoke`` as a subprocess: its markdown and JSON reports."""
    out = tmp_path_factory.mktemp("bench-smoke")
    env = {**os.environ, "TRITUNE_DB": str(out / "configs.sqlite")}
    procs = {}
    for script, extra in SMOKE_ARGS.items():
        md, js = out / f"{script}.md", out / f"{script}.json"
        cmd = [sys.executable, str(SCRIPTS / script), "--smoke", "--out", str(md), "--json", str(js), *extra]
        procs[script] = (subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300), md, js)
    reports = {}
    for script, (proc, md, js) in procs.items():
        assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        reports[script] = (md.read_text(), json.loads(js.read_text()))
    return reports


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("script", sorted(SMOKE_ARGS))
def test_smoke_run_writes_reports_with_every_row_of_ours_passing(smoke_reports, script: str) -> None:
    markdown, data = smoke_reports[script]
    rows = data["rows"]
    ours = [r for r in rows if _ours(r)]
    assert ours, f"{script}: no tritune row"
    assert [r["impl"] for r in ours if r["status"] != "ok"] == []
    assert all(r["eager_us"] and r["eager_gpu_us"] for r in ours)
    env = data["environment"]
    for field in ("date_utc", "command", "torch", "triton", "cuda", "python", "gpu"):
        assert field in env, field
    assert script in env["command"] and "--smoke" in env["command"]
    assert "eager: max(do_bench GPU time, host time)" in markdown
    assert "| FAILED |" not in markdown


@pytest.mark.slow
@pytest.mark.interpreter
def test_prefill_smoke_labels_the_cudnn_row_and_reads_gqa_natively(smoke_reports) -> None:
    """cuDNN at Lq != Lkv is the dense-mask row, outside the fastest peer; at Lq = Lkv the causal one."""
    markdown, data = smoke_reports["bench_prefill.py"]
    cudnn = {(r["shape"], r["impl"]) for r in data["rows"] if r["impl"].startswith("SDPA cuDNN")}
    assert ("D=64 Lq=16 Lkv=64", "SDPA cuDNN (dense mask)") in cudnn
    assert ("D=64 Lq=32 Lkv=32", "SDPA cuDNN") in cudnn
    assert "torch has no bottom-right causal cuDNN kernel" in markdown
    flash = [r for r in data["rows"] if r["impl"] == "SDPA flash"]
    assert flash and all(r["note"].startswith("enable_gqa=True; ran: flash (") for r in flash)
    math = [r for r in data["rows"] if r["impl"].startswith("SDPA math")]
    assert math and all("ran: math (" in r["note"] for r in math)


@pytest.mark.slow
@pytest.mark.interpreter
def test_decode_smoke_records_the_sdpa_backend(smoke_reports) -> None:
    _, data = smoke_reports["bench_decode.py"]
    flash = [r for r in data["rows"] if r["impl"] == "SDPA flash"]
    assert flash and all(r["note"].startswith("enable_gqa=True; ran: flash (") for r in flash)


@pytest.mark.slow
@pytest.mark.interpreter
def test_varlen_smoke_ratio_is_reference_over_this(smoke_reports) -> None:
    _, data = smoke_reports["bench_varlen.py"]
    served = {r["mix"]: r for r in data["rows"] if r["impl"] == "tritune varlen (dispatcher)"}
    for r in data["rows"]:
        if r["eager_vs_varlen"] is not None:
            assert r["eager_vs_varlen"] == pytest.approx(served[r["mix"]]["eager_us"] / r["eager_us"])


# ---- unit rules of the varlen benchmark -------------------------------------------------------------


@pytest.fixture
def varlen(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import _varlen_workload
    import bench_varlen

    return bench_varlen, _varlen_workload


def test_varlen_ratio_follows_the_reports_convention(varlen) -> None:
    """'vs varlen' is tritune varlen's time / this row's: above 1 the row is faster, as every ratio reads."""
    bench, wl = varlen
    rows = [
        bench.Row(mix="m", kind="varlen", kv_bytes=1, impl=wl.SERVED, eager_us=10.0),
        bench.Row(mix="m", kind="peer", kv_bytes=1, impl=wl.FLEX, eager_us=20.0),
        bench.Row(mix="m", kind="peer", kv_bytes=1, impl=wl.VARLEN_ATTN, eager_us=5.0),
    ]
    assert bench._vs_varlen(rows[1], rows, "eager") == pytest.approx(0.5)
    assert bench._vs_varlen(rows[2], rows, "eager") == pytest.approx(2.0)
    assert bench._vs_varlen(rows[1], rows, "graph") is None


@pytest.mark.interpreter
def test_varlen_attn_peer_is_not_charged_for_the_gather(varlen, monkeypatch) -> None:
    """Both packed-KV peers get their K/V packed outside the timed call; no gather runs inside it."""
    _, wl = varlen
    w = wl.build_workload(wl.SMOKE_MIXES["mixed"], torch.device("cpu"), 0)
    impl = wl._varlen_attn_impl(w, standin=True)
    assert impl.fn is not None and "built outside the timed region" in impl.note

    def no_gather(*args, **kwargs):
        raise AssertionError("index_select inside the timed call")

    monkeypatch.setattr(torch, "index_select", no_gather)
    out = impl.fn()
    assert float((out.float() - w.expected).abs().max()) < 3e-2


# ---- measure_overhead's header --------------------------------------------------------------------


def test_overhead_report_header_names_versions_date_and_the_real_command(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.setattr(sys, "argv", ["scripts/measure_overhead.py", "--profile", "--out", "x.md"])
    import measure_overhead

    text = measure_overhead.header(gpu=False)
    assert "Command: `python scripts/measure_overhead.py --profile --out x.md`" in text
    for field in ("torch ", "triton ", "CUDA ", "cuDNN ", "Python ", " UTC"):
        assert field in text, field
    assert "median of 7 interleaved rounds" in text


def test_q4k_bench_pins_the_portable_rules_tiles_where_the_default_is_dequant(monkeypatch) -> None:
    """From M=256 up (M=512 on SM90) the untuned default is the dequant path: the 'portable path (pinned)' row takes
    the portable rules' tiles (what served there before), not the dequant default's fields."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_q4k

    from tritune.kernels.device import DeviceInfo
    from tritune.kernels.q4k.kernel import KERNEL, Q4KKey, portable_default

    h200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
    key = Q4KKey(arch="sm90", sm_count=132, dtype="bfloat16", m_bucket=2048, n=4096, k=14336, fp8=False)
    assert KERNEL.default_config(key).path == "dequant"
    tiles = KERNEL.space.to_dict(portable_default(key))
    assert bench_q4k._path_default(tiles, "portable", key, h200) == tiles
    assert tiles["BLOCK_M"] == 128 and tiles["BLOCK_N"] == 128 and tiles["BLOCK_K"] == 64


# ---- unit rules of the online-tuning benchmark ------------------------------------------------------


def test_an_online_rerun_borrows_the_earlier_offline_columns_key_by_key(monkeypatch, tmp_path) -> None:
    """The offline columns come from the earlier run's row of the same kernel and key (field order
    aside); a key that run did not meet keeps none, and the medians are the medians proper."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_jit

    earlier = [
        {"kernel": "k", "key": {"a": 1, "b": 2}, "offline_s": 20.0, "offline_speedup": 2.0},
        {"kernel": "k", "key": {"a": 1, "b": 3}, "offline_s": 40.0, "offline_speedup": 1.0},
        {"kernel": "other", "key": {"a": 1, "b": 2}, "offline_s": 99.0, "offline_speedup": 9.0},
    ]
    (tmp_path / "rows.json").write_text(json.dumps({"rows": earlier, "provisional": None, "missed": None}))
    rows = [
        {"kernel": "k", "key": {"b": 2, "a": 1}, "label": "x", "tune_s": 5.0, "online_speedup": 1.8},
        {"kernel": "k", "key": {"a": 1, "b": 3}, "label": "y", "tune_s": 8.0, "online_speedup": 1.0},
        {"kernel": "k", "key": {"a": 2, "b": 3}, "label": "z", "tune_s": 4.0, "online_speedup": 1.5},
    ]
    bench_jit.borrow_offline(rows, tmp_path / "rows.json")
    assert [(r.get("offline_s"), r.get("offline_speedup")) for r in rows] == [(20.0, 2.0), (40.0, 1.0), (None, None)]
    env = {"gpu": "g", "sm_count": 1, "memory_gib": 1.0, "torch": "t", "triton": "t", "cuda": None,
           "cudnn": None, "python": "3", "date_utc": "d", "command": "c"}  # fmt: skip
    markdown = bench_jit.report(env, rows, None, None)
    # Speedup fractions 0.9 and 1.0, time shares 0.25 and 0.2: their medians are the means of the two.
    assert "median online/offline speedup 0.950" in markdown
    assert "median online/offline tuning time 0.225" in markdown
