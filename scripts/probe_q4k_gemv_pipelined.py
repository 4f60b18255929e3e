"""Probe: the one-launch Q4_K GEMV with its code loads pipelined by Triton, against the shipped winners.

    python scripts/probe_q4k_gemv_pipelined.py   (writes $OUT/gemv_probe.json, default /tmp)

At M=1 on the three Llama-3-8B shapes, CUDA-graph replays (L2 flushed by do_bench) of:
the shipped GEMV winner; the same kernel at one and two warps; and a copy of it whose loop
names its stages (``tl.range(..., num_stages=3)``), so that Triton 3.6 pipelines the loads of
the dot-free loop with cp.async into shared memory, with the code words read per iteration at
the products' rank or as one contiguous row slice (``FLAT``). Every variant writes the shipped
kernel's bits on the interpreter; here each is checked by its NMSE against the float64 product.
"""

import concurrent.futures as cf
import functools
import itertools
import json
import os
import random
import time

import torch
import triton
import triton.language as tl

from tritune.kernels.q4k._triton_common import _small_as_float, _store_tile
from tritune.kernels.q4k._triton_gemv import _dp4a, _gemv_x, _q4k_gemv_fused_kernel, _quantize_tile
from tritune.kernels.q4k.launch import launch
from tritune.kernels.q4k.weight import Q4KWeight
from tritune.search_spaces.q4k_fp8_gemm import SPACE


