"""Re-stamp one kernel's entries of a shipped bundle with the kernel's current version.

    python scripts/restamp_bundle.py configs_db/bundles/nvidia-h200-sm90-132sm.json --kernel tma_prefill

For a change that moves a kernel's version but not its generated code: a reshaped config space
(the version hashes the space's structure) with every JIT kernel's canonical code unchanged. Each
entry of ``--kernel`` keeps its key, times and trial count; its config keeps exactly the fields
its path's member space has (for a :class:`~tritune.search_spaces.base.UnionSpace`; all fields
otherwise), with unchanged values, and its ``kernel_version`` becomes the one this source computes
(``KernelSpec.version``, :mod:`tritune.kernels.versioning`); its ``portable_config``, where it has
one, is reshaped by the same rules. Fields the new space lacks are
dropped and listed, so that each can be checked to have held a value that launched nothing different
(a neutral value). An entry missing a field of its member is refused: the member's default might
not be what the entry ran. A field the space has gained is filled only where the caller names
its value with ``--add FIELD=VALUE`` (a JSON value, e.g. ``--add KV_TMA=false``): the value whose
launches build the code the entries measured. Whether the code really is unchanged is the
caller's claim to check (``git diff`` of the JIT kernels, ``tests/test_sm90_build.py``, and for
a new field the SASS of the winners with that value before and after: ``tests/sm90_build.py
--bundle-winners``); this tool does not re-measure.

Every re-stamped entry must then be admitted by the runtime loader on the bundle's GPU
(:func:`tritune.kernels.winners.admit`: current version, key and config in the space, feasible);
if one is not, nothing is written. The file is rewritten as :func:`tritune.configs_db.bundles.bundle_text`
formats it (sorted keys, indent 2), keeping the entries' order, so the diff shows only what changed.
Pass ``--dry-run`` to print the changes without writing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from tritune.configs_db.bundles import load_bundle
from tritune.configs_db.values import strict_loads
from tritune.kernels.device import DeviceInfo
from tritune.kernels.registry import get_spec
from tritune.kernels.winners import Rejection, admit
from tritune.search_spaces.base import UnionSpace

#: "sm90" -> (9, 0), "sm100" -> (10, 0), "sm89" -> (8, 9).
_SM_ARCH = re.compile(r"sm(\d+)(\d)")


def bundle_device(doc: dict[str, Any]) -> DeviceInfo:
    """The NVIDIA GPU a bundle names, rebuilt from its name and a key's arch and SM count."""
    keys = [entry["key"] for entry in doc["winners"] if "arch" in entry["key"]]
    if not keys:
        raise SystemExit("the bundle has no entry whose key names an arch")
    arch, sm_count = keys[0]["arch"], keys[0]["sm_count"]
    match = _SM_ARCH.fullmatch(arch)
    if match is None:
        raise SystemExit(f"arch {arch!r}: only NVIDIA bundles (arch smNN) can be checked")
    device = DeviceInfo(doc["gpu_name"], "nvidia", (int(match[1]), int(match[2])), sm_count, arch)
    if device.slug != doc["gpu"]:
        raise SystemExit(f"rebuilt device {device.slug!r} is not the bundle's GPU {doc['gpu']!r}")
    return device


def member_fields(space: Any, config: dict[str, Any]) -> tuple[str, ...]:
    """The fields a config of ``space`` holds: its path's member's for a union space."""
    if isinstance(space, UnionSpace):
        path = config.get(space.discriminant)
        if path not in space.members:
            raise SystemExit(f"{space.discriminant}={path!r} is not a path of {space.kernel}: {tuple(space.members)}")
        return tuple(space.members[path].dimensions)
    return tuple(space.dimensions)


