"""A kernel of your own on tritune: a fused RMSNorm, declared once, then tuned, served and shipped.

    tune --device cpu --kernel examples/rmsnorm.py:RMSNORM      # or --device 0 on a GPU
    tune export --gpu cpu-interpreter --out b.json && tune import b.json --kernel examples/rmsnorm.py:RMSNORM

``rms_norm(x, weight)`` then serves the tuned config for each row length (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune.kernels.declare import Kernel, KernelTuning, Output, Scalar, Tensor
from tritune.kernels.spec import Problem, TuningKey, pow2_bucket
from tritune.search_spaces.base import SearchSpace, choice


@triton.jit
def _rmsnorm_kernel(X, W, Out, n_cols, stride_x, stride_o, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    squares = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        x = tl.load(X + row * stride_x + start + offs, mask=start + offs < n_cols, other=0.0).to(tl.float32)
        squares += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(squares) / n_cols + eps)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + offs < n_cols
        x = tl.load(X + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + start + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + row * stride_o + start + offs, (x * rstd * w).to(Out.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class RMSNormConfig:
    BLOCK_N: int = choice(256, (64, 128, 256, 512, 1024, 2048))
    num_warps: int = choice(4, (1, 2, 4, 8))


@dataclass(frozen=True)
class RMSNormKey(TuningKey):
    dtype: str
    n_bucket: int
    BUCKETS = ("n_bucket",)


def _launch(config: RMSNormConfig, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    rows, out_rows = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    _rmsnorm_kernel[(rows.shape[0],)](rows, weight, out_rows, rows.shape[1], rows.stride(0), out_rows.stride(0), eps,
                                      BLOCK_N=config.BLOCK_N, num_warps=config.num_warps)  # fmt: skip


class RMSNormTuning(KernelTuning):
    def make_problem(self, key: RMSNormKey, device: torch.device, seed: int) -> Problem:
        gen = torch.Generator(device=device).manual_seed(seed)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[key.dtype]
        x = torch.randn(4 if device.type == "cpu" else 4096, key.n_bucket, generator=gen, device=device).to(dtype)
        weight = torch.rand(key.n_bucket, generator=gen, device=device).to(dtype)
        return Problem(args=(x, weight), kwargs={"eps": 1e-6}, bytes_moved=3.0 * x.numel() * x.element_size())

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: object = None) -> str | None:
        error, scale = float((out.double() - expected).abs().max()), float(expected.abs().max())
        return None if error <= 8 * torch.finfo(out.dtype).eps * scale else f"max error {error:.3g}"

    def default_keys(self, device) -> list[RMSNormKey]:  # type: ignore[no-untyped-def]
        dtype, lengths = ("fp32", (64, 256)) if device.is_interpreter else ("bf16", (1024, 4096, 8192))
        return [RMSNormKey(device.arch, device.sm_count, dtype, n) for n in lengths]


RMSNORM = Kernel(
    "example_rmsnorm",
    arguments=[
        Tensor("x", ("*M", "N"), dtypes=(torch.bfloat16, torch.float16, torch.float32), unit_inner_stride=True),
        Tensor("weight", ("N",), dtype_of="x", unit_inner_stride=True),
        Scalar("eps", float, default=1e-6, bounds=(0.0, 1.0)),
        Output("out", like="x", contiguous=True),
    ],
    facts=("dtype", "N"), space=SearchSpace("example_rmsnorm", RMSNormConfig), key_type=RMSNormKey,
    key=lambda device, f: RMSNormKey(device.arch, device.sm_count, f.dtype, pow2_bucket(f.N)),
    reference=lambda x, weight, eps: x.double() * torch.rsqrt(x.double().square().mean(-1, True) + eps) * weight,
    launch=_launch, jit_kernels=(_rmsnorm_kernel,), protocol=1, tuning=RMSNormTuning(),
)  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dim, with the tuned config."""
    return RMSNORM.call(x, weight, eps, out)
