"""Shared pieces of the varlen tests: one step's segments (``Mix``), its inputs and the reference check.

Stores hold NaN wherever no live position sits (past ``kv_end``, unused columns), and so do the
query rows no segment covers: none of it may reach the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritune.kernels import varlen_attention
from tritune.kernels.pins import use_config
from tritune.kernels.varlen.reference import compare, varlen_reference
from tritune.search_spaces.varlen_sdpa import SPACE, VarlenConfig

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
NAN = float("nan")

#: Pinned configs: many short splits (with 4 SMs planned on the interpreter), and split-K off.
SPLIT = {"BLOCK_M": 16, "BLOCK_N": 16, "MIN_CHUNK": 16, "MAX_SPLITS": 4, "TARGET_WAVES": 4}
NO_SPLIT = {"BLOCK_M": 16, "BLOCK_N": 16, "MAX_SPLITS": 1}


def config_of(config: dict) -> VarlenConfig:
    """The config a pinned config dict stands for (other fields at their defaults)."""
    return SPACE.parse(config)


def config_fields(config: dict) -> dict:
    """The registered op's keyword config fields for a pinned config dict."""
    return SPACE.field_values(config_of(config))


@dataclass(frozen=True)
class Mix:
    """One step: segments (q_start, q_len, col, kv_end) over [rows, cols, kv_heads, D] stores."""

    segments: tuple[tuple[int, int, int, int], ...]
    tokens: int
    rows: int
    cols: int
    kv_heads: int = 1
    group: int = 4
    head_dim: int = 64
    causal: bool = True
    window: int | None = None
    ring: bool = False
    dtype: torch.dtype = torch.float16
    #: S; the table's rows past the segments are unused (zeros).
    slots: int | None = None

    @property
    def kwargs(self) -> dict:
        return {"causal": self.causal, "window": self.window, "ring": self.ring}


def make_inputs(mix: Mix, *, seed: int = 0, tail: float = NAN, device: str = DEVICE):
    """Random q and stores; ``tail`` wherever no live position or covered query row sits."""
    gen = torch.Generator().manual_seed(seed)
    q_heads = mix.kv_heads * mix.group
    q = torch.randn(mix.tokens, q_heads, mix.head_dim, generator=gen)
    k = torch.randn(mix.rows, mix.cols, mix.kv_heads, mix.head_dim, generator=gen)
    v = torch.randn(mix.rows, mix.cols, mix.kv_heads, mix.head_dim, generator=gen)
    live = torch.zeros(mix.rows, mix.cols, dtype=torch.bool)
    covered = torch.zeros(mix.tokens, dtype=torch.bool)
    for q_start, q_len, col, kv_end in mix.segments:
        if q_len == 0:
            continue
        covered[q_start : q_start + q_len] = True
        live[: min(kv_end, mix.rows), col] = True
    k[~live], v[~live] = tail, tail
    q[~covered] = tail
    table = torch.zeros(mix.slots or len(mix.segments), 4, dtype=torch.int32)
    table[: len(mix.segments)] = torch.tensor(mix.segments, dtype=torch.int32).reshape(-1, 4)
    return (q.to(device, mix.dtype), k.to(device, mix.dtype), v.to(device, mix.dtype), table.to(device))


def run_and_compare(mix: Mix, config: dict | None = None, *, seed: int = 0, tail: float = NAN, **overrides):
    q, k, v, seq_info = make_inputs(mix, seed=seed, tail=tail)
    out = torch.full_like(q, NAN)
    kwargs = {**mix.kwargs, **overrides}
    if config is None:
        varlen_attention(q, k, v, seq_info, out=out, **kwargs)
    else:
        with use_config("varlen_sdpa", config):
            varlen_attention(q, k, v, seq_info, out=out, **kwargs)
    expected = varlen_reference(q, k, v, seq_info, **kwargs)
    problem = compare(out, expected, mix.dtype)
    assert problem is None, problem
    return out, expected
