"""What a key's search is asked to do and what it comes to: options, results, the winner rule.

Shared by the search loop (:mod:`.search`), its entry points for one process (:mod:`.study`) and
for shared studies (:mod:`.shared`), and the command line.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import triton

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels.device import DeviceInfo
from tritune.kernels.spec import TuningKey

from .noise import NoisePolicy

if TYPE_CHECKING:
    from .candidates import Bench
    from .timing import Timer

__all__ = ["KeyResult", "TuneOptions", "TuningError", "environment_id", "pick_winner", "tritune_version"]

Ident = TypeVar("Ident", bound=Hashable)


def _usable_cpus() -> int:
    """CPUs this process may run on (affinity and cgroup-aware where the OS says), at most 16."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:
        count = os.cpu_count() or 1
    return max(1, min(16, count))


#: Winners at or above this many milliseconds need no eager alternative: a launch's host cost
#: (tens of microseconds) is then hidden behind the GPU's work in an eager caller too.
EAGER_MAX_MS = 0.5


@dataclass
class TuneOptions:
    trials: int = 40
    time_budget_s: float | None = None
    seed: int = 0
    #: Candidates proposed (and compiled) together before any of their results reaches the
    #: sampler; ``None``: a quarter of the trials (at least 4), at most one per compile thread.
    #: A batch as large as the budget would make TPE a random search: it learns between batches.
    batch: int | None = None
    compile_workers: int = field(default_factory=lambda: _usable_cpus())
    #: Rounds of the final interleaved re-timing of winner, runner-up and portable default.
    final_rounds: int = 3
    #: Share of the trial budget spent last on the best config's neighbours (0 turns it off).
    polish: float = 0.3
    #: Run candidates in a worker process (crash and hang isolation). The ``tune`` command turns
    #: it on; in-process is the default here for tests of the loop with a fake timer.
    isolate: bool = False
    #: Seconds one candidate (first launch, check and timing) may take in the worker before it is
    #: killed and recorded as failed; ``None`` waits forever.
    trial_timeout_s: float | None = 120.0
    noise: NoisePolicy = field(default_factory=NoisePolicy)
    #: Time the kernel's peer (the PyTorch call a user would make instead) in the final rounds and
    #: store it with the winner. Online tuning turns it off: a serving process has no use for it.
    time_peer: bool = True
    #: At keys whose winner runs under :data:`EAGER_MAX_MS`, time the launch host cost of the best
    #: configs too and store an eager alternative where one serves eager calls faster
    #: (:class:`~tritune.configs_db.records.EagerAlternative`). ``None``: on CUDA devices only (on
    #: the interpreter every launch is host work, so its times say nothing about eager calls).
    time_eager: bool | None = None

    @property
    def batch_size(self) -> int:
        if self.batch is not None:
            return max(1, self.batch)
        return max(1, min(self.compile_workers, max(4, -(-self.trials // 4))))

    def make_bench(self, device: torch.device, timer: Timer) -> Bench:
        """Where these options run candidates: a worker process when ``isolate``, else this process.

        One bench serves many keys (a worker's start-up, importing torch and creating a CUDA
        context, is paid once): ``tune`` makes one per run, online tuning one per process.
        """
        from .local_bench import LocalBench

        if not self.isolate:
            return LocalBench(device, timer, noise=self.noise, compile_workers=self.compile_workers)
        from .worker import Worker, worker_device

        return Worker(
            worker_device(device),
            timer,
            trial_timeout_s=self.trial_timeout_s,
            noise=self.noise,
            compile_workers=self.compile_workers,
        )


@dataclass
class KeyResult:
    kernel: str
    key: TuningKey
    config: dict[str, Any]
    best_ms: float
    portable_ms: float
    measured: int
    reused: int
    failed: int
    pruned: int
    notes: list[str] = field(default_factory=list)
    #: Whether the DB took this winner; ``False`` where it keeps a faster one (``kept``, when readable).
    stored: bool = True
    kept: WinnerRecord | None = None

    @property
    def speedup(self) -> float:
        return self.portable_ms / self.best_ms if self.best_ms > 0 else 1.0


class TuningError(RuntimeError):
    """The key cannot be tuned at all (the portable default itself fails)."""


def tritune_version() -> str:
    try:
        return metadata.version("tritune")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def environment_id(store: ConfigStore, device: DeviceInfo) -> int:
    env_id: int = store.environment(
        gpu=device.slug,
        gpu_name=device.name,
        capability=f"{device.capability[0]}.{device.capability[1]}",
        sm_count=device.sm_count,
        driver=device.driver,
        cuda=device.cuda,
        torch_version=torch.__version__,
        triton_version=triton.__version__,
        tritune_version=tritune_version(),
    )
    return env_id


def pick_winner(times: dict[Ident, float], default: Ident) -> Ident:
    """The fastest of the re-timed configs; the portable default unless another is strictly faster."""
    return min(times, key=lambda ident: (times[ident], ident != default))
