"""Build tritune's Triton kernels for sm_90 on a machine without a GPU.

The CPU test tier runs the kernels on the Triton interpreter, which executes their Python and so
never sees what Triton's compiler front end refuses (a name bound only under a ``constexpr``
branch, a type that does not unify across branches, ...). Triton can still compile for sm_90
here, all the way to a cubin with its bundled ptxas; this module does that in two halves:

- in the test process (interpreter or not), :func:`record_launches` intercepts kernel launches
  instead of running them, and :func:`specialize` turns each recorded launch into what
  ``JITFunction.run`` would compile for an H200: the signature, ``constexpr`` values and
  divisibility attributes derived from the real arguments by Triton's own binder, and the launch
  options;
- in a process without ``TRITON_INTERPRET`` (the kernels must be ``JITFunction`` objects), this
  file as a script compiles each recorded launch with ``triton.compile`` for
  ``GPUTarget("cuda", 90, 32)`` and prints one JSON line per launch: the compiler's message if it
  failed, else its shared memory and the PTX's atomics and L2-only (``.cg``) loads, what a kernel
  whose programs hand data to each other within a launch depends on.

Script use: ``python tests/sm90_build.py --records FILE [--detail]`` (records as :func:`specialize` writes
them; ``--detail`` adds :func:`code_report`'s digests, registers and spills),
``python tests/sm90_build.py --bundle-winners BUNDLE KERNEL JIT_KERNEL`` (the distinct launches of
``JIT_KERNEL`` at ``KERNEL``'s winners in a bundle, with :func:`code_report`: whether the code a
bundle's timings measured is still what its configs build, :func:`build_bundle_winners`),
``python tests/sm90_build.py --gemv '[{"k": K, "n": N, "config": {...}}, ...]'`` (the launches
of one Q4_K call with ptxas' report, code digests and reduction layouts: :func:`build_gemv`),
``python tests/sm90_build.py --prefill-ws '[[HEAD_DIM, CAUSAL, HAS_KV_LEN], ...]'`` (the
warp-specialized prefill kernel at its starting configs with ptxas' report: :func:`build_prefill_ws`),
or ``python tests/sm90_build.py '[[BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages], ...]'``
for the folded fp8 Q4_K kernel with what ptxas made of it (tensor-core instructions, registers,
spill bytes, shared memory, where wgmma's A operand comes from, asynchronous copies); a sixth
element ``true`` builds the folded kernel with ``SWAP_AB``, ``"portable"`` the
portable (bf16) kernel, ``"int8"`` and ``"int8-swap"`` the int8 kernel without and with
``SWAP_AB``. With ``--sass`` first, each line also counts the SASS opcodes of the
kernel's main loop (:func:`sass_loop_counts`), the measure of the dequantization's cost.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

#: What the records are built for: an H200 (compute capability 9.0, 32-thread warps).
TARGET = GPUTarget("cuda", 90, 32)


# ---- the test-process half: record launches, specialize them as a launch on the target would ----


@dataclass
class Launch:
    """One intercepted ``kernel[grid](*args, **kwargs)``."""

    kernel: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grid: Any = None


@dataclass
class Recorder:
    launches: list[Launch] = field(default_factory=list)


def build_reason() -> str | None:
    """Why Triton's CUDA backend cannot build for sm_90 here (no ptxas), or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception as exc:
        return f"Triton's CUDA backend cannot build here: {exc}"
    if not os.access(ptxas, os.X_OK):
        return f"Triton's ptxas is not executable here: {ptxas}"
    return None


