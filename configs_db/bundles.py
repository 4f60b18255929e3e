"""Shipped bundles: reviewed, diffable JSON files of tuned winners, one per GPU.

A bundle lives at ``configs_db/bundles/<gpu-slug>.json`` and looks like::

    {
      "schema": "tritune-bundle",
      "schema_version": 1,
      "gpu": "nvidia-h200-sm90-132sm",
      "gpu_name": "NVIDIA H200",
      "created": "2025-01-01T00:00:00+00:00",
      "provenance": {"cuda": "...", "driver": "...", "torch": "...", "triton": "...", "tritune": "..."},
      "winners": [
        {"kernel": "...", "kernel_version": "...", "key": {...}, "config": {...},
         "time_ms": 0.1, "portable_ms": 0.2, "speedup": 2.0, "trials": 40,
         "peer_ms": 0.15, "peer_name": "SDPA flash",
         "eager": {"config": {...}, "ms": 0.05, "winner_ms": 0.08},
         "portable_config": {...}}
      ]
    }

``peer_ms`` and ``peer_name`` (the PyTorch call a user would make instead, timed beside the winner
in the same run) come together or not at all: an entry without them, or with both null, has no peer time.

``eager`` (optional) is the config that serves the key's eager calls, where it beats the winner
there: ``config`` a non-empty flat object like ``config``, ``ms`` and ``winner_ms`` the estimated
eager milliseconds per call of it and of the winner (finite, positive, ``ms`` below ``winner_ms``).
An entry without it, or with ``null``, has none: the winner serves every call. A malformed one
refuses its entry, as any other malformed field does.

``portable_config`` (optional) is the portable default that ``portable_ms`` timed, a flat object
like ``config``: ``speedup`` is against that config. Where the running code's default at the
entry's key is another config, the entry does not serve (the speedup says nothing about the
default that would serve instead). Left out or ``null`` in entries written before it was stored.

Checks here are structural only: a file that is not a regular file (a FIFO, device, directory or
dangling link), too big, not JSON, not a bundle, of an unknown schema version or for another GPU is
refused whole, with one reason; a malformed entry is refused alone (with its index), and the good
entries beside it are kept. Strings that would reach a log, a terminal or the database must be
printable: a control character (a forged log line, an ANSI escape) or a lone surrogate refuses
its entry, and every reason given is itself escaped. Whether a kernel version, key or
config is still valid is decided by :mod:`tritune.kernels.winners`, which sees every record.
Files are only ever parsed with ``json.loads``: nothing in a bundle is executed.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .records import Rejection, WinnerRecord
from .urls import mode_kind
from .values import (
    canonical_json,
    check_flat,
    describe,
    printable,
    strict_loads,
    text_problem,
    winner_numbers_problem,
)
from .winner_fields import (
    eager_alternative,
    eager_fields,
    eager_problem,
    flat_config_problem,
    peer_problem,
    portable_config_problem,
)

BUNDLE_SCHEMA = "tritune-bundle"
BUNDLE_SCHEMA_VERSION = 1
#: A bundle bigger than this is refused before it is read (real ones are a few hundred KB).
MAX_BUNDLE_BYTES = 8 * 1024 * 1024
#: More entries than this is no bundle (each would cost a check and perhaps a logged refusal).
MAX_BUNDLE_ENTRIES = 20_000
PROVENANCE_FIELDS = ("cuda", "driver", "torch", "triton", "tritune")
TOP_LEVEL_FIELDS = ("schema", "schema_version", "gpu", "gpu_name", "created", "provenance", "winners")
ENTRY_FIELDS = ("kernel", "kernel_version", "key", "config", "time_ms", "portable_ms", "speedup", "trials")
#: Entry fields that may be left out (no peer time or eager alternative, or written before they were stored).
OPTIONAL_ENTRY_FIELDS = ("peer_ms", "peer_name", "eager", "portable_config")
#: GPU slugs as :class:`tritune.kernels.device.DeviceInfo` makes them; also keeps paths inside bundles/.
GPU_SLUG = re.compile(r"[a-z0-9][a-z0-9-]*")
#: Widths of the DB columns a bundle's strings are stored in (``configs_db.models``).
TEXT_COLUMN_CHARS = {"gpu": 128, "gpu_name": 128, "provenance": 64, "kernel": 64, "kernel_version": 64}


def shipped_bundle_dir() -> Path:
    """The folder of bundles shipped with the package (``configs_db/bundles``)."""
    return Path(__file__).resolve().with_name("bundles")


def bundle_path(gpu_slug: str, directory: Path | None = None) -> Path:
    """Where the bundle of ``gpu_slug`` lives (in the shipped folder unless ``directory`` is given)."""
    if not GPU_SLUG.fullmatch(gpu_slug):
        raise ValueError(f"{gpu_slug!r} is not a GPU slug such as nvidia-h200-sm90-132sm")
    return (directory or shipped_bundle_dir()) / f"{gpu_slug}.json"


def shipped_records(gpu_slug: str) -> tuple[list[WinnerRecord], list[Rejection]]:
    """The shipped bundle's records for this GPU; ``([], [])`` when none is shipped for it."""
    try:
        path = bundle_path(gpu_slug)
    except ValueError as exc:
        return [], [Rejection(f"bundle:{gpu_slug}", str(exc))]
    # Anything at the path, a dangling link or a FIFO included, is read (and refused with its reason).
    if not os.path.lexists(path):
        return [], []
    return read_bundle(path, expected_gpu=gpu_slug)


