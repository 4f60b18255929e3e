"""The miss log: keys resolved without an exact winner, noted in memory, written in batches, tuned by tune --missed."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import toy_kernel
import triton
from typer.testing import CliRunner

from tritune.configs_db import misses as miss_store
from tritune.configs_db import storage
from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import misses, registry, settings
from tritune.kernels.device import device_info
from tritune.kernels.dispatcher import DISPATCHER, dispatch_config
from tritune.tuner.cli import app

CPU = device_info("cpu")


@pytest.fixture(autouse=True)
def miss_log(monkeypatch, tmp_path):
    """The toy kernel known, the miss log on (the test tier turns it off), a fresh log per test."""
    monkeypatch.setitem(registry._SPECS, "toy_scale", f"{toy_kernel.__name__}:SPEC")
    monkeypatch.setenv("TRITUNE_MISS_LOG", "1")
    settings.reload()
    fresh = misses.MissLog()
    # No writer thread in tests: they flush themselves.
    monkeypatch.setattr(fresh, "_start", lambda: None)
    monkeypatch.setattr(misses, "MISSES", fresh)
    DISPATCHER.clear()
    yield fresh
    DISPATCHER.clear()


def db() -> str:
    return settings.settings().db_url


def db_path() -> Path:
    return Path(db().removeprefix("sqlite:///"))


def serve(n: int) -> None:
    spec = toy_kernel.SPEC
    dispatch_config("toy_scale", "cpu", -1, tuple(spec.facts(torch.randn(n))))


def store_winner(n_bucket: int) -> None:
    spec = toy_kernel.SPEC
    key = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", n_bucket)
    versions = {"torch_version": torch.__version__, "triton_version": triton.__version__, "tritune_version": "test"}
    with ConfigStore(db()) as store:
        env = store.environment(gpu=CPU.slug, **versions)
        record = WinnerRecord(
            kernel=spec.name,
            kernel_version=spec.version,
            gpu=CPU.slug,
            key=key.to_dict(),
            config={"BLOCK": 64, "BROKEN": False, "num_warps": 2},
            time_ms=1.0,
            portable_ms=1.5,
            speedup=1.5,
            trials=3,
            **versions,
        )
        assert store.offer_winner(record, env)


def logged() -> dict[int, miss_store.MissRecord]:
    """Logged rows of the toy kernel by n_bucket."""
    rows = miss_store.read_misses(db(), kernel="toy_scale", timeout_s=10)
    return {row.key()["n_bucket"]: row for row in rows}


def pending_counts() -> dict[int, int]:
    return {ident[4].n_bucket: seen.count for ident, seen in misses.pending().items()}  # type: ignore[attr-defined]


def test_keys_without_an_exact_winner_are_noted_once_per_resolution():
    store_winner(128)
    for _ in range(5):
        serve(100)  # bucket 128: the exact winner serves, no miss
        serve(300)  # bucket 512: no winner of its own (its neighbour lends or not): a miss
        serve(2000)  # bucket 2048: a miss
    assert pending_counts() == {512: 1, 2048: 1}, "the per-call memo hit notes nothing"
    DISPATCHER.clear()  # a reload resolves again
    serve(300)
    assert pending_counts() == {512: 2, 2048: 1}


def test_only_a_real_call_is_noted_and_for_the_key_it_asked(monkeypatch):
    """``tune bench`` and scripts select without a call's device; a fallback key's lookup is on behalf of another."""
    spec = toy_kernel.SPEC
    DISPATCHER.select(spec, CPU, toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", 4096))
    assert pending_counts() == {}, "a select without a call is no miss"
    monkeypatch.setattr(
        spec, "fallback_key", lambda key: dataclasses.replace(key, dtype="float32") if key.dtype != "float32" else None
    )
    dispatch_config("toy_scale", "cpu", -1, tuple(spec.facts(torch.randn(300, dtype=torch.float16))))
    assert [(ident[4].dtype, seen.count) for ident, seen in misses.pending().items()] == [("float16", 1)]


def test_flush_writes_and_a_second_flush_adds_counts():
    serve(300)
    serve(2000)
    assert not db_path().exists()
    # A missing DB is created the way tune creates it (Alembic is installed in the test environment).
    assert misses.flush() == 2
    first = logged()
    assert {n: row.count for n, row in first.items()} == {512: 1, 2048: 1}
    assert first[512].kernel_version == toy_kernel.SPEC.version and first[512].gpu == CPU.slug
    assert (first[512].triton_version, first[512].torch_version) == (triton.__version__, torch.__version__)
    assert misses.pending() == {}
    assert misses.flush() == 0, "nothing new, nothing written"
    DISPATCHER.clear()
    serve(300)
    assert misses.flush() == 1
    second = logged()
    assert {n: row.count for n, row in second.items()} == {512: 2, 2048: 1}
    assert second[512].first_seen == first[512].first_seen
    assert second[512].last_seen > first[512].last_seen


def test_the_log_writes_only_the_misses_table():
    store_winner(128)
    with ConfigStore(db()) as store:
        before = store.winners()
    serve(300)
    assert misses.flush() == 1
    with ConfigStore(db()) as store:
        assert store.winners() == before


def test_off_notes_nothing():
    with settings.override(miss_log=False):
        serve(300)
    assert misses.pending() == {}


@pytest.mark.parametrize("where", ["compile", "graph-capture"])
def test_only_the_memory_record_while_tracing_or_capturing(where, monkeypatch):
    fresh = misses.MissLog()
    started = []
    monkeypatch.setattr(fresh, "_start", lambda: started.append(True))
    monkeypatch.setattr(misses, "MISSES", fresh)
    if where == "compile":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    else:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    serve(300)
    assert pending_counts() == {512: 1}
    assert started == [], "no writer is started inside tracing or capture"
    assert not db_path().exists()


def test_a_dispatch_mode_counts_as_tracing_for_the_log_and_online_tuning():
    """One detector for the miss log and online tuning (``jit.eager``): FakeTensor tracing included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tritune.kernels import jit

    assert not misses.in_capture_or_trace() and jit.eager()
    with FakeTensorMode():
        assert misses.in_capture_or_trace() and not jit.eager()


