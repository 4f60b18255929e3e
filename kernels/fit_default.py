"""A portable default that fits the shared memory of the GPU its key names.

The attention families choose their portable defaults on the large parts (an H200's 227 KiB of
shared memory per block, 96 KiB everywhere else they were checked). A GPU that gives a block less
(Turing's 64 KiB, Pascal's 48 KiB, an AMD workgroup's 64 KiB of LDS) would fail to compile those
tiles, and ``tune`` refuses to start from a default its space's rule finds infeasible. The key
carries the GPU's architecture, so the default can be fitted to it here, by the space's own rule:
fewer pipeline stages first, smaller tiles only where no stage count fits.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from tritune.search_spaces.base import TargetLimits

from .spec import TuningKey, lds_limit_bytes, smem_limit_bytes

__all__ = ["arch_smem_limit_bytes", "fit_shared_memory", "halve_first"]

C = TypeVar("C")
K = TypeVar("K", bound=TuningKey)
C_in = TypeVar("C_in", contravariant=True)
K_in = TypeVar("K_in", contravariant=True)


class _Space(Protocol[C_in, K_in]):
    """What :func:`fit_shared_memory` asks of a search space (one path's or a union's): its rule."""

    def infeasible_reason(self, config: C_in, key: K_in, limits: TargetLimits) -> str | None: ...


#: The smallest tile :func:`halve_first` leaves (the spaces' smallest block).
_MIN_TILE = 16


def arch_smem_limit_bytes(arch: str) -> int | None:
    """Shared memory per block on the GPU a key's ``arch`` names ("sm75", "sm100", "gfx942"), as
    :meth:`~.spec.KernelSpec.limits` gives it for that GPU; ``None`` for the interpreter and for a
    name that is neither an NVIDIA nor an AMD architecture."""
    nvidia = re.fullmatch(r"sm(\d+)(\d)", arch)
    if nvidia is not None:
        return smem_limit_bytes((int(nvidia[1]), int(nvidia[2])))
    if arch.startswith("gfx"):
        return lds_limit_bytes(arch)
    return None


def halve_first(*fields: str) -> Callable[[Any], Any]:
    """A ``smaller`` step for :func:`fit_shared_memory`: ``fields`` in order, the first one still
    above 16 halved (``None`` once all are 16)."""

    def smaller(config: Any) -> Any:
        for name in fields:
            value = getattr(config, name)
            if value > _MIN_TILE:
                return dataclasses.replace(config, **{name: value // 2})
        return None

    return smaller


def fit_shared_memory(config: C, key: K, space: _Space[C, K], smaller: Callable[[C], C | None]) -> C:
    """``config`` where the space's rule admits it on the GPU ``key.arch`` names, else the first
    config that it admits: at each tile (``config``'s, then each ``smaller`` one in turn) the most
    pipeline stages up to ``config``'s that fit.

    The interpreter's keys and unknown architectures get ``config`` as it is, and so does a key
    where nothing fits (the rule then says why, as it did before). ``config`` needs a
    ``num_stages`` field; ``smaller`` returns the next smaller tile, or ``None`` where there is none.
    """
    limit = arch_smem_limit_bytes(key.arch)
    if limit is None:
        return config
    limits = TargetLimits(smem_bytes=limit)
    stages: int = getattr(config, "num_stages")  # noqa: B009 (C is any config dataclass)
    tile: C | None = config
    while tile is not None:
        for depth in range(stages, 0, -1):
            candidate = dataclasses.replace(tile, num_stages=depth)  # type: ignore[type-var]
            if space.infeasible_reason(candidate, key, limits) is None:
                return candidate
        tile = smaller(tile)
    return config
