"""The in-memory table of stored winners the dispatcher serves from, and how records get in.

Records come from two places: the bundle shipped for the detected GPU and the user's config DB
(and, with ``TRITUNE_CROSS_GPU=serve``, the nearest other GPUs' bundles at the keys this GPU's
bundle lacks: :mod:`.prior`). Each record is checked against the running environment before it
is admitted: the kernel must exist, its version must match the running code, it must be for this
GPU, its key and config must parse strictly against the kernel's key type and search space and
be feasible here, and where it names the portable default its speedup was measured against, that
must be the running code's default at its key (a default can change while the kernel's version,
its Triton code and space, stays). Anything else is refused with one logged reason, and the
portable path serves that key instead.

A record that passes every check but was tuned under another Triton or torch version is admitted
*provisional* (``Entry.provisional``): an upgrade rarely changes which tile is fastest by much,
and the tuned config is a better bet than the portable default until ``tune`` re-measures it
(``tune`` takes keys with provisional winners first). One INFO line per kernel says how many
provisional entries serve and under which versions they were tuned. A provisional entry never
replaces a current one at the same key, whichever source comes later.

Records of a kernel not declared in this process yet (a user's kernel whose module is imported
after the first call of another kernel) are kept aside in the table and admitted when a kernel of
that name is declared (:meth:`WinnerTable.admit_waiting`). A name no installed package declares
either is logged as unknown when the table loads.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton

from tritune.configs_db.records import Rejection, WinnerRecord
from tritune.configs_db.values import printable

from .device import DeviceInfo
from .registry import entry_points, get_spec, known
from .settings import settings
from .spec import TuningKey

log = logging.getLogger("tritune.dispatch")


@dataclass(frozen=True)
class Entry:
    config: Any
    speedup: float
    source: str
    #: Tuned under other Triton/torch versions, or on another GPU (:mod:`.prior`): serves until re-tuned.
    provisional: bool = False
    #: Where a provisional entry was measured, for messages: "Triton 3.5.0, torch 2.11.0".
    tuned_under: str = ""
    #: The config serving eager calls outside CUDA-graph capture, where the tuner found one faster
    #: there than ``config`` (:class:`~tritune.configs_db.records.EagerAlternative`); else None.
    eager_config: Any = None


class WinnerTable:
    """Winners of one device, indexed for exact and nearest-bucket lookup."""

    def __init__(self, device: DeviceInfo | None = None) -> None:
        self.device = device
        self.exact: dict[tuple[str, TuningKey], Entry] = {}
        self.groups: dict[tuple[str, tuple[Any, ...]], list[tuple[TuningKey, Entry]]] = defaultdict(list)
        #: Records of kernels not declared in this process, by kernel name, in the order they were read.
        self.waiting: dict[str, list[WinnerRecord]] = defaultdict(list)

    def add(self, kernel: str, key: TuningKey, entry: Entry) -> bool:
        """Later additions override earlier ones (the user's DB is added after the bundle), except that a
        provisional entry never replaces a current one; whether ``entry`` was added."""
        previous = self.exact.get((kernel, key))
        if previous is not None and entry.provisional and not previous.provisional:
            return False
        self.exact[(kernel, key)] = entry
        group = self.groups[(kernel, key.group())]
        if previous is not None:
            group[:] = [(k, e) for k, e in group if k != key]
        group.append((key, entry))
        return True

    def provisional(self) -> dict[str, Counter[str]]:
        """Kernel -> how many provisional entries serve, by the versions (or GPU) they were tuned under."""
        found: dict[str, Counter[str]] = defaultdict(Counter)
        for (kernel, _key), entry in self.exact.items():
            if entry.provisional:
                found[kernel][entry.tuned_under] += 1
        return found

    def __len__(self) -> int:
        return len(self.exact)

    def admit_waiting(self, kernel: str) -> int:
        """Admit the records kept aside for ``kernel`` (declared since the table loaded); how many."""
        records = self.waiting.pop(kernel, [])
        if not records or self.device is None:
            return 0
        refused: Counter[str] = Counter()
        for record in records:
            outcome = admit(record, self.device)
            if isinstance(outcome, Rejection):
                refused[outcome.reason] += 1
            else:
                self.add(*outcome)
        _log_refused(refused)
        log_provisional(self, kernels={kernel})
        return len(records) - sum(refused.values())


def admit(record: WinnerRecord, device: DeviceInfo) -> tuple[str, TuningKey, Entry] | Rejection:
    """Check one record against the running environment; the reason names what is off.

    Never raises: a key whose values break the kernel's own rules (a zero length that a
    feasibility rule divides by, say) is refused like any other bad entry, so one hostile entry
    of one kernel cannot take the other winners, or any call, down with it.
    """
    try:
        return _admit(record, device)
    except Exception as exc:
        where = f"{record.source} {record.kernel}"
        return Rejection(
            record.source, f"{where}: the kernel's checks failed on this entry ({type(exc).__name__}: {exc})"
        )


#: Why a winner timed against another portable default than the running one's at its key is refused:
#: its speedup says nothing about the default that serves instead, which may be the faster one.
OTHER_DEFAULT = (
    "its speedup was measured against another portable default than this tritune's at its key; "
    "the default serves until `tune` measures the key again"
)


def _admit(record: WinnerRecord, device: DeviceInfo) -> tuple[str, TuningKey, Entry] | Rejection:
    where = f"{record.source} {record.kernel}"
    try:
        spec = get_spec(record.kernel)
    except KeyError:
        return Rejection(record.source, f"{where}: unknown kernel")
    if record.gpu != device.slug:
        return Rejection(record.source, f"{where}: recorded for GPU {record.gpu}, this is {device.slug}")
    if record.kernel_version != spec.version:
        return Rejection(
            record.source, f"{where}: stale kernel version {record.kernel_version} (running {spec.version})"
        )
    try:
        key = spec.key_type.from_dict(record.key)
    except (TypeError, ValueError) as exc:
        return Rejection(record.source, f"{where}: malformed key ({exc})")
    if key.arch != device.arch or key.sm_count != device.sm_count:
        return Rejection(record.source, f"{where}: key is for {key.arch}/{key.sm_count} SMs, not this GPU")
    try:
        config = spec.space.parse(record.config)
    except ValueError as exc:
        return Rejection(record.source, f"{where}: config outside the search space ({exc})")
    limits = spec.limits(device)
    why = spec.space.infeasible_reason(config, key, limits)
    if why is not None:
        return Rejection(record.source, f"{where}: config infeasible on this GPU ({why})")
    if not (record.speedup > 0 and record.speedup < 1e3):
        return Rejection(record.source, f"{where}: absurd speedup {record.speedup!r}")
    if _against_other_default(record, spec, key):
        return Rejection(record.source, f"{where}: {OTHER_DEFAULT}")
    eager = _eager(record, key, spec, limits, device)
    entry = Entry(config=config, speedup=record.speedup, source=record.source, eager_config=eager)
    under = tuned_under(record)
    if under:
        entry = replace(entry, provisional=True, tuned_under=under)
    return record.kernel, key, entry


#: Eager alternatives refused, each reason logged once per process (the winner still serves).
_refused_eager: set[str] = set()


def _eager(record: WinnerRecord, key: TuningKey, spec: Any, limits: Any, device: DeviceInfo) -> Any:
    """``record``'s eager alternative parsed and feasible at ``key``; None where it has none, it is
    refused (logged once; its winner is admitted all the same, and serves eager calls too), or its
    host times predate eager replay while replay is on.

    Such an alternative was chosen against the host cost of running the launch function every call
    (50-230 us a call on an H100 host, against 15-30 us replayed), which says nothing about which
    config serves a replayed call faster: re-timed with replay, most stored alternatives lost to
    their winner (``docs/perf/HISTORY.md``). The interpreter replays nothing."""
    if record.eager is None:
        return None
    if not record.eager.replayed and not device.is_interpreter and settings().eager_replay:
        return None
    where = f"{record.source} {record.kernel}"
    try:
        eager = spec.space.parse(record.eager.config)
    except ValueError as exc:
        eager, why = None, f"outside the search space ({exc})"
    else:
        infeasible = spec.space.infeasible_reason(eager, key, limits)
        why = None if infeasible is None else f"infeasible on this GPU ({infeasible})"
    if why is not None:
        reason = f"{where}: eager config {why}"
        if reason not in _refused_eager:
            _refused_eager.add(reason)
            log.warning("refused stored eager config: %s", printable(reason, limit=1000))
        return None
    return eager


def is_current(record: WinnerRecord) -> bool:
    """Whether ``record`` was measured under the running Triton and torch.

    The one rule for every reader: a record that is not current serves provisionally, does not
    stop a tune of its key (online or ``tune --missed``), and a fresh measurement replaces it in
    the DB (``configs_db.upserts`` applies the same rule in SQL).
    """
    return record.triton_version == triton.__version__ and record.torch_version == torch.__version__


def _against_other_default(record: WinnerRecord, spec: Any, key: TuningKey) -> bool:
    """Whether ``record`` names the portable default its speedup is against, and that is not
    ``spec``'s default at ``key`` in the running code."""
    return record.portable_config is not None and record.portable_config != spec.space.to_dict(spec.default_config(key))


