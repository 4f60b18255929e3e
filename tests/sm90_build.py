"""Compile the folded fp8 Q4_K kernel for sm_90 without a GPU and report what ptxas made of it.

Run as a script, in a process without ``TRITON_INTERPRET`` (the interpreter replaces the jit
kernels): ``python tests/sm90_build.py '[[BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages], ...]'``.
Prints one JSON line per config: the tensor-core instructions in the PTX, registers, spill bytes
and shared memory. Arguments are specialized as a launch specializes them (16-byte divisible
pointers and sizes, unit output stride), which decides whether Triton pipelines the loads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from tritune.kernels.q4k._triton_q4k import _q4k_gemm_fp8_fold_kernel

SIGNATURE = {
    "xq_ptr": "*fp8e4nv",
    "row_scale_ptr": "*fp32",
    "qs_ptr": "*u8",
    "sc_ptr": "*u8",
    "mn_ptr": "*u8",
    "ss_ptr": "*fp16",
    "bias_ptr": "*bf16",
    "out_ptr": "*bf16",
    "M": "i32",
    "N": "i32",
    "K": "i32",
    "stride_qn": "i32",
    "stride_sn": "i32",
    "stride_ssn": "i32",
    "stride_om": "i32",
    "stride_ok": "i32",
    "stride_bn": "i32",
}


def build(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, k: int = 4096) -> dict[str, Any]:
    kernel = _q4k_gemm_fp8_fold_kernel
    constants = {
        "stride_on": 1,
        "HAS_BIAS": False,
        "ROUND_IN_FP32": False,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "GROUP_M": 8,
        "SPLIT_K": 1,
        "K_TILES": k // block_k,
    }
    signature = {**SIGNATURE, **dict.fromkeys(constants, "constexpr")}
    index = kernel.arg_names.index
    source = ASTSource(
        kernel,
        signature,
        constexprs={(index(name),): value for name, value in constants.items()},
        attrs={(index(name),): [["tt.divisibility", 16]] for name in SIGNATURE},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", os.path.join(tmp, "kernel.o")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    registers = re.search(r"Used (\d+) registers", log)
    mma = re.findall(r"(wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.\w+\.\w+|mma\.sync\.aligned\.[\w.]+)", ptx)
    return {
        "config": [block_m, block_n, block_k, num_warps, num_stages],
        "mma": sorted(set(mma)),
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else None,
        "shared": compiled.metadata.shared,
    }


if __name__ == "__main__":
    for config in json.loads(sys.argv[1]):
        print(json.dumps(build(*config)), flush=True)
