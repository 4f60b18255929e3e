"""Host-side cost of tritune's public entry points per call, against the bare kernel launch.

    python scripts/measure_overhead.py [--out FILE] [--profile]

Two tables. The first runs on any machine (on one without a CUDA GPU, on CPU tensors under the
Triton interpreter, which it switches on itself): for each public entry point, the host work of a
call up to its kernel launch (input checks, facts, the dispatch lookup, the config's scalars), with
every registered op's call stubbed out so that nothing launches. That is the public path's cost
over a direct launch, which the dispatcher is built to keep under 5 us. The lookup alone (a memo hit) is shown
beside it.

With a CUDA GPU, the launch-bound tables follow. At tiny shapes the host time per call is what an
eager decode loop pays (a CUDA graph replays none of it). For each public entry point, each
variant is called N times back to back and timed on the host, the GPU synchronised before and after:

- public: the public function as a user calls it, its output allocated by the call (as the
  PyTorch call's is): in plain eager mode a layout that replayed before replays its launches
  without the checks (``kernels/_replay.py``); the same call into a given ``out`` (replayed
  without the checks as well, ``out`` checked against the inputs' memory each call); the first
  with eager replay off (input checks + facts + dispatch + the op's body, called directly);
- through torch.library: the same call with the registered op forced (what ``torch.compile``,
  dispatch modes and autograd see);
- launch: the kernel's own launch of the same config (the Triton launch plus its host-side
  set-up, no checks, no dispatch), with bound launches (``kernels/_fastlaunch.py``), with them but
  each host tensor descriptor encoded again (``kernels/_descriptor_cache.py`` off), and without
  them (through ``JITFunction.run``);
- lookup: the generated one-pass check + the dispatch lookup alone (what a call pays before it
  launches);
- the public call captured in a CUDA graph and replayed, and eager time over replay time: what an
  eager caller pays over a graph-replaying one;
- the PyTorch call a user would make instead (SDPA for prefill and decode, ``x @ W.T`` on the
  weight dequantized once for Q4_K; varlen has none), and the public call against it, each
  counted as the larger of its host and GPU time per call.

In every table the variants take turns in every round (interleaved, so clock or cache drift hits
all alike) and the median round counts. Each GPU time per call (CUDA events over the same loop)
is printed beside the host time: where it is larger, the loop was GPU-bound and the host number
is an upper bound. Also verifies that importing tritune.kernels created no CUDA context.

``--profile`` adds, per GPU table, the functions where the public call's host time goes (cProfile
over the same call, own time per call), to find what the host table's stubbed calls leave out.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import platform
import pstats
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
    """Make every declared kernel take its registered op (as under torch.compile or a dispatch mode)."""
    from tritune.kernels import declare

    original = declare.no_modes
    declare.no_modes = lambda: False
    try:
        yield
    finally:
        declare.no_modes = original


@contextlib.contextmanager
def launches_stubbed() -> Iterator[None]:
    """Make every launch a no-op: a public call then does its host work and stops there."""
    from tritune.kernels import declare

    # Both doors: the direct launch of a plain eager call, and the registered op.
    original_run, original_op = declare.run_unwrapped, declare.Kernel._call_op
    declare.run_unwrapped = lambda fn, args, mutated: None
    declare.Kernel._call_op = lambda self, config, args: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        declare.run_unwrapped = original_run
        declare.Kernel._call_op = original_op  # type: ignore[method-assign]


def bare_launch(kernel: object, config: object, *args: object) -> Callable[[], None]:
    """The kernel's own launch of ``config`` on checked arguments: no checks, no dispatch."""
    from tritune.kernels._oplib import run_unwrapped

    launch = kernel._launch  # type: ignore[attr-defined]
    return lambda: run_unwrapped(launch, (config, *args), ())


def launch_through_triton(launch: Callable[[], None]) -> Callable[[], None]:
    """``launch`` with bound launches off: every Triton launch goes through ``JITFunction.run``."""
    from tritune.kernels._fastlaunch import set_enabled

    def run() -> None:
        set_enabled(False)
        try:
            launch()
        finally:
            set_enabled(None)

    return run


