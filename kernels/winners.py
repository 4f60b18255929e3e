"""The in-memory table of stored winners the dispatcher serves from, and how records get in.

Records come from two places: the bundle shipped for the detected GPU and the user's config DB.
Each record is checked against the running environment before it is admitted: the kernel must
exist, its source hash and the Triton version must match, it must be for this GPU, and its key and
config must parse strictly against the kernel's key type and search space. Anything else is
refused with one logged reason, and the portable path serves that key instead.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import triton

from tritune.configs_db.records import Rejection, WinnerRecord
from tritune.configs_db.values import printable

from .device import DeviceInfo
from .registry import get_spec
from .spec import TuningKey

log = logging.getLogger("tritune.dispatch")


@dataclass(frozen=True)
class Entry:
    config: Any
    speedup: float
    source: str


class WinnerTable:
    """Winners of one device, indexed for exact and nearest-bucket lookup."""

    def __init__(self) -> None:
        self.exact: dict[tuple[str, TuningKey], Entry] = {}
        self.groups: dict[tuple[str, tuple[Any, ...]], list[tuple[TuningKey, Entry]]] = defaultdict(list)

    def add(self, kernel: str, key: TuningKey, entry: Entry) -> None:
        """Later additions override earlier ones (the user's DB is added after the bundle)."""
        previous = self.exact.get((kernel, key))
        self.exact[(kernel, key)] = entry
        group = self.groups[(kernel, key.group())]
        if previous is not None:
            group[:] = [(k, e) for k, e in group if k != key]
        group.append((key, entry))

    def __len__(self) -> int:
        return len(self.exact)


def admit(record: WinnerRecord, device: DeviceInfo) -> tuple[str, TuningKey, Entry] | Rejection:
    """Check one record against the running environment; the reason names what is off."""
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
    if record.triton_version != triton.__version__:
        return Rejection(
            record.source, f"{where}: tuned with Triton {record.triton_version}, running {triton.__version__}"
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
    why = spec.space.infeasible_reason(config, key, spec.limits(device))
    if why is not None:
        return Rejection(record.source, f"{where}: config infeasible on this GPU ({why})")
    if not (record.speedup > 0 and record.speedup < 1e3):
        return Rejection(record.source, f"{where}: absurd speedup {record.speedup!r}")
    return record.kernel, key, Entry(config=config, speedup=record.speedup, source=record.source)


def build_table(record_sets: Iterable[Iterable[WinnerRecord]], device: DeviceInfo) -> WinnerTable:
    """Admit records in order (later sets override earlier ones), logging each refusal once."""
    table = WinnerTable()
    refused: Counter[str] = Counter()
    for records in record_sets:
        for record in records:
            outcome = admit(record, device)
            if isinstance(outcome, Rejection):
                refused[outcome.reason] += 1
                continue
            table.add(*outcome)
    # Rows of an older kernel version share one reason: say it once with a count, not per row.
    for reason, count in refused.items():
        log.warning(
            "refused stored config: %s%s", printable(reason, limit=1000), f" ({count} entries)" if count > 1 else ""
        )
    return table
