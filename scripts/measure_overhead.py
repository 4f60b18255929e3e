"""Host-side cost of tritune's public entry points per call, against the bare kernel launch.

    python scripts/measure_overhead.py [--out FILE]

At tiny, launch-bound shapes the host time per call is what an eager decode loop pays (a CUDA
graph replays none of it). For prefill and decode, each variant is called N times back to back
and timed on the host, the GPU synchronised before and after; the variants take turns in every
round (interleaved, so clock or cache drift hits all alike) and the median round counts:

- public: the public function (input checks + facts + dispatch + the op's body, called directly
  in plain eager mode);
- through torch.library: the same call with the registered op forced (what ``torch.compile``,
  dispatch modes and autograd see);
- launch: the spec's launch of the same config (the Triton launch plus its host-side set-up,
  no checks, no dispatch);
- lookup: facts + dispatch alone (the dict lookup the dispatcher promises).

Each GPU time per call (CUDA events over the same loop) is printed beside it: where it is larger
than the host time, the loop was GPU-bound and the host number is an upper bound.
Also verifies that importing tritune.kernels created no CUDA context.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

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

    lines = [
        f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}",
        "Command: `python scripts/measure_overhead.py`",
        f"Host us per call: median of {ROUNDS} interleaved rounds of {CALLS} calls. GPU us: CUDA events over the"
        " same loop (GPU-bound where it exceeds the host time).",
        "",
    ]
    for build in (prefill_variants, decode_variants):
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
