"""A tiny kernel spec whose candidates fault for real: the ``fault`` part of ``scripts/bench_tuner.py``.

The kernel is a row-wise scaled copy (``out = x * alpha``) with a small search space. Three configs
misbehave on purpose, inside the Triton kernel itself rather than in Python around it:

- ``ACTION="oob"`` stores to page zero (the output pointer minus its own address). On a GPU that is
  a real illegal memory access: the launch's error is sticky and the CUDA context is lost. Under
  the interpreter the store is a raw host write to address 0, so the worker process dies of SIGSEGV.
- ``ACTION="hang"`` spins on a flag that never turns (a volatile load in a loop), on a GPU and in
  the interpreter alike, so only the per-trial timeout ends it.
- ``ACTION="wrong"`` writes ``x * alpha + 1``: the tuner's correctness gate must refuse it.

The faulting ones refuse to launch outside a worker process (where they would take
``bench_tuner.py`` down). The module is importable by name (``_fault_kernel``) from ``scripts/``, which is on a
spawned worker's ``sys.path`` because it is on the script's; it is kept out of the runtime packages.
"""

from __future__ import annotations

import multiprocessing
import resource
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, Problem, TuningKey, pow2_bucket
from tritune.search_spaces.base import SearchSpace, TargetLimits, choice

ACTIONS = ("none", "wrong", "oob", "hang")
#: The block size the misbehaving configs use (the others are the real candidates).
FAULT_BLOCK = 512


@triton.jit
def _fault_scale_kernel(x_ptr, out_ptr, flag_ptr, n, alpha, bad_offset, BLOCK: tl.constexpr, ACTION: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if ACTION == "hang":
        # The flag is 0 and nothing ever writes it: only killing the process ends this loop.
        while tl.load(flag_ptr, volatile=True) == 0:
            pid += 0
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = x * alpha
    if ACTION == "wrong":
        y = y + 1.0
    if ACTION == "oob":
        # bad_offset is minus the output's own address in elements: the store lands on page zero.
        tl.store(out_ptr + bad_offset + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class FaultConfig:
    BLOCK: int = choice(256, (256, FAULT_BLOCK, 1024))
    ACTION: str = choice("none", ACTIONS)


@dataclass(frozen=True)
class FaultKey(TuningKey):
    dtype: str
    n_bucket: int

    BUCKETS = ("n_bucket",)


class FaultFacts(NamedTuple):
    dtype: str
    n: int


def _feasible(config: FaultConfig, key: FaultKey, limits: TargetLimits) -> str | None:
    if config.ACTION != "none" and config.BLOCK != FAULT_BLOCK:
        return f"misbehaviour is tried at BLOCK={FAULT_BLOCK} only"
    return None


def _refuse_outside_worker(action: str) -> None:
    if action in ("oob", "hang") and multiprocessing.parent_process() is None:
        raise RuntimeError(f"ACTION={action!r} faults on purpose and launches only inside a worker process")


class FaultSpec(KernelSpec[FaultConfig, FaultKey]):
    name = "fault_check"
    jit_kernels = (_fault_scale_kernel,)
    protocol = 1
    key_type = FaultKey
    space: SearchSpace[FaultConfig, FaultKey] = SearchSpace("fault_check", FaultConfig, feasibility=_feasible)

    def facts(self, x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None) -> FaultFacts:
        return FaultFacts(str(x.dtype).removeprefix("torch."), x.numel())

    def key_for(self, device: DeviceInfo, facts: tuple[Any, ...]) -> FaultKey:
        f = FaultFacts(*facts)
        return FaultKey(arch=device.arch, sm_count=device.sm_count, dtype=f.dtype, n_bucket=pow2_bucket(f.n))

    def launch(
        self, config: FaultConfig, x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        _refuse_outside_worker(config.ACTION)
        out = torch.empty_like(x) if out is None else out
        bad_offset = 0
        if config.ACTION == "oob":
            bad_offset = -(out.data_ptr() // out.element_size())
            if out.device.type == "cpu":
                # The interpreter's store is a host write: a SIGSEGV, without a core file left behind.
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # Only the spinner reads its flag; the others are given x (never read) to keep their launch lean.
        flag = torch.zeros(1, dtype=torch.int32, device=x.device) if config.ACTION == "hang" else x
        grid = (triton.cdiv(x.numel(), config.BLOCK),)
        _fault_scale_kernel[grid](
            x, out, flag, x.numel(), alpha, bad_offset, BLOCK=config.BLOCK, ACTION=config.ACTION, num_warps=4
        )
        return out

    def reference(self, x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None) -> torch.Tensor:
        return x.double() * alpha

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        if not bool(torch.isfinite(out).all()):
            return "non-finite output"
        err = float((out.double() - expected).abs().max())
        return None if err <= 1e-5 else f"max error {err:.3g}"

    def make_problem(self, key: FaultKey, device: torch.device, seed: int) -> Problem:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(key.n_bucket - 3, generator=gen).to(device)
        return Problem(args=(x,), kwargs={"alpha": 1.5}, bytes_moved=8.0 * x.numel())

    def default_keys(self, device: DeviceInfo, n: list[int] | None = None) -> list[FaultKey]:
        """GPU: 4M elements (16 MB in, 16 MB out: cheap); interpreter: 256."""
        sizes = n or ([256] if device.is_interpreter else [1 << 22])
        return [FaultKey(device.arch, device.sm_count, "float32", pow2_bucket(v)) for v in sizes]


SPEC = FaultSpec()
