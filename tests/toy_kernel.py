"""A deliberately small kernel spec for testing the dispatcher and the tuner loop quickly.

It is a real Triton kernel (row-wise scaled copy, ``out = x * alpha``) with a real search space,
plus one config that is wrong on purpose (``BROKEN=True`` writes ``x * alpha + 1``) so that the
tuner's correctness gate has something to refuse.

:data:`PATHS` is the same kernel on a space of two paths (a ``UnionSpace``): each config holds only
its own path's fields. For the reliability tests, which tune in worker processes, the end of the
file adds what must be importable there by name: :class:`CostTimer` (a fake timer that pickles),
:class:`LingeringTimer` and :data:`MISBEHAVING`, a spec of the same kernel whose ``ACTION`` configs
crash, hang, run out of memory or poison the (simulated) CUDA context on purpose, and only inside
a worker process.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import triton
import triton.language as tl

from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, Problem, TuningKey, pow2_bucket
from tritune.search_spaces.base import SearchSpace, TargetLimits, UnionSpace, choice


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, BROKEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = x * alpha
    if BROKEN:
        y = y + 1.0
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class ToyConfig:
    BLOCK: int = choice(32, (16, 32, 64, 128))
    BROKEN: bool = choice(False, (False, True))
    num_warps: int = choice(4, (1, 2, 4))


def _feasible(config: ToyConfig, key: ToyKey, limits: TargetLimits) -> str | None:
    if config.BLOCK == 128 and config.num_warps == 1:
        return "BLOCK=128 with one warp: too many elements per thread"
    return None


@dataclass(frozen=True)
class ToyKey(TuningKey):
    dtype: str
    n_bucket: int

    BUCKETS = ("n_bucket",)


class ToyFacts(NamedTuple):
    dtype: str
    n: int


class ToySpec(KernelSpec[ToyConfig, ToyKey]):
    name = "toy_scale"
    jit_kernels = (_scale_kernel,)
    protocol = 1
    key_type = ToyKey
    space: SearchSpace[ToyConfig, ToyKey] = SearchSpace("toy_scale", ToyConfig, feasibility=_feasible)
    #: ``tune --key n=100``: a length, bucketed as calls are.
    key_aliases: ClassVar[dict[str, tuple[str, Callable[[int], int]]]] = {"n": ("n_bucket", pow2_bucket)}

    def facts(self, x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None) -> ToyFacts:
        return ToyFacts(str(x.dtype).removeprefix("torch."), x.numel())

    def key_for(self, device: DeviceInfo, facts: tuple[Any, ...]) -> ToyKey:
        f = ToyFacts(*facts)
        return ToyKey(arch=device.arch, sm_count=device.sm_count, dtype=f.dtype, n_bucket=pow2_bucket(f.n))

    def launch(self, config: ToyConfig, x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None):
        out = torch.empty_like(x) if out is None else out
        grid = (triton.cdiv(x.numel(), config.BLOCK),)
        _scale_kernel[grid](
            x, out, x.numel(), alpha, BLOCK=config.BLOCK, BROKEN=config.BROKEN, num_warps=config.num_warps
        )
        return out

    def reference(self, x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None) -> torch.Tensor:
        return x.double() * alpha

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        if not bool(torch.isfinite(out).all()):
            return "non-finite output"
        err = float((out.double() - expected).abs().max())
        return None if err <= 1e-5 else f"max error {err:.3g}"

    def make_problem(self, key: ToyKey, device: torch.device, seed: int) -> Problem:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(key.n_bucket - 3, generator=gen).to(device)
        return Problem(args=(x,), kwargs={"alpha": 1.5}, bytes_moved=8.0 * x.numel())

    def default_keys(self, device: DeviceInfo, n: list[int] | None = None) -> list[ToyKey]:
        return [ToyKey(device.arch, device.sm_count, "float32", pow2_bucket(v)) for v in (n or [64, 256])]

    def valid_key(self, key: ToyKey) -> bool:
        return key.dtype in ("float32", "float16", "bfloat16") and key.n_bucket >= 16


SPEC = ToySpec()


# ---- the same kernel on a space of paths ------------------------------------------------------


@dataclass(frozen=True)
class NarrowConfig:
    path: str = choice("narrow", ("narrow",))
    BLOCK: int = choice(32, (16, 32, 64))
    num_warps: int = choice(2, (1, 2))


@dataclass(frozen=True)
class WideConfig:
    path: str = choice("wide", ("wide",))
    BLOCK: int = choice(256, (128, 256, 512))
    num_warps: int = choice(4, (4, 8))
    BROKEN: bool = choice(False, (False, True))


def paths_cost(config: Any) -> float:
    """Fake time: the wide path's BLOCK=256 with 8 warps is fastest; a broken config fastest of all."""
    if getattr(config, "BROKEN", False):
        return 0.01
    return 1.0 + abs(config.BLOCK - 256) / 64 + (0.0 if config.num_warps == 8 else 0.5)