def encoding_every_launch(launch: Callable[[], None]) -> Callable[[], None]:
    """``launch`` with kept descriptor encodings off: each host tensor descriptor encoded again."""
    from tritune.kernels import _descriptor_cache

    def run() -> None:
        _descriptor_cache.set_enabled(False)
        try:
            launch()
        finally:
            _descriptor_cache.set_enabled(True)

    return run


def replay_off(public: Callable[[], object]) -> Callable[[], object]:
    """``public`` with eager replay off: every call runs its launch function (``TRITUNE_EAGER_REPLAY=0``)."""
    from tritune.kernels import _replay

    def run() -> object:
        _replay.set_enabled(False)
        try:
            return public()
        finally:
            _replay.set_enabled(None)

    return run


def lookup(kernel: object, *args: object) -> Callable[[], object]:
    """The one-pass check and the dispatcher's memo hit of a call: what a call pays before its launch."""
    from tritune.kernels.dispatcher import dispatch_config_eager

    check = kernel.fast_check().fn  # type: ignore[attr-defined]
    name = kernel.name  # type: ignore[attr-defined]

    def run() -> object:
        facts, device, _ = check(*args)
        return dispatch_config_eager(name, device, facts)

    return run


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
    from tritune.kernels.device import device_info
    from tritune.kernels.dispatcher import dispatch_config_eager
    from tritune.kernels.prefill.kernel import KERNEL as PREFILL

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

    args = (q, k, v, kv_len, True, None, out)
    facts, dev, _ = PREFILL.fast_check().fn(*args)
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
        "dispatch lookup alone (prefill facts, memo hit)": lambda: dispatch_config_eager(PREFILL.name, dev, facts),
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


#: The row of a GPU table timing the PyTorch call a user would make instead, where there is one.
PEER = "the PyTorch call it replaces"


def _gpu_variants(
    kernel: object,
    public: Callable[[], object],
    into: Callable[[], object],
    args: tuple[object, ...],
    peer: tuple[str, Callable[[], object]] | None = None,
) -> tuple[dict[str, Callable[[], object]], str]:
    """The timed variants of one entry point and the config its public call serves. ``public``
    allocates its output (as the PyTorch call does), ``into`` writes a given ``out``; ``peer``:
    (what it is, the call) of the PyTorch call computing the same output, timed in the same
    interleaved rounds."""
    from tritune.kernels.dispatcher import dispatch_config_eager

    facts, device, checked = kernel.fast_check().fn(*args)  # type: ignore[attr-defined]
    config = dispatch_config_eager(kernel.name, device, facts)  # type: ignore[attr-defined]

    def through_op() -> None:
        with forced_op():
            public()

    bare = bare_launch(kernel, config, *checked)
    variants = {
        "public call": public,
        "public call into a given `out`": into,
        "public call, eager replay off (TRITUNE_EAGER_REPLAY=0)": replay_off(public),
        "public, through torch.library": through_op,
        "the kernel's launch alone (same config)": bare,
        "the same launch, its tensor descriptors encoded every launch": encoding_every_launch(bare),
        "the same launch through JITFunction.run (TRITUNE_FAST_LAUNCH=0)": launch_through_triton(bare),
        "fast check + dispatch lookup": lookup(kernel, *args),
    }
    if peer is not None:
        try:
            peer[1]()
        except Exception as exc:  # a backend this torch lacks: the table goes on without the row
            print(f"{PEER} ({peer[0]}) left out: {type(exc).__name__}: {exc}")
        else:
            variants[f"{PEER}: {peer[0]}"] = peer[1]
    return variants, bl.config_text(kernel.space.to_dict(config))  # type: ignore[attr-defined]