@contextlib.contextmanager
def record_launches() -> Iterator[Recorder]:
    """Record every Triton kernel launch in the block instead of running it.

    Patches ``run`` of both kernel classes (``InterpretedFunction`` under ``TRITON_INTERPRET``,
    ``JITFunction`` otherwise), which every launch reaches, whether through ``kernel[grid]`` or
    torch's ``wrap_triton``. Nothing runs, so the arguments may be meta tensors.

    The arrival counters that launches in the block ask for come from buffers of their own, kept
    out of the process's (``_launch.COUNTERS``): a buffer on meta holds no values to check.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from tritune.kernels import _launch

    recorder = Recorder()

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        recorder.launches.append(Launch(self, args, kwargs, grid))

    saved = {cls: cls.__dict__["run"] for cls in (InterpretedFunction, JITFunction)}
    counters, retired = _launch.COUNTERS, _launch._RETIRED_COUNTERS
    try:
        _launch.COUNTERS, _launch._RETIRED_COUNTERS = {}, []
        for cls in saved:
            cls.run = run
        yield recorder
    finally:
        _launch.COUNTERS, _launch._RETIRED_COUNTERS = counters, retired
        for cls, original in saved.items():
            cls.run = original


def _json_value(value: Any) -> Any:
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"dtype": str(value)}
    if isinstance(value, tl.constexpr):
        return _json_value(value.value)
    return value


def specialize(launch: Launch) -> dict[str, Any]:
    """What ``JITFunction.run`` would compile for :data:`TARGET` from this launch, as plain JSON.

    Uses Triton's own binder for the target's backend, so tensors become ``*bf16``/``*fp8e4nv``/...,
    ints ``i32``/``i64`` (or the constant 1), pointers and ints divisible by 16 carry
    ``tt.divisibility``, ``None`` is a ``constexpr``, and host ``TensorDescriptor`` objects become
    ``tensordesc<...>``, exactly as a launch on an H200 specializes the same arguments. Relies on
    ``JITFunction._pack_args``, Triton 3.6's own step from bound arguments to a compile request.
    """
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = launch.kernel.fn
    jit = launch.kernel if isinstance(launch.kernel, JITFunction) else JITFunction(fn)
    backend = make_backend(TARGET)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    _, signature, constexprs, attrs = jit._pack_args(backend, launch.kwargs, bound, specialization, options)
    names = set(jit.arg_names)
    return {
        "module": fn.__module__,
        "kernel": fn.__name__,
        "signature": signature,
        "constexprs": [[list(path), _json_value(value)] for path, value in constexprs.items()],
        "attrs": [[list(path), value] for path, value in attrs.items()],
        "options": {name: value for name, value in launch.kwargs.items() if name not in names},
    }


# ---- the compile half: run without TRITON_INTERPRET ------------------------------------------


def _constexpr_value(value: Any) -> Any:
    import triton.language as tl

    if isinstance(value, dict) and "dtype" in value:
        return tl.dtype(value["dtype"])
    return value


def compile_record(record: dict[str, Any]) -> Any:
    """``triton.compile`` of one record for :data:`TARGET`; raises what the compiler raises."""
    import importlib

    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(record["module"]), record["kernel"])
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(f"{record['kernel']} is a {type(kernel).__name__}: compile without TRITON_INTERPRET")
    # A Gluon kernel (explicit layouts) is built from its own source class, as its launch would.
    source_type = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    source = source_type(
        kernel,
        record["signature"],
        constexprs={tuple(path): _constexpr_value(value) for path, value in record["constexprs"]},
        attrs={tuple(path): value for path, value in record["attrs"]},
    )
    return triton.compile(source, target=TARGET, options=record["options"])


def _build_one(record: dict[str, Any], detail: bool = False) -> dict[str, Any]:
    try:
        compiled = compile_record(record)
    except Exception as exc:
        return {"id": record.get("id"), "error": f"{type(exc).__name__}: {exc}"}
    ptx = compiled.asm["ptx"]
    result = {
        "id": record.get("id"),
        "error": None,
        "shared": compiled.metadata.shared,
        "atomics": sorted(set(re.findall(r"\batom(?:\.\w+)+", ptx))),
        "cg_loads": len(re.findall(r"\bld\.global\.cg\b", ptx)),
        "tma_loads": len(re.findall(r"\bcp\.async\.bulk\.tensor\.", ptx)),
    }
    if detail:
        result.update(code_report(compiled))
    return result


def _build_detailed(record: dict[str, Any]) -> dict[str, Any]:
    return _build_one(record, detail=True)


def build_records(records: list[dict[str, Any]], workers: int, detail: bool = False) -> Iterator[dict[str, Any]]:
    """Compile ``records`` in ``workers`` processes; results in the records' order (``detail``:
    with :func:`code_report`'s fields)."""
    build = _build_detailed if detail else _build_one
    if workers <= 1:
        yield from map(build, records)
        return
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        yield from pool.map(build, records)