def parse_additions(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` items (VALUE in JSON) as a mapping; a malformed item names itself."""
    additions = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--add {item!r}: expected FIELD=VALUE, e.g. KV_TMA=false")
        try:
            additions[name] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--add {item!r}: VALUE must be JSON (false, 64, ...): {exc}") from None
    return additions


def reshape(
    space: Any, config: dict[str, Any], additions: dict[str, Any], what: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``config`` with exactly its member's fields: ``additions`` set where it lacks them, the fields
    the space lacks dropped; and what was added and dropped. A field still missing refuses it."""
    fields = member_fields(space, config)
    added = {name: value for name, value in additions.items() if name in fields and name not in config}
    config = {**config, **added}
    missing = [name for name in fields if name not in config]
    if missing:
        raise SystemExit(f"{what} lacks {missing}; re-tune it instead")
    dropped = {name: value for name, value in config.items() if name not in fields}
    config = {name: config[name] for name in fields}
    # Refuses values outside the member's choices, naming the field.
    space.parse(config)
    return config, added, dropped


def restamp(doc: dict[str, Any], kernel: str, additions: dict[str, Any] | None = None) -> list[str]:
    """Rewrite ``kernel``'s entries of ``doc`` in place; one line per entry saying what changed.

    ``additions``: values for fields the space has gained, set in the entries whose member has the
    field and whose config lacks it (a field the space lacks is refused).
    """
    spec = get_spec(kernel)
    additions = additions or {}
    unknown = sorted(set(additions) - set(spec.space.dimensions))
    if unknown:
        raise SystemExit(f"--add: {kernel}'s space has no field {unknown}")
    notes = []
    for index, entry in enumerate(doc["winners"]):
        if entry["kernel"] != kernel:
            continue
        where = f"winners[{index}] ({kernel})"
        config, added, dropped = reshape(spec.space, entry["config"], additions, f"{where}: config")
        old = entry["kernel_version"]
        change = "current" if old == spec.version else f"{old} -> {spec.version}"
        notes.append(
            f"winners[{index}]: {change}"
            + (f", added {added}" if added else "")
            + (f", dropped {dropped}" if dropped else "")
        )
        entry["config"] = config
        entry["kernel_version"] = spec.version
        if entry.get("portable_config") is not None:
            # The default its speedup is against, in the same shape; the loader then checks that it
            # is the running default at the key.
            portable = reshape(spec.space, entry["portable_config"], additions, f"{where}: portable_config")
            entry["portable_config"] = portable[0]
    if not notes:
        raise SystemExit(f"--kernel: the bundle has no {kernel} entries")
    return notes


def refused(path: Path, kernel: str) -> list[str]:
    """Why the runtime loader would refuse each of ``kernel``'s entries of the bundle at ``path``."""
    text = path.read_text(encoding="utf-8")
    device = bundle_device(strict_loads(text))
    records, rejections = load_bundle(path, expected_gpu=device.slug)
    reasons = [r.reason for r in rejections]
    for record in records:
        if record.kernel == kernel:
            outcome = admit(record, device)
            if isinstance(outcome, Rejection):
                reasons.append(outcome.reason)
    return reasons


def document_text(doc: dict[str, Any]) -> str:
    """The bundle's text as ``bundle_text`` formats it (entries in their current order)."""
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=True, allow_nan=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path, help="the bundle file to rewrite")
    parser.add_argument("--kernel", required=True, help="the kernel whose entries to re-stamp")
    parser.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a field the space has gained, set (JSON value) where an entry lacks it",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the changes, write nothing")
    args = parser.parse_args(argv)

    additions = parse_additions(args.add)
    doc = strict_loads(args.bundle.read_text(encoding="utf-8"))
    for line in restamp(doc, args.kernel, additions):
        print(line)
    # Check the rewritten document as the loader would read it, before it replaces the bundle.
    fd, scratch = tempfile.mkstemp(prefix=f".{args.bundle.name}.", suffix=".tmp", dir=args.bundle.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(document_text(doc))
        reasons = refused(Path(scratch), args.kernel)
        if reasons:
            print("not written: the loader would refuse\n" + "\n".join(reasons), file=sys.stderr)
            return 1
        if args.dry_run:
            return 0
        os.chmod(scratch, 0o644)
        os.replace(scratch, args.bundle)
        scratch = ""
    finally:
        if scratch:
            Path(scratch).unlink(missing_ok=True)
    print(f"wrote {args.bundle}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
