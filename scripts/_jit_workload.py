"""One scripted model-like workload over the four kernels, for ``bench_jit.py``.

Run as a script in a process of its own (the settings it is measured under come from the
environment ``bench_jit.py`` gives it)::

    python scripts/_jit_workload.py --device 0 --json calls.json [--smoke]

It calls prefill chunks over long KV caches, decode steps of several batch sizes, one varlen
serving step and Q4_K linears at several M, each shape twice, and writes one JSON row per call:
the kernel, the tuning key of the call (as the dispatcher derives it), the config served, and the
wall time of the first and second call (the first includes any online tuning of its key). With
``--smoke`` the shapes are tiny and the kernels run on the Triton interpreter (CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _benchlib as bl
import torch

DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Call:
    """One shape of one kernel: the public call and the arguments the key is derived from."""

    kernel: str
    label: str
    fn: Callable[[], Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _prefill_calls(device: torch.device, smoke: bool) -> list[Call]:
    from tritune.kernels import prefill_attention

    shapes = [(16, 64)] if smoke else [(512, 16384), (2048, 65536), (4096, 131072)]
    heads, kv_heads, dim = (4, 2, 64) if smoke else (32, 8, 128)
    calls = []
    for lq, lkv in shapes:
        q = torch.randn(1, heads, lq, dim, device=device, dtype=DTYPE)
        k = torch.randn(1, kv_heads, lkv, dim, device=device, dtype=DTYPE)
        v = torch.randn_like(k)
        kv_len = torch.full((1,), lkv, dtype=torch.int32, device=device)
        kwargs = {"causal": True, "kv_len": kv_len}
        calls.append(
            Call(
                "tma_prefill",
                f"Lq={lq} Lkv={lkv}",
                lambda q=q, k=k, v=v, kw=kwargs: prefill_attention(q, k, v, **kw),
                (q, k, v),
                kwargs,
            )
        )
    return calls


def _decode_calls(device: torch.device, smoke: bool) -> list[Call]:
    from tritune.kernels import decode_attention

    shapes = [(1, 64), (2, 128)] if smoke else [(1, 4096), (8, 32768), (64, 4096)]
    heads, kv_heads, dim = (4, 2, 64) if smoke else (32, 8, 128)
    calls = []
    for batch, lkv in shapes:
        q = torch.randn(batch, heads, 1, dim, device=device, dtype=DTYPE)
        k = torch.randn(batch, kv_heads, lkv, dim, device=device, dtype=DTYPE)
        v = torch.randn_like(k)
        kv_len = torch.full((batch,), lkv, dtype=torch.int32, device=device)
        calls.append(
            Call(
                "splitk_decode",
                f"B={batch} Lkv={lkv}",
                lambda q=q, k=k, v=v, n=kv_len: decode_attention(q, k, v, n),
                (q, k, v, kv_len),
                {},
            )
        )
    return calls


def _varlen_calls(device: torch.device, smoke: bool) -> list[Call]:
    import _varlen_workload as vw

    from tritune.kernels import varlen_attention

    mix = (
        vw.MixSpec("smoke", decodes=3, chunks=1, chunk=16, kv_min=16, kv_max=64, q_heads=4, kv_heads=2, head_dim=64)
        if smoke
        else vw.MIXES["mixed"]
    )
    w = vw.build_workload(mix, device, seed=0)
    args = (w.q, w.k_store, w.v_store, w.seq_info)
    return [Call("varlen_sdpa", f"mix={mix.name}", lambda a=args: varlen_attention(*a), args, {})]


def _q4k_calls(device: torch.device, smoke: bool) -> list[Call]:
    from tritune.kernels import Q4KWeight, q4k_linear

    shapes = [(256, 64)] if smoke else [(4096, 14336)]
    ms = (1, 3, 16) if smoke else (1, 16, 4096)
    calls = []
    for k_dim, n in shapes:
        weight = Q4KWeight.quantize(torch.randn(n, k_dim, device=device) * 0.02)
        for m in ms:
            x = torch.randn(m, k_dim, device=device, dtype=DTYPE)
            calls.append(
                Call("q4k_fp8_gemm", f"M={m} K={k_dim} N={n}", lambda x=x, w=weight: q4k_linear(x, w), (x, weight), {})
            )
    return calls


def run(device: torch.device, smoke: bool) -> list[dict[str, Any]]:
    """Each call twice, timed; its key and served config from the dispatcher's own derivation."""
    from tritune.kernels.device import device_info
    from tritune.kernels.registry import get_spec

    info = device_info(device)
    rows = []
    for build in (_prefill_calls, _decode_calls, _varlen_calls, _q4k_calls):
        for call in build(device, smoke):
            spec = get_spec(call.kernel)
            facts = tuple(spec.facts(*call.args, **call.kwargs))
            key = spec.key_for(info, facts)
            seconds = []
            for _ in range(2):
                bl.synchronize(device)
                start = time.perf_counter()
                call.fn()
                bl.synchronize(device)
                seconds.append(time.perf_counter() - start)
            served = bl.served_config(spec, facts, device)
            rows.append(
                {
                    "kernel": call.kernel,
                    "label": call.label,
                    "key": dataclasses.asdict(key),
                    "served": served,
                    "first_s": seconds[0],
                    "second_s": seconds[1],
                }
            )
            print(f"{call.kernel} {call.label}: first {seconds[0]:.3f} s, then {seconds[1] * 1e3:.3f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="0", help="a CUDA index, or cpu (with --smoke)")
    parser.add_argument("--json", required=True, help="file to write the call rows to")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the Triton interpreter (CPU)")
    parser.add_argument(
        "--fake-triton-version", default=None, help="pretend to run this Triton version (stored configs then differ)"
    )
    args = parser.parse_args(argv)
    if args.fake_triton_version:
        import triton

        triton.__version__ = args.fake_triton_version
    if args.smoke:
        bl.use_interpreter()
    bl.setup_logging()
    device = bl.bench_device(args.smoke)
    torch.manual_seed(0)
    rows = run(device, args.smoke)
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
