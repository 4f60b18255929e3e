"""The attention kernels' peer: ``scaled_dot_product_attention`` on the fastest backend that runs the call.

The tuning halves of prefill, decode and varlen build their peers here (the tuner imports them;
serving never does). A user calling SDPA picks a backend, or lets PyTorch pick one; the peer is
the best of those choices on this device, so a ratio above 1 means faster than every SDPA backend
that runs the call here, not only the default one:

- on a GPU, each of flash, cuDNN and efficient attention, with ``enable_gqa`` and with the KV
  heads expanded (the copy made before timing), that runs the call is timed briefly
  (``triton.testing.do_bench``) and the fastest is the peer;
- on the CPU (the Triton interpreter's tier), the math backend, untimed.

Each variant is pinned to its one backend (``sdpa_kernel``), so a backend that cannot run a call
raises instead of falling back to another one under its name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from .spec import Peer, Problem

__all__ = ["SdpaCall", "bottom_right_causal", "bound_arguments", "fastest_sdpa"]

log = logging.getLogger("tritune.peer")

_GPU_BACKENDS = (
    ("flash", SDPBackend.FLASH_ATTENTION),
    ("cuDNN", SDPBackend.CUDNN_ATTENTION),
    ("efficient", SDPBackend.EFFICIENT_ATTENTION),
)
_CPU_BACKENDS = (("math", SDPBackend.MATH),)
#: The brief timing that ranks the variants on a GPU (ms of warm-up and of repetitions).
_RANK_WARMUP_MS, _RANK_REP_MS = 5, 20


@dataclass(frozen=True)
class SdpaCall:
    """One SDPA call: ``q [B, Hq, Lq, D]`` over ``k, v [B, Hkv, Lkv, D]``, a mask or causal bias, a scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | CausalBias | None = None
    scale: float | None = None

    def expanded(self) -> SdpaCall:
        """The same call with each KV head repeated for its query heads (for backends without GQA)."""
        group = self.q.shape[1] // self.k.shape[1]
        if group == 1:
            return self
        return replace(self, k=self.k.repeat_interleave(group, dim=1), v=self.v.repeat_interleave(group, dim=1))

    def __call__(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            self.q,
            self.k,
            self.v,
            attn_mask=self.mask,
            scale=self.scale,
            enable_gqa=self.q.shape[1] != self.k.shape[1],
        )


def bound_arguments(arguments: Sequence[Any], problem: Problem) -> dict[str, Any]:
    """A problem's call arguments by name (``arguments``: the declaration's, in order)."""
    return {a.name: value for a, value in zip(arguments, problem.args, strict=False)} | dict(problem.kwargs)


def bottom_right_causal(seqlen_q: int, seqlen_k: int) -> CausalBias | None:
    """The causal bias of a query block that ends at the last key (none where one query sees every key)."""
    return causal_lower_right(seqlen_q, seqlen_k) if seqlen_q > 1 else None


def fastest_sdpa(
    calls: Sequence[SdpaCall],
    assemble: Callable[[list[torch.Tensor]], torch.Tensor],
    *,
    prefix: str = "",
) -> Peer | None:
    """The fastest SDPA variant that runs every one of ``calls``, as a :class:`Peer`; ``None`` if none runs.

    ``assemble`` turns the calls' outputs into the kernel's result (the one output itself, or a
    varlen step's rows). The peer's name is ``prefix`` + "SDPA <backend>", with ", KV heads
    expanded" where that variant won.
    """
    if not calls:
        return None
    device = calls[0].q.device
    backends = _CPU_BACKENDS if device.type == "cpu" else _GPU_BACKENDS
    grouped = any(c.q.shape[1] != c.k.shape[1] for c in calls)
    variants: list[Peer] = []
    for label, backend in backends:
        for expand in (False, True) if grouped and device.type != "cpu" else (False,):
            peer = _variant(calls, assemble, backend, expand, f"{prefix}SDPA {label}")
            if peer is not None:
                variants.append(peer)
    if len(variants) <= 1:
        return variants[0] if variants else None
    import triton.testing

    times = [triton.testing.do_bench(p.fn, warmup=_RANK_WARMUP_MS, rep=_RANK_REP_MS) for p in variants]
    return min(zip(times, range(len(variants)), variants, strict=True))[2]


def _variant(
    calls: Sequence[SdpaCall],
    assemble: Callable[[list[torch.Tensor]], torch.Tensor],
    backend: SDPBackend,
    expand: bool,
    name: str,
) -> Peer | None:
    """One backend's variant, run once; ``None`` (logged at DEBUG) where the backend cannot run it."""
    try:
        ready = [c.expanded() for c in calls] if expand else list(calls)

        def fn() -> torch.Tensor:
            with sdpa_kernel(backend):
                return assemble([call() for call in ready])

        fn()
        if ready[0].q.device.type == "cuda":
            torch.cuda.synchronize(ready[0].q.device)
    except Exception as exc:
        log.debug("%s%s cannot run this call: %s", name, " (KV heads expanded)" if expand else "", exc)
        if isinstance(exc, torch.OutOfMemoryError):
            torch.cuda.empty_cache()
        return None
    return Peer(f"{name}, KV heads expanded" if expand else name, fn)
