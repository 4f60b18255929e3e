"""``scripts/_benchlib.py`` and ``_bench_timing.py``, the harness of the benchmark scripts: how a row is checked,
timed and reported.

A benchmark must never report a time for an implementation whose output failed its check, must
keep going when a peer cannot run, and must say why a graph column is empty. These run on the CPU
with plain PyTorch calls standing in for the kernels.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bl(monkeypatch):
    """The harness module, imported from ``scripts/`` as the benchmark scripts import it."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import _benchlib

    return _benchlib


@pytest.fixture
def bt(monkeypatch):
    """The row timing module, imported from ``scripts/`` as the benchmark scripts import it."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import _bench_timing

    return _bench_timing


@pytest.fixture
def row(bt):
    @dataclass
    class Row(bt.TimedRow):
        shape: str
        max_err: float | None = None

    return Row(shape="tiny", impl="impl", note="config A")


CPU = torch.device("cpu")


def test_a_passing_call_is_timed(bt, row):
    bt.measure(row, lambda: torch.ones(4), lambda out: None, CPU, graphs=False)
    assert row.status == "ok" and row.eager_us is not None and row.eager_us > 0
    assert row.graph_us is None and row.graph_status == "" and row.note == "config A"
    # Host time is a GPU column: on the interpreter every call is host work, and none is reported.
    assert row.host_us is None


@pytest.mark.gpu
def test_host_time_per_call_counts_queued_calls_only(bt):
    """A call that queues a long kernel costs its host little: the host column stays well below the GPU time."""
    if not torch.cuda.is_available():
        pytest.skip("GPU tier: needs a CUDA GPU (run on the H200)")
    a = torch.randn(4096, 4096, device="cuda")
    gpu_us = bt.time_ms(lambda: a @ a, torch.device("cuda")) * 1e3
    host_us = bt.host_us_per_call(lambda: a @ a, torch.device("cuda"))
    assert host_us is not None and 0 < host_us < gpu_us / 2, (host_us, gpu_us)


def test_a_failed_check_is_never_timed(bt, row):
    bt.measure(row, lambda: torch.zeros(4), lambda out: "max err 1.0e+00", CPU, graphs=False)
    assert row.status == "FAILED" and row.eager_us is None and row.graph_us is None
    assert row.note == "FAILED correctness check: max err 1.0e+00; config A"


def test_a_check_may_record_its_metric(bt, row):
    def check(out: torch.Tensor) -> str | None:
        row.max_err = float(out.abs().max())
        return None

    bt.measure(row, lambda: torch.full((3,), -0.5), check, CPU, graphs=False)
    assert row.max_err == 0.5 and row.status == "ok"


def test_a_missing_implementation_is_unavailable_with_its_reason(bt, row):
    bt.measure(row, None, lambda out: None, CPU, graphs=False, error="no cuDNN on this machine")
    assert (row.status, row.note, row.eager_us) == ("unavailable", "no cuDNN on this machine", None)


@pytest.mark.parametrize("raised", ["unavailable", "FAILED"])
def test_an_exception_is_reported_in_the_row(bt, row, raised):
    def boom() -> torch.Tensor:
        raise RuntimeError("no kernel image")

    bt.measure(row, boom, lambda out: None, CPU, graphs=False, raised=raised)
    assert row.status == raised and row.eager_us is None
    assert row.note == "config A; RuntimeError: no kernel image"


def test_graph_cells_say_why_a_graph_time_is_missing(bl, row):
    row.graph_status = "cannot capture: RuntimeError: a | b"
    cell, note = bl.graph_cells(row)
    assert cell == "cannot capture"
    assert note == "config A; graph: cannot capture: RuntimeError: a / b"
    row.graph_us, row.graph_status = 1234.5, "ok"
    assert bl.graph_cells(row, scale=1e-3, digits=3) == ("1.234", "config A")


def test_fastest_and_rates(bl, bt, row):
    rows = [row, bt.TimedRow(impl="peer A", eager_us=30.0), bt.TimedRow(impl="peer B", eager_us=20.0)]
    row.eager_us = 10.0
    assert bl.fastest(rows, ["peer A", "peer B"], "eager_us") == 20.0
    assert bl.fastest(rows, ["peer A", "peer B"], "graph_us") is None
    assert bl.ratio(20.0, row.eager_us) == "2.00x"
    assert bl.tera_per_s(4e6, 2.0) == pytest.approx(2.0)
    assert bl.tera_per_s(4e6, None) is None


def test_common_arguments(bl):
    parser = argparse.ArgumentParser()
    bl.add_common_arguments(parser, flex=False)
    args = parser.parse_args(["--db", "x.sqlite", "--smoke", "--no-graph"])
    assert (args.db, args.smoke, args.no_graph, args.seed) == ("x.sqlite", True, True, 0)
    assert args.out is None and args.json is None
    assert not hasattr(args, "skip_flex")
    with pytest.raises(SystemExit, match=r"--db missing\.sqlite: no such file"):
        bl.checked_db("missing.sqlite")


def test_fastest_ignores_rows_that_did_not_pass(bl, bt):
    """A FAILED or unavailable peer row never becomes the reference a ratio divides, whatever time it holds."""
    rows = [
        bt.TimedRow(impl="peer A", eager_us=30.0),
        bt.TimedRow(impl="peer B", status="FAILED", eager_us=5.0, graph_us=4.0),
        bt.TimedRow(impl="peer C", status="unavailable", eager_us=1.0),
    ]
    assert bl.fastest(rows, ["peer A", "peer B", "peer C"], "eager_us") == 30.0
    assert bl.fastest(rows, ["peer A", "peer B", "peer C"], "graph_us") is None


def _boom() -> torch.Tensor:
    raise RuntimeError("no kernel image")


@pytest.mark.parametrize(
    ("impl", "status"), [("tritune tuned (dispatcher)", "FAILED"), ("loop: tritune attention", "FAILED"),
                         ("SDPA flash", "unavailable")],
)  # fmt: skip
def test_an_exception_in_our_row_is_failed_by_default(bt, impl, status):
    row = bt.TimedRow(impl=impl)
    bt.measure(row, _boom, lambda out: None, CPU, graphs=False)
    assert row.status == status and row.eager_us is None


def test_eager_time_is_the_larger_of_gpu_and_host_time(bt, row, monkeypatch):
    """The flushed do_bench time hides the host work overlapping the flush: the eager figure counts it."""
    monkeypatch.setattr(bt, "time_ms", lambda fn, device: 0.020)
    monkeypatch.setattr(bt, "host_us_per_call", lambda fn, device: 55.0)
    bt.measure(row, lambda: torch.ones(4), lambda out: None, CPU, graphs=False)
    assert row.eager_gpu_us == pytest.approx(20.0) and row.host_us == 55.0
    assert row.eager_us == pytest.approx(55.0)
    monkeypatch.setattr(bt, "host_us_per_call", lambda fn, device: 5.0)
    bt.measure(row, lambda: torch.ones(4), lambda out: None, CPU, graphs=False)
    assert row.eager_us == pytest.approx(20.0)
    assert bt.eager_cost_us(None, None) is None and bt.eager_cost_us(3.0, None) == 3.0


def test_the_eager_note_says_how_eager_is_timed(bt):
    assert "max(do_bench GPU time, host time)" in bt.EAGER_NOTE


def test_sdpa_peer_reads_the_gqa_cache_natively(bl, monkeypatch):
    """Every SDPA peer gets K/V with Hkv heads and enable_gqa=True, never K/V repeated to Hq."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((k.shape[1], kwargs.get("enable_gqa")))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q = torch.randn(1, 4, 8, 16)
    k, v = torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    peer = bl.sdpa_peer(SDPBackend.MATH, q, k, v, is_causal=False)
    assert peer.fn is not None and peer.note == "enable_gqa=True"
    out = peer.fn()
    assert seen and all(s == (2, True) for s in seen)
    expected = real(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(out, expected)


def test_sdpa_peer_repeats_kv_only_where_gqa_is_refused(bl):
    from torch.nn.attention import SDPBackend

    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 12, 16)
    peer = bl.sdpa_peer(SDPBackend.CUDNN_ATTENTION, q, k, k)  # no cuDNN on the CPU: refused both ways
    assert peer.fn is None and peer.error.startswith("refused enable_gqa")