def ptxas_report(ptx: str) -> dict[str, int | None]:
    """Registers and spill bytes (stores + loads) ptxas reports for ``ptx`` built for sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas

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
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else None,
    }


def code_report(compiled: Any) -> dict[str, Any]:
    """What identifies a build's code and its cost: digests of the normalized PTX
    (:func:`normalized_ptx`) and of the SASS (``nvdisasm -c``), ptxas' registers and spills, and
    the TMA loads (``cp.async.bulk.tensor``) in the PTX."""
    import hashlib

    ptx = compiled.asm["ptx"]
    return {
        "ptx_sha256": hashlib.sha256(normalized_ptx(ptx).encode()).hexdigest(),
        "sass_sha256": hashlib.sha256(_sass(compiled.asm["cubin"]).encode()).hexdigest(),
        "tma_loads": len(re.findall(r"\bcp\.async\.bulk\.tensor\.", ptx)),
        **ptxas_report(ptx),
    }


# ---- a bundle's winners as an H200 launches them (the code its timings measured) ---------------


def meta_problem(spec: Any, key: Any) -> Any:
    """``spec``'s GPU problem at ``key`` on meta tensors: GPU shapes, nothing allocated or computed.

    ``make_problem`` seeds ``torch.Generator(device=...)``, which has no meta form: a CPU generator
    stands in while it runs (random draws accept one for meta tensors).
    """
    import torch

    generator = torch.Generator

    class MetaGenerator(generator):  # type: ignore[misc, valid-type]
        def __new__(cls, device: Any = "cpu") -> torch.Generator:
            return generator() if torch.device(device).type == "meta" else generator(device)

    torch.Generator = MetaGenerator  # type: ignore[misc]
    try:
        return spec.make_problem(key, torch.device("meta"), 0)
    finally:
        torch.Generator = generator  # type: ignore[misc]


def record_winners(
    kernel: str, entries: list[tuple[dict[str, Any], dict[str, Any]]], jit_kernel: str, *, direct_body: bool = True
) -> list[dict[str, Any]]:
    """The distinct specializations of ``jit_kernel`` that ``kernel`` launches at each ``(key,
    config)`` of ``entries`` (plain dicts, as a bundle holds them), recorded from the real launch
    code at the key's GPU problem on meta tensors; per specialization the record and the indices of
    the entries that launch it (``entries``). ``direct_body``: launch as an op body called directly
    (``wrap_triton`` off), where host-side descriptors are allowed."""
    import torch
    from torch._library.triton import set_wrap_triton_enabled

    from tritune.kernels import _launch, settings
    from tritune.kernels.registry import get_spec

    spec = get_spec(kernel)
    meta = torch.device("meta")
    distinct: dict[str, dict[str, Any]] = {}
    saved = _launch.SM_COUNTS.get(meta)
    # Replayed launches would go around the interception: every call runs its launch function.
    try:
        with settings.override(eager_replay=False):
            for index, (key_fields, config) in enumerate(entries):
                key = spec.key_type(**key_fields)
                # Launch plans read the SM count of the tensors' device: the key's GPU's.
                _launch.SM_COUNTS[meta] = key.sm_count
                problem = meta_problem(spec, key)
                # An op with no meta kernel (the staged path's fp8 GEMM, cuBLASLt's) ends the
                # call there; the Triton launches before it are recorded.
                with (
                    record_launches() as recorder,
                    set_wrap_triton_enabled(not direct_body),
                    contextlib.suppress(NotImplementedError),
                ):
                    spec.launch(spec.space.parse(config), *problem.args, **problem.kwargs)
                for launch in recorder.launches:
                    if launch.kernel.fn.__name__ != jit_kernel:
                        continue
                    record = specialize(launch)
                    identity = json.dumps(record, sort_keys=True)
                    distinct.setdefault(identity, {"record": record, "entries": []})["entries"].append(index)
    finally:
        if saved is None:
            _launch.SM_COUNTS.pop(meta, None)
        else:
            _launch.SM_COUNTS[meta] = saved
    return list(distinct.values())


def record_bundle_winners(bundle: str, kernel: str, jit_kernel: str) -> list[dict[str, Any]]:
    """:func:`record_winners` at ``kernel``'s winners in ``bundle``; ``entries`` index the bundle's winners."""
    from tritune.configs_db.values import strict_loads

    with open(bundle, encoding="utf-8") as f:
        winners = strict_loads(f.read())["winners"]
    indices = [i for i, entry in enumerate(winners) if entry["kernel"] == kernel]
    found = record_winners(kernel, [(winners[i]["key"], winners[i]["config"]) for i in indices], jit_kernel)
    for item in found:
        item["entries"] = [indices[i] for i in item["entries"]]
    return found


def build_bundle_winners(bundle: str, kernel: str, jit_kernel: str) -> Iterator[dict[str, Any]]:
    """:func:`record_bundle_winners`, each built for sm_90 with :func:`code_report`'s fields; one
    result per distinct specialization, in the bundle's order. Run without ``TRITON_INTERPRET``."""
    found = record_bundle_winners(bundle, kernel, jit_kernel)
    records = [{**item["record"], "id": i} for i, item in enumerate(found)]
    for item, result in zip(found, build_records(records, len(os.sched_getaffinity(0)), detail=True), strict=True):
        yield {"entries": item["entries"], **result}


