"""GPU tier: eager calls replayed per argument layout compute what their launch functions compute.

Each public entry point runs at shapes that pick its different paths (descriptors, workspaces,
fused split merges with arrival counters, several launches). Each call's inputs are fresh random
tensors of one layout; a replayed call's output (replayed before its checks, from its raw
arguments' layout) must equal, bit for bit, the output of the same config's launch function on
the same inputs (replay switched off), and the layout must have been recorded (a refusal would
leave every call on its launch function and this test blind).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tritune.kernels import (
    Q4KWeight,
    _replay,
    decode_attention,
    prefill_attention,
    q4k_linear,
    settings,
    varlen_attention,
)
from tritune.kernels.decode.kernel import KERNEL as DECODE
from tritune.kernels.pins import use_config
from tritune.kernels.prefill.kernel import KERNEL as PREFILL
from tritune.kernels.q4k.kernel import KERNEL as Q4K
from tritune.kernels.varlen.kernel import KERNEL as VARLEN

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU tier: needs a CUDA GPU (run on the H200)"),
]

BF16 = torch.bfloat16


def _prefill(d: int, lq: int, lkv: int, batch: int = 1) -> tuple[Any, Callable[..., Any], Callable[[], tuple]]:
    def inputs() -> tuple:
        q = torch.randn(batch, 16, lq, d, device="cuda", dtype=BF16)
        k, v = (torch.randn(batch, 2, lkv, d, device="cuda", dtype=BF16) for _ in range(2))
        kv_len = torch.randint(lkv // 2, lkv + 1, (batch,), device="cuda", dtype=torch.int32)
        return q, k, v, kv_len

    return PREFILL, lambda q, k, v, kv_len: prefill_attention(q, k, v, kv_len=kv_len), inputs


def _decode(batch: int, lkv: int) -> tuple[Any, Callable[..., Any], Callable[[], tuple]]:
    def inputs() -> tuple:
        q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=BF16)
        k, v = (torch.randn(batch, 8, lkv, 128, device="cuda", dtype=BF16) for _ in range(2))
        return q, k, v, torch.randint(1, lkv + 1, (batch,), device="cuda", dtype=torch.int32)

    return DECODE, decode_attention, inputs


def _varlen() -> tuple[Any, Callable[..., Any], Callable[[], tuple]]:
    seq_info = torch.tensor([[0, 1, 0, 900], [1, 1, 1, 300], [2, 30, 2, 30]], device="cuda", dtype=torch.int32)

    def inputs() -> tuple:
        q = torch.randn(32, 32, 128, device="cuda", dtype=BF16)
        k, v = (torch.randn(1024, 4, 8, 128, device="cuda", dtype=BF16) for _ in range(2))
        return q, k, v, seq_info

    return VARLEN, varlen_attention, inputs


_WEIGHTS: dict[tuple[int, int], Q4KWeight] = {}


def _q4k(m: int, n: int, k: int) -> tuple[Any, Callable[..., Any], Callable[[], tuple]]:
    def inputs() -> tuple:
        weight = _WEIGHTS.get((n, k))
        if weight is None:
            weight = _WEIGHTS[(n, k)] = Q4KWeight.quantize(torch.randn(n, k, device="cuda") * 0.02)
        return torch.randn(m, k, device="cuda", dtype=BF16), weight

    return Q4K, q4k_linear, inputs


#: The dequant path in chunks of 4096 weight rows: four launches and four GEMMs into views of out
#: (the last a partial chunk), one scratch reused by all of them.
DEQUANT_IN_CHUNKS = {"path": "dequant", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8, "CHUNK_N": 4096}


#: The staged path (fp8 opt-in) in chunks of 2048 weight rows (seven at N=14336): a prepass, then per chunk a
#: dequantization launch and cuBLASLt's scaled fp8 GEMM into a view of out.
STAGED_IN_CHUNKS = {"path": "staged", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "CHUNK_N": 2048}


def _pinned(case: tuple[Any, Callable[..., Any], Callable[[], tuple]], config: dict[str, Any]) -> tuple:
    kernel, call, inputs = case

    def pinned(*args: Any) -> Any:
        with use_config(kernel.name, config):
            return call(*args)

    return kernel, pinned, inputs


CASES = {
    "prefill-small": lambda: _prefill(64, 16, 128),
    "prefill-long-d128": lambda: _prefill(128, 512, 16384),
    "prefill-batch2-d64": lambda: _prefill(64, 256, 4096, batch=2),
    "decode-b1-1k": lambda: _decode(1, 1024),
    "decode-b8-32k": lambda: _decode(8, 32768),
    "varlen": _varlen,
    "q4k-m1": lambda: _q4k(1, 4096, 4096),
    "q4k-m32-tma": lambda: _q4k(32, 14336, 4096),
    "q4k-m256": lambda: _q4k(256, 4096, 4096),
    # The dequant path (SM90 bundles from M=512): a dequantization launch, then cuBLAS into out
    # (replayed torch ops), whole and in chunks of weight rows.
    "q4k-m512-dequant": lambda: _q4k(512, 4096, 4096),
    "q4k-m1024-dequant-chunks": lambda: _pinned(_q4k(1024, 14336, 4096), DEQUANT_IN_CHUNKS),
    "q4k-m1024-staged-chunks": lambda: _pinned(_q4k(1024, 14336, 4096), STAGED_IN_CHUNKS),
}
#: Settings a case runs under, for the whole test: a settings change forgets every recording.
CASE_SETTINGS = {"q4k-m1024-staged-chunks": {"q4k_fp8": True}}


def _without_replay(fn: Callable[..., Any], *args: Any) -> Any:
    _replay.set_enabled(False)
    try:
        return fn(*args)
    finally:
        _replay.set_enabled(None)


@pytest.mark.parametrize("case", sorted(CASES))
def test_replayed_calls_equal_their_launch_function(case: str) -> None:
    with settings.override(**CASE_SETTINGS.get(case, {})):
        _replayed_calls_equal_their_launch_function(case)


def _replayed_calls_equal_their_launch_function(case: str) -> None:
    kernel, call, inputs = CASES[case]()
    kernel._plans.clear()
    for _ in range(4):  # compile, record, replay after the checks
        call(*inputs())
    assert any(plan is not None for plan in kernel._plans._plans.values()), f"{case}: the layout was not recorded"
    assert kernel._plans.early_entries, f"{case}: the raw arguments' layout was not remembered"
    for _ in range(3):
        args = inputs()
        replayed = call(*args)
        direct = _without_replay(call, *args)
        torch.cuda.synchronize()
        assert not replayed.isnan().any()
        assert torch.equal(replayed, direct), f"{case}: a replayed call differs from its launch function"


def test_a_passed_output_is_written_and_its_version_bumped() -> None:
    _, call, inputs = _q4k(1, 4096, 4096)
    for _ in range(3):
        call(*inputs())
    x, weight = inputs()
    out = torch.full((1, 4096), float("nan"), device="cuda", dtype=BF16)
    version = out._version
    q4k_linear(x, weight, out=out)
    assert out._version > version
    torch.testing.assert_close(out, _without_replay(q4k_linear, x, weight), rtol=0, atol=0)


#: Calls passing their output: (the case, the call with ``out`` last, which input ``out`` may alias).
OUT_CASES = {
    "decode": (lambda: _decode(1, 1024), lambda q, k, v, n, out: decode_attention(q, k, v, n, out=out), 0),
    "prefill": (
        lambda: _prefill(64, 16, 128),
        lambda q, k, v, n, out: prefill_attention(q, k, v, kv_len=n, out=out),
        0,
    ),
    "q4k-tma": (lambda: _q4k(32, 14336, 4096), lambda x, w, out: q4k_linear(x, w, out=out), None),
}


@pytest.mark.parametrize("case", sorted(OUT_CASES))
def test_calls_passing_their_output_replay_before_the_checks(case: str) -> None:
    """Once a layout with a passed output has replayed, its calls skip the checks and write that
    output, bit for bit what the launch function writes; an output aliasing an input still gets
    the checks' error."""
    make, with_out, aliased = OUT_CASES[case]
    kernel, call, inputs = make()
    kernel._plans.clear()

    def fresh_out(args: tuple) -> torch.Tensor:
        return torch.full_like(_without_replay(call, *args), float("nan"))

    for _ in range(4):
        args = inputs()
        with_out(*args, fresh_out(args))
    checks = kernel._fast
    counted: list[int] = []
    counting = type("Counted", (), {"fn": staticmethod(lambda *a: counted.append(1) or checks.fn(*a))})()
    for _ in range(3):
        args = inputs()
        out = fresh_out(args)
        # Only the call under test is counted: the launch function's own calls go through the checks.
        kernel._fast = counting
        try:
            result = with_out(*args, out)
        finally:
            kernel._fast = checks
        assert result is out
        torch.cuda.synchronize()
        assert torch.equal(out, _without_replay(call, *args)), f"{case}: the passed output differs"
    assert not counted, f"{case}: a call passing its output went through the checks"
    if aliased is not None:
        args = inputs()
        replayed = _outcome(lambda: with_out(*args, args[aliased]))
        plain = _outcome(lambda: _without_replay(with_out, *args, args[aliased]))
        assert replayed[0] == plain[0] == "error" and replayed[1:] == plain[1:]