def test_the_detector_survives_torch_dropping_or_breaking_a_private_check(monkeypatch):
    from tritune.kernels import jit

    monkeypatch.delattr(torch._C, "_len_torch_dispatch_stack")
    monkeypatch.delattr(torch.fx._symbolic_trace, "is_fx_tracing")
    assert not misses.in_capture_or_trace() and jit.eager()
    monkeypatch.setattr(torch.jit, "is_tracing", lambda: 1 / 0)
    assert misses.in_capture_or_trace() and not jit.eager(), "a check that raises counts as tracing"


def test_outside_tracing_the_writer_starts_once(monkeypatch):
    fresh = misses.MissLog()
    started = []
    monkeypatch.setattr(fresh, "_start", lambda: started.append(True) or setattr(fresh, "_thread", object()))
    monkeypatch.setattr(misses, "MISSES", fresh)
    serve(300)
    serve(2000)
    assert started == [True]


def test_missing_db_without_alembic_keeps_the_misses_and_says_so_once(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tritune.misses")
    monkeypatch.setattr(miss_store, "alembic_available", lambda: False)
    serve(300)
    assert misses.flush() == 0
    assert misses.flush() == 0
    assert pending_counts() == {512: 1}, "kept in memory"
    assert not db_path().exists(), "nothing created"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "1 missed key(s) kept in memory, not logged: no config DB at" in lines[0]
    assert "pip install 'tritune[tune]'" in lines[0]


def test_older_revision_is_upgraded_with_alembic_and_kept_without(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tritune.misses")
    storage.upgrade(db(), "0002")
    serve(300)
    with monkeypatch.context() as patched:
        patched.setattr(miss_store, "alembic_available", lambda: False)
        assert misses.flush() == 0
    assert "is at schema revision 0002" in caplog.text
    assert misses.flush() == 1
    assert {n: row.count for n, row in logged().items()} == {512: 1}


def test_a_db_that_refuses_writes_never_raises_and_is_not_retried(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tritune.misses")
    ConfigStore(db()).close()
    opened = []
    make_engine = storage.make_engine

    def read_only_engine(url, **options):
        # What a read-only file, folder or mount answers: SQLite refuses the write.
        if not options.get("read_only"):
            opened.append(url)
        return make_engine(url, **{**options, "read_only": True})

    monkeypatch.setattr(storage, "make_engine", read_only_engine)
    serve(300)
    assert misses.flush() == 0
    DISPATCHER.clear()
    serve(300)
    assert misses.flush() == 0
    assert len(opened) == 1, "a DB that refused writes is not tried again by this process"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "refuses writes" in lines[0], lines
    assert pending_counts() == {512: 2}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only files")
def test_a_read_only_file_never_raises(caplog):
    caplog.set_level(logging.INFO, logger="tritune.misses")
    ConfigStore(db()).close()
    db_path().chmod(0o444)
    db_path().parent.chmod(0o555)
    try:
        serve(300)
        assert misses.flush() == 0
        assert "refuses writes" in caplog.text
    finally:
        db_path().parent.chmod(0o755)


def test_a_write_that_fails_otherwise_is_retried_later(monkeypatch):
    serve(300)

    def locked(url, rows, *, timeout_s):
        raise miss_store.StoreError("database is locked")

    with monkeypatch.context() as patched:
        patched.setattr(miss_store, "write_misses", locked)
        assert misses.flush() == 0
    assert misses.flush() == 1


def _slow_write(monkeypatch, pause_s: float, inside: list[int] | None = None):
    """``_write`` after a pause; ``inside`` gets the number of writes running at each start."""
    write = miss_store._write
    running = [0]

    def slow(url, batch, timeout_s):
        running[0] += 1
        if inside is not None:
            inside.append(running[0])
        try:
            time.sleep(pause_s)
            return write(url, batch, timeout_s)
        finally:
            running[0] -= 1

    monkeypatch.setattr(miss_store, "_write", slow)


def _wait_for_writes() -> None:
    # The abandoned write's thread holds the lock to its end.
    writing = getattr(miss_store, "_writing", None)
    if writing is None:
        time.sleep(2.0)
        return
    assert writing.acquire(timeout=30)
    writing.release()


def test_a_timed_out_write_is_dropped_not_counted_twice(monkeypatch, caplog):
    """The write left running past its bound lands later; its batch is not offered again."""
    caplog.set_level(logging.INFO, logger="tritune.misses")
    monkeypatch.setattr(miss_store, "SETUP_TIMEOUT_S", 0.05, raising=False)
    serve(300)
    with monkeypatch.context() as patched:
        _slow_write(patched, 1.5)
        assert misses.flush(timeout_s=0.05) == 0
        deadline = time.monotonic() + 30
        while not logged() and time.monotonic() < deadline:
            time.sleep(0.05)
        _wait_for_writes()
    assert pending_counts() == {}
    misses.flush()
    assert {n: row.count for n, row in logged().items()} == {512: 1}
    assert "1 missed key(s) dropped, not retried" in caplog.text


def test_two_writes_never_overlap(monkeypatch):
    monkeypatch.setattr(miss_store, "SETUP_TIMEOUT_S", 0.05)
    inside: list[int] = []
    now = misses.datetime.now(misses.timezone.utc)
    key = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", 8)
    row = misses._row((db(), CPU.slug, "toy_scale", toy_kernel.SPEC.version, key), misses.Seen(1, now, now))
    _slow_write(monkeypatch, 1.0, inside)
    with pytest.raises(miss_store.WriteTimedOut):
        miss_store.write_misses(db(), [row], timeout_s=0.05)
    with pytest.raises(miss_store.StoreError, match="an earlier write of missed keys"):
        miss_store.write_misses(db(), [row], timeout_s=0.05)
    _wait_for_writes()
    assert inside == [1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_is_not_blocked_by_a_write_of_its_parent():
    assert miss_store._writing.acquire(timeout=5)
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if miss_store._writing.acquire(timeout=1) else 1)
    finally:
        miss_store._writing.release()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_the_first_write_to_a_db_may_take_longer_than_a_plain_one(monkeypatch):
    """Creating or upgrading the DB is the first write's job: it gets ``SETUP_TIMEOUT_S``."""
    serve(300)
    _slow_write(monkeypatch, 0.8)
    assert misses.flush(timeout_s=0.05) == 1
    DISPATCHER.clear()
    serve(300)
    with pytest.raises(miss_store.WriteTimedOut):
        miss_store.write_misses(db(), [misses._row(*next(iter(misses.pending().items())))], timeout_s=0.05)
    _wait_for_writes()


SERVING = """
import sys, torch
sys.path.insert(0, {tests!r})
import toy_kernel
from tritune.kernels import registry
from tritune.kernels.dispatcher import dispatch_config
registry._SPECS["toy_scale"] = "toy_kernel:SPEC"
# Every key resolved while tracing (a torch.compile-only model): no writer thread ever starts.
torch.compiler.is_compiling = lambda: True
for n in (300, 300, 2000):
    dispatch_config("toy_scale", "cpu", -1, tuple(toy_kernel.SPEC.facts(torch.randn(n))))
"""


def test_a_serving_process_writes_its_misses_at_exit():
    environment = {**os.environ, "TRITUNE_MISS_LOG": "1", "TRITUNE_DB": str(db_path()), "TRITON_INTERPRET": "1"}
    code = SERVING.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert {n: row.count for n, row in logged().items()} == {512: 1, 2048: 1}


# ---- tune missed / tune --missed --------------------------------------------------------------


def run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_tune_missed_lists_the_logged_keys():
    store_winner(128)
    serve(300)
    serve(2000)
    DISPATCHER.clear()
    serve(300)
    misses.flush()
    store_winner(2048)
    result = run("missed", "--db", db())
    assert result.exit_code == 0, result.output
    lines = [" ".join(line.split("│")) for line in result.output.splitlines() if "toy_scale" in line]
    assert len(lines) == 2, result.output
    # Most frequent first; a winner stored since the key was logged is shown.
    first, second = (line.split() for line in lines)
    assert first[:5] == ["cpu-interpreter", "toy_scale", "dtype=float32", "n_bucket=512", "2"] and first[-1] == "no"
    assert second[:5] == ["cpu-interpreter", "toy_scale", "dtype=float32", "n_bucket=2048", "1"]
    assert second[-2:] == ["yes", "(db)"]
    other = run("missed", "--db", db(), "--gpu", "nvidia-h200-sm90-132sm")
    assert "no missed keys logged" in other.output


def test_tune_missed_option_tunes_exactly_the_logged_keys():
    serve(300)
    serve(2000)
    misses.flush()
    result = run("--device", "cpu", "--kernel", "toy_scale", "--missed", "--trials", "2", "--no-isolate", "--db", db())
    assert result.exit_code == 0, result.output
    with ConfigStore(db()) as store:
        tuned = sorted(w.key["n_bucket"] for w in store.winners(kernel="toy_scale"))
    assert tuned == [512, 2048]
    # Run again: both keys hold a winner now, nothing is left to tune.
    again = run("--device", "cpu", "--kernel", "toy_scale", "--missed", "--trials", "2", "--no-isolate", "--db", db())
    assert again.exit_code == 0, again.output
    assert "2 logged key(s) already tuned" in " ".join(again.output.split())
    assert "tuning 0 key(s)" in again.output


def test_tune_missed_option_skips_malformed_rows_with_a_reason():
    serve(300)
    misses.flush()
    spec = toy_kernel.SPEC
    bad = miss_store.MissRecord(
        gpu=CPU.slug,
        kernel=spec.name,
        kernel_version=spec.version,
        key_json='{"arch":"cpu-interpreter","n_bucket":"many","sm_count":1}',
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        count=5,
        first_seen=misses.datetime.now(misses.timezone.utc),
        last_seen=misses.datetime.now(misses.timezone.utc),
    )
    assert miss_store.write_misses(db(), [bad], timeout_s=10) == 1
    result = run("--device", "cpu", "--kernel", "toy_scale", "--missed", "--trials", "2", "--no-isolate", "--db", db())
    assert result.exit_code == 0, result.output
    assert "left out: malformed key" in " ".join(result.output.split())
    with ConfigStore(db()) as store:
        assert [w.key["n_bucket"] for w in store.winners(kernel="toy_scale")] == [512]


def test_tune_missed_option_without_misses_says_what_to_do():
    ConfigStore(db()).close()
    result = run("--device", "cpu", "--kernel", "toy_scale", "--missed", "--db", db())
    assert result.exit_code == 1
    assert "no missed keys of toy_scale on cpu-interpreter" in " ".join(result.output.split())


def test_tune_missed_option_narrowed_by_key_values():
    """``--key`` with ``--missed`` tunes only the logged keys holding one of its values; values no
    logged key holds are refused, naming the logged keys."""
    serve(300)
    serve(2000)
    misses.flush()
    args = ("--device", "cpu", "--kernel", "toy_scale", "--missed", "--trials", "2", "--no-isolate", "--db", db())
    result = run(*args, "--key", "n=2000")
    assert result.exit_code == 0, result.output
    with ConfigStore(db()) as store:
        assert [w.key["n_bucket"] for w in store.winners(kernel="toy_scale")] == [2048]
    refused = run(*args, "--key", "n_bucket=64")
    assert refused.exit_code == 1
    said = " ".join(refused.output.split())
    assert "--key n_bucket=64: none of the" in said and "n_bucket=512" in said


@pytest.mark.gpu
def test_real_graph_capture_notes_in_memory_only(monkeypatch):
    """Inside a real CUDA-graph capture a new key is noted and nothing else: no writer, no DB."""
    fresh = misses.MissLog()
    started = []
    monkeypatch.setattr(fresh, "_start", lambda: started.append(True))
    monkeypatch.setattr(misses, "MISSES", fresh)
    spec = toy_kernel.SPEC
    x = torch.randn(3000, device="cuda")
    out = torch.empty_like(x)
    # Warm the kernel up outside the capture, on a key of its own.
    spec.launch(spec.default_config(None), x, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        config = dispatch_config("toy_scale", "cuda", torch.cuda.current_device(), tuple(spec.facts(x)))
        spec.launch(config, x, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert [ident[4].n_bucket for ident in misses.pending()] == [4096]  # type: ignore[attr-defined]
    assert started == [] and not db_path().exists()