@triton.jit
def _scales(sc_ptrs, mn_ptrs, ss_row, k_start, i, G: tl.constexpr):
    d_ptrs = ss_row + ((k_start // 32 + i * G + tl.arange(0, G)) // 8 * 2)[None, :]
    s = tl.load(d_ptrs).to(tl.float32) * _small_as_float(tl.load(sc_ptrs + i * G))
    o = tl.load(d_ptrs + 1).to(tl.float32) * _small_as_float(tl.load(mn_ptrs + i * G))
    return s, o


@triton.jit
def gemv_pipe_kernel(
    x_ptr,
    xw_ptr,
    xs_ptr,
    xlost_ptr,
    xsum_ptr,
    qs_ptr,
    sc_ptr,
    mn_ptr,
    ss_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counters_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_ssn,
    stride_om,
    stride_on,
    stride_pk,
    stride_pm,
    stride_bn,
    HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_TILES: tl.constexpr,
    FUSE_QUANT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    COPIES: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SCALES_AHEAD: tl.constexpr,
    FLAT: tl.constexpr = False,
):
    W: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_start = pid_k * (K_TILES * BLOCK_K)
    offs_m = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_g = tl.arange(0, G)
    offs_w = (offs_g * 4)[:, None] + tl.arange(0, 4)[None, :]
    x_tile = (
        x_ptr
        + rows_m[:, None, None, None] * stride_xm
        + tl.zeros((COPIES,), tl.int32)[None, :, None, None]
        + (k_start + offs_g * 32)[None, None, :, None]
        + tl.arange(0, 32)[None, None, None, :]
    )
    x_even = x_tile
    xg = rows_m
    q_row = (qs_ptr + rows_n * stride_qn + k_start // 2).to(tl.pointer_type(tl.int32))
    q_ptrs = q_row[None, :, None, None] + offs_w[None, None, :, :]
    q_flat = q_row[None, :, None] + tl.arange(0, W)[None, None, :]
    sc_ptrs = sc_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    mn_ptrs = mn_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    ss_row = ss_ptr + rows_n[:, None] * stride_ssn

    acc = tl.zeros((ROWS, BLOCK_N, G), dtype=tl.float32)
    xa, _, _, _, _ = _gemv_x(x_tile, x_even, xs_ptr, xlost_ptr, xsum_ptr, xg, K, 0, FUSE_QUANT, BLOCK_K, W, G)
    s, o = _scales(sc_ptrs, mn_ptrs, ss_row, k_start, 0, G)
    for i in tl.range(K_TILES, num_stages=NUM_STAGES):
        ahead = tl.minimum(i + 1, K_TILES - 1)
        next_xa, _, _, _, _ = _gemv_x(
            x_tile, x_even, xs_ptr, xlost_ptr, xsum_ptr, xg, K, ahead, FUSE_QUANT, BLOCK_K, W, G
        )
        xe, xo, xs, lost, xsum = _quantize_tile(xa, ROWS, BLOCK_N, G, COPIES)
        if SCALES_AHEAD:
            next_s, next_o = _scales(sc_ptrs, mn_ptrs, ss_row, k_start, ahead, G)
        else:
            s, o = _scales(sc_ptrs, mn_ptrs, ss_row, k_start, i, G)
        qw = tl.reshape(tl.load(q_flat + i * W), (1, BLOCK_N, G, 4)) if FLAT else tl.load(q_ptrs + i * W)
        shape: tl.constexpr = (ROWS, BLOCK_N, G, 4)
        lo = tl.broadcast_to(qw & 0x0F0F0F0F, shape)
        hi = tl.broadcast_to((qw >> 4) & 0x0F0F0F0F, shape)
        isum = tl.sum(_dp4a(lo, xe, _dp4a(hi, xo, hi, ASM, True), ASM), axis=3)
        centred = xs[:, None, :] * isum.to(tl.float32) + 8.0 * lost[:, None, :]
        acc += s[None, :, :] * centred - o[None, :, :] * xsum[:, None, :]
        if SCALES_AHEAD:
            s, o = next_s, next_o
        xa = next_xa
    total = tl.sum(acc, axis=2)
    if SPLIT_K == 1:
        _store_tile(total, out_ptr, bias_ptr, offs_m, offs_n, M, N, 0, stride_om, stride_on, 0, stride_bn, HAS_BIAS, 1)
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        part = part_ptr + offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
        tl.store(part + pid_k * stride_pk, total, mask=mask)
        tl.debug_barrier()
        counter = counters_ptr + tl.program_id(2) * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            reduced = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            for split in tl.static_range(1, SPLIT_K):
                reduced += tl.load(part + split * stride_pk, mask=mask, other=0.0, cache_modifier=".cg")
            _store_tile(
                reduced, out_ptr, bias_ptr, offs_m, offs_n, M, N, 0, stride_om, stride_on, 0, stride_bn, HAS_BIAS, 1
            )
            tl.store(counter, 0)


def launch_pipe(
    x,
    weight,
    out,
    *,
    BLOCK_N,
    BLOCK_K,
    num_warps,
    SPLIT_K,
    NUM_STAGES,
    SCALES_AHEAD=True,
    FLAT=False,
    counters=None,
    interpreted=False,
):
    import torch

    m, k = x.shape
    n = weight.shape[0]
    rows = 1
    while rows < m:
        rows *= 2
    grid = ((n + BLOCK_N - 1) // BLOCK_N, SPLIT_K, (m + rows - 1) // rows)
    copies = max(1, 32 * num_warps * 4 // (rows * BLOCK_K))
    part = torch.empty((SPLIT_K, m, n), dtype=torch.float32, device=out.device) if SPLIT_K > 1 else out
    if counters is None:
        counters = torch.zeros(grid[0] * grid[2], dtype=torch.int32, device=out.device)
    qs, sc, mn, ss = weight.qs, weight.scales, weight.mins, weight.super_scales
    extra = dict(NUM_STAGES=NUM_STAGES, SCALES_AHEAD=SCALES_AHEAD, FLAT=FLAT) if NUM_STAGES else {}
    kernel = gemv_pipe_kernel if NUM_STAGES else _q4k_gemv_fused_kernel
    kernel[grid](
        x,
        None,
        None,
        None,
        None,
        qs,
        sc,
        mn,
        ss,
        out,
        out,
        part,
        counters,
        m,
        n,
        k,
        x.stride(0),
        qs.stride(0),
        sc.stride(0),
        ss.stride(0),
        out.stride(0),
        out.stride(1),
        part.stride(0) if SPLIT_K > 1 else 0,
        part.stride(1) if SPLIT_K > 1 else 0,
        0,
        HAS_BIAS=False,
        ASM=not interpreted,
        ROWS=rows,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        SPLIT_K=SPLIT_K,
        K_TILES=k // BLOCK_K // SPLIT_K,
        FUSE_QUANT=True,
        FUSED_REDUCE=SPLIT_K > 1,
        COPIES=copies,
        **extra,
        num_warps=num_warps,
    )
    return counters


SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # K x N
OFFICIAL = {
    (4096, 4096): dict(
        path="gemv", BLOCK_N=128, BLOCK_K=256, num_warps=4, SPLIT_K=8, FUSE_QUANT=True, FUSED_REDUCE=True
    ),
    (4096, 14336): dict(
        path="gemv", BLOCK_N=32, BLOCK_K=512, num_warps=4, SPLIT_K=1, FUSE_QUANT=True, FUSED_REDUCE=False
    ),
    (14336, 4096): dict(
        path="gemv", BLOCK_N=128, BLOCK_K=256, num_warps=4, SPLIT_K=8, FUSE_QUANT=True, FUSED_REDUCE=True
    ),
}


def candidates(k, n):
    out = []
    grid = list(itertools.product((32, 64, 128), (256, 512), (4, 8), (1, 2, 4, 8), (3,)))
    grid += list(itertools.product((16, 32, 64), (128,), (1,), (1, 2, 4), (0, 3)))
    grid += list(itertools.product((16, 32, 64), (256,), (2,), (1, 2, 4), (0, 3)))
    for bn, bk, nw, split, st in grid:
        if bk > 128 * nw or (bn * bk // 8) // (32 * nw) > 32 or (bn * bk // 8) < 128 * nw:
            continue
        if k % (bk * split) or k // bk // split < 3:
            continue
        ctas = (n // bn) * split
        if ctas < 128 or ctas > 4000:
            continue
        out.append(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, SPLIT_K=split, NUM_STAGES=st))
        if st:
            out.append(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, SPLIT_K=split, NUM_STAGES=st, FLAT=True))
    return out


def make(k, n):
    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = Q4KWeight.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
    return w, x


def _compile(job):
    k, n, cands = job
    w, x = make(k, n)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    bad = []
    for c in cands:
        try:
            launch_pipe(x, w, out, **c)
        except Exception as e:
            bad.append((c, str(e)[:200]))
    torch.cuda.synchronize()
    return bad


def graph_time(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return 1000 * triton.testing.do_bench(g.replay, warmup=25, rep=150)


def main():
    t0 = time.time()
    jobs = []
    for k, n in SHAPES:
        c = candidates(k, n)
        for i in range(0, len(c), 8):
            jobs.append((k, n, c[i : i + 8]))
    print("candidates", {f"{k}x{n}": len(candidates(k, n)) for k, n in SHAPES}, flush=True)
    ctx = torch.multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(12, mp_context=ctx) as pool:
        for bad in pool.map(_compile, jobs):
            for b in bad:
                print("compile failed", b, flush=True)
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    results = {}
    for k, n in SHAPES:
        w, x = make(k, n)
        ref = x.double() @ w.dequantize().double().T

        def nmse(o, ref=ref):
            return ((o.double() - ref) ** 2).mean().item() / (ref**2).mean().item()

        out0 = torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        cfg = SPACE.parse(OFFICIAL[(k, n)])
        t_off = graph_time(functools.partial(launch, cfg, x, w, None, out0))
        mb = w.nbytes
        print(
            f"{k}x{n} official {OFFICIAL[(k, n)]} {t_off:.2f} us  nmse {nmse(out0):.2e}  {mb / t_off / 1e6:.2f} TB/s",
            flush=True,
        )
        rows = []
        t_shape = time.time()
        cands = candidates(k, n)
        random.Random(0).shuffle(cands)
        for c in cands:
            if time.time() - t_shape > 45:
                print("   shape time cap", flush=True)
                break
            out = torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            counters = launch_pipe(x, w, out, **c)
            err = nmse(out)
            same = None
            if all(OFFICIAL[(k, n)].get(f) == c[f] for f in ("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K")):
                same = torch.equal(out, out0)
            try:
                t = graph_time(functools.partial(launch_pipe, x, w, out, counters=counters, **c))
            except Exception as e:
                print("run failed", c, str(e)[:200], flush=True)
                continue
            rows.append((t, c, err, same))
        rows.sort(key=lambda r: r[0])
        for t, c, err, same in rows[:12]:
            print(
                f"   {t:7.2f} us {t_off / t:5.2f}x  {mb / t / 1e6:.2f} TB/s nmse {err:.2e} same {same} {c}", flush=True
            )
        print(f"   worst {rows[-1][0]:.2f} us; {len(rows)} timed; at {time.time() - t0:.0f} s", flush=True)
        results[f"{k}x{n}"] = dict(official=t_off, rows=[(t, c, err) for t, c, err, _ in rows])
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "gemv_probe.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
