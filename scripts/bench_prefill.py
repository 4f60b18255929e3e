"""Benchmark causal GQA prefill: tritune (untuned, tuned, best TMA / best portable) vs PyTorch peers.

Run on a GPU after tuning into a DB:

    python scripts/bench_prefill.py --db /tmp/tune.sqlite --out docs/perf/DATE-tma_prefill-GPU.md

Every implementation is checked against an fp32 reference on a sample of query rows (the first and
last 64 rows of every head) before it is timed; one that fails is reported as FAILED, never as a
speedup; a peer that cannot run is reported as unavailable. Times are medians of
``triton.testing.do_bench`` (warm-up, L2 flushed between repetitions). TFLOP/s count only unmasked
query-key pairs (4 * D flops each). On a GPU every row is also timed as a CUDA-graph replay (its
output poisoned with NaN, replayed and checked first): where an eager call's host path outlasts
the kernel and the L2 flush, the eager time measures the host, the graph time the kernel. The
report is rewritten after every shape, so a run cut short keeps what it measured. ``--smoke``
runs the same code on the CPU under ``TRITON_INTERPRET=1`` at tiny shapes: a dry run of the
script, with meaningless times (and no graph column).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

if "--smoke" in sys.argv:
    # Must precede any triton import: kernels are defined as interpreter kernels at import.
    os.environ["TRITON_INTERPRET"] = "1"

import _benchlib as bl
import torch
import torch.nn.functional as F

# B=1, Hq=16, Hkv=2, bf16; (D, Lq, Lkv)
SHAPES = [
    (64, 512, 16384),
    (64, 4096, 131072),
    (128, 512, 16384),
    (128, 1024, 131072),
    (128, 4096, 131072),
    (64, 16384, 16384),
    (128, 16384, 16384),
]
SMOKE_SHAPES = [(64, 16, 64), (64, 32, 96)]
HQ, HKV, B = 16, 2, 1
SMOKE_HQ = 4
PEERS = ("SDPA flash", "SDPA cuDNN", "FlexAttention")
#: Max |error| on the sampled rows against the fp32 reference for bf16 outputs.
TOLERANCE = 3e-2


def causal_pairs(lq: int, lkv: int) -> int:
    """Unmasked (query, key) pairs of bottom-right causal attention with Lq <= Lkv."""
    return lq * (lkv - lq) + lq * (lq + 1) // 2


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 bottom-right causal attention for the selected query rows only."""
    group = q.shape[1] // k.shape[1]
    lq, lkv = q.shape[2], k.shape[2]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q[:, :, rows].float(), kf) * scale
    position = (lkv - lq + rows)[:, None]
    scores = scores.masked_fill(torch.arange(lkv, device=q.device)[None, :] > position, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, dim=-1), vf)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default=None, help="config DB holding the tuned winners and trials")
    parser.add_argument("--out", default=None, help="markdown report to write")
    parser.add_argument("--json", default=None, help="JSON rows to write")
    parser.add_argument("--shapes", default=None, help="subset, e.g. 128x4096x131072,64x512x16384 (D x Lq x Lkv)")
    parser.add_argument("--skip-flex", action="store_true", help="leave FlexAttention out (its compile is slow)")
    parser.add_argument("--smoke", action="store_true", help="CPU dry run on the Triton interpreter at tiny shapes")
    parser.add_argument("--no-graph", action="store_true", help="eager times only (no CUDA-graph replay column)")
    args = parser.parse_args()
    bl.setup_logging()
    if args.smoke:
        bl.prepare_interpreter()
    device = bl.bench_device(args.smoke)
    db = bl.checked_db(args.db)

    from tritune.kernels import settings

    # Held for the whole run. (Entering a temporary override and dropping it, as an earlier
    # version did, let the generator be collected at once: its `finally` restored the default DB,
    # and the H200 run of 2026-11-29 12:47 timed the portable default as "tuned (dispatcher)".)
    stack = contextlib.ExitStack()
    if db:
        stack.enter_context(settings.override(db_url=db))
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]

    from tritune.kernels.device import device_info
    from tritune.kernels.prefill.spec import SPEC

    best_by_path = bl.best_trials_by_path(db, SPEC.name, SPEC.version, device_info(device).slug) if db else {}
    flex = None
    if not args.skip_flex and not args.smoke:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)

    env = bl.environment(device, args.smoke)
    rows: list[dict[str, Any]] = []
    for d, lq, lkv in shapes:
        graphs = device.type == "cuda" and not args.no_graph
        rows.extend(bench_shape(device, d, lq, lkv, best_by_path, flex, smoke=args.smoke, graphs=graphs))
        markdown = report(env, rows)
        bl.write_report(markdown, env, rows, args.out, args.json)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bl.print_report(report(env, rows))
    stack.close()
    return 0


