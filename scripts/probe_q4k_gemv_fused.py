"""Probe: the Q4_K GEMV with x quantized inside the kernel, against the shipped GEMV path.

The shipped GEMV path (``path="gemv"``) quantizes x in a pre-pass launch (int8 words, scales,
sums) that costs about 5 us of a 32 us call at M=1 on the H200. The variant here, ``_fused_gemv``,
quantizes each K tile of x in every program instead (the same rounding, the same words), which
saves the launch and the pre-pass's loads at the price of about 60% more instructions a loop
(sm_90 SASS: 305 against 188 at 32 x 256, 4 warps). Each is checked against the float64 reference
(SQNR) and timed as a CUDA-graph replay with the L2 flushed. On the GPU machine:
``python scripts/probe_q4k_gemv_fused.py --out fused.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _benchlib as bl
import torch
import triton
import triton.language as tl

from tritune.kernels.q4k._triton_q4k import _dp4a, _small_as_float, _store_tile

SHAPES = ((4096, 14336), (14336, 4096), (4096, 4096))  # (K, N)
#: (BLOCK_N, BLOCK_K, num_warps, SPLIT_K)
TILES = ((32, 256, 4, 1), (32, 256, 4, 2), (32, 256, 4, 4), (64, 256, 8, 1), (64, 256, 4, 2), (32, 512, 4, 1))


@triton.jit
def _x_words(xv, ROWS: tl.constexpr, G: tl.constexpr):
    """A K tile of x ``[ROWS, G, 32]`` as the GEMV pre-pass makes it: even and odd int8 words
    ``[ROWS, G, 4]``, each sub-block's scale, the sum its rounding lost, and its exact sum."""
    xf = xv.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=2)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full([ROWS, G], 127.0, tl.float32)), 1.0)
    q = tl.math.div_rn(xf, tl.broadcast_to(scale[:, :, None], (ROWS, G, 32)))
    xr = tl.clamp((q + 12582912.0) - 12582912.0, -127.0, 127.0)
    lost = tl.sum(xf - scale[:, :, None] * xr, axis=2)
    even, odd = tl.split(tl.reshape(xr.to(tl.int32) & 0xFF, (ROWS, G, 4, 4, 2)))
    shifts = (8 * tl.arange(0, 4))[None, None, None, :]
    return tl.sum(even << shifts, axis=3), tl.sum(odd << shifts, axis=3), scale, lost, tl.sum(xf, axis=2)