def gpu_tables() -> list[tuple[str, dict[str, Callable[[], object]], str]]:
    """The four public entry points at host-bound shapes, each beside its bare launch."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from tritune.kernels import Q4KWeight, decode_attention, prefill_attention, q4k_linear, varlen_attention
    from tritune.kernels.decode.kernel import KERNEL as DECODE
    from tritune.kernels.prefill.kernel import KERNEL as PREFILL
    from tritune.kernels.q4k.kernel import KERNEL as Q4K
    from tritune.kernels.varlen.kernel import KERNEL as VARLEN

    bf16, cuda = torch.bfloat16, "cuda"
    q = torch.randn(1, 16, 16, 64, device=cuda, dtype=bf16)
    k = torch.randn(1, 2, 128, 64, device=cuda, dtype=bf16)
    v, out = torch.randn_like(k), torch.empty_like(q)
    kv_len = torch.tensor(128, device=cuda, dtype=torch.int32)
    dq = torch.randn(1, 32, 1, 128, device=cuda, dtype=bf16)
    dk = torch.randn(1, 8, 1024, 128, device=cuda, dtype=bf16)
    dv, dout = torch.randn_like(dk), torch.empty_like(dq)
    lengths = torch.full((1,), 1024, device=cuda, dtype=torch.int32)
    vq = torch.randn(32, 32, 128, device=cuda, dtype=bf16)
    vk = torch.randn(1024, 4, 8, 128, device=cuda, dtype=bf16)
    vv, vout = torch.randn_like(vk), torch.empty_like(vq)
    seq_info = torch.tensor([[0, 1, 0, 900], [1, 1, 1, 300], [2, 30, 2, 30]], device=cuda, dtype=torch.int32)
    weight = Q4KWeight.quantize(torch.randn(4096, 4096, device=cuda) * 0.02)
    x, xout = torch.randn(1, 4096, device=cuda, dtype=bf16), torch.empty(1, 4096, device=cuda, dtype=bf16)
    dense = weight.dequantize().to(bf16)
    # 32 rows over a 14336 x 4096 weight: SM90's default there is the tma path (two tensor descriptors).
    weight_up = Q4KWeight.quantize(torch.randn(14336, 4096, device=cuda) * 0.02)
    x32, x32_out = torch.randn(32, 4096, device=cuda, dtype=bf16), torch.empty(32, 14336, device=cuda, dtype=bf16)
    dense_up = weight_up.dequantize().to(bf16)
    causal = causal_lower_right(16, 128)
    # As the prefill benchmark's peers: a bottom-right causal bias with the K/V heads repeated.
    k_rep, v_rep = k.repeat_interleave(8, dim=1), v.repeat_interleave(8, dim=1)
    return [
        (
            "prefill q [1, 16, 16, 64], k/v [1, 2, 128, 64] bf16",
            *_gpu_variants(
                PREFILL,
                lambda: prefill_attention(q, k, v, kv_len=kv_len),
                lambda: prefill_attention(q, k, v, kv_len=kv_len, out=out),
                (q, k, v, kv_len, True, None, out),
                (
                    "SDPA, bottom-right causal, K/V heads repeated",
                    lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=causal),
                ),
            ),
        ),
        (
            "decode q [1, 32, 1, 128], cache [1, 8, 1024, 128] bf16",
            *_gpu_variants(
                DECODE,
                lambda: decode_attention(dq, dk, dv, lengths),
                lambda: decode_attention(dq, dk, dv, lengths, out=dout),
                (dq, dk, dv, lengths, None, dout),
                ("SDPA, enable_gqa", lambda: F.scaled_dot_product_attention(dq, dk, dv, enable_gqa=True)),
            ),
        ),
        (
            "varlen q [32, 32, 128], stores [1024, 4, 8, 128], 3 segments",
            *_gpu_variants(
                VARLEN,
                lambda: varlen_attention(vq, vk, vv, seq_info),
                lambda: varlen_attention(vq, vk, vv, seq_info, out=vout),
                (vq, vk, vv, seq_info, True, None, False, None, vout),
            ),
        ),
        (
            "q4k_linear x [1, 4096], W [4096, 4096]",
            *_gpu_variants(
                Q4K,
                lambda: q4k_linear(x, weight),
                lambda: q4k_linear(x, weight, out=xout),
                (x, weight, None, xout),
                ("x @ W.T, W dequantized to bf16 once", lambda: x @ dense.t()),
            ),
        ),
        (
            "q4k_linear x [32, 4096], W [14336, 4096]",
            *_gpu_variants(
                Q4K,
                lambda: q4k_linear(x32, weight_up),
                lambda: q4k_linear(x32, weight_up, out=x32_out),
                (x32, weight_up, None, x32_out),
                ("x @ W.T, W dequantized to bf16 once", lambda: x32 @ dense_up.t()),
            ),
        ),
    ]


def graph_us(fn: Callable[[], object]) -> float:
    """Microseconds per replay of ``fn`` captured in a CUDA graph (replays back to back)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    samples = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(CALLS // 4):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / (CALLS // 4) * 1e3)
    return statistics.median(samples)


def profile_lines(fn: Callable[[], object], top: int = 15) -> list[str]:
    """The ``top`` functions by own time in ``CALLS`` calls of ``fn``, in us per call (cProfile inflates all)."""
    for _ in range(50):
        fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CALLS):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    lines = ["| function (file:line) | own us per call | calls per call |", "| --- | --- | --- |"]
    for (file, line, name), (_, calls, own, _, _) in rows:
        where = f"{file.rsplit('site-packages/', 1)[-1].rsplit('/work/', 1)[-1]}:{line}"
        lines.append(f"| `{name}` ({where}) | {own / CALLS * 1e6:.2f} | {calls / CALLS:g} |")
    return [*lines, ""]


