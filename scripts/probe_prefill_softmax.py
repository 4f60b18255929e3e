"""Probe: cheaper softmax steps in the TMA prefill kernel, A/B against the shipped kernel.

On the GPU machine, from the repository root: ``python scripts/probe_prefill_softmax.py --out softmax.md``.

Why: Nsight Compute put the shipped kernel at D=64, Lq=4096, Lkv=128K at 50% tensor-pipe use with
2 warps per scheduler, and its SASS (compiled for sm_90 on the CPU machine) shows each
warpgroup waiting for its QK^T wgmma, then running 66 ``MUFU.EX2`` a tile, then issuing P@V: the
tensor cores and the exp unit take turns. A 64 x 128 tile costs the SM about as many cycles in
``MUFU.EX2`` (8192 exps at 16 a clock) as in the two MMAs at D=64, so the softmax's length is
what to cut. The variants, each a constexpr of the probe's copy of the kernel:

- ``FUSE_SCALE``: the row max on the raw scores, and ``exp2(s * scale - m)`` as one FFMA per
  score instead of a multiply and a subtract (a negative scale is handled by negating q).
- ``PIPE``: the next tile's QK^T issued before this tile's softmax (software pipelining by hand),
  so that ptxas can run the wgmma under the exps (it does: the SASS interleaves them).
- ``POLY``: ``1/POLY`` of each tile's exps (its last columns) computed on the FMA pipe with a
  cubic (Cody-Waite split, relative error 2.2e-4, below bf16's rounding of P) instead of ``MUFU``.

- ``FLIP_Q`` (on unless a ``--variant`` turns it off): the negation of q for a negative scale
  done as a select in the kernel, which makes Triton hold q in registers for the wgmma.

Each variant's output is compared with the shipped kernel's (same config) before it is timed.
Session 9 found FUSE_SCALE 3-6% faster and POLY and PIPE slower
(``docs/perf/2026-11-29-h200-evidence-session9.md``); the shipped kernels took FUSE_SCALE with the
sign as a constexpr.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import _benchlib as bl
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune.kernels.prefill._triton_portable import LOG2E, _kv_tile_range, _valid_kv_len


@triton.jit
def _exp2_poly(x):
    """``2**x`` for ``x <= 0`` on the FMA pipe: ``x = j + f`` (``j`` an integer, ``|f| <= 1/2``), a
    cubic for ``2**f`` and ``j`` added to its exponent bits."""
    x = tl.maximum(x, -125.0)
    # 1.5 * 2**23 leaves no fraction bits: the sum rounds x to an integer j, held in the low bits.
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = 1.0 + f * (0.6931372594155273 + f * (0.24193555589462007 + f * 0.05568196182014608))
    return (p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _split_cols(x, BM: tl.constexpr, BN: tl.constexpr):
    """Columns ``[0, BN/2)`` and ``[BN/2, BN)`` of ``x`` (register bits in the wgmma layout: no movement)."""
    return tl.split(tl.permute(tl.reshape(x, [BM, 2, BN // 2]), [0, 2, 1]))


@triton.jit
def _join_cols(a, b, BM: tl.constexpr, BN: tl.constexpr):
    return tl.reshape(tl.permute(tl.join(a, b), [0, 2, 1]), [BM, BN])


@triton.jit
def _exp2_mixed(x, BM: tl.constexpr, BN: tl.constexpr, POLY: tl.constexpr):
    """``exp2`` of a ``[BM, BN]`` tile, its last ``BN / POLY`` columns through :func:`_exp2_poly`."""
    if POLY == 0:
        return tl.exp2(x)
    elif POLY == 2:
        a, b = _split_cols(x, BM, BN)
        return _join_cols(tl.exp2(a), _exp2_poly(b), BM, BN)
    elif POLY == 4:
        a, b = _split_cols(x, BM, BN)
        b1, b2 = _split_cols(b, BM, BN // 2)
        return _join_cols(tl.exp2(a), _join_cols(tl.exp2(b1), _exp2_poly(b2), BM, BN // 2), BM, BN)
    else:
        tl.static_assert(POLY == 8)
        a, b = _split_cols(x, BM, BN)
        b1, b2 = _split_cols(b, BM, BN // 2)
        c1, c2 = _split_cols(b2, BM, BN // 4)
        bb = _join_cols(tl.exp2(b1), _join_cols(tl.exp2(c1), _exp2_poly(c2), BM, BN // 4), BM, BN // 2)
        return _join_cols(tl.exp2(a), bb, BM, BN)


@triton.jit
def _attend_tile_v(
    acc, m_i, l_i, q, kt, v, qk_scale, offs_n, q_pos, kv,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, FUSE_SCALE: tl.constexpr, POLY: tl.constexpr,
):  # fmt: skip
    BM: tl.constexpr = q.shape[0]
    BN: tl.constexpr = kt.shape[1]
    s = tl.dot(q, kt)
    if not FUSE_SCALE:
        s = s * qk_scale
    if MASKED:
        valid = offs_n[None, :] < kv
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, float("-inf"))
    row_max = tl.max(s, 1)
    if FUSE_SCALE:
        row_max = row_max * qk_scale
    m_new = tl.maximum(m_i, row_max)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    alpha = tl.exp2(m_i - m_use)
    arg = s * qk_scale - m_use[:, None] if FUSE_SCALE else s - m_use[:, None]
    p = _exp2_mixed(arg, BM, BN, POLY)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _softmax_step(acc, m_i, l_i, s, v, qk_scale, POLY: tl.constexpr):
    """An unmasked online-softmax step on raw scores ``s`` (FUSE_SCALE's arithmetic)."""
    BM: tl.constexpr = s.shape[0]
    BN: tl.constexpr = s.shape[1]
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = _exp2_mixed(s * qk_scale - m_new[:, None], BM, BN, POLY)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _prefill_tma_variant(
    q_desc, k_desc, v_desc, o_desc, KV_LEN, stride_kvl, seqlen_q, seqlen_k, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PACK_GQA: tl.constexpr, FUSE_SCALE: tl.constexpr, POLY: tl.constexpr, PIPE: tl.constexpr = False,
    FLIP_Q: tl.constexpr = True,
):  # fmt: skip
    """The shipped ``_prefill_tma_kernel`` without a KV split, with the probe's softmax variants."""
    HEADS: tl.constexpr = GROUP if PACK_GQA else 1
    ROWS: tl.constexpr = BLOCK_M // HEADS
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_hb = tl.program_id(1)
    pid_b = tl.program_id(2)
    head0 = pid_hb * HEADS
    pid_kvh = head0 // GROUP
    kv = _valid_kv_len(KV_LEN, stride_kvl, pid_b, seqlen_k, True)
    q_shift = kv - seqlen_q
    start_m = pid_m * ROWS
    n_full, n_total = _kv_tile_range(kv, q_shift, start_m, tl.minimum(start_m + ROWS, seqlen_q), BLOCK_N, True)
    rows = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q_pos = q_shift + start_m + rows % ROWS
    q = q_desc.load([pid_b, head0, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    if FLIP_Q:
        # The max is taken on raw scores: a negative scale flips it, so flip q (exact) and the scale.
        # (Without FLIP_Q the probe's positive scale needs nothing; q then stays a wgmma operand in
        # shared memory, where the select makes Triton hold it in registers.)
        q = tl.where(qk_scale < 0, -q, q)
        qk_scale = tl.abs(qk_scale)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PIPE:
        # QK^T of the next tile issued before this tile's softmax, so the wgmma can run under it.
        last = tl.maximum(n_full - 1, 0)
        k = k_desc.load([pid_b, pid_kvh, 0, 0]).reshape(BLOCK_N, HEAD_DIM)
        s = tl.dot(q, tl.trans(k))
        for t in tl.range(0, n_full):
            v = v_desc.load([pid_b, pid_kvh, t * BLOCK_N, 0]).reshape(BLOCK_N, HEAD_DIM)
            k = k_desc.load([pid_b, pid_kvh, tl.minimum(t + 1, last) * BLOCK_N, 0]).reshape(BLOCK_N, HEAD_DIM)
            s_next = tl.dot(q, tl.trans(k))
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, qk_scale, POLY)
            s = s_next
    for t in tl.range(0, 0 if PIPE else n_full):
        start_n = t * BLOCK_N
        k = k_desc.load([pid_b, pid_kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = v_desc.load([pid_b, pid_kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc, m_i, l_i = _attend_tile_v(
            acc, m_i, l_i, q, tl.trans(k), v, qk_scale, offs_n, q_pos, kv, False, True, FUSE_SCALE, POLY
        )
    for t in tl.range(n_full, n_total):
        start_n = t * BLOCK_N
        k = k_desc.load([pid_b, pid_kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = v_desc.load([pid_b, pid_kvh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = tl.where((start_n + offs_n < kv)[:, None], v, 0.0)
        acc, m_i, l_i = _attend_tile_v(
            acc, m_i, l_i, q, tl.trans(k), v, qk_scale, start_n + offs_n, q_pos, kv, True, True, FUSE_SCALE, POLY
        )
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_desc.store([pid_b, head0, start_m, 0], acc.to(q.dtype).reshape(1, HEADS, ROWS, HEAD_DIM))


def launch_variant(
    q, k, v, kv_len, out, scale: float, config: dict, fuse: bool, poly: int, pipe: bool = False, flip: bool = True
) -> None:
    batch, q_heads, seqlen_q, head_dim = q.shape
    group = q_heads // k.shape[1]
    heads = group if config["PACK_GQA"] else 1
    rows = config["BLOCK_M"] // heads
    q_desc = TensorDescriptor.from_tensor(q, [1, heads, rows, head_dim])
    k_desc = TensorDescriptor.from_tensor(k, [1, 1, config["BLOCK_N"], head_dim])
    v_desc = TensorDescriptor.from_tensor(v, [1, 1, config["BLOCK_N"], head_dim])
    o_desc = TensorDescriptor.from_tensor(out, [1, heads, rows, head_dim])
    grid = (triton.cdiv(seqlen_q, rows), q_heads // heads, batch)
    _prefill_tma_variant[grid](
        q_desc, k_desc, v_desc, o_desc, kv_len, 0, seqlen_q, k.shape[2], scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
        PACK_GQA=config["PACK_GQA"], FUSE_SCALE=fuse or pipe, POLY=poly, PIPE=pipe,
        FLIP_Q=(fuse or pipe) and flip, num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip


#: (D, Lq, Lkv, shipped winner's config from the H200 bundle at that key, SPLIT_KV=1 only).
SHAPES = [
    (64, 4096, 131072, {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "PACK_GQA": True}),
    (64, 16384, 16384, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PACK_GQA": True}),
    (64, 16384, 16384, {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "PACK_GQA": True}),
    (128, 4096, 131072, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "PACK_GQA": True}),
    (128, 16384, 16384, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "PACK_GQA": True}),
    (128, 16384, 16384, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "PACK_GQA": False}),
]
#: (FUSE_SCALE, POLY, PIPE); the first is the shipped kernel's arithmetic.
VARIANTS = [
    (False, 0, False),
    (True, 0, False),
    (True, 8, False),
    (True, 4, False),
    (True, 2, False),
    (True, 0, True),
    (True, 8, True),
    (True, 4, True),
]


def probe_shape(
    d: int,
    lq: int,
    lkv: int,
    config: dict,
    variants: list[tuple[bool, int, bool, bool]],
    device: torch.device,
    rows: list[str],
) -> None:
    """Time the shipped kernel and every variant at one shape and config, appending table rows."""
    from tritune.kernels import prefill_attention

    torch.manual_seed(0)
    q = torch.randn(1, 16, lq, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 2, lkv, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(1, 2, lkv, d, device=device, dtype=torch.bfloat16)
    kv_len = torch.tensor(lkv, device=device, dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    pairs = 16 * (lq * (lkv - lq) + lq * (lq + 1) / 2)
    pinned = {"path": "tma", "SPLIT_KV": 1, **config}
    shipped = bl.pinned_call("tma_prefill", pinned, prefill_attention, q, k, v, causal=True, kv_len=kv_len)
    expected = shipped()
    base_ms = bl.time_ms(shipped, device)
    label = " ".join(f"{key}={value}" for key, value in config.items())

    def add(variant: str, ms: float, diff: str) -> None:
        tflops = 4 * pairs * d / ms / 1e9
        rows.append(f"| {d} | {lq} | {lkv} | {label} | {variant} | {ms:.3f} | {tflops:.0f} | "
                    f"{base_ms / ms:.3f}x | {diff} |")  # fmt: skip
        print(rows[-1], flush=True)

    add("shipped kernel (dispatcher, pinned)", base_ms, "0")
    for fuse, poly, pipe, flip in variants:
        out = torch.full_like(q, float("nan"))

        def call(out=out, fuse=fuse, poly=poly, pipe=pipe, flip=flip) -> None:
            launch_variant(q, k, v, kv_len, out, scale, config, fuse, poly, pipe, flip)

        name = f"FUSE_SCALE={fuse} POLY={poly} PIPE={pipe}" + ("" if flip else " FLIP_Q=False")
        try:
            call()
            torch.cuda.synchronize()
            diff = (out.float() - expected.float()).abs().max().item()
            ms = bl.time_ms(call, device)
        except Exception as exc:  # a probe reports a variant that fails, and goes on
            rows.append(f"| {d} | {lq} | {lkv} | {label} | {name} | failed: {bl.error_text(exc)} | | | |")
            print(rows[-1], flush=True)
            continue
        add(name, ms, f"{diff:.2e}")


def _variant(text: str) -> tuple[bool, int, bool, bool]:
    fuse, poly, pipe, flip = (int(part) for part in text.split(","))
    return bool(fuse), poly, bool(pipe), bool(flip)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--variant",
        action="append",
        help="FUSE_SCALE,POLY,PIPE,FLIP_Q as 0/1 flags and an int, e.g. 1,0,0,0 (default: session 9 call 2's set)",
    )
    args = parser.parse_args(argv)
    variants = [_variant(text) for text in args.variant] if args.variant else [(*v, True) for v in VARIANTS]
    device = torch.device("cuda")
    rows = [
        "| D | Lq | Lkv | config | variant | ms | TFLOP/s | vs shipped | max abs diff vs shipped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d, lq, lkv, config in SHAPES:
        probe_shape(d, lq, lkv, config, variants, device, rows)
        torch.cuda.empty_cache()
    notes = ["B=1, Hq=16, Hkv=2, bf16, bottom-right causal, kv_len on the device; SPLIT_KV=1 configs.",
             "ms: do_bench median, L2 flushed. TFLOP/s counts unmasked pairs. vs shipped: shipped ms / variant ms.",
             "Variant FUSE_SCALE=False POLY=0 PIPE=False: the probe's copy of the shipped kernel."]  # fmt: skip
    return bl.finish_probe(device, "Prefill TMA kernel: softmax variants (probe)", notes, rows, args.out)


if __name__ == "__main__":
    sys.exit(main())
