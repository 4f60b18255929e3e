"""Probe: candidate small-M (decode) Q4_K kernels against the shipped portable kernel.

The portable kernel at M=16, K=4096, N=14336 runs at about 1 TB/s (34 us for 34 MB of weight).
Nsight Compute found it issuing about 7.5 instructions per weight with 0.57 waves, and
``scripts/sass_q4k_loop.py`` counts 7.3 in its main loop's SASS. Every variant here is one kernel,
``_gemv_kernel``, with ``CODES`` choosing how a tile of codes becomes a dot operand:

* ``float``: the portable kernel's dequantization (``s*q - o`` in float32, then bf16);
* ``asm``: the same weights from packed bf16x2 PTX (``prmt``/``lop3`` make ``128 + q`` two codes
  at a time, ``sub.bf16x2`` removes the 128 exactly, ``fma.rn.bf16x2`` applies ``s`` and ``o``
  rounded to bf16): 5.6 SASS instructions per weight instead of 7.3;
* ``magic``, ``pairs``, ``nat16``, ``f32codes``: no per-weight scaling. The codes (bf16
  ``128 + q`` from integer operations, or exact float codes) meet x in one dot per 32-wide
  sub-block, scaled by ``d*sc`` into the accumulator; the offsets (``(128*d*sc + dmin*m)`` or
  ``dmin*m``, times x's sub-block sums) come off at the end as one small float32 dot. ``magic`` and
  ``pairs`` load x in a permuted order that matches the order their joins make.

``SWAP`` puts the weight first in the dot (``out^T = w @ x^T``). Each candidate is checked against
a float64 reference (relative error below 2e-2) and timed as a CUDA-graph replay with the L2
flushed (the tuner's timer for launch-bound keys), next to bf16 cuBLAS and the shipped dispatcher.
The variants are probes, not library code: the ``asm`` one cannot run on the Triton interpreter.

On the GPU machine: ``python scripts/probe_q4k_gemv.py --m 16 --m 1 --codes asm --codes float
--out gemv.md`` (session 8, call 5; call 2 swept ``--codes magic --codes float``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _benchlib as bl
import torch
import triton
import triton.language as tl

from tritune.kernels.q4k._triton_q4k import _codes_as_float


@triton.jit
def _half(pair, SHIFT: tl.constexpr):
    """The bf16 in bits ``SHIFT .. SHIFT + 15`` of int32 ``pair``."""
    return ((pair >> SHIFT) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_code_pairs(qw):
    """int32 code words -> ``[..., 2, 2, 2]`` bf16 ``128 + q``: nibble ``j`` of a word sits at index
    ``(j % 2, (j // 2) % 2, j // 4)`` of its last three dims (one AND/OR makes two codes)."""
    p0 = (qw & 0x000F000F) | 0x43004300
    p1 = ((qw >> 4) & 0x000F000F) | 0x43004300
    p2 = ((qw >> 8) & 0x000F000F) | 0x43004300
    p3 = ((qw >> 12) & 0x000F000F) | 0x43004300
    low = tl.join(tl.join(_half(p0, 0), _half(p1, 0)), tl.join(_half(p2, 0), _half(p3, 0)))
    high = tl.join(tl.join(_half(p0, 16), _half(p1, 16)), tl.join(_half(p2, 16), _half(p3, 16)))
    return tl.join(low, high)


@triton.jit
def _codes_bf16(qw, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """int32 ``[ROWS, WORDS]`` code words -> bf16 ``[ROWS, WORDS*8]`` values ``128 + q``.

    Position ``8w + r`` holds nibble ``bitrev3(r)`` of word ``w``: the order the joins make (x is
    loaded in the same order, so the dot is unchanged).
    """
    return tl.reshape(_bf16_code_pairs(qw), (ROWS, WORDS * 8))


@triton.jit
def _codes_pairs(qw, ROWS: tl.constexpr):
    """int32 ``[ROWS, 4]`` code words (one 32-wide sub-block) -> bf16 ``[ROWS, 32]`` values ``128 + q``,
    position ``p = 2w + a + 8*b + 16*c`` holding code ``k = 8w + (b + 2c) + 4a`` of the sub-block.

    Each 32-bit ``pair`` holds two bf16 codes side by side (``a``), and thread-held word ``w`` lands
    on positions ``2w, 2w + 1 (+8, +16, +24)``: the k pairs an mma operand register holds.
    """
    codes = _bf16_code_pairs(qw)  # [ROWS, w, b, c, a]
    return tl.reshape(tl.permute(codes, (0, 3, 2, 1, 4)), (ROWS, 32))


@triton.jit
def _codes_nat16(qw, ROWS: tl.constexpr, COLS: tl.constexpr):
    """int32 ``[ROWS, COLS/8]`` code words -> bf16 ``[ROWS, COLS]`` values ``128 + q`` in natural order
    (the join structure of the portable kernel's ``_codes_as_float``)."""
    t = tl.join(qw, qw >> 16)
    c0 = ((t & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    c1 = (((t >> 4) & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    c2 = (((t >> 8) & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    c3 = (((t >> 12) & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (ROWS, COLS))


_DEQUANT_ASM = tl.constexpr("""
{
.reg .b32 hi, p<4>, v<4>, sc, of;
.reg .b32 m128;
shr.u32 hi, $8, 4;
prmt.b32 p0, $8, hi, 0x0400;
prmt.b32 p1, $8, hi, 0x1511;
prmt.b32 p2, $8, hi, 0x2622;
prmt.b32 p3, $8, hi, 0x3733;
lop3.b32 v0, p0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 v1, p1, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 v2, p2, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 v3, p3, 0x000F000F, 0x43004300, 0xEA;
mov.b32 m128, 0x43004300;
sub.bf16x2 v0, v0, m128;
sub.bf16x2 v1, v1, m128;
sub.bf16x2 v2, v2, m128;
sub.bf16x2 v3, v3, m128;
cvt.rn.bf16x2.f32 sc, $9, $9;
cvt.rn.bf16x2.f32 of, $10, $10;
fma.rn.bf16x2 v0, v0, sc, of;
fma.rn.bf16x2 v1, v1, sc, of;
fma.rn.bf16x2 v2, v2, sc, of;
fma.rn.bf16x2 v3, v3, sc, of;
mov.b32 {$0, $1}, v0;
mov.b32 {$2, $3}, v1;
mov.b32 {$4, $5}, v2;
mov.b32 {$6, $7}, v3;
}
""")


@triton.jit
def _dequant_asm(qw, s, o, ROWS: tl.constexpr, COLS: tl.constexpr):
    """int32 ``[ROWS, COLS/8]`` words and their sub-blocks' float32 ``s``, ``o`` -> bf16 ``s*q - o``
    ``[ROWS, COLS]`` in natural order, in packed bf16x2 arithmetic (s and o rounded to bf16)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
        _DEQUANT_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [qw, s, o],
        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
    )  # fmt: skip
    t = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(t, (ROWS, COLS))


@triton.jit
def _gemv_kernel(
    x_ptr, qs_ptr, sc_ptr, mn_ptr, ss_ptr, out_ptr,
    M, N, stride_xm, stride_qn, stride_sn, stride_ssn, stride_ok, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    K_TILES: tl.constexpr, CODES: tl.constexpr, SWAP: tl.constexpr, F32DOT: tl.constexpr = False,
):  # fmt: skip
    G: tl.constexpr = BLOCK_K // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_start = pid_k * (K_TILES * BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    q_row = (qs_ptr + rows_n[:, None] * stride_qn + k_start // 2).to(tl.pointer_type(tl.int32))
    ss_row = ss_ptr + rows_n * stride_ssn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32) if SWAP else tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if CODES != "float" and CODES != "asm":
        offs_p = tl.arange(0, 32)
        # Position 8w + r of a sub-block holds code bitrev3(r) of word w.
        if CODES == "nat16" or CODES == "f32codes":
            perm = offs_p
        elif CODES == "pairs":
            # p = 2w + a + 8b + 16c holds k = 8w + b + 2c + 4a.
            perm = 8 * ((offs_p // 2) % 4) + (offs_p // 8) % 2 + 2 * (offs_p // 16) + 4 * (offs_p % 2)
        else:
            r = offs_p % 8
            perm = offs_p - r + ((r & 1) << 2) + (r & 2) + ((r >> 2) & 1)
        offs_w = tl.arange(0, 4)
        for i in range(K_TILES):
            k0 = k_start + i * BLOCK_K
            d = tl.load(ss_row + k0 // 256 * 2).to(tl.float32)  # BLOCK_K divides 256
            for g in tl.static_range(G):
                x = tl.load(x_ptr + rows_m[:, None] * stride_xm + (k0 + g * 32 + perm)[None, :])
                qw = tl.load(q_row + (i * BLOCK_K // 8 + g * 4 + offs_w)[None, :])
                if CODES == "f32codes":
                    w = _codes_as_float(qw, BLOCK_N, 32, 8).to(tl.bfloat16)
                elif CODES == "nat16":
                    w = _codes_nat16(qw, BLOCK_N, 32)
                elif CODES == "pairs":
                    w = _codes_pairs(qw, BLOCK_N)
                else:
                    w = _codes_bf16(qw, BLOCK_N, 4)
                if F32DOT:
                    w = w.to(tl.float32)
                    x = x.to(tl.float32)
                s = d * tl.load(sc_ptr + rows_n * stride_sn + k0 // 32 + g).to(tl.float32)
                if SWAP:
                    acc += tl.dot(w, tl.trans(x)) * s[:, None]
                else:
                    acc += tl.dot(x, tl.trans(w)) * s[None, :]
        # Offsets: sum_g (128*d*sc + dmin*m)[n, g] * xsum[m, g], in float32.
        GC: tl.constexpr = 16
        GROUPS: tl.constexpr = K_TILES * BLOCK_K // 32
        offs_gc = tl.arange(0, GC)
        offs_kc = tl.arange(0, GC * 32)
        for c in range((GROUPS + GC - 1) // GC):
            g_ok = c * GC + offs_gc < GROUPS
            k_ok = c * GC * 32 + offs_kc < GROUPS * 32
            xk = tl.load(
                x_ptr + rows_m[:, None] * stride_xm + (k_start + c * GC * 32 + offs_kc)[None, :],
                mask=k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            xs = tl.sum(tl.reshape(xk, (BLOCK_M, GC, 32)), axis=2)  # [BLOCK_M, GC]
            gg = k_start // 32 + c * GC + offs_gc
            if SWAP:
                idx = rows_n[:, None] * stride_sn + gg[None, :]  # [BLOCK_N, GC]
                dp = ss_ptr + rows_n[:, None] * stride_ssn + (gg // 8 * 2)[None, :]
                ok = g_ok[None, :]
            else:
                idx = rows_n[None, :] * stride_sn + gg[:, None]  # [GC, BLOCK_N]
                dp = ss_ptr + rows_n[None, :] * stride_ssn + (gg // 8 * 2)[:, None]
                ok = g_ok[:, None]
            sc = tl.load(sc_ptr + idx, mask=ok, other=0).to(tl.float32)
            mn = tl.load(mn_ptr + idx, mask=ok, other=0).to(tl.float32)
            dd = tl.load(dp, mask=ok, other=0.0).to(tl.float32)
            dm = tl.load(dp + 1, mask=ok, other=0.0).to(tl.float32)
            off = dm * mn if CODES == "f32codes" else 128.0 * (dd * sc) + dm * mn
            if SWAP:
                acc -= tl.dot(off, tl.trans(xs), input_precision="ieee")
            else:
                acc -= tl.dot(xs, off, input_precision="ieee")
    else:
        offs_k = tl.arange(0, BLOCK_K)
        offs_w = tl.arange(0, BLOCK_K // 8)
        offs_g = tl.arange(0, G)
        for i in range(K_TILES):
            k0 = k_start + i * BLOCK_K
            x = tl.load(x_ptr + rows_m[:, None] * stride_xm + (k0 + offs_k)[None, :])
            qw = tl.load(q_row + (i * BLOCK_K // 8 + offs_w)[None, :])
            dp = ss_row[:, None] + ((k0 // 32 + offs_g) // 8 * 2)[None, :]
            gidx = rows_n[:, None] * stride_sn + (k0 // 32 + offs_g)[None, :]
            scale = tl.load(dp).to(tl.float32) * tl.load(sc_ptr + gidx).to(tl.float32)
            offset = tl.load(dp + 1).to(tl.float32) * tl.load(mn_ptr + gidx).to(tl.float32)
            if CODES == "asm":
                s_w = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, G, 4)), (BLOCK_N, BLOCK_K // 8))
                o_w = tl.reshape(tl.broadcast_to(offset[:, :, None], (BLOCK_N, G, 4)), (BLOCK_N, BLOCK_K // 8))
                w = _dequant_asm(qw, s_w, -o_w, BLOCK_N, BLOCK_K)
            else:
                q = tl.reshape(_codes_as_float(qw, BLOCK_N, BLOCK_K, 8), (BLOCK_N, G, 32))
                w = tl.reshape(q * scale[:, :, None] - offset[:, :, None], (BLOCK_N, BLOCK_K)).to(tl.bfloat16)
            if F32DOT:
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc) if SWAP else tl.dot(x, tl.trans(w), acc)
    if SWAP:
        ptrs = out_ptr + pid_k * stride_ok + offs_m[None, :] * stride_om + offs_n[:, None]
        mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    else:
        ptrs = out_ptr + pid_k * stride_ok + offs_m[:, None] * stride_om + offs_n[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


def run(x, weight, out, part, cfg):
    from tritune.kernels.q4k._triton_q4k import _splitk_reduce_kernel

    m, k = x.shape
    n = weight.qs.shape[0]
    split = cfg["SPLIT_K"]
    target = out if split == 1 else part[:split, :m]
    stride_ok = 0 if split == 1 else target.stride(0)
    stride_om = target.stride(-2)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x, weight.qs, weight.scales, weight.mins, weight.super_scales, target,
        m, n, x.stride(0), weight.qs.stride(0), weight.scales.stride(0), weight.super_scales.stride(0),
        stride_ok, stride_om,
        BLOCK_M=16, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split,
        K_TILES=k // cfg["BLOCK_K"] // split, CODES=cfg["CODES"], SWAP=cfg["SWAP"], F32DOT=x.device.type == "cpu",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split > 1:
        _splitk_reduce_kernel[(triton.cdiv(m, 16), triton.cdiv(n, 128))](
            target, out, out, m, n, target.stride(0), target.stride(1), out.stride(0), out.stride(1), 0,
            HAS_BIAS=False, SPLIT_K=split, BLOCK_M=16, BLOCK_N=128, num_warps=4,
        )  # fmt: skip


#: The configs swept at the first shape, per CODES: (SWAP, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages).
_GRIDS = {
    "float": [(False, 64, 256, split, 4, 3) for split in (1, 4)],
    "asm": [
        (False, bn, bk, sp, 4, st) for bn in (32, 64, 128) for bk in (128, 256) for sp in (1, 2, 4) for st in (2, 3)
    ]
    + [
        (True, bn, bk, sp, w, st)
        for bn in (64, 128)
        for bk in (128, 256)
        for sp in (1, 2, 4)
        for w in (4, 8)
        for st in (2, 3)
    ],
}
_SUB_BLOCK_GRID = [
    (swap, bn, bk, sp, w, st)
    for swap in (True, False)
    for bn in (32, 64, 128)
    for bk in (128, 256)
    for sp in (1, 2, 4)
    for w in (4, 8)
    for st in (2, 3)
    if not (swap and bn < 64) and not (w == 8 and bn < 64)
]
#: How many of a variant's fastest configs at the first shape and M are timed at the others.
_CARRIED = 8


def _sweep(grid, x, weight, out, part, ref, k: int, timed) -> list[tuple[float, dict, float]]:
    """(us, config, relative error) of each config that runs and passes the check, fastest first."""
    results = []
    for codes, swap, bn, bk, split, warps, stages in grid:
        if (k // bk) % split:
            continue
        cfg = {"CODES": codes, "SWAP": swap, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
               "num_warps": warps, "num_stages": stages}  # fmt: skip
        out.fill_(float("nan"))
        try:
            run(x, weight, out, part, cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # a probe reports and goes on
            print(f"{cfg}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            continue
        err = float((out.double() - ref).norm() / ref.norm())
        if not err < 2e-2:
            print(f"{cfg}: rel err {err}", file=sys.stderr)
            continue
        results.append((timed(lambda cfg=cfg: run(x, weight, out, part, cfg)), cfg, err))
    return sorted(results, key=lambda r: r[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--m", type=int, action="append", help="rows of x, at most 16 (default 16)")
    parser.add_argument("--codes", action="append", help="variants to sweep (default asm and float)")
    args = parser.parse_args(argv)
    from tritune.kernels import Q4KWeight, q4k_linear
    from tritune.tuner.timing import GpuTimer

    device = torch.device("cuda")
    timer = GpuTimer()
    variants = args.codes or ["asm", "float"]
    grid = [(c, *cfg) for c in variants for cfg in _GRIDS.get(c, _SUB_BLOCK_GRID)]
    lines = [
        "| K x N | M | kernel | config | us | vs shipped portable | vs cuBLAS | rel err |",
        "| --- " * 8 + "|",
    ]
    torch.manual_seed(0)
    for k, n in ((4096, 14336), (14336, 4096), (4096, 4096)):
        weight = Q4KWeight.quantize(torch.randn(n, k, device=device) * 0.02)
        dense = weight.dequantize().to(device)
        dense_bf16 = dense.bfloat16()
        for m in args.m or [16]:
            x = torch.randn(m, k, device=device).bfloat16()
            ref = x.double() @ dense.double().T
            out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
            part = torch.empty((8, 16, n), dtype=torch.float32, device=device)

            def timed(fn) -> float:
                return timer.measure(fn, config=None, flush_l2=True, launch_bound=True).ms * 1e3

            cublas = timed(lambda x=x, dense_bf16=dense_bf16, out=out: torch.matmul(x, dense_bf16.T, out=out))
            shipped = timed(lambda x=x, weight=weight, out=out: q4k_linear(x, weight, out=out))
            lines.append(f"| {k} x {n} | {m} | bf16 cuBLAS | | {cublas:.1f} | | 1.00x | |")
            lines.append(
                f"| {k} x {n} | {m} | shipped dispatcher | | {shipped:.1f} | 1.00x | {cublas / shipped:.2f}x | |"
            )
            results = _sweep(grid, x, weight, out, part, ref, k, timed)
            # Only the first shape and M sweep the whole grid; the others time its fastest configs.
            grid = [
                tuple(cfg.values())
                for c in variants
                for _, cfg, _ in [r for r in results if r[1]["CODES"] == c][:_CARRIED]
            ]
            for c in variants:
                for us, cfg, err in [r for r in results if r[1]["CODES"] == c][:_CARRIED]:
                    desc = " ".join(f"{a}={b}" for a, b in cfg.items())
                    ratios = f"{shipped / us:.2f}x | {cublas / us:.2f}x"
                    lines.append(f"| {k} x {n} | {m} | {c} | {desc} | {us:.1f} | {ratios} | {err:.1e} |")
            print("\n".join(lines[-(2 + _CARRIED * len(variants)) :]), flush=True)
    return bl.finish_probe(device, "Q4_K small-M kernel probe", [], lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