# ---- the folded fp8 Q4_K kernel with ptxas' report (tests/test_q4k.py) -----------------------

FOLD_SIGNATURE = {
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

INT8_SIGNATURE = {
    "xq_ptr": "*i8",
    "x_scale_ptr": "*fp32",
    "w_scale_ptr": "*fp32",
    **{name: kind for name, kind in FOLD_SIGNATURE.items() if name not in ("xq_ptr", "row_scale_ptr")},
}

PORTABLE_SIGNATURE = {
    "x_ptr": "*bf16",
    "qs_ptr": "*u8",
    "sc_ptr": "*u8",
    "mn_ptr": "*u8",
    "ss_ptr": "*fp16",
    "bias_ptr": "*bf16",
    "out_ptr": "*bf16",
    "M": "i32",
    "N": "i32",
    "stride_xm": "i32",
    "stride_qn": "i32",
    "stride_sn": "i32",
    "stride_ssn": "i32",
    "stride_om": "i32",
    "stride_ok": "i32",
    "stride_bn": "i32",
}

#: Opcodes that issue at a quarter of the ALU rate on Hopper (16 per clock per SM): the
#: conversions between integers and floats or between float widths (F2FP, the packing one, is not).
QUARTER_RATE = ("I2F", "I2FP", "F2F", "F2I")

_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_SASS_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def sass_loop_counts(sass: str) -> dict[str, int]:
    """Opcodes (without modifiers) of the longest loop in ``nvdisasm -c`` output: the
    instructions from a label to the last branch back to it. A Triton K loop is not unrolled, so
    for a GEMM this is one iteration of its main loop."""
    labels: dict[str, int] = {}
    opcodes: list[str] = []
    best: tuple[int, int] = (0, 0)
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            labels[label.group(1)] = len(opcodes)
            continue
        instruction = _SASS_INSTRUCTION.match(line)
        if not instruction:
            continue
        opcodes.append(instruction.group(1))
        branch = _SASS_BRANCH.search(line)
        if branch and branch.group(1) in labels:
            start = labels[branch.group(1)]
            if len(opcodes) - start > best[1] - best[0]:
                best = (start, len(opcodes))
    counts: dict[str, int] = {}
    for opcode in opcodes[best[0] : best[1]]:
        counts[opcode] = counts.get(opcode, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _sass(cubin: bytes) -> str:
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


def _sass_report(cubin: bytes, weights_per_thread: int) -> dict[str, Any]:
    """The main loop's opcode counts and its issue slots per weight, counting the quarter-rate
    conversions four times."""
    counts = sass_loop_counts(_sass(cubin))
    slots = sum(counts.values()) + 3 * sum(counts.get(op, 0) for op in QUARTER_RATE)
    return {
        "weights_per_thread": weights_per_thread,
        "loop_instructions": sum(counts.values()),
        "issue_slots_per_weight": round(slots / weights_per_thread, 3),
        "loop_opcodes": counts,
    }


#: A wgmma's operands after its accumulator registers: ``{...}`` (A in registers) or a ``%rd``
#: shared-memory descriptor (A in shared memory), then B's descriptor.
_WGMMA_A = re.compile(r"wgmma\.mma_async[^{]*\{[^}]*\},\s*(\{|%rd)")


def build_q4k(
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    variant: bool | str = False,
    k: int = 4096,
    sass: bool = False,
) -> dict[str, Any]:
    """Build a Q4_K kernel (``variant``: ``False`` the folded fp8 kernel, ``True`` it with ``SWAP_AB``,
    ``"portable"`` the portable one, ``"int8"``/``"int8-swap"`` the int8 one without/with
    ``SWAP_AB``) as a launch specializes it (16-byte divisible pointers and
    sizes, unit strides along K and N) and report the MMA instructions, registers, spills, shared
    memory, where wgmma's A operand comes from and how many wgmma groups stay in flight
    (``wgmma.wait_group N``: 0 waits for each), and the pipelined loads as ``cp.async``
    (Ampere-style asynchronous copies) and ``cp.async.bulk`` (TMA) instructions; with ``sass``,
    the main loop's SASS opcodes too (:func:`_sass_report`)."""

    from tritune.kernels.q4k import _triton_fold, _triton_int8, _triton_portable

    if variant in ("int8", "int8-swap"):
        kernel = _triton_int8._q4k_gemm_int8_kernel
        signature = INT8_SIGNATURE
        flags = {"stride_on": 1, "HAS_BIAS": False, "SWAP_AB": variant == "int8-swap"}
    elif variant == "portable":
        kernel = _triton_portable._q4k_gemm_portable_kernel
        signature = PORTABLE_SIGNATURE
        flags = {"stride_xk": 1, "stride_on": 1, "HAS_BIAS": False, "DOT_IN_FP32": False}
    elif isinstance(variant, bool):
        kernel = _triton_fold._q4k_gemm_fp8_fold_kernel
        signature = FOLD_SIGNATURE
        flags = {"stride_on": 1, "HAS_BIAS": False, "ROUND_IN_FP32": False, "SWAP_AB": variant}
    else:
        raise ValueError(f"variant: expected False, True, 'portable', 'int8' or 'int8-swap', got {variant!r}")
    constants = {
        **flags,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "GROUP_M": 8,
        "SPLIT_K": 1,
        "K_TILES": k // block_k,
    }
    index = kernel.arg_names.index
    record = {
        "module": kernel.fn.__module__,
        "kernel": kernel.fn.__name__,
        "signature": {**signature, **dict.fromkeys(constants, "constexpr")},
        "constexprs": [[[index(name)], value] for name, value in constants.items()],
        "attrs": [[[index(name)], [["tt.divisibility", 16]]] for name in signature],
        "options": {"num_warps": num_warps, "num_stages": num_stages},
    }
    compiled = compile_record(record)
    ptx = compiled.asm["ptx"]
    report = ptxas_report(ptx)
    mma = re.findall(r"(wgmma\.mma_async\.sync\.aligned\.\w+\.[fs]32\.\w+\.\w+|mma\.sync\.aligned\.[\w.]+)", ptx)
    a_sources = {"{": "registers", "%rd": "shared"}
    result = {
        "config": [block_m, block_n, block_k, num_warps, num_stages],
        "kernel": kernel.fn.__name__,
        "swap": variant is True or variant == "int8-swap",
        "mma": sorted(set(mma)),
        "wgmma_a": sorted({a_sources[a] for a in _WGMMA_A.findall(ptx)}),
        "wgmma_in_flight": max(map(int, re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)), default=None),
        "cp_async": len(re.findall(r"cp\.async\.c[ag]\.", ptx)),
        "tma": len(re.findall(r"cp\.async\.bulk\.", ptx)),
        **report,
        "shared": compiled.metadata.shared,
    }
    if sass:
        result.update(_sass_report(compiled.asm["cubin"], block_n * block_k // (32 * num_warps)))
    return result


# ---- the Q4_K GEMV launches with ptxas' report and their reduction layouts ---------------------

#: A blocked layout's fields in TTGIR text.
_BLOCKED_FIELDS = re.compile(
    r"sizePerThread = \[([\d, ]*)\], threadsPerWarp = \[([\d, ]*)\], warpsPerCTA = \[([\d, ]*)\], order = \[([\d, ]*)\]"
)
_LAYOUT_ALIAS = re.compile(r"^(#\w+) = (.*)$", re.MULTILINE)


def normalized_ptx(ptx: str) -> str:
    """``ptx`` without what moves when only source lines move: ``.loc`` directives, the debug
    labels (``$L__tmpN:``) and everything from the first ``.file`` on (the DWARF sections)."""
    body = ptx.split("\t.file", 1)[0]
    return "\n".join(line for line in body.splitlines() if not re.match(r"\s*(\.loc\b|\$L__tmp\d+:)", line))


def _resolve_layout(layout: str, aliases: dict[str, str]) -> str:
    """``layout`` with every ``#alias`` replaced by its definition (recursively)."""
    return re.sub(r"#(?!ttg\.)\w+", lambda m: _resolve_layout(aliases.get(m.group(0), m.group(0)), aliases), layout)


def reductions(ttgir: str) -> list[dict[str, Any]]:
    """Every ``tt.reduce`` of a kernel's TTGIR: its axis, operand shape and element type, combine
    op (``addf``, ``addi``, ``maxnumf`` ...) and operand layout (aliases resolved), with the
    blocked layout's fields along the axis where the operand's layout is blocked: what fixes the
    order in which a float sum adds its values."""
    aliases = dict(_LAYOUT_ALIAS.findall(ttgir))
    found = []
    for match in re.finditer(r'"tt\.reduce"\(', ttgir):
        rest = ttgir[match.end() :]
        axis = int(re.match(r"[^)]*\) <\{axis = (\d+)", rest).group(1))  # type: ignore[union-attr]
        body, _, tail = rest.partition("}) : (tensor<")
        operand = tail.split(") -> ", 1)[0]
        shape, _, layout = operand.partition(", ")
        combine = re.search(r"arith\.(\w+)", body)
        resolved = _resolve_layout(layout[:-1], aliases)
        entry: dict[str, Any] = {
            "axis": axis,
            "shape": [int(d) for d in shape.split("x")[:-1]],
            "type": shape.split("x")[-1],
            "combine": combine.group(1) if combine else None,
            "layout": resolved,
        }
        blocked = _BLOCKED_FIELDS.fullmatch(resolved.removeprefix("#ttg.blocked<{").removesuffix("}>"))
        if blocked:
            per_thread, lanes, warps, order = ([int(v) for v in f.split(", ")] for f in blocked.groups())
            entry["along_axis"] = {
                "per_thread": per_thread[axis],
                "lanes": lanes[axis],
                "warps": warps[axis],
                "lowest_lanes": order[0] == axis,
            }
        found.append(entry)
    return found


#: A load in TTGIR: its pointers' shape, element type and layout (an alias or an inline layout).
_LOAD = re.compile(r"= tt\.load [^:]*: tensor<([\dx]+)x!tt\.ptr<(\w+)>, (#\w+)>")


def global_loads(ttgir: str) -> list[dict[str, Any]]:
    """Every ``tt.load`` of a kernel's TTGIR whose layout is a blocked one: the shape and element type
    of its pointers, and the blocked layout's fields (``per_thread``, ``lanes``, ``warps``, ``order``),
    which fix how many rows and how many consecutive bytes one warp's load instruction reads."""
    aliases = dict(_LAYOUT_ALIAS.findall(ttgir))
    found = []
    for shape, element, layout in _LOAD.findall(ttgir):
        resolved = _resolve_layout(layout, aliases)
        blocked = _BLOCKED_FIELDS.search(resolved)
        if not resolved.startswith("#ttg.blocked<") or blocked is None:
            continue
        per_thread, lanes, warps, order = ([int(v) for v in f.split(", ")] for f in blocked.groups())
        entry = {"shape": [int(d) for d in shape.split("x")], "type": element}
        found.append({**entry, "per_thread": per_thread, "lanes": lanes, "warps": warps, "order": order})
    return found


def meta_q4k_call(m: int, n: int, k: int, bias: bool = False) -> tuple[Any, tuple[Any, ...], Any, Any]:
    """A Q4_K call's tensors on the meta device (nothing allocated): bf16 x ``[m, k]``, the four
    parts of a ``[n, k]`` Q4_K weight (codes, scales, mins, super-scales), the bias or None, and out."""
    import torch

    meta = torch.device("meta")
    parts = (
        torch.empty((n, k // 2), dtype=torch.uint8, device=meta),
        torch.empty((n, k // 32), dtype=torch.uint8, device=meta),
        torch.empty((n, k // 32), dtype=torch.uint8, device=meta),
        torch.empty((n, k // 256, 2), dtype=torch.float16, device=meta),
    )
    x = torch.empty((m, k), dtype=torch.bfloat16, device=meta)
    bias_t = torch.empty((n,), dtype=torch.bfloat16, device=meta) if bias else None
    return x, parts, bias_t, torch.empty((m, n), dtype=torch.bfloat16, device=meta)


def run_script(args: list[str], cache_dir: str, timeout: int = 600) -> list[Any]:
    """Run this file as a script (``args`` after its path) without ``TRITON_INTERPRET`` and with
    its own Triton cache; fail with the end of its stderr, else return its JSON lines."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = cache_dir
    run = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def build_gemv(k: int, n: int, config: dict[str, Any], m: int = 1, bias: bool = False) -> list[dict[str, Any]]:
    """The launches of one ``q4k_fp8_gemm`` call (bf16 x ``[m, k]``, a Q4_K weight ``[n, k]``) with
    ``config``, recorded from the real launch code on meta tensors and built for sm_90 as an H200
    launch would specialize them; per launch: the kernel, registers, spill bytes, shared memory,
    atomics, L2-only (``.cg``) loads, digests of the normalized PTX (:func:`normalized_ptx`) and
    of the SASS, the kernel's reductions (:func:`reductions`) and its loads' layouts
    (:func:`global_loads`). Run without ``TRITON_INTERPRET``."""
    import hashlib

    import torch
    from torch._library.triton import set_wrap_triton_enabled

    from tritune.kernels import _launch
    from tritune.kernels.q4k.kernel import KERNEL
    from tritune.kernels.q4k.launch import launch
    from tritune.kernels.q4k.weight import Q4KWeight

    meta = torch.device("meta")
    x, parts, bias_t, out = meta_q4k_call(m, n, k, bias)
    _launch.SM_COUNTS[meta] = 132
    with record_launches() as recorder, set_wrap_triton_enabled(False):
        launch(KERNEL.space.parse(config), x, Q4KWeight(*parts), bias_t, out)
    results = []
    for recorded in recorder.launches:
        compiled = compile_record(specialize(recorded))
        ptx = compiled.asm["ptx"]
        report = ptxas_report(ptx)
        results.append(
            {
                "kernel": recorded.kernel.fn.__name__,
                **report,
                "shared": compiled.metadata.shared,
                "atomics": sorted(set(re.findall(r"\batom(?:\.\w+)+", ptx))),
                "cg_loads": len(re.findall(r"\bld\.global\.cg\b", ptx)),
                "ptx_sha256": hashlib.sha256(normalized_ptx(ptx).encode()).hexdigest(),
                "sass_sha256": hashlib.sha256(_sass(compiled.asm["cubin"]).encode()).hexdigest(),
                "reductions": reductions(compiled.asm["ttgir"]),
                "loads": global_loads(compiled.asm["ttgir"]),
            }
        )
    return results


# ---- the Gluon Q4_K kernel of the tma path with ptxas' report (tests/test_q4k_tma.py) ----------


def build_q4k_tma(k: int, n: int, m: int, config: dict[str, Any], bias: bool = False) -> list[dict[str, Any]]:
    """The launches of one tma-path ``q4k_fp8_gemm`` call (bf16 x ``[m, k]``, a Q4_K weight
    ``[n, k]``) with ``config``, recorded from ``launch_tma`` on meta tensors and built for sm_90;
    per launch: the kernel, registers, spill bytes, shared memory and the SASS counts of wgmma
    (``HGMMA``), CTA barriers (``BAR``), mbarrier operations (``SYNCS``) and TMA loads (``UTMALDG``)."""

    from tritune.kernels.q4k.launch_tma import launch_tma
    from tritune.search_spaces.q4k_fp8_gemm import SPACE

    x, parts, bias_t, out = meta_q4k_call(m, n, k, bias)
    with record_launches() as recorder:
        launch_tma(SPACE.parse({"path": "tma", **config}), x, parts, bias_t, out)
    results = []
    for recorded in recorder.launches:
        compiled = compile_record(specialize(recorded))
        sass = _sass(compiled.asm["cubin"])
        opcodes = _sass_opcodes(sass)
        results.append(
            {
                "kernel": recorded.kernel.fn.__name__,
                **ptxas_report(compiled.asm["ptx"]),
                "shared": compiled.metadata.shared,
                "num_warps": compiled.metadata.num_warps,
                "sass": {op: opcodes.get(op, 0) for op in ("HGMMA", "BAR", "SYNCS", "UTMALDG")},
                "reads_before_drain": reads_before_drain(sass),
            }
        )
    return results


#: An instruction that reads accumulator registers on the way out of a GEMM: a conversion to
#: 16 bits, a float add or multiply (bias, partial sums), a global or shared store.
_ACC_READ = re.compile(r"\b(F2FP|FADD|FMUL|FFMA|STG|STS)\b")


def reads_before_drain(sass: str) -> int:
    """Instructions between the last wgmma (``HGMMA``) and the first full drain after it
    (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) that may read the accumulator (:data:`_ACC_READ`); 0 in a
    correct build. Such reads see registers the last wgmma may still be writing (ptxas moved an
    epilogue's conversions above a drain that followed the K loop, in warp-specialized builds)."""
    lines = sass.splitlines()
    last = max((i for i, line in enumerate(lines) if "HGMMA" in line), default=None)
    if last is None:
        return 0
    reads = 0
    for line in lines[last + 1 :]:
        if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            return reads
        reads += bool(_ACC_READ.search(line))
    return reads


# ---- the warp-specialized Gluon prefill kernel with ptxas' report (tests/test_prefill_ws.py) ---


def _sass_segments(sass: str) -> list[tuple[str, str]]:
    """``nvdisasm -c`` output cut at each ``USETMAXREG``: ``(that instruction, the code after it)``,
    the first segment named ``"entry"``. Each warp-specialized partition runs in a segment of its
    own after its register reallocation."""
    segments: list[tuple[str, list[str]]] = [("entry", [])]
    for line in sass.splitlines():
        instruction = _SASS_INSTRUCTION.match(line)
        if instruction and instruction.group(1) == "USETMAXREG":
            segments.append((line.split("*/", 2)[-1].strip().rstrip(" ;"), []))
        segments[-1][1].append(line)
    return [(name, "\n".join(lines)) for name, lines in segments]


def _sass_opcodes(sass: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in sass.splitlines():
        instruction = _SASS_INSTRUCTION.match(line)
        if instruction:
            counts[instruction.group(1)] = counts.get(instruction.group(1), 0) + 1
    return counts


def build_prefill_ws(head_dim: int, causal: bool = True, has_kv_len: bool = True) -> dict[str, Any]:
    """Build the ws prefill kernel at its starting configs for an H200 key (bf16, GQA 8, Lq 4096,
    Lkv 16384) as ``launch_ws`` specializes it, and report per config what ptxas and the SASS say:
    registers, spill bytes, shared memory, the ``setmaxnreg`` values in the PTX, the kernel's
    counts of wgmma (``HGMMA``), register reallocations (``USETMAXREG``), CTA/named barriers
    (``BAR``) and mbarrier operations (``SYNCS``), and the highest register each partition's code
    touches (segments of the SASS between reallocations that hold a wgmma or a TMA copy)."""
    import torch

    from tritune.kernels.device import DeviceInfo
    from tritune.kernels.prefill.kernel import PrefillKey
    from tritune.kernels.prefill.launch import launch_ws
    from tritune.kernels.prefill.tuning import TUNING

    h200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
    key = PrefillKey("sm90", 132, "bf16", head_dim, 8, causal, 4096, 16384)
    meta = torch.device("meta")
    q = torch.empty(1, 16, 4096, head_dim, dtype=torch.bfloat16, device=meta)
    k = torch.empty(1, 2, 16384, head_dim, dtype=torch.bfloat16, device=meta)
    kv_len = torch.empty((), dtype=torch.int32, device=meta) if has_kv_len else None
    results = []
    for config in TUNING.starting_configs(key, h200):
        with record_launches() as recorder:
            launch_ws(config, q, k, torch.empty_like(k), kv_len, causal, head_dim**-0.5, torch.empty_like(q))
        (launch,) = recorder.launches
        compiled = compile_record(specialize(launch))
        ptx = compiled.asm["ptx"]
        report = ptxas_report(ptx)
        sass = _sass(compiled.asm["cubin"])
        opcodes = _sass_opcodes(sass)
        partitions = []
        for name, code in _sass_segments(sass):
            seg = _sass_opcodes(code)
            if seg.get("HGMMA", 0) or seg.get("UTMALDG", 0):
                used = [int(r) for r in re.findall(r"\bR(\d+)\b", code)]
                partitions.append({"after": name, "max_register": max(used, default=-1), "hgmma": seg.get("HGMMA", 0)})
        results.append(
            {
                "config": {name: getattr(config, name) for name in ("BLOCK_M", "BLOCK_N", "num_stages")}
                | {"CONSUMER_REGS": config.CONSUMER_REGS, "PRODUCER_REGS": config.PRODUCER_REGS},
                **report,
                "shared": compiled.metadata.shared,
                "setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                "sass": {
                    op: opcodes.get(op, 0) for op in ("HGMMA", "USETMAXREG", "BAR", "SYNCS", "UTMALDG", "UTMASTG")
                },
                "partitions": partitions,
            }
        )
    return {"head_dim": head_dim, "causal": causal, "has_kv_len": has_kv_len, "builds": results}


def main(argv: list[str]) -> None:
    if argv[:1] == ["--gemv"]:
        for case in json.loads(argv[1]):
            print(json.dumps({"case": case, "launches": build_gemv(**case)}), flush=True)
        return
    if argv[:1] == ["--q4k-tma"]:
        for case in json.loads(argv[1]):
            print(json.dumps({"case": case, "launches": build_q4k_tma(**case)}), flush=True)
        return
    if argv[:1] == ["--prefill-ws"]:
        for head_dim, causal, has_kv_len in json.loads(argv[1]):
            print(json.dumps(build_prefill_ws(head_dim, causal, has_kv_len)), flush=True)
        return
    if argv[:1] == ["--records"]:
        detail = "--detail" in argv
        rest = [arg for arg in argv[2:] if arg != "--detail"]
        with open(argv[1]) as f:
            records = json.load(f)
        workers = int(rest[0]) if rest else len(os.sched_getaffinity(0))
        for result in build_records(records, workers, detail):
            print(json.dumps(result), flush=True)
        return
    if argv[:1] == ["--bundle-winners"]:
        for result in build_bundle_winners(argv[1], argv[2], argv[3]):
            print(json.dumps(result), flush=True)
        return
    sass = argv[:1] == ["--sass"]
    for config in json.loads(argv[-1]):
        print(json.dumps(build_q4k(*config, sass=sass)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
