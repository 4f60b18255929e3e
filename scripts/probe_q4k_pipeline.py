"""Probe: where the portable Q4_K kernel's time goes at mid M, by loop variants of one kernel.

The portable kernel dequantizes its weight tile in registers from plain loads, so the pipeliner
may leave the code words' latency exposed each K step. The variants here change one thing each:

- ``prefetch``: the next K step's codes, scales and super-scales are loaded before the current
  step is dequantized (a register double buffer);
- ``desc``: the code words come through a tensor descriptor (TMA), which the pipeliner buffers
  ``num_stages`` deep in shared memory;
- ``swap``: the dequantized tile is the MMA's A operand (registers) and x^T its B operand, so the
  weight never goes through shared memory as a B operand; the tile is stored transposed;
- ``gluon``, ``gluon-swap``: the loop written out in Gluon (``_probe_q4k_gluon.py``): x by TMA
  through mbarriers, the dequantized tile double-buffered in shared memory, one wgmma left in
  flight while the next tile is dequantized, ``W x^T`` for small M with ``-swap``; ``gluon-tma``
  adds the code words to the TMA ring and loads the scales three steps ahead.

Every variant is checked against ``x @ dequant(W)^T`` in float32 before it is timed, as a CUDA
graph replay over four weight copies (past the L2), median of ``triton.testing.do_bench``.

    python scripts/probe_q4k_pipeline.py --m 16 64 128 256 512 --out probe.md
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _probe_q4k_gluon import run_gluon

from tritune.kernels.q4k._triton_common import _codes_as_float, _small_as_float
from tritune.kernels.q4k.weight import Q4KWeight


@triton.jit
def _weight_tile(qw, scale_raw, mins_raw, d, dmin, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    G: tl.constexpr = BLOCK_K // 32
    scale = d * _small_as_float(scale_raw)
    offset = dmin * _small_as_float(mins_raw)
    q = tl.reshape(_codes_as_float(qw, BLOCK_N, BLOCK_K, 8), (BLOCK_N, G, 32))
    return tl.reshape(q * scale[:, :, None] - offset[:, :, None], (BLOCK_N, BLOCK_K)).to(DTYPE)


@triton.jit
def _probe_kernel(
    x_ptr, qs_ptr, q_desc, sc_ptr, mn_ptr, ss_ptr, out_ptr, M, N,
    stride_xm, stride_qn, stride_sn, stride_ssn, stride_om, stride_ok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
    PREFETCH: tl.constexpr, DESC: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = BLOCK_K // 32
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(2)
    pid_k = tl.program_id(1)
    k_start = pid_k * (K_TILES * BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_n = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_g = tl.arange(0, G)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    q_ptrs = (qs_ptr + rows_n[:, None] * stride_qn + k_start // 2).to(tl.pointer_type(tl.int32)) + offs_w[None, :]
    sc_ptrs = sc_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    mn_ptrs = mn_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    ss_row = ss_ptr + rows_n[:, None] * stride_ssn
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        d_ptrs = ss_row + ((k_start // 32 + offs_g) // 8 * 2)[None, :]
        qw_next = tl.load(q_ptrs)
        sc_next = tl.load(sc_ptrs)
        mn_next = tl.load(mn_ptrs)
        d_next = tl.load(d_ptrs).to(tl.float32)
        dmin_next = tl.load(d_ptrs + 1).to(tl.float32)
    for i in range(K_TILES):
        x = tl.load(x_ptrs)
        if PREFETCH:
            qw, sc, mn, d, dmin = qw_next, sc_next, mn_next, d_next, dmin_next
            if i + 1 < K_TILES:
                nd_ptrs = ss_row + ((k_start // 32 + (i + 1) * G + offs_g) // 8 * 2)[None, :]
                qw_next = tl.load(q_ptrs + (i + 1) * (BLOCK_K // 8))
                sc_next = tl.load(sc_ptrs + (i + 1) * G)
                mn_next = tl.load(mn_ptrs + (i + 1) * G)
                d_next = tl.load(nd_ptrs).to(tl.float32)
                dmin_next = tl.load(nd_ptrs + 1).to(tl.float32)
        else:
            d_ptrs = ss_row + ((k_start // 32 + i * G + offs_g) // 8 * 2)[None, :]
            if DESC:
                qw = q_desc.load([pid_n * BLOCK_N, (k_start + i * BLOCK_K) // 8])
            else:
                qw = tl.load(q_ptrs + i * (BLOCK_K // 8))
            sc = tl.load(sc_ptrs + i * G)
            mn = tl.load(mn_ptrs + i * G)
            d = tl.load(d_ptrs).to(tl.float32)
            dmin = tl.load(d_ptrs + 1).to(tl.float32)
        w = _weight_tile(qw, sc, mn, d, dmin, BLOCK_N, BLOCK_K, x.dtype)
        acc = tl.dot(w, tl.trans(x), acc) if SWAP else tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
    mask_m = offs_m < M
    if SWAP:
        ptrs = out_ptr + pid_k * stride_ok + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(ptrs, acc, mask=mask_m[None, :])
    else:
        ptrs = out_ptr + pid_k * stride_ok + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask_m[:, None])


def _configs(variants: dict, m: int, splits: tuple[int, ...]):
    """(variant, flags, BLOCK_M, BLOCK_N, SPLIT_K, stages) to try at ``m`` rows. The Gluon kernel
    runs one warpgroup: its wgmma's M side (x's rows, or W's with ``SWAP``) is 64."""
    for name, flags in variants.items():
        if flags.get("WARPS") == 8:
            # Two warpgroups over 128 weight rows: half the dequantization a thread.
            tiles = [(bm, 128) for bm in (64, 128) if bm <= max(64, m)]
            stages = (2, 3)
        elif flags.get("GLUON") and flags["SWAP"]:
            bms = [b for b in (16, 32, 64, 128, 256) if b <= max(16, m)][-2:]
            tiles = [(bm, 64) for bm in bms] + [(bm, 128) for bm in bms if bm <= 64]
            stages = (3, 4)
        elif flags.get("GLUON"):
            tiles = [(64, 64), (64, 128)]
            stages = (3, 4)
        else:
            bms = [16] if m <= 16 else [64] if m <= 64 else [64, 128]
            tiles = list(itertools.product(bms, (64, 128)))
            stages = (3,)
        for (bm, bn), split, st in itertools.product(tiles, splits, stages):
            yield name, flags, bm, bn, split, st


