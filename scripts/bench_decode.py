"""Benchmark GQA decode attention over a KV cache: tritune (untuned, tuned) vs SDPA flash, SDPA cuDNN, FlexAttention.

On the GPU machine, after tuning ``splitk_decode`` into a DB:

    python scripts/bench_decode.py --db /tmp/tune.sqlite --out decode.md --json decode.json

Hq=32, Hkv=8, D=128, bf16, one new token per sequence, B x Lkv over a cache of exactly Lkv positions.
``kv_len`` is Lkv for every sequence, or drawn per sequence with ``--ragged``. Every implementation is
checked against the fp64 reference (``tritune.kernels.decode.reference``) before it is timed; one that
fails is reported as FAILED, a peer that cannot run as unavailable with its error, one of our rows
raising as FAILED. Each is timed eagerly (the larger of ``do_bench``, L2 flushed, and the host time
per call) and as one captured CUDA graph replayed under ``do_bench`` (same L2 flush); the graph
output is poisoned with NaN and checked again after a replay. Effective bandwidth
counts the bytes of K and V the valid lengths need (2 x sum(kv_len) x Hkv x D x 2 B), the same for
every implementation, so it compares times rather than measuring what each one really reads.

``--smoke`` runs the same code on the CPU under ``TRITON_INTERPRET=1`` at tiny shapes (no CUDA graphs,
no cuDNN): a dry run that proves the script works before GPU time is spent on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import _bench_timing as bt
import _benchlib as bl
import torch

log = logging.getLogger("tritune.bench")

HQ, HKV, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32, 64)
LKVS = (4096, 32768, 131072)
SMOKE_BATCHES = (1, 3)
SMOKE_LKVS = (160,)
PEERS = ("SDPA flash", "SDPA cuDNN", "FlexAttention")
UNTUNED = "tritune untuned (portable default)"
TUNED = "tritune tuned (dispatcher)"


@dataclass
class Row(bt.TimedRow):
    batch: int
    lkv: int
    ragged: bool
    kv_bytes: int
    max_err: float | None = None

    def tbps(self, us: float | None) -> float | None:
        return bl.tera_per_s(self.kv_bytes, us)


@dataclass
class Impl:
    name: str
    fn: Callable[[], torch.Tensor] | None
    note: str = ""
    #: Why it cannot run here (reported as unavailable); ``fn`` is then None.
    error: str = ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_common_arguments(parser)
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default 1 8 32 64)")
    parser.add_argument("--lkv", type=int, action="append", help="cache lengths (default 4096 32768 131072)")
    parser.add_argument("--ragged", action="store_true", help="per-sequence kv_len drawn from U[1, Lkv]")
    parser.add_argument("--max-kv-gb", type=float, default=40.0, help="skip combinations whose K+V exceed this")
    args = parser.parse_args()
    run = bl.start(args)
    batches = args.batch or list(SMOKE_BATCHES if args.smoke else BATCHES)
    lkvs = args.lkv or list(SMOKE_LKVS if args.smoke else LKVS)
    flex = None if args.skip_flex else bl.compiled_flex()

    rows: list[Row] = []
    with bl.tuned_db(run.db):
        for batch in batches:
            for lkv in lkvs:
                kv_gb = 2 * batch * HKV * lkv * HEAD_DIM * DTYPE.itemsize / 1e9
                if kv_gb > args.max_kv_gb:
                    log.info(
                        "skip B=%d Lkv=%d: K+V would take %.1f GB (> --max-kv-gb %.0f)",
                        batch,
                        lkv,
                        kv_gb,
                        args.max_kv_gb,
                    )
                    continue
                rows.extend(bench_shape(batch, lkv, args, run, flex))
                bl.write_report(_report(rows, args, run), run.env, [_json_row(r) for r in rows], args.out, args.json)
                if run.device.type == "cuda":
                    torch.cuda.empty_cache()
    bl.print_report(_report(rows, args, run))
    return 0


def _json_row(r: Row) -> dict:
    return {**dataclasses.asdict(r), "eager_tbps": r.tbps(r.eager_us), "graph_tbps": r.tbps(r.graph_us)}


def draw_lengths(batch: int, lkv: int, ragged: bool, seed: int) -> torch.Tensor:
    """int32 [B] on the host: Lkv everywhere, or U[1, Lkv] with the first sequence full (the longest split plan)."""
    if not ragged:
        return torch.full((batch,), lkv, dtype=torch.int32)
    lengths = torch.randint(1, lkv + 1, (batch,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    lengths[0] = lkv
    return lengths


def bench_shape(batch: int, lkv: int, args: argparse.Namespace, run: bl.BenchRun, flex) -> list[Row]:
    """Check, then time (eager and CUDA graph), every implementation at one (B, Lkv)."""
    from tritune.kernels.decode.reference import compare, decode_reference

    device = run.device
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q = torch.randn(batch, HQ, 1, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    k = torch.randn(batch, HKV, lkv, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    v = torch.randn(batch, HKV, lkv, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    lengths = draw_lengths(batch, lkv, args.ragged, args.seed)
    kv_len = lengths.to(device)
    kv_bytes = 2 * int(lengths.sum()) * HKV * HEAD_DIM * DTYPE.itemsize
    expected = decode_reference(q, k, v, kv_len)
    log.info(
        "B=%d Lkv=%d%s: K+V %.2f GB, reference ready",
        batch,
        lkv,
        " ragged" if args.ragged else "",
        2 * k.numel() * DTYPE.itemsize / 1e9,
    )
    # Ragged lengths need a padding mask for SDPA; uniform ones need none (the cache is exactly Lkv long).
    mask = None
    if args.ragged:
        mask = (torch.arange(lkv, device=device)[None, :] < kv_len[:, None])[:, None, None, :]  # [B, 1, 1, Lkv]

    from torch.nn.attention import SDPBackend

    impls = [
        *_tritune_impls(q, k, v, kv_len),
        _sdpa_impl("SDPA flash", SDPBackend.FLASH_ATTENTION, q, k, v, mask),
        _sdpa_impl("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION, q, k, v, mask),
    ]
    if flex is not None:
        impls.append(_flex_impl(flex, q, k, v, kv_len))

    def recheck(out: torch.Tensor) -> str | None:
        return compare(out, expected, DTYPE)

    rows = []
    for impl in impls:
        row = Row(batch=batch, lkv=lkv, ragged=args.ragged, kv_bytes=kv_bytes, impl=impl.name, note=impl.note)

        def check(out: torch.Tensor, row: Row = row) -> str | None:
            row.max_err = float((out.double() - expected).abs().max())
            return recheck(out)

        raised = "FAILED" if impl.name in (UNTUNED, TUNED) else "unavailable"
        rows.append(
            bt.measure(row, impl.fn, check, device, run.graphs, error=impl.error, raised=raised, recheck=recheck)
        )
        _log_row(row)
    return rows


def _tritune_impls(q, k, v, kv_len) -> list[Impl]:
    from tritune.kernels import decode_attention
    from tritune.kernels.decode.kernel import KERNEL as SPEC
    from tritune.kernels.device import device_info

    facts = SPEC.facts(q, k, v, kv_len)
    key = SPEC.key_for(device_info(q.device), facts)
    untuned = SPEC.space.to_dict(SPEC.default_config(key))
    served = bl.served_config(SPEC, facts, q.device)

    run_untuned = bl.pinned_call(SPEC.name, untuned, decode_attention, q, k, v, kv_len)

    def run_tuned() -> torch.Tensor:
        return decode_attention(q, k, v, kv_len)

    tag = "same as untuned" if served == untuned else "tuned"
    return [
        Impl(UNTUNED, run_untuned, note=bl.config_text(untuned)),
        Impl(TUNED, run_tuned, note=f"{tag}: {bl.config_text(served)}{bl.eager_note(SPEC, facts, q.device)}"),
    ]


def _sdpa_impl(name: str, backend, q, k, v, mask) -> Impl:
    """SDPA pinned to one backend, GQA native where it takes ``enable_gqa``; the note names the backend that ran."""
    peer = bl.sdpa_peer(backend, q, k, v, attn_mask=mask)
    if peer.fn is None:
        return Impl(name, None, error=peer.error)
    return Impl(name, peer.fn, note=bl.join_notes(peer.note, bl.backend_ran(peer.fn, q.device)))


def _flex_impl(flex, q, k, v, kv_len) -> Impl:
    from torch.nn.attention.flex_attention import create_block_mask

    batch, lkv = k.shape[0], k.shape[2]

    def within_kv_len(b, h, q_idx, kv_idx):
        return kv_idx < kv_len[b]

    try:
        block_mask = create_block_mask(within_kv_len, B=batch, H=None, Q_LEN=1, KV_LEN=lkv, device=q.device)
    except Exception as exc:
        return Impl("FlexAttention", None, error=f"create_block_mask: {bl.error_text(exc)}")
    return Impl(
        "FlexAttention",
        lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True),
        note="torch.compile(flex_attention), block mask kv_idx < kv_len[b], enable_gqa=True",
    )


def _log_row(r: Row) -> None:
    bl.log_row(f"B={r.batch:<3d} Lkv={r.lkv:<6d} {r.impl:<36s}", r, r.tbps, "TB/s", f"err={bl.fmt(r.max_err, 4)}")


def _report(rows: list[Row], args: argparse.Namespace, run: bl.BenchRun) -> str:
    env, db = run.env, run.db
    peak = bl.HBM_TBPS.get(env["gpu"])
    notes = [
        f"Hq={HQ}, Hkv={HKV}, D={HEAD_DIM}, bf16, 1 new token per sequence; cache [B, Hkv, Lkv, D] of exactly Lkv "
        + (
            "positions, per-sequence kv_len drawn from U[1, Lkv] (sequence 0 full); SDPA gets a padding mask."
            if args.ragged
            else "positions, kv_len = Lkv for every sequence."
        ),
        "Times: median of triton.testing.do_bench (warm-up, L2 flushed before every repetition), in us. "
        "Graph: one call captured in a CUDA graph, replay() timed the same way (output NaN-poisoned and "
        "re-checked after a replay first).",
        bt.EAGER_NOTE,
        "SDPA peers get the cache itself with enable_gqa=True (the bytes ours reads); a backend refusing it "
        "gets K/V heads repeated outside the timed region, as its note says. Each SDPA row's note names "
        "the backend that ran ('ran: ...', from torch.profiler over one call at warm-up).",
        "TB/s: effective K+V bandwidth, 2 x sum(kv_len) x Hkv x D x 2 bytes / time, the same bytes for every "
        "implementation" + (f" (HBM peak of this GPU: about {peak} TB/s)." if peak else "."),
        "vs peer: fastest passing peer (SDPA flash, SDPA cuDNN, FlexAttention) time / this time, eager and graph "
        "separately; above 1.00x is faster than every peer.",
        "Checked against the fp64 reference (tritune.kernels.decode.reference.compare, bf16 tolerance) before "
        "timing; FAILED rows are never timed.",
        f"Tuned configs: {'DB ' + db if db else 'default settings (user DB and shipped bundles)'}; untuned = "
        "portable default pinned with use_config.",
    ]
    notes.append(bt.HOST_NOTE)
    if not run.graphs:
        notes.append("CUDA graphs: not measured (" + ("CPU smoke run" if env["smoke"] else "--no-graph") + ").")
    text = bl.header_markdown(env, "Decode attention (splitk_decode)", notes)
    lines = [
        "| B | Lkv | implementation | check | max err | eager us | eager TB/s | eager vs peer | host us | graph us "
        "| graph TB/s | graph vs peer | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape in dict.fromkeys((r.batch, r.lkv) for r in rows):
        group = [r for r in rows if (r.batch, r.lkv) == shape]
        eager_peer, graph_peer = bl.fastest(group, PEERS, "eager_us"), bl.fastest(group, PEERS, "graph_us")
        for r in group:
            graph_cell, note = bl.graph_cells(r)
            lines.append(
                f"| {r.batch} | {r.lkv} | {r.impl} | {r.status} | {bl.fmt(r.max_err, 4)} | {bl.fmt(r.eager_us, 1)} "
                f"| {bl.fmt(r.tbps(r.eager_us), 2)} | {bl.ratio(eager_peer, r.eager_us)} | {bl.fmt(r.host_us, 1)} "
                f"| {graph_cell} "
                f"| {bl.fmt(r.tbps(r.graph_us), 2)} | {bl.ratio(graph_peer, r.graph_us)} | {note} |"
            )
    return text + "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