def _limit() -> str:
    return f"the limit of {MAX_BUNDLE_BYTES} bytes for a bundle ({MAX_BUNDLE_BYTES // 2**20} MiB)"


def _read_text(path: Path) -> str:
    """The file's text, refusing an oversized one before reading it (``ValueError`` says why).

    Only regular files are read: a FIFO would block the reader forever and a device never ends.
    The file is opened non-blocking and checked again on the open descriptor, so a path swapped
    for a FIFO after the first check cannot block either.
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise ValueError(f"dangling symbolic link (to {printable(os.readlink(path))})") from None
        raise
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"is {mode_kind(info.st_mode)}, not a regular file")
    if info.st_size > MAX_BUNDLE_BYTES:
        raise ValueError(f"file is {info.st_size} bytes, over {_limit()}")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"is {mode_kind(mode)}, not a regular file")
        # Read one byte past the limit: the file may have grown since stat.
        data = fh.read(MAX_BUNDLE_BYTES + 1)
    if len(data) > MAX_BUNDLE_BYTES:
        raise ValueError(f"file grew over {_limit()} while read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _document_problem(doc: Any, expected_gpu: str | None) -> str | None:
    """Why the whole document is not a usable bundle, or ``None``."""
    if not isinstance(doc, dict):
        return f"top level is {describe(doc)}, expected an object"
    if doc.get("schema") != BUNDLE_SCHEMA:
        return f"schema is {doc.get('schema')!r}, expected {BUNDLE_SCHEMA!r}"
    version = doc.get("schema_version")
    if isinstance(version, bool) or version != BUNDLE_SCHEMA_VERSION:
        return f"unknown schema_version {version!r} (this tritune reads {BUNDLE_SCHEMA_VERSION})"
    missing = [name for name in TOP_LEVEL_FIELDS if name not in doc]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    unknown = sorted(set(doc) - set(TOP_LEVEL_FIELDS))
    if unknown:
        return f"unknown field(s) {', '.join(unknown)}"
    gpu = doc["gpu"]
    if not isinstance(gpu, str) or not GPU_SLUG.fullmatch(gpu) or len(gpu) > TEXT_COLUMN_CHARS["gpu"]:
        return f"gpu is {printable(repr(gpu))}, expected a GPU slug such as nvidia-h200-sm90-132sm"
    if expected_gpu is not None and gpu != expected_gpu:
        return f"bundle is for GPU {gpu}, expected {expected_gpu}"
    if not isinstance(doc["gpu_name"], str):
        return f"gpu_name is {describe(doc['gpu_name'])}, expected a string"
    problem = text_problem(doc["gpu_name"], "gpu_name", TEXT_COLUMN_CHARS["gpu_name"])
    if problem is not None:
        return problem
    created = doc["created"]
    if not isinstance(created, str):
        return f"created is {describe(created)}, expected an ISO 8601 time"
    try:
        datetime.fromisoformat(created)
    except ValueError:
        return f"created is {created!r}, expected an ISO 8601 time"
    provenance = doc["provenance"]
    if not isinstance(provenance, dict):
        return f"provenance is {describe(provenance)}, expected an object"
    if set(provenance) != set(PROVENANCE_FIELDS):
        return f"provenance has fields {sorted(provenance)}, expected {list(PROVENANCE_FIELDS)}"
    for name in PROVENANCE_FIELDS:
        if not isinstance(provenance[name], str):
            return f"provenance.{name} is {describe(provenance[name])}, expected a string"
        problem = text_problem(provenance[name], f"provenance.{name}", TEXT_COLUMN_CHARS["provenance"])
        if problem is not None:
            return problem
    if not isinstance(doc["winners"], list):
        return f"winners is {describe(doc['winners'])}, expected a list"
    if len(doc["winners"]) > MAX_BUNDLE_ENTRIES:
        return f"{len(doc['winners'])} winners, more than {MAX_BUNDLE_ENTRIES} (a GPU's tuned keys are hundreds)"
    return None


def _entry_problem(entry: Any) -> str | None:
    """Why one winners entry is malformed, or ``None``."""
    if not isinstance(entry, dict):
        return f"is {describe(entry)}, expected an object"
    missing = [name for name in ENTRY_FIELDS if name not in entry]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    unknown = sorted(set(entry) - set(ENTRY_FIELDS) - set(OPTIONAL_ENTRY_FIELDS))
    if unknown:
        return f"unknown field(s) {', '.join(unknown)}"
    if ("peer_ms" in entry) != ("peer_name" in entry):
        return "peer_ms and peer_name come together: one is missing"
    if "peer_ms" in entry:
        problem = peer_problem(entry["peer_ms"], entry["peer_name"])
        if problem is not None:
            return problem
    problem = eager_problem(entry.get("eager")) or portable_config_problem(entry.get("portable_config"))
    if problem is not None:
        return problem
    for name in ("kernel", "kernel_version"):
        if not isinstance(entry[name], str) or not entry[name]:
            return f"{name} is {describe(entry[name])}, expected a non-empty string"
        problem = text_problem(entry[name], name, TEXT_COLUMN_CHARS[name])
        if problem is not None:
            return problem
    for name in ("key", "config"):
        problem = flat_config_problem(entry[name], name)
        if problem is not None:
            return problem
    return winner_numbers_problem(entry["time_ms"], entry["portable_ms"], entry["speedup"], entry["trials"])


class BundleError(ValueError):
    """A file refused whole as a bundle; the message starts with the (escaped) path."""


def read_bundle(path: Path | str, expected_gpu: str | None = None) -> tuple[list[WinnerRecord], list[Rejection]]:
    """Read a bundle: its well-formed records, and one :class:`Rejection` per refused file or entry."""
    try:
        return load_bundle(path, expected_gpu)
    except BundleError as exc:
        return [], [Rejection(f"bundle:{printable(str(path), limit=1000)}", str(exc))]


def load_bundle(path: Path | str, expected_gpu: str | None = None) -> tuple[list[WinnerRecord], list[Rejection]]:
    """Like :func:`read_bundle`, but a file refused whole raises :class:`BundleError` (``tune import`` tells
    a file it could not use from one whose every entry it refused)."""
    path = Path(path)
    # The path reaches logs and terminals too: escaped once here, for every reason below.
    shown = printable(str(path), limit=1000)
    source = f"bundle:{shown}"

    def refuse(reason: str) -> BundleError:
        return BundleError(f"{shown}: {printable(reason, limit=1000)}")

    try:
        text = _read_text(path)
    except OSError as exc:
        raise refuse(f"cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise refuse(str(exc)) from None
    try:
        doc = strict_loads(text)
    except ValueError as exc:
        raise refuse(f"broken JSON ({exc})") from None
    problem = _document_problem(doc, expected_gpu)
    if problem is not None:
        raise refuse(problem)

    provenance = doc["provenance"]
    records: list[WinnerRecord] = []
    rejections: list[Rejection] = []
    seen: dict[tuple[str, str, str], int] = {}
    for index, entry in enumerate(doc["winners"]):
        where = f"{shown}: winners[{index}]"
        problem = _entry_problem(entry)
        if problem is None:
            identity = (entry["kernel"], entry["kernel_version"], canonical_json(entry["key"]))
            if identity in seen:
                problem = f"same kernel, version and key as winners[{seen[identity]}]"
            seen.setdefault(identity, index)
        if problem is not None:
            kernel = entry.get("kernel") if isinstance(entry, dict) else None
            label = f" ({printable(kernel)})" if isinstance(kernel, str) else ""
            rejections.append(Rejection(source, f"{where}{label}: {printable(problem, limit=1000)}"))
            continue
        records.append(
            WinnerRecord(
                kernel=entry["kernel"],
                kernel_version=entry["kernel_version"],
                gpu=doc["gpu"],
                key=dict(entry["key"]),
                config=dict(entry["config"]),
                time_ms=float(entry["time_ms"]),
                portable_ms=float(entry["portable_ms"]),
                speedup=float(entry["speedup"]),
                trials=int(entry["trials"]),
                # null stands for "none" as a left-out field does (peer_problem and eager_problem say so).
                peer_ms=None if entry.get("peer_ms") is None else float(entry["peer_ms"]),
                peer_name=entry.get("peer_name"),
                eager=eager_alternative(entry.get("eager")),
                portable_config=None if entry.get("portable_config") is None else dict(entry["portable_config"]),
                triton_version=provenance["triton"],
                torch_version=provenance["torch"],
                tritune_version=provenance["tritune"],
                source=source,
                extra={"gpu_name": doc["gpu_name"], "cuda": provenance["cuda"], "driver": provenance["driver"]},
            )
        )
    return records, rejections


def _entry(record: WinnerRecord) -> dict[str, Any]:
    problem = winner_numbers_problem(record.time_ms, record.portable_ms, record.speedup, record.trials)
    problem = problem or peer_problem(record.peer_ms, record.peer_name)
    fields = None if record.eager is None else eager_fields(record.eager)
    problem = problem or eager_problem(fields) or portable_config_problem(record.portable_config)
    if problem is not None:
        raise ValueError(f"{record.kernel} at {record.key}: {problem}")
    optional: dict[str, Any] = {}
    if record.peer_ms is not None:
        optional.update(peer_ms=float(record.peer_ms), peer_name=record.peer_name)
    eager = eager_alternative(fields)
    if eager is not None:
        optional["eager"] = eager_fields(eager)
    if record.portable_config is not None:
        optional["portable_config"] = check_flat(record.portable_config, "portable_config")
    return {
        "kernel": record.kernel,
        "kernel_version": record.kernel_version,
        "key": check_flat(record.key, "key"),
        "config": check_flat(record.config, "config"),
        "time_ms": float(record.time_ms),
        "portable_ms": float(record.portable_ms),
        "speedup": float(record.speedup),
        "trials": int(record.trials),
        **optional,
    }


def bundle_text(
    records: Iterable[WinnerRecord],
    gpu: str,
    gpu_name: str,
    provenance: Mapping[str, str],
    created: str | datetime | None = None,
) -> str:
    """The bundle document as text: sorted keys and entries, indent 2, trailing newline.

    The same records give the same bytes (pass ``created`` to pin the timestamp), so a re-tune
    shows up in review as a diff of the entries that changed. Records must all belong to ``gpu``
    and carry the Triton, torch and tritune versions named in ``provenance``: a bundle states
    its provenance once, so mixed records would be mislabelled.
    """
    if not GPU_SLUG.fullmatch(gpu):
        raise ValueError(f"{gpu!r} is not a GPU slug such as nvidia-h200-sm90-132sm")
    if set(provenance) != set(PROVENANCE_FIELDS):
        raise ValueError(f"provenance needs exactly the fields {list(PROVENANCE_FIELDS)}, got {sorted(provenance)}")
    if created is None:
        created = datetime.now(timezone.utc).replace(microsecond=0)
    if isinstance(created, datetime):
        created = created.isoformat()
    entries: dict[tuple[str, str, str], dict[str, Any]] = {}
    for record in records:
        labels = (
            ("gpu", record.gpu, gpu),
            ("triton", record.triton_version, provenance["triton"]),
            ("torch", record.torch_version, provenance["torch"]),
            ("tritune", record.tritune_version, provenance["tritune"]),
        )
        for name, mine, bundle in labels:
            if mine != bundle:
                raise ValueError(f"{record.kernel} at {record.key}: {name} {mine!r} is not the bundle's {bundle!r}")
        identity = (record.kernel, record.kernel_version, canonical_json(record.key))
        if identity in entries:
            raise ValueError(f"two records for {record.kernel} {record.kernel_version} at {record.key}")
        entries[identity] = _entry(record)
    doc = {
        "schema": BUNDLE_SCHEMA,
        "schema_version": BUNDLE_SCHEMA_VERSION,
        "gpu": gpu,
        "gpu_name": gpu_name,
        "created": created,
        "provenance": {name: str(provenance[name]) for name in PROVENANCE_FIELDS},
        "winners": [entries[identity] for identity in sorted(entries)],
    }
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=True, allow_nan=False) + "\n"


def write_bundle(
    records: Iterable[WinnerRecord],
    path: Path | str,
    gpu: str,
    gpu_name: str,
    provenance: Mapping[str, str],
    created: str | datetime | None = None,
) -> Path:
    """Write :func:`bundle_text` to ``path`` atomically (a reader never sees half a bundle)."""
    path = Path(path)
    text = bundle_text(records, gpu, gpu_name, provenance, created)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        # mkstemp makes the file private; a bundle is a data file anyone may read.
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


__all__ = [
    "BUNDLE_SCHEMA",
    "BUNDLE_SCHEMA_VERSION",
    "MAX_BUNDLE_BYTES",
    "BundleError",
    "bundle_path",
    "bundle_text",
    "load_bundle",
    "read_bundle",
    "shipped_bundle_dir",
    "shipped_records",
    "write_bundle",
]
