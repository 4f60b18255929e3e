"""The tuning half of a declared kernel: how the tuner makes problems, checks results and picks keys.

Kept apart from :mod:`.declare` (which re-exports it) so the declaration module holds the
runtime half alone; a kernel's tuning half subclasses :class:`KernelTuning` in a module only the
tuner imports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .device import DeviceInfo
from .spec import Peer, Problem

__all__ = ["KernelTuning"]


class KernelTuning:
    """The tuning half of a kernel: how the tuner makes problems, checks results and picks keys.

    Subclass it next to the declaration (``kernels/<family>/tuning.py`` for the built-ins) and
    name it in ``Kernel(tuning="module:attribute")``; only the tuner imports it.
    """

    #: ``tune --key NAME=VALUES`` names besides the key's own fields: NAME -> (field, transform of
    #: each value), for example ``{"lq": ("lq_bucket", pow2_bucket)}`` so that ``--key lq=4096`` works.
    key_aliases: ClassVar[dict[str, tuple[str, Callable[[int], int]]]] = {}

    def make_problem(self, key: Any, device: torch.device, seed: int) -> Problem:
        """Fresh random inputs representative of ``key`` (tiny shapes on the interpreter)."""
        raise NotImplementedError

    def check_problem(self, key: Any, device: torch.device, seed: int) -> Problem:
        """The problem the correctness gate compares with the reference (default: a fresh one)."""
        return self.make_problem(key, device, seed)

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        """``None`` if ``out`` is close enough to ``expected`` (the reference), else why not."""
        raise NotImplementedError

    def check_full(self, out: torch.Tensor, portable: torch.Tensor, config: Any) -> str | None:
        """At the timed size: why ``out`` is too far from the portable output (see ``KernelSpec.check_full``)."""
        return None

    def default_keys(self, device: DeviceInfo) -> list[Any]:
        """Keys ``tune`` sweeps when the user names none (``--key field=values`` replaces fields)."""
        raise NotImplementedError

    def starting_configs(self, key: Any, device: DeviceInfo) -> list[Any]:
        """Rules for configs to measure first at ``key``, after the portable default and stored winners."""
        return []

    def winner_variants(self, config: Any, key: Any, device: DeviceInfo) -> list[Any]:
        """Configs to measure right after a stored winner ``config`` at ``key``: its twins along a
        choice it may never have had (an option added to the space since it was tuned), so that a
        short re-tune seeded from the winners tries them. Infeasible ones are dropped by the tuner."""
        return []

    def valid_key(self, key: Any) -> bool:
        """Whether a key built from ``--key`` overrides is one this kernel can be tuned at."""
        return True

    def peer(self, key: Any, problem: Problem) -> Peer | None:
        """The PyTorch call a user would make instead of the kernel, on ``problem``'s inputs; ``None`` if none.

        It computes the same function as the kernel's launch on ``problem`` (its ``fn`` returns that
        result) with any setup done before ``fn``; the tuner times it beside the winner at every
        key and stores its time with the winner, and ``tune bench`` prints it beside ours.
        """
        return None