def header(gpu: bool) -> str:
    """The report's header: device, torch / Triton / CUDA / cuDNN / Python versions, date and the real command."""
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    env = bl.environment(device, smoke=not gpu)
    if not gpu:
        env["gpu"] = f"none; CPU {platform.processor() or platform.machine()} (Triton interpreter: host tables only)"
    note = f"Host us per call: median of {ROUNDS} interleaved rounds of {CALLS} calls."
    if gpu:
        note += " GPU us: CUDA events over the same loop (GPU-bound where it exceeds the host time)."
    return bl.header_markdown(env, "Host overhead of the public calls", [note])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="add where each public call's host time goes")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    if not gpu:
        # Before the kernel modules are imported (the public functions import them on first use).
        bl.use_interpreter()

    lines = [header(gpu), *host_table("cuda" if gpu else "cpu")]
    for shape, variants, served in gpu_tables() if gpu else ():
        times = interleaved_us(variants)
        public_host, public_gpu = times["public call"]
        launch = times["the kernel's launch alone (same config)"][0]
        replay = graph_us(variants["public call"])
        lines += [
            f"**{shape}** (serves {served})",
            "",
            "| path | host us per call | GPU us per call |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {name} | {h:.1f} | {g:.1f} |" for name, (h, g) in times.items()]
        lines += [
            f"| overhead of the public call over the bare launch | {public_host - launch:.1f} | |",
            f"| CUDA-graph replay of the public call | | {replay:.1f} |",
            f"| eager / graph time per call | {max(public_host, public_gpu) / replay:.2f}x | |",
        ]
        peer = next((name for name in times if name.startswith(PEER)), None)
        if peer is not None:
            # An eager caller pays about the larger of host and GPU time per call, either way.
            ratio = max(times[peer]) / max(public_host, public_gpu)
            lines.append(f"| the public call against {PEER}, eager (above 1: faster) | {ratio:.2f}x | |")
        lines.append("")
        if args.profile:
            lines += [f"Where the public call's host time goes (cProfile, {shape}):", ""]
            lines += profile_lines(variants["public call"])
    lines.append(f"torch.cuda.is_initialized() right after `import tritune.kernels`: {CUDA_INITIALISED_AFTER_IMPORT}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
