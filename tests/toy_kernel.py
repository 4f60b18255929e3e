"""A deliberately small kernel spec for testing the dispatcher and the tuner loop quickly.

It is a real Triton kernel (row-wise scaled copy, ``out = x * alpha``) with a real search space,
plus one config that is wrong on purpose (``BROKEN=True`` writes ``x * alpha + 1``) so that the
tuner's correctness gate has something to refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import KernelSpec, Problem, TuningKey, pow2_bucket
from tritune.search_spaces.base import SearchSpace, TargetLimits, choice


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
    source_modules = (__name__,)
    key_type = ToyKey
    space: SearchSpace[ToyConfig, ToyKey] = SearchSpace("toy_scale", ToyConfig, feasibility=_feasible)

    def facts(self, x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None) -> ToyFacts:
        return ToyFacts(str(x.dtype).removeprefix("torch."), x.numel())

    def key_for(self, device: DeviceInfo, facts: tuple[Any, ...]) -> ToyKey:
        f = ToyFacts(*facts)
        return ToyKey(arch=device.arch, sm_count=device.sm_count, dtype=f.dtype, n_bucket=pow2_bucket(f.n))

    def launch(self, config: ToyConfig, x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None):
        out = torch.empty_like(x) if out is None else out
        grid = (triton.cdiv(x.numel(), config.BLOCK),)
        _scale_kernel[grid](x, out, x.numel(), alpha, BLOCK=config.BLOCK, BROKEN=config.BROKEN,
                            num_warps=config.num_warps)
        return out

    def reference(self, x: torch.Tensor, *, alpha: float = 2.0, out: torch.Tensor | None = None) -> torch.Tensor:
        return x.double() * alpha

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem) -> str | None:
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


SPEC = ToySpec()