def bench_shape(
    device: torch.device, d: int, lq: int, lkv: int, best_by_path: dict, flex: Any, *, smoke: bool, graphs: bool
) -> list[dict[str, Any]]:
    """Check, then time, every implementation at one shape (eagerly, and as a graph replay if ``graphs``)."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.bias import causal_lower_right

    from tritune.kernels import prefill_attention
    from tritune.kernels.device import device_info
    from tritune.kernels.prefill.spec import SPEC

    q_heads = SMOKE_HQ if smoke else HQ
    torch.manual_seed(0)
    q = torch.randn(B, q_heads, lq, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, lkv, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(B, HKV, lkv, d, device=device, dtype=torch.bfloat16)
    kv_len = torch.tensor(lkv, device=device, dtype=torch.int32)
    sample = torch.unique(torch.cat([torch.arange(0, min(64, lq)), torch.arange(max(0, lq - 64), lq)])).to(device)
    expected = reference_rows(q, k, v, sample, d**-0.5)
    flops = 4.0 * d * causal_pairs(lq, lkv) * B * q_heads
    shape = f"D={d} Lq={lq} Lkv={lkv}"
    # Peers get the K/V heads repeated outside the timed region where a backend lacks GQA.
    k_rep = k.repeat_interleave(q_heads // HKV, dim=1)
    v_rep = v.repeat_interleave(q_heads // HKV, dim=1)
    mask = causal_lower_right(lq, lkv)

    facts = SPEC.facts(q, k, v, causal=True, kv_len=kv_len, softmax_scale=None, out=None)
    key = SPEC.key_for(device_info(device), tuple(facts))
    impls: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("tritune portable (untuned)", pinned(SPEC.space.to_dict(SPEC.default_config(key)), q, k, v, kv_len)),
        ("tritune tuned (dispatcher)", lambda: prefill_attention(q, k, v, kv_len=kv_len)),
    ]
    for path in ("portable", "tma"):
        best = best_by_path.get((json.dumps(key.to_dict(), sort_keys=True), path))
        if best is not None:
            impls.append((f"tritune best {path} (tuned)", pinned(best, q, k, v, kv_len)))
    impls.append(("SDPA flash", lambda: sdpa(SDPBackend.FLASH_ATTENTION, q, k_rep, v_rep, mask)))
    impls.append(("SDPA cuDNN", lambda: sdpa(SDPBackend.CUDNN_ATTENTION, q, k_rep, v_rep, mask)))
    if smoke:
        impls.append(("SDPA math (smoke stand-in)", lambda: sdpa(SDPBackend.MATH, q, k_rep, v_rep, mask)))
    if flex is not None:
        from torch.nn.attention.flex_attention import create_block_mask

        offset = lkv - lq

        def causal_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return q_idx + offset >= kv_idx

        block_mask = create_block_mask(causal_mod, B=None, H=None, Q_LEN=lq, KV_LEN=lkv, device=device)
        impls.append(("FlexAttention", lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)))

    def check(out: torch.Tensor) -> str | None:
        err = float((out[:, :, sample].float() - expected).abs().max())
        return None if err <= TOLERANCE else f"max err {err:.2e}"

    rows = []
    for name, fn in impls:
        note = served_config_text(name, fn, q, k, v, kv_len) if name.startswith("tritune") else ""
        row: dict[str, Any] = {
            "shape": shape, "impl": name, "ms": None, "tflops": None, "graph_ms": None, "max_err": None, "note": note
        }  # fmt: skip
        try:
            out = fn()
            bl.synchronize(device)
            err = float((out[:, :, sample].float() - expected).abs().max())
            row["max_err"] = err
            if not err <= TOLERANCE:
                row["note"] = f"FAILED correctness check; {note}"
            else:
                row["ms"] = bl.time_ms(fn, device)
                row["tflops"] = flops / row["ms"] / 1e9
                if graphs:
                    us, status = bl.graph_time(fn, check)
                    row["graph_ms"] = None if us is None else us / 1e3
                    if status != "ok":
                        row["note"] = f"graph {status}; {row['note']}"
        except Exception as exc:  # a peer that cannot run is reported, and the run goes on
            row["note"] = "unavailable: " + bl.error_text(exc)
        rows.append(row)
        bl.log.info("%s %-30s %s ms (graph %s) %s", shape, name, bl.fmt(row["ms"], 3), bl.fmt(row["graph_ms"], 3),
                    row["note"])  # fmt: skip
    return rows


def served_config_text(name: str, fn: Callable[[], torch.Tensor], q, k, v, kv_len) -> str:
    """The config the dispatcher serves for this row (under the row's pin, if any), as the note says it."""
    from tritune.kernels import dispatcher
    from tritune.kernels._launch import device_index
    from tritune.kernels.prefill.spec import SPEC

    def served() -> str:
        facts = SPEC.facts(q, k, v, causal=True, kv_len=kv_len, softmax_scale=None, out=None)
        values = dispatcher.dispatch(SPEC.name, q.device.type, device_index(q.device), tuple(facts))
        config = dispatcher.config_from_values(SPEC, values)
        return " ".join(f"{field}={getattr(config, field)}" for field in SPEC.space.dimensions)

    pin = getattr(fn, "pin", None)
    if pin is None:
        return "served: " + served()
    from tritune.kernels import use_config

    with use_config("tma_prefill", pin):
        return "served: " + served()


def pinned(config: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor):
    from tritune.kernels import prefill_attention

    run = bl.pinned_call("tma_prefill", config, prefill_attention, q, k, v, kv_len=kv_len)
    run.pin = config  # type: ignore[attr-defined]
    return run


def sdpa(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def report(env: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    notes = [
        f"B={B}, Hq={HQ}, Hkv={HKV}, bf16, bottom-right causal, kv_len as a device tensor.",
        "Median of triton.testing.do_bench (L2 flushed). TFLOP/s count unmasked pairs only.",
        "'vs fastest peer' = fastest PyTorch peer's time / this time (>1: faster than every peer), eager and graph"
        " separately.",
        "graph: one call captured in a CUDA graph, its replay timed the same way (no host time; '-' where not run).",
        "Peers get K/V heads repeated to Hq outside the timed region.",
    ]
    lines = [
        "| shape | implementation | time (ms) | TFLOP/s | vs fastest peer | graph (ms) | graph vs fastest peer "
        "| max err (sampled rows) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        group = [r for r in rows if r["shape"] == shape]
        peer_times = [r["ms"] for r in group if r["impl"] in PEERS and r["ms"] is not None]
        fastest = min(peer_times) if peer_times else None
        peer_graphs = [r["graph_ms"] for r in group if r["impl"] in PEERS and r.get("graph_ms") is not None]
        fastest_graph = min(peer_graphs) if peer_graphs else None
        for r in group:
            err = "-" if r["max_err"] is None else f"{r['max_err']:.2e}"
            graph_ms = r.get("graph_ms")
            lines.append(
                f"| {shape} | {r['impl']} | {bl.fmt(r['ms'], 3)} | {bl.fmt(r['tflops'], 0)} | "
                f"{bl.ratio(fastest, r['ms'])} | {bl.fmt(graph_ms, 3)} | {bl.ratio(fastest_graph, graph_ms)} | "
                f"{err} | {r['note']} |"
            )
    return bl.header_markdown(env, "tma_prefill vs PyTorch peers", notes) + "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