def test_another_stream_and_a_graph_capture_after_replays() -> None:
    """Decode's fused merge keeps arrival counters per stream: a replay on another stream must use
    that stream's, and a capture after replays must record a graph that replays correctly."""
    _, call, inputs = _decode(1, 1024)
    for _ in range(4):
        call(*inputs())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(4):
            args = inputs()
            got = call(*args)
            assert torch.equal(got, _without_replay(call, *args))
    torch.cuda.current_stream().wait_stream(stream)
    q, k, v, lengths = inputs()
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k, v, lengths, out=out)
    for _ in range(2):
        fresh = inputs()
        for dst, src in zip((q, k, v, lengths), fresh, strict=True):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _without_replay(call, q, k, v, lengths))


def _outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        result = fn()
    except Exception as exc:  # the error a user would see
        return ("error", type(exc), str(exc))
    torch.cuda.synchronize()
    return ("result", result.float().cpu())


def test_arguments_the_checks_treat_otherwise_are_checked_as_without_replay() -> None:
    """A replayed layout's next call with ``causal=1`` (equal to True, another type) or a passed
    output must get what it gets with replay off: the early key tells them apart."""
    _, call, inputs = _prefill(64, 16, 128)
    for _ in range(4):
        call(*inputs())
    q, k, v, kv_len = inputs()
    calls = {
        "causal=1": lambda: prefill_attention(q, k, v, kv_len=kv_len, causal=1),
        "out passed": lambda: prefill_attention(q, k, v, kv_len=kv_len, out=torch.empty_like(q)),
        "k needs grad": lambda: prefill_attention(q, k.requires_grad_(), v, kv_len=kv_len),
    }
    for what, fn in calls.items():
        replayed, plain = _outcome(fn), _outcome(lambda fn=fn: _without_replay(fn))
        assert replayed[0] == plain[0], what
        if replayed[0] == "result":
            assert torch.equal(replayed[1], plain[1]), what
        else:
            assert replayed[1:] == plain[1:], what
        k.requires_grad_(False)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("case", ["prefill-small", "decode-b1-1k", "varlen", "q4k-m1", "q4k-m32-tma"])
def test_calls_on_another_gpu_run_there(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors on GPU 1 while GPU 0 is current (a model spread over the GPUs of one process): every
    call, repeated past the point where calls replay, writes on GPU 1 the bits the same call makes
    with GPU 1 current."""
    # The weight cache holds tensors of the current device: this test's live on GPU 1.
    monkeypatch.setitem(globals(), "_WEIGHTS", {})
    other = torch.device("cuda", 1)
    with torch.cuda.device(other):
        _, call, inputs = CASES[case]()
        args = inputs()
        expected = call(*args).clone()
        torch.cuda.synchronize()
    assert torch.cuda.current_device() != other.index
    for _ in range(5):
        got = call(*args)
        assert got.device == other
        torch.cuda.synchronize(other)
        assert torch.equal(got, expected), f"{case}: a call from another current device differs"