class PathsSpec(ToySpec):
    name = "toy_paths"
    space = UnionSpace(  # type: ignore[assignment]
        "toy_paths", "path", [SearchSpace("toy_paths", NarrowConfig), SearchSpace("toy_paths", WideConfig)]
    )

    def launch(self, config: Any, x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None):
        out = torch.empty_like(x) if out is None else out
        grid = (triton.cdiv(x.numel(), config.BLOCK),)
        broken = getattr(config, "BROKEN", False)
        _scale_kernel[grid](x, out, x.numel(), alpha, BLOCK=config.BLOCK, BROKEN=broken, num_warps=config.num_warps)
        return out


PATHS = PathsSpec()


# ---- for the reliability tests: importable by a worker process --------------------------------


def toy_cost(config: Any) -> float:
    """Fake time of a config: bigger blocks are faster, two warps best, a broken config fastest of all."""
    if getattr(config, "BROKEN", False):
        return 0.01
    return 10.0 / config.BLOCK + (0.0 if getattr(config, "num_warps", 2) == 2 else 0.05)


class CostTimer:
    """The FakeTimer of isolated tuning: module-level, so it pickles into the worker process.

    Times are ``toy_cost(config) * scale``. With ``hold_after``, every measurement after the first
    ``hold_after`` blocks until the process is killed: a kill -9 test can stop a tune at a known point.
    """

    def __init__(self, scale: float = 1.0, hold_after: int | None = None) -> None:
        self.scale = scale
        self.hold_after = hold_after
        self.calls = 0

    def __call__(self, fn: Any, *, config: object, flush_l2: bool, launch_bound: bool) -> float:
        while self.hold_after is not None and self.calls >= self.hold_after:
            time.sleep(1.0)
        fn()
        self.calls += 1
        return toy_cost(config) * self.scale


#: Seconds the thread a :class:`LingeringTimer` leaves behind outlives the work (a test's failure, not its run).
LINGER_S = 90.0


def linger() -> None:
    """Start a thread that outlives this process's work, as a compile pool's threads may: an ordinary
    interpreter exit waits for it."""
    threading.Thread(target=time.sleep, args=(LINGER_S,), name="toy-lingering").start()


class LingeringTimer(CostTimer):
    """A :class:`CostTimer` that, once unpickled in a worker process, leaves a thread there (:func:`linger`)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        linger()


ACTIONS = ("none", "segfault", "hang", "oom", "illegal_access")


@dataclass(frozen=True)
class MisbehavingConfig:
    BLOCK: int = choice(32, (32, 64))
    ACTION: str = choice("none", ACTIONS)


def _misbehaving_feasible(config: MisbehavingConfig, key: ToyKey, limits: TargetLimits) -> str | None:
    if config.ACTION != "none" and config.BLOCK != 64:
        return "misbehaviour is tried at BLOCK=64 only"
    return None


def misbehave(action: str) -> None:
    if action == "none":
        return
    if multiprocessing.parent_process() is None:
        # In the test process itself a segfault or a hang would take pytest down.
        raise RuntimeError(f"ACTION={action!r} misbehaves only inside a worker process")
    if action == "segfault":
        # A real invalid read (SIGSEGV), without leaving a core file behind.
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        ctypes.string_at(0)
    elif action == "hang":
        while True:
            time.sleep(1.0)
    elif action == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB (toy_misbehaving)")
    elif action == "illegal_access":
        # What an illegal memory access does on a GPU: the launch fails and every later CUDA call
        # in the process fails too. The interpreter has no CUDA context to poison, so this worker's
        # health check is made to report it lost.
        from tritune.tuner import candidates

        candidates.context_alive = lambda device: False
        raise RuntimeError("CUDA error: an illegal memory access was encountered (toy_misbehaving)")


class MisbehavingSpec(ToySpec):
    name = "toy_misbehaving"
    space = SearchSpace("toy_misbehaving", MisbehavingConfig, feasibility=_misbehaving_feasible)  # type: ignore[assignment]

    def launch(self, config: Any, x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None):
        misbehave(config.ACTION)
        out = torch.empty_like(x) if out is None else out
        grid = (triton.cdiv(x.numel(), config.BLOCK),)
        _scale_kernel[grid](x, out, x.numel(), alpha, BLOCK=config.BLOCK, BROKEN=False)
        return out


MISBEHAVING = MisbehavingSpec()
