"""Count the SASS instructions in a small-M Q4_K kernel's main loop, on any machine (no GPU needed).

Triton compiles for an explicit target (``GPUTarget("cuda", 90, 32)``) with the ptxas and nvdisasm
its wheel ships, so this runs on the CPU machine. For each loop of the compiled kernel (a backward
branch), it prints the instruction count, the most frequent opcodes and, for the first (main)
loop, instructions per weight per thread: the number that bounds an issue-bound dequantizing GEMM
(session 8 found the shipped portable kernel at 7.3, matching Nsight Compute's count on the H200).

    python scripts/sass_q4k_loop.py                                  # the shipped portable kernel
    python scripts/sass_q4k_loop.py --probe asm --block-n 64         # a variant of probe_q4k_gemv.py

The probe variants' ``CODES`` are those of ``scripts/probe_q4k_gemv.py``.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _compile(fn, signature: dict[str, str], constexprs: dict[str, object], num_warps: int, num_stages: int):
    """Compile ``fn`` for sm_90, with every non-constexpr argument assumed 16-divisible (as the launches' are)."""
    for name in constexprs:
        signature[name] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind != "constexpr"}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def _loops(cubin: bytes) -> tuple[list[tuple[int, collections.Counter[str]]], str]:
    """(instruction count, opcode histogram) of each loop in the cubin, and its register use."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([_TOOLS / "nvdisasm", "-c", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run(
            [_TOOLS / "cuobjdump", "--dump-resource-usage", path], capture_output=True, text=True
        ).stdout
    labels: dict[str, int] = {}
    instructions: list[str] = []
    for line in sass.splitlines():
        if label := re.match(r"^(\.L_x_\d+):", line):
            labels[label.group(1)] = len(instructions)
        if op := re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            instructions.append(op.group(1))
    loops = []
    for end, text in enumerate(instructions):
        branch = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if branch and labels.get(branch.group(1), end + 1) < end:
            body = instructions[labels[branch.group(1)] : end + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in body)
            loops.append((len(body), ops))
    registers = re.search(r"REG:(\d+)", usage)
    return loops, registers.group(1) if registers else "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe", help="a CODES value of probe_q4k_gemv.py (default: the shipped portable kernel)")
    parser.add_argument("--swap", action="store_true", help="probe variants: the weight as the dot's first operand")
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--block-k", type=int, default=256)
    parser.add_argument("--split-k", type=int, default=1)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=3)
    args = parser.parse_args(argv)
    k_tiles = args.k // args.block_k // args.split_k
    pointers = {"x_ptr": "*bf16", "qs_ptr": "*u8", "sc_ptr": "*u8", "mn_ptr": "*u8", "ss_ptr": "*fp16"}
    if args.probe is None:
        from tritune.kernels.q4k._triton_q4k import _q4k_gemm_portable_kernel as kernel

        signature = {**pointers, "bias_ptr": "*bf16", "out_ptr": "*bf16"}
        scalars = ("M", "N", "stride_xm", "stride_xk", "stride_qn", "stride_sn", "stride_ssn", "stride_om")
        signature |= {name: "i32" for name in (*scalars, "stride_on", "stride_ok", "stride_bn")}
        constexprs: dict[str, object] = {
            "stride_xk": 1,
            "stride_on": 1,
            "HAS_BIAS": False,
            "DOT_IN_FP32": False,
            "GROUP_M": 1,
        }
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from probe_q4k_gemv import _gemv_kernel as kernel

        signature = {**pointers, "out_ptr": "*fp32"}
        scalars = ("M", "N", "stride_xm", "stride_qn", "stride_sn", "stride_ssn", "stride_ok", "stride_om")
        signature |= {name: "i32" for name in scalars}
        constexprs = {"CODES": args.probe, "SWAP": args.swap, "F32DOT": False}
    constexprs |= {
        "BLOCK_M": 16,
        "BLOCK_N": args.block_n,
        "BLOCK_K": args.block_k,
        "SPLIT_K": args.split_k,
        "K_TILES": k_tiles,
    }
    compiled = _compile(kernel, signature, constexprs, args.num_warps, args.num_stages)
    loops, registers = _loops(compiled.asm["cubin"])
    weights_per_thread = args.block_n * args.block_k / (32 * args.num_warps)
    print(f"{args.probe or 'shipped portable'}: {registers} registers, {compiled.metadata.shared} B shared memory")
    for index, (count, ops) in enumerate(loops):
        per_weight = f", {count / weights_per_thread:.2f} per weight per thread" if index == 0 else ""
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(10))
        print(f"  loop {index}: {count} instructions{per_weight}: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
