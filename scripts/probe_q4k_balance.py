"""Does the Q4_K decode kernel lose time to an uneven grid? Time one tile over several N.

The shipped decode tile (16 x 64 x 256, 4 warps, 3 stages, no split) makes ``N / 64`` programs; at
the Llama-3-8B up projection (N = 14336) that is 224 programs on 132 SMs, so 92 SMs run two and 40
run one, and the call lasts as long as the SMs with two. This probe times the same tile at N values
that give 0.5 to 4 programs per SM (K = 4096, M = 16) and reports each call's weight bandwidth next to
bf16 cuBLAS on the dequantized weight: if the 224-program grid is the odd one out (bandwidth well
below its neighbours 198 and 264), balancing the grid is worth a kernel change; if bandwidth grows
smoothly with the program count, the kernel is bound per program, not by the grid.

Every call is timed as a CUDA-graph replay with the L2 flushed (``_benchlib.graph_time``), after its
output was NaN-poisoned, replayed and checked against the float32 reference (SQNR >= 40 dB).

    python scripts/probe_q4k_balance.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _benchlib as bl
import torch

from tritune.kernels import Q4KWeight, q4k_linear, use_config
from tritune.kernels.q4k.reference import q4k_linear_reference, sqnr_db

#: The shipped portable decode tile (``Q4KSpec.default_config`` at M <= 16, N = 14336).
TILE = {"path": "portable", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4,
        "num_stages": 3, "SPLIT_K": 1}  # fmt: skip
#: Programs per call of that tile, 66 (half the SMs) to 528 (four per SM); 224 is N = 14336.
PROGRAMS = (66, 132, 198, 224, 264, 330, 396, 528)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = [
        "| N | programs | per SM | tritune us | weight GB/s | cuBLAS bf16 us | vs cuBLAS |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    gen = torch.Generator(device=device).manual_seed(0)
    for programs in PROGRAMS:
        n = programs * TILE["BLOCK_N"]
        weight = Q4KWeight.quantize(torch.randn(n, args.k, generator=gen, device=device) * 0.02)
        x = torch.randn(args.m, args.k, generator=gen, device=device).bfloat16()
        expected = q4k_linear_reference(x, weight)
        dense = weight.dequantize().to(device=device, dtype=torch.bfloat16)

        def check(out: torch.Tensor, expected: torch.Tensor = expected) -> str | None:
            sqnr = sqnr_db(out.float(), expected)
            return None if sqnr >= 40.0 else f"SQNR {sqnr:.1f} dB"

        with use_config("q4k_fp8_gemm", TILE):
            ours, status = bl.graph_time(lambda x=x, weight=weight: q4k_linear(x, weight), check)
        theirs, their_status = bl.graph_time(lambda x=x, dense=dense: x @ dense.t(), check)
        if ours is None or theirs is None:
            rows.append(f"| {n} | {programs} | {programs / sms:.2f} | {status} | | {their_status} | |")
            continue
        rate = weight.nbytes / (ours * 1e-6) / 1e9
        per_sm = programs / sms
        cells = (n, programs, f"{per_sm:.2f}", f"{ours:.1f}", f"{rate:.0f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x")
        rows.append("| " + " | ".join(map(str, cells)) + " |")
        print(rows[-1], flush=True)
    notes = [
        f"Tile: {TILE}; M={args.m}, K={args.k}; N = programs x {TILE['BLOCK_N']}.",
        "Times: CUDA-graph replays, L2 flushed (median of triton.testing.do_bench), each output checked first.",
        "weight GB/s: the Q4_K weight's bytes (codes, scales, mins, d) over the call's time.",
    ]
    return bl.finish_probe(device, "Q4_K decode tile: time against programs per SM", notes, rows, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
