"""Host-side cost of tritune's public entry points per call, against the bare kernel launch.

    python scripts/measure_overhead.py [--out FILE]

Two tables. The first runs on any machine (on one without a CUDA GPU, on CPU tensors under the
Triton interpreter, which it switches on itself): for each public entry point, the host work of a
call up to its kernel launch (input checks, facts, the dispatch lookup, the config's scalars), with
every registered op's call stubbed out so that nothing launches. That is the public path's cost
over a direct launch, which the dispatcher is built to keep under 5 us. The lookup alone (a memo hit) is shown
beside it.

With a CUDA GPU, the launch-bound tables follow. At tiny shapes the host time per call is what an
eager decode loop pays (a CUDA graph replays none of it). For prefill and decode, each variant is
called N times back to back and timed on the host, the GPU synchronised before and after:

- public: the public function (input checks + facts + dispatch + the op's body, called directly
  in plain eager mode);
- through torch.library: the same call with the registered op forced (what ``torch.compile``,
  dispatch modes and autograd see);
- launch: the spec's launch of the same config (the Triton launch plus its host-side set-up,
  no checks, no dispatch);
- lookup: facts + dispatch alone (the dict lookup the dispatcher promises).

In every table the variants take turns in every round (interleaved, so clock or cache drift hits
all alike) and the median round counts. Each GPU time per call (CUDA events over the same loop)
is printed beside the host time: where it is larger, the loop was GPU-bound and the host number
is an upper bound. Also verifies that importing tritune.kernels created no CUDA context.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator

import _benchlib as bl
import torch

import tritune.kernels  # noqa: F401  (import first: must not initialise CUDA)

CUDA_INITIALISED_AFTER_IMPORT = torch.cuda.is_initialized()
CALLS = 2000
ROUNDS = 7


@contextlib.contextmanager
def forced_op() -> Iterator[None]:
    """Make every TritonOp take the registered op (as under torch.compile or a dispatch mode)."""
    from tritune.kernels import _oplib

    original = _oplib._plain_eager
    _oplib._plain_eager = lambda args: False
    try:
        yield
    finally:
        _oplib._plain_eager = original


@contextlib.contextmanager
def launches_stubbed() -> Iterator[None]:
    """Make every registered op's call a no-op: a public call then does its host work and stops there."""
    from tritune.kernels._oplib import TritonOp

    # Both doors: the public wrappers call ``call_body`` themselves in plain eager mode.
    original_call, original_body = TritonOp.__call__, TritonOp.call_body
    TritonOp.__call__ = lambda self, *args: None  # type: ignore[method-assign]
    TritonOp.call_body = lambda self, args: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        TritonOp.__call__ = original_call  # type: ignore[method-assign]
        TritonOp.call_body = original_body  # type: ignore[method-assign]


