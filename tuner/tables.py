"""The rows of ``tune show`` and ``tune bench``: their columns, how a stored winner or a live timing
becomes cells (markup-safe), and whether the runtime would serve a stored winner here."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from tritune.configs_db.records import key_text

from .app import plain
from .provisional import provisional_mark

__all__ = [
    "BENCH_COLUMNS",
    "SHOW_COLUMNS",
    "BenchRow",
    "bench_cells",
    "bench_key",
    "eager_text",
    "ms_text",
    "peer_ratio",
    "serving_verdict",
    "show_row",
]


#: ``tune show``'s columns, in the order :func:`show_row` fills them.
SHOW_COLUMNS = (
    "gpu",
    "kernel",
    "key",
    "config",
    "time ms",
    "portable ms",
    "speedup",
    "trials",
    "peer",
    "peer ms",
    "vs peer",
    "served here",
)


def show_row(w: Any, verdict: str | None, *, provisional: bool = False) -> list[str]:
    """One stored winner as :data:`SHOW_COLUMNS`' cells (markup-safe).

    ``verdict``: why it is not served here (``None``: it is); ``provisional``: it serves here provisionally.
    """
    return [
        plain(w.gpu),
        plain(w.kernel),
        plain(key_text(w.key)),
        plain(" ".join(f"{k}={v}" for k, v in w.config.items())),
        f"{w.time_ms:.4g}",
        f"{w.portable_ms:.4g}",
        f"{w.speedup:.3f}x",
        str(w.trials),
        "-" if w.peer_name is None else plain(w.peer_name),
        ms_text(w.peer_ms),
        peer_ratio(w.peer_ms, w.time_ms),
        ("yes (provisional)" if provisional else "yes") if verdict is None else "[yellow]no[/yellow]",
    ]


def eager_text(eager: Any) -> str:
    """A winner's eager alternative (not None): its config and both estimated eager times per call."""
    config = " ".join(f"{k}={v}" for k, v in eager.config.items())
    return f"{config} (about {eager.ms * 1e3:.1f} us a call; the winner {eager.winner_ms * 1e3:.1f} us)"


def peer_ratio(peer_ms: float | None, ours_ms: float | None) -> str:
    """How many times faster ours is than the peer (``peer_ms / ours_ms``; above 1x: ours is faster)."""
    if peer_ms is None or ours_ms is None or not ours_ms > 0:
        return "-"
    return f"{peer_ms / ours_ms:.2f}x"


def ms_text(value: float | None) -> str:
    """A time in milliseconds for a cell; ``-`` where there is none."""
    return "-" if value is None else f"{value:.4g}"


def serving_verdict(record: Any, device: Any) -> str | None:
    """Why the runtime on ``device`` would not serve ``record``; ``None`` when it would."""
    from tritune.kernels import registry, settings
    from tritune.kernels.winners import Rejection, admit

    if not registry.known(record.kernel):
        # A user's kernel the runtime would serve once its module is imported: not "unknown".
        return "kernel not declared here (add --kernel package.module:NAME)"
    outcome = admit(record, device)
    if isinstance(outcome, Rejection):
        return str(outcome.reason).removeprefix(f"{record.source} {record.kernel}: ")
    threshold: float = 1.0 + settings.settings().margin
    if record.speedup < threshold:
        _, key, entry = outcome
        is_default = entry.config == registry.get_spec(record.kernel).default_config(key)
        if is_default and entry.eager_config not in (None, entry.config):
            # The key's default itself: graphs get it, eager calls its eager alternative.
            return None
        return f"only {record.speedup:.3f}x the portable default (TRITUNE_MARGIN asks {threshold:.3f}x)"
    return None


#: ``tune bench``'s columns, in the order :func:`bench_cells` fills them.
BENCH_COLUMNS = (
    "kernel",
    "key",
    "served config",
    "portable ms",
    "ours ms",
    "peer",
    "peer ms",
    "vs peer",
    "host us",
    "eager vs peer",
)


@dataclass(frozen=True)
class BenchRow:
    """One key's live timings: the portable default, the served config (ours) and the peer."""

    kernel: str
    key: Any
    served: dict[str, Any]
    #: Said after the served config: " (provisional)" where a provisional winner serves it, else "".
    mark: str
    portable_ms: float
    ours_ms: float
    peer_name: str | None
    peer_ms: float | None
    #: Why a cell is empty (the peer failed, a host time was not taken), for a note under the table.
    note: str | None
    #: Host milliseconds per eager call queued back to back: ours (the public call, dispatched as
    #: a user's is) and the peer's; None where not timed (the interpreter, or no peer).
    ours_host_ms: float | None = None
    peer_host_ms: float | None = None
    #: GPU milliseconds of the config eager calls get, where it is the winner's eager alternative.
    ours_eager_ms: float | None = None

    def eager_ratio(self) -> float | None:
        """The peer's eager cost per call over ours, each about ``max(GPU time, host time)``."""
        peer_ms, ours_host, peer_host = self.peer_ms, self.ours_host_ms, self.peer_host_ms
        if peer_ms is None or ours_host is None or peer_host is None:
            return None
        ours = max(self.ours_ms if self.ours_eager_ms is None else self.ours_eager_ms, ours_host)
        return max(peer_ms, peer_host) / ours if ours > 0 else None


