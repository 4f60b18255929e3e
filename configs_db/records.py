"""Plain records exchanged between storage (DB, bundles) and the runtime, free of SQLAlchemy.

The dispatcher imports these without importing SQLAlchemy; :mod:`configs_db.store` and
:mod:`configs_db.bundles` produce them from a database or a JSON bundle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

#: A key's fields that name the GPU; messages and tables leave them out (the GPU slug beside the key says it).
GPU_KEY_FIELDS = ("arch", "sm_count")


class _HasToDict(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


def key_text(key: Mapping[str, Any] | _HasToDict) -> str:
    """A tuning key (a ``TuningKey`` or its stored fields) for logs and tables: ``name=value`` for
    each field but the GPU's."""
    values = key if isinstance(key, Mapping) else key.to_dict()
    return " ".join(f"{name}={value}" for name, value in values.items() if name not in GPU_KEY_FIELDS)


#: What became of one measured config. Only ``ok`` trials carry a time.
TRIAL_STATUSES = ("ok", "failed-compile", "failed-correctness", "failed-runtime", "pruned")


@dataclass(frozen=True)
class EagerAlternative:
    """The config that serves a key's eager calls where it beats the winner there.

    The winner is chosen by its GPU time (a CUDA-graph replay at launch-bound keys), which leaves
    out the host's cost of launching it. A plain eager call pays both, about ``max(GPU time, host
    time)`` per call when calls follow each other, so at a small key a config with fewer launches
    can serve eager calls faster than the winner. The tuner stores one only when it is faster
    eagerly by more than its margin; the dispatcher serves it to eager calls outside CUDA-graph
    capture and the winner everywhere else.
    """

    config: dict[str, Any]
    #: Estimated eager milliseconds per call of ``config`` and of the winner, ``max(GPU, host)``.
    ms: float
    winner_ms: float
    #: Whether the host times were taken with eager calls replayed per argument layout (what a
    #: serving process does by default); older tunes timed every call's launch function.
    replayed: bool = False


@dataclass(frozen=True)
class WinnerRecord:
    """One stored winner: the best measured config of a kernel at one tuning key on one GPU."""

    kernel: str
    kernel_version: str
    gpu: str  # DeviceInfo.slug, e.g. "nvidia-h200-sm90-132sm"
    key: dict[str, Any]
    config: dict[str, Any]
    time_ms: float
    portable_ms: float
    speedup: float
    trials: int
    triton_version: str
    torch_version: str
    tritune_version: str
    #: Where the record came from, for messages: "db:<url>" or "bundle:<path>".
    source: str = ""
    #: The peer (the PyTorch call a user would make instead) timed at this key in the same run,
    #: and its name; ``None`` where the kernel names no peer or the record predates peer timing.
    peer_ms: float | None = None
    peer_name: str | None = None
    #: The config serving eager calls where it beats ``config`` there (``None``: the winner serves all).
    eager: EagerAlternative | None = None
    #: The portable default that ``portable_ms`` timed (``speedup`` is against it); ``None`` where
    #: the record predates storing it. Where the running code's default at the key is another
    #: config, the speedup says nothing about it and the winner does not serve
    #: (:mod:`tritune.kernels.winners`).
    portable_config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rejection:
    """A record or file refused on load, with the one reason given to the user."""

    source: str
    reason: str


@dataclass(frozen=True)
class TrialRow:
    """One measured config as stored, for resuming a tune and skipping configs already tried."""

    environment_id: int
    kernel: str
    kernel_version: str
    key: dict[str, Any]
    config: dict[str, Any]
    status: str  # one of TRIAL_STATUSES
    time_ms: float | None
    error: str | None
    created_at: datetime