def run_probe(x, w: Q4KWeight, cfg: dict, part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if cfg.get("GLUON"):
        return run_gluon(x, w, cfg, part, out)
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = w.shape[0]
    split = cfg["SPLIT_K"]
    k_tiles = k // cfg["BLOCK_K"] // split
    words = w.qs.view(torch.int32)
    desc = TensorDescriptor.from_tensor(words, [cfg["BLOCK_N"], cfg["BLOCK_K"] // 8]) if cfg["DESC"] else None
    grid = (n // cfg["BLOCK_N"], split, triton.cdiv(m, cfg["BLOCK_M"]))
    _probe_kernel[grid](
        x, w.qs, desc, w.scales, w.mins, w.super_scales, part, m, n,
        x.stride(0), w.qs.stride(0), w.scales.stride(0), w.super_scales.stride(0), part.stride(1), part.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], K_TILES=k_tiles,
        PREFETCH=cfg["PREFETCH"], DESC=cfg["DESC"], SWAP=cfg["SWAP"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    torch.sum(part, dim=0, out=out)
    return out


def graph_time(fn, reps: int = 4) -> float:
    """Median ms of one call, as a CUDA graph replay of ``reps`` calls."""
    fn(0)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for r in range(reps):
                fn(r)
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=150) / reps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[16, 64, 128, 256, 512])
    p.add_argument("--shapes", nargs="+", default=["4096x14336", "14336x4096"], help="K x N")
    p.add_argument("--out", default=None)
    p.add_argument("--seconds", type=float, default=200.0, help="stop starting new shapes past this")
    p.add_argument("--variants", nargs="+", default=None, help="loop variants to time (default: all)")
    args = p.parse_args()
    import time

    t0 = time.time()
    torch.manual_seed(0)
    lines = [
        f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}",
        "",
        "| K x N | M | variant | BLOCK_M | BLOCK_N | BLOCK_K | warps | stages | split | graph us "
        "| vs cuBLAS bf16 | rel err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    variants = {
        "base": dict(PREFETCH=False, DESC=False, SWAP=False),
        "prefetch": dict(PREFETCH=True, DESC=False, SWAP=False),
        "desc": dict(PREFETCH=False, DESC=True, SWAP=False),
        "swap": dict(PREFETCH=False, DESC=False, SWAP=True),
        "swap+prefetch": dict(PREFETCH=True, DESC=False, SWAP=True),
        "gluon": dict(GLUON=True, SWAP=False),
        "gluon-swap": dict(GLUON=True, SWAP=True),
        "gluon-tma": dict(GLUON=True, CODES_TMA=True, SWAP=False),
        "gluon-tma-swap": dict(GLUON=True, CODES_TMA=True, SWAP=True),
        "gluon-tma-swap-8warps": dict(GLUON=True, CODES_TMA=True, SWAP=True, WARPS=8),
    }
    if args.variants:
        variants = {name: variants[name] for name in args.variants}
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        weights = [Q4KWeight.quantize(torch.randn(n, k, device="cuda") * 0.02) for _ in range(4)]
        dense = [w.dequantize().to(torch.bfloat16) for w in weights]
        for m in args.m:
            if time.time() - t0 > args.seconds:
                break
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ weights[0].dequantize().float().T
            t_cublas = graph_time(lambda r, x=x, dense=dense: x @ dense[r].T)
            best: dict[str, tuple[float, str]] = {}
            splits = (1, 4) if k >= 8192 else (1,)
            for name, flags, bm, bn, split, stages in _configs(variants, m, splits):
                bk = 128
                warps = flags.get("WARPS", 4) if flags.get("GLUON") or bm * bn <= 64 * 64 else 8
                cfg = dict(
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SPLIT_K=split, **flags
                )
                part = torch.full((split, m, n), float("nan"), device="cuda")
                out = torch.empty(m, n, device="cuda")
                try:
                    got = run_probe(x, weights[0], cfg, part, out)
                    torch.cuda.synchronize()
                except Exception as exc:  # a config the compiler refuses: next one
                    print(f"{shape} M={m} {name} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                err = float((got - want).norm() / want.norm())
                if not err < 2e-2:
                    print(f"{shape} M={m} {name} {cfg}: rel err {err}", flush=True)
                    continue
                t = graph_time(
                    lambda r, x=x, w=weights, cfg=cfg, part=part, out=out: run_probe(x, w[r], cfg, part, out)
                )
                row = (
                    f"| {shape} | {m} | {name} | {bm} | {bn} | {bk} | {warps} | {stages} | {split} "
                    f"| {t * 1e3:.1f} | {t_cublas / t:.2f}x | {err:.1e} |"
                )
                if name not in best or t < best[name][0]:
                    best[name] = (t, row)
            for _, row in best.values():
                lines.append(row)
                print(row, flush=True)
            lines.append(f"| {shape} | {m} | bf16 cuBLAS | | | | | | | {t_cublas * 1e3:.1f} | 1.00x | |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