def bench_key(spec: Any, key: Any, info: Any, torch_device: Any, timer: Any, seed: int, host: Any = None) -> BenchRow:
    """Time the portable default, the served config and the peer on one problem of ``key``.

    ``host(fn)`` (:func:`~.timing.host_ms_per_call`; None: not timed) gives the host cost of an
    eager call: the kernel's public call as a user makes it (checks, dispatch, launches; a spec
    without one: the served config's checked launch), and the peer's. Where the winner has an
    eager alternative, eager calls get that config: its GPU time is timed too and counts for them.
    """
    from tritune.kernels.dispatcher import DISPATCHER, EagerChoice

    from .candidates import describe_exception

    problem = spec.make_problem(key, torch_device, seed)
    default = spec.default_config(key)
    choice = DISPATCHER.choose(spec, info, key)
    served, eager = (choice.graph, choice.eager) if type(choice) is EagerChoice else (choice, None)
    mark = provisional_mark(DISPATCHER.table(info), spec.name, key, served)

    def time(fn: Any, config: Any) -> float:
        return float(timer(fn, config=config, flush_l2=problem.flush_l2, launch_bound=problem.launch_bound))

    def launch(config: Any) -> Any:
        return spec.prepare(config, *problem.args, **problem.kwargs)

    portable_ms, ours_ms = (time(launch(c), c) for c in (default, served))
    peer: Any = None
    peer_ms: float | None = None
    notes: list[str] = []
    try:
        peer = spec.peer(key, problem)
        if peer is not None:
            peer_ms = time(peer.fn, peer)
    except Exception as exc:
        peer_ms = None
        notes.append(f"the peer failed: {describe_exception(exc)}")
    ours_host = peer_host = eager_ms = None
    if host is not None:
        try:
            eager_ms = None if eager is None else time(launch(eager), eager)
            ours_host = _public_host(spec, key, info, problem, host, launch(eager or served), notes)
            peer_host = None if peer_ms is None else host(peer.fn)
        except Exception as exc:
            ours_host = peer_host = None
            notes.append(f"host timing failed: {describe_exception(exc)}")
    return BenchRow(
        spec.name, key, spec.space.to_dict(served), mark, portable_ms, ours_ms,
        None if peer is None else peer.name, peer_ms, "; ".join(notes) or None, ours_host, peer_host, eager_ms,
    )  # fmt: skip


def _public_host(spec: Any, key: Any, info: Any, problem: Any, host: Any, launch: Any, notes: list[str]) -> Any:
    """Host ms of one eager call of ``key``'s problem as a user makes it, or of ``launch`` (the
    config eager calls get, checked once) for a spec without a public call; None (with a note)
    where this process's settings resolve the problem to another key (``TRITUNE_Q4K_FP8``, say)."""
    if not callable(spec):
        return host(launch)
    from tritune.kernels import settings

    facts = spec.facts(*problem.args, **problem.kwargs)
    resolved = spec.key_for(info, tuple(facts))
    if resolved != key:
        changed = " ".join(f"{k}={v}" for k, v in resolved.to_dict().items() if v != key.to_dict()[k])
        notes.append(f"no host time: under this process's settings a call of this problem has another key ({changed})")
        return None
    # A user's call, but one that neither tunes online nor logs its key as missed (``tune bench``
    # holds those settings already: an override would make the dispatcher reload per key).
    current = settings.settings()
    quiet = current.jit == "off" and not current.miss_log
    with contextlib.nullcontext() if quiet else settings.override(jit="off", miss_log=False):
        return host(lambda: spec(*problem.args, **problem.kwargs))


def bench_cells(row: BenchRow) -> list[str]:
    """One :class:`BenchRow` as :data:`BENCH_COLUMNS`' cells (markup-safe)."""
    return [
        plain(row.kernel),
        plain(key_text(row.key)),
        plain(" ".join(f"{k}={v}" for k, v in row.served.items()) + row.mark),
        f"{row.portable_ms:.4g}",
        f"{row.ours_ms:.4g}",
        "-" if row.peer_name is None else plain(row.peer_name),
        ms_text(row.peer_ms),
        peer_ratio(row.peer_ms, row.ours_ms),
        _host_text(row.ours_host_ms, row.peer_host_ms),
        "-" if (ratio := row.eager_ratio()) is None else f"{ratio:.2f}x",
    ]


def _host_text(ours_ms: float | None, peer_ms: float | None) -> str:
    """``ours / peer`` host microseconds per call (the "host us" cells); ``-`` for a side not timed."""
    if ours_ms is None and peer_ms is None:
        return "-"
    return " / ".join("-" if ms is None else f"{ms * 1e3:.1f}" for ms in (ours_ms, peer_ms))