def host_us(variants: dict[str, Callable[[], object]]) -> dict[str, tuple[float, float]]:
    """Median and fastest round's host microseconds per call of each variant (nothing launches).

    The fastest round is shown too: on a shared machine other processes inflate some rounds.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        for _ in range(200):
            fn()
    for _ in range(ROUNDS):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            times[name].append((time.perf_counter() - start) / CALLS * 1e6)
    return {name: (statistics.median(samples), min(samples)) for name, samples in times.items()}


def host_variants(device: str) -> dict[str, Callable[[], object]]:
    """Each public entry point at a small serving shape, and the dispatch lookup alone."""
    from tritune.kernels import (
        Q4KWeight,
        attention,
        decode_attention,
        prefill_attention,
        q4k_linear,
        use_config,
        varlen_attention,
    )
    from tritune.kernels._launch import device_index
    from tritune.kernels.device import device_info
    from tritune.kernels.dispatcher import dispatch
    from tritune.kernels.prefill.spec import SPEC as PREFILL

    bf16 = torch.bfloat16
    q = torch.randn(1, 16, 16, 64, device=device, dtype=bf16)
    k = torch.randn(1, 2, 128, 64, device=device, dtype=bf16)
    v, out = torch.randn_like(k), torch.empty_like(q)
    kv_len = torch.tensor(128, device=device, dtype=torch.int32)

    dq = torch.randn(1, 32, 1, 128, device=device, dtype=bf16)
    dk = torch.randn(1, 8, 1024, 128, device=device, dtype=bf16)
    dv, dout = torch.randn_like(dk), torch.empty_like(dq)
    lengths = torch.full((1,), 1024, device=device, dtype=torch.int32)

    vq = torch.randn(32, 32, 128, device=device, dtype=bf16)
    vk = torch.randn(1024, 4, 8, 128, device=device, dtype=bf16)
    vv, vout = torch.randn_like(vk), torch.empty_like(vq)
    seq_info = torch.tensor([[0, 1, 0, 900], [1, 1, 1, 300], [2, 30, 2, 30], [32, 0, 3, 0]], device=device)
    seq_info = seq_info.to(torch.int32)

    n, kdim = 4096, 4096
    u8 = dict(device=device, dtype=torch.uint8)
    weight = Q4KWeight(
        torch.zeros(n, kdim // 2, **u8),
        torch.zeros(n, kdim // 32, **u8),
        torch.zeros(n, kdim // 32, **u8),
        torch.zeros(n, kdim // 256, 2, device=device, dtype=torch.float16),
    )
    x, xout = torch.randn(1, kdim, device=device, dtype=bf16), torch.empty(1, n, device=device, dtype=bf16)

    # An indexed device: the dispatcher keys CUDA devices by ordinal (a bare "cuda" has none).
    dev = q.device
    facts = tuple(PREFILL.facts(q, k, v, causal=True, kv_len=kv_len, softmax_scale=1 / math.sqrt(64), out=out))
    pin = PREFILL.space.to_dict(PREFILL.default_config(PREFILL.key_for(device_info(dev), facts)))

    def pinned_each_call() -> object:
        with use_config(PREFILL.name, pin):
            return prefill_attention(q, k, v, kv_len=kv_len, out=out)

    pinned_inside = bl.pinned_call(PREFILL.name, pin, prefill_attention, q, k, v, kv_len=kv_len, out=out)
    return {
        "`prefill_attention` q [1, 16, 16, 64], k/v [1, 2, 128, 64], kv_len []": lambda: prefill_attention(
            q, k, v, kv_len=kv_len, out=out
        ),
        "`prefill_attention`, `with use_config(...)` around each call": pinned_each_call,
        "`prefill_attention` inside a long-lived `use_config`": pinned_inside,
        "`attention`, routed to prefill (same call)": lambda: attention(q, k, v, kv_len=kv_len, out=out),
        "`decode_attention` q [1, 32, 1, 128], cache [1, 8, 1024, 128]": lambda: decode_attention(
            dq, dk, dv, lengths, out=dout
        ),
        "`attention`, routed to decode (same call)": lambda: attention(dq, dk, dv, kv_len=lengths, out=dout),
        "`varlen_attention` q [32, 32, 128], stores [1024, 4, 8, 128], S=4": lambda: varlen_attention(
            vq, vk, vv, seq_info, out=vout
        ),
        "`q4k_linear` x [1, 4096], W [4096, 4096]": lambda: q4k_linear(x, weight, out=xout),
        "dispatch lookup alone (prefill facts, memo hit)": lambda: dispatch(
            PREFILL.name, dev.type, device_index(dev), facts
        ),
    }


def host_table(device: str) -> list[str]:
    with launches_stubbed():
        times = host_us(host_variants(device))
    return [
        f"**Host work before the launch ({device} tensors; every op call stubbed out, so nothing launches)**",
        "",
        "| entry point | host us per call (median) | fastest round |",
        "| --- | --- | --- |",
        *(f"| {name} | {median:.2f} | {fastest:.2f} |" for name, (median, fastest) in times.items()),
        "",
    ]


def interleaved_us(variants: dict[str, Callable[[], object]]) -> dict[str, tuple[float, float]]:
    """Median host and GPU microseconds per call of each variant."""
    host: dict[str, list[float]] = {name: [] for name in variants}
    gpu: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        for _ in range(50):
            fn()
    for _ in range(ROUNDS):
        for name, fn in variants.items():
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            start_event.record()
            for _ in range(CALLS):
                fn()
            end_event.record()
            host_s = time.perf_counter() - start
            torch.cuda.synchronize()
            host[name].append(host_s / CALLS * 1e6)
            gpu[name].append(start_event.elapsed_time(end_event) / CALLS * 1e3)
    return {name: (statistics.median(host[name]), statistics.median(gpu[name])) for name in variants}


def prefill_variants() -> tuple[str, dict[str, Callable[[], object]]]:
    from tritune.kernels import prefill_attention
    from tritune.kernels.dispatcher import config_from_values, dispatch
    from tritune.kernels.prefill.spec import SPEC

    q = torch.randn(1, 16, 16, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kv_len = torch.tensor(128, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    kwargs = dict(causal=True, kv_len=kv_len, softmax_scale=None, out=out)
    config = config_from_values(SPEC, dispatch(SPEC.name, "cuda", 0, tuple(SPEC.facts(q, k, v, **kwargs))))

    def through_op() -> None:
        with forced_op():
            prefill_attention(q, k, v, kv_len=kv_len, out=out)

    shape = f"prefill q [1, 16, 16, 64], k/v [1, 2, 128, 64] bf16, served {config}"
    return shape, {
        "public `prefill_attention`": lambda: prefill_attention(q, k, v, kv_len=kv_len, out=out),
        "public, through torch.library": through_op,
        "`SPEC.launch` (same config)": lambda: SPEC.launch(config, q, k, v, **kwargs),
        "facts + dispatch lookup": lambda: dispatch(SPEC.name, "cuda", 0, tuple(SPEC.facts(q, k, v, **kwargs))),
    }


def decode_variants() -> tuple[str, dict[str, Callable[[], object]]]:
    from tritune.kernels import decode_attention
    from tritune.kernels.decode.spec import SPEC
    from tritune.kernels.dispatcher import config_from_values, dispatch

    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kv_len = torch.full((1,), 1024, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    facts = lambda: tuple(SPEC.facts(q, k, v, kv_len, softmax_scale=None, out=out))  # noqa: E731
    config = config_from_values(SPEC, dispatch(SPEC.name, "cuda", 0, facts()))

    def through_op() -> None:
        with forced_op():
            decode_attention(q, k, v, kv_len, out=out)

    shape = f"decode q [1, 32, 1, 128], cache [1, 8, 1024, 128] bf16, served {config}"
    return shape, {
        "public `decode_attention`": lambda: decode_attention(q, k, v, kv_len, out=out),
        "public, through torch.library": through_op,
        "`SPEC.launch` (same config)": lambda: SPEC.launch(config, q, k, v, kv_len, out=out),
        "facts + dispatch lookup": lambda: dispatch(SPEC.name, "cuda", 0, facts()),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    if not gpu:
        # Before the kernel modules are imported (the public functions import them on first use).
        bl.use_interpreter()

    where = f"GPU: {torch.cuda.get_device_name()}" if gpu else f"CPU: {platform.processor() or platform.machine()}"
    lines = [
        f"{where} | torch {torch.__version__} | triton {__import__('triton').__version__}",
        "Command: `python scripts/measure_overhead.py`",
        f"Host us per call: median of {ROUNDS} interleaved rounds of {CALLS} calls."
        + (" GPU us: CUDA events over the same loop (GPU-bound where it exceeds the host time)." if gpu else ""),
        "",
        *host_table("cuda" if gpu else "cpu"),
    ]
    for build in (prefill_variants, decode_variants) if gpu else ():
        shape, variants = build()
        times = interleaved_us(variants)
        public = next(iter(times.values()))[0]
        launch = times["`SPEC.launch` (same config)"][0]
        lines += [f"**{shape}**", "", "| path | host us per call | GPU us per call |", "| --- | --- | --- |"]
        lines += [f"| {name} | {h:.1f} | {g:.1f} |" for name, (h, g) in times.items()]
        lines += [f"| overhead of the public path over the launch | {public - launch:.1f} | |", ""]
    lines.append(f"torch.cuda.is_initialized() right after `import tritune.kernels`: {CUDA_INITIALISED_AFTER_IMPORT}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