@triton.jit
def _fused_gemv(
    x_ptr, qs_ptr, sc_ptr, mn_ptr, ss_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ssn,
    stride_om, stride_ok, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, K_TILES: tl.constexpr,
):  # fmt: skip
    W: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 32
    pid_k = tl.program_id(1)
    k_start = pid_k * (K_TILES * BLOCK_K)
    offs_m = tl.arange(0, ROWS)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_g = tl.arange(0, G)
    offs_w = (offs_g * 4)[:, None] + tl.arange(0, 4)[None, :]
    offs_x = (offs_g * 32)[:, None] + tl.arange(0, 32)[None, :]
    x_ptrs = x_ptr + rows_m[:, None, None] * stride_xm + (k_start + offs_x)[None, :, :]
    q_ptrs = (qs_ptr + rows_n * stride_qn + k_start // 2).to(tl.pointer_type(tl.int32))[:, None, None] + offs_w[None]
    sc_ptrs = sc_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    mn_ptrs = mn_ptr + rows_n[:, None] * stride_sn + (k_start // 32 + offs_g)[None, :]
    ss_row = ss_ptr + rows_n[:, None] * stride_ssn
    acc = tl.zeros((ROWS, BLOCK_N, G), dtype=tl.float32)
    qw = tl.load(q_ptrs)
    xv = tl.load(x_ptrs)
    d_ptrs = ss_row + ((k_start // 32 + offs_g) // 8 * 2)[None, :]
    s = tl.load(d_ptrs).to(tl.float32) * _small_as_float(tl.load(sc_ptrs))
    o = tl.load(d_ptrs + 1).to(tl.float32) * _small_as_float(tl.load(mn_ptrs))
    for i in range(K_TILES):
        ahead = tl.minimum(i + 1, K_TILES - 1)
        next_qw = tl.load(q_ptrs + ahead * W)
        next_xv = tl.load(x_ptrs + ahead * BLOCK_K)
        nd_ptrs = ss_row + ((k_start // 32 + ahead * G + offs_g) // 8 * 2)[None, :]
        next_s = tl.load(nd_ptrs).to(tl.float32) * _small_as_float(tl.load(sc_ptrs + ahead * G))
        next_o = tl.load(nd_ptrs + 1).to(tl.float32) * _small_as_float(tl.load(mn_ptrs + ahead * G))
        xe, xo, xs, lost, xsum = _x_words(xv, ROWS, G)
        shape: tl.constexpr = (ROWS, BLOCK_N, G, 4)
        lo = tl.broadcast_to((qw & 0x0F0F0F0F)[None, :, :, :], shape)
        hi = tl.broadcast_to(((qw >> 4) & 0x0F0F0F0F)[None, :, :, :], shape)
        xe4 = tl.broadcast_to(xe[:, None, :, :], shape)
        xo4 = tl.broadcast_to(xo[:, None, :, :], shape)
        isum = tl.sum(_dp4a(lo, xe4, _dp4a(hi, xo4, hi, True, True), True), axis=3)
        centred = xs[:, None, :] * isum.to(tl.float32) + 8.0 * lost[:, None, :]
        acc += s[None, :, :] * centred - o[None, :, :] * xsum[:, None, :]
        qw, xv, s, o = next_qw, next_xv, next_s, next_o
    _store_tile(
        tl.sum(acc, axis=2), out_ptr, out_ptr, offs_m, offs_n, M, N, pid_k, stride_om, 1, stride_ok, 0, False, SPLIT_K
    )


def _fused_call(x: torch.Tensor, weight, tile: tuple[int, int, int, int]) -> torch.Tensor:
    from tritune.kernels.q4k import launch

    block_n, block_k, warps, split = tile
    m, k = x.shape
    n = weight.shape[0]
    qs, scales, mins, super_scales = weight.tensors()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    target = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    stride_ok = target.stride(0) if split > 1 else 0
    _fused_gemv[(triton.cdiv(n, block_n), split)](
        x, qs, scales, mins, super_scales, target, m, n, k, x.stride(0), qs.stride(0), scales.stride(0),
        super_scales.stride(0), target.stride(-2), stride_ok,
        ROWS=1, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, K_TILES=k // block_k // split, num_warps=warps,
    )  # fmt: skip
    if split > 1:
        launch._splitk_reduce_kernel[(1, triton.cdiv(n, 128))](
            target, out, out, m, n, target.stride(0), target.stride(1), out.stride(0), out.stride(1), 0,
            HAS_BIAS=False, SPLIT_K=split, BLOCK_M=16, BLOCK_N=128, num_warps=4,
        )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from tritune.kernels import Q4KWeight, q4k_linear, use_config
    from tritune.kernels.q4k.reference import q4k_linear_reference, sqnr_db

    device = torch.device("cuda")
    rows = [
        "| K x N | kernel | tile (BLOCK_N, BLOCK_K, warps, SPLIT_K) | us | SQNR dB |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k, n in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        weight = Q4KWeight.quantize(torch.randn(n, k, generator=gen, device=device) * 0.02)
        x = torch.randn(1, k, generator=gen, device=device).to(torch.bfloat16)
        expected = q4k_linear_reference(x, weight)
        for tile in TILES:
            block_n, block_k, warps, split = tile
            config = {"path": "gemv", "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "SPLIT_K": split}
            for label, call in (
                ("shipped GEMV (pre-pass)", lambda c=config, a=x, w=weight: _pinned(use_config, q4k_linear, c, a, w)),
                ("fused quantization", lambda t=tile, a=x, w=weight: _fused_call(a, w, t)),
            ):
                us, out = bl.graph_replay_us(call)
                rows.append(f"| {k} x {n} | {label} | {tile} | {us:.1f} | {sqnr_db(out.float(), expected):.1f} |")
                print(rows[-1], flush=True)
    notes = ["M=1, bf16. CUDA-graph replays, L2 flushed before each (median)."]
    return bl.finish_probe(device, "Q4_K GEMV: x quantized in a pre-pass or in every program", notes, rows, args.out)


def _pinned(use_config, q4k_linear, config, x, weight):
    with use_config("q4k_fp8_gemm", config):
        return q4k_linear(x, weight)


if __name__ == "__main__":
    sys.exit(main())