def test_backend_ran_names_the_sdpa_backend(bl):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 8, 16)

    def run(backend):
        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, q, q)

        return call

    assert bl.backend_ran(run(SDPBackend.MATH), CPU).startswith("ran: math (")
    assert bl.backend_ran(run(SDPBackend.FLASH_ATTENTION), CPU).startswith("ran: flash (")
    names = ["void at::native::elementwise_kernel", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]
    assert bl.backend_family(names).startswith("cudnn (")
    assert bl.backend_family(["fmha_cutlassF_bf16_aligned_64x128_rf_sm80"]).startswith("mem-efficient (")


@pytest.mark.gpu
def test_sdpa_peers_on_the_gpu_read_gqa_natively_and_name_their_backend(bl, bt):
    """What the prefill benchmark's SDPA rows rely on: flash takes the GQA K/V with a bottom-right
    causal mask, and cuDNN runs (its causal kernel at Lq = Lkv, its dense-bias one otherwise)."""
    if not torch.cuda.is_available():
        pytest.skip("GPU tier: needs a CUDA GPU (run on the H200)")
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.bias import causal_lower_right

    gpu = torch.device("cuda")
    q = torch.randn(1, 16, 256, 128, device=gpu, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 1024, 128, device=gpu, dtype=torch.bfloat16) for _ in range(2))
    flash = bl.sdpa_peer(SDPBackend.FLASH_ATTENTION, q, k, v, attn_mask=causal_lower_right(256, 1024))
    assert flash.fn is not None and flash.note == "enable_gqa=True"
    assert bl.backend_ran(flash.fn, gpu).startswith("ran: flash ("), bl.backend_ran(flash.fn, gpu)
    dense = bl.sdpa_peer(SDPBackend.CUDNN_ATTENTION, q, k, v, attn_mask=causal_lower_right(256, 1024))
    causal = bl.sdpa_peer(SDPBackend.CUDNN_ATTENTION, q, k[:, :, :256], v[:, :, :256], is_causal=True)
    for peer in (dense, causal):
        if peer.fn is not None:
            assert bl.backend_ran(peer.fn, gpu).startswith("ran: cudnn ("), bl.backend_ran(peer.fn, gpu)
    row = bt.TimedRow(impl="SDPA flash")
    bt.measure(row, flash.fn, lambda out: None, gpu, graphs=False)
    assert row.eager_us == max(row.eager_gpu_us, row.host_us)