def against_other_default(record: WinnerRecord) -> bool:
    """Whether ``record`` was timed against another portable default than the running code's at its
    key: refused by the dispatcher (:data:`OTHER_DEFAULT`), so ``tune`` and online tuning measure
    its key again as they do a key with no current winner. ``False`` where the record names no
    default, or its kernel or key is not one this process can read (refused for that reason)."""
    if record.portable_config is None:
        return False
    try:
        spec = get_spec(record.kernel)
        return _against_other_default(record, spec, spec.key_type.from_dict(record.key))
    except Exception:  # an unknown kernel or a malformed key: refused for that, by admit
        return False


def tuned_under(record: WinnerRecord) -> str:
    """The Triton and torch versions ``record`` was tuned under where they differ from the running ones
    ("Triton 3.5.0, torch 2.11.0"); ``""`` when both match (a current record)."""
    if is_current(record):
        return ""
    return f"Triton {record.triton_version}, torch {record.torch_version}"


def build_table(record_sets: Iterable[Iterable[WinnerRecord]], device: DeviceInfo) -> WinnerTable:
    """Admit records in order (later sets override earlier ones), logging each refusal once.

    A record of a kernel not declared here is kept aside (see the module docstring).
    """
    table = WinnerTable(device)
    refused: Counter[str] = Counter()
    installed: dict[str, str] | None = None
    from . import prior

    # The nearest other GPUs' winners first: this GPU's own bundle and DB override them.
    try:
        lent = prior.serving_entries(device)
    except Exception as exc:  # a broken prior (another GPU's bundle, the ranking) must not take a call down
        log.warning("winners of other GPUs not used for %s: %s", device.slug, printable(str(exc), limit=1000))
        lent = []
    for kernel, key, entry in lent:
        table.add(kernel, key, entry)
    for records in record_sets:
        for record in records:
            if not known(record.kernel):
                table.waiting[record.kernel].append(record)
                if installed is None:
                    installed = _installed()
                if record.kernel not in installed:
                    reason = f"{record.source} {record.kernel}: unknown kernel"
                    refused[f"{reason} (kept aside: served if a kernel of that name is declared)"] += 1
                continue
            outcome = admit(record, device)
            if isinstance(outcome, Rejection):
                refused[outcome.reason] += 1
                continue
            table.add(*outcome)
    _log_refused(refused)
    log_provisional(table)
    return table


def log_provisional(table: WinnerTable, kernels: set[str] | None = None) -> None:
    """One INFO line per kernel (of ``kernels``, else all) with provisional entries: how many, tuned under what."""
    running = f"Triton {triton.__version__}, torch {torch.__version__}"
    for kernel, under in sorted(table.provisional().items()):
        if kernels is not None and kernel not in kernels:
            continue
        log.info(
            "%s: %d stored config(s) serve provisionally, tuned under %s (running %s); "
            "`tune --kernel %s` re-measures them",
            kernel,
            sum(under.values()),
            "; ".join(f"{printable(what)} ({count})" for what, count in sorted(under.items())),
            running,
            kernel,
        )


def _installed() -> dict[str, str]:
    """Kernels installed packages declare (entry points); none if the metadata cannot be read."""
    try:
        return entry_points()
    except Exception as exc:  # a broken install must not take the kernels down
        log.debug("installed kernels not listed: %s", exc)
        return {}


def _log_refused(refused: Counter[str]) -> None:
    # Rows of an older kernel version share one reason: say it once with a count, not per row.
    for reason, count in refused.items():
        log.warning(
            "refused stored config: %s%s", printable(reason, limit=1000), f" ({count} entries)" if count > 1 else ""
        )
