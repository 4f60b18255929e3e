"""What a re-tune changed: two bundles of one GPU compared key by key, as a Markdown table.

    tune export --gpu nvidia-h200-sm90-132sm --out before.json         # or the shipped file
    tune --device 0 --bundled --trials 4 --db retune.sqlite
    tune export --gpu nvidia-h200-sm90-132sm --db retune.sqlite --out after.json
    python scripts/compare_bundles.py before.json after.json --out compare.md

Per key both bundles hold: the winner and its time in each, ``after / before`` (below 1: faster
now), and whether the winner's config changed. A key whose served time moved by more than
``--noise`` (default 3%) either way is listed after the table; keys only one bundle holds are
counted. Times are each bundle's own stored measurements (the tune's final re-timing), so a key
whose config did not change shows the run-to-run noise of that kernel there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tritune.configs_db.bundles import BundleError, read_bundle
from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.values import canonical_json

Identity = tuple[str, str]


def by_key(path: str) -> dict[Identity, WinnerRecord]:
    """``path``'s records by (kernel, canonical key); a file that cannot be read ends the script."""
    records, rejections = read_bundle(Path(path))
    if not records and rejections:
        raise BundleError(rejections[0].reason)
    for rejection in rejections:
        print(f"{path}: {rejection.source}: {rejection.reason}", file=sys.stderr)
    return {(r.kernel, canonical_json(r.key)): r for r in records}


def key_text(key: dict[str, Any]) -> str:
    """The key's fields without the GPU's (both bundles are of one GPU)."""
    return " ".join(f"{name}={value}" for name, value in sorted(key.items()) if name not in ("arch", "sm_count"))


def config_text(config: dict[str, Any]) -> str:
    return " ".join(f"{name}={value}" for name, value in sorted(config.items()))


def header(before: str, after: str, noise: float) -> str:
    """The report's title, the command and each bundle's creation time and provenance."""
    lines = ["# Bundle comparison", "", f"Command: `python scripts/compare_bundles.py {Path(before).name} "
             f"{Path(after).name}{'' if noise == 0.03 else f' --noise {noise}'}`", ""]  # fmt: skip
    for name, path in (("before", before), ("after", after)):
        doc = json.loads(Path(path).read_text())
        lines.append(f"- {name}: `{Path(path).name}`, created {doc.get('created')}, provenance {doc.get('provenance')}")
    return "\n".join([*lines, "", ""])


def compare(before: dict[Identity, WinnerRecord], after: dict[Identity, WinnerRecord], noise: float) -> str:
    """The Markdown report: a row per key both hold, then the moves beyond ``noise`` and the one-sided keys."""
    shared = [identity for identity in before if identity in after]
    lines = [
        "| kernel | key | before | before ms | after | after ms | after / before | config |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    moved: list[str] = []
    for identity in sorted(shared):
        old, new = before[identity], after[identity]
        ratio = new.time_ms / old.time_ms
        same = old.config == new.config
        lines.append(
            f"| {old.kernel} | {key_text(old.key)} | {config_text(old.config)} | {old.time_ms:.4f} | "
            f"{'same' if same else config_text(new.config)} | {new.time_ms:.4f} | {ratio:.3f} | "
            f"{'same' if same else 'changed'} |"
        )
        if abs(ratio - 1.0) > noise:
            moved.append(f"- {old.kernel} {key_text(old.key)}: {ratio:.3f} ({'same config' if same else 'new config'})")
    only_before = len([i for i in before if i not in after])
    only_after = len([i for i in after if i not in before])
    summary = [
        "",
        f"{len(shared)} keys in both; {len(moved)} moved by more than {noise:.0%}; "
        f"{only_before} only before, {only_after} only after.",
    ]
    if moved:
        summary += ["", f"Moved by more than {noise:.0%}:", "", *moved]
    return "\n".join(lines + summary) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="the bundle before (e.g. configs_db/bundles/<gpu>.json)")
    parser.add_argument("after", help="the bundle after (tune export of the re-tuned DB)")
    parser.add_argument("--noise", type=float, default=0.03, help="relative move to list (default 0.03)")
    parser.add_argument("--out", help="write the Markdown here (default: print it)")
    args = parser.parse_args(argv)
    if not 0 < args.noise < 1:
        parser.error(f"--noise: expected a fraction between 0 and 1, got {args.noise}")
    try:
        before, after = by_key(args.before), by_key(args.after)
        # Both files are bundles now (read_bundle refused anything else).
        gpus = {json.loads(Path(path).read_text()).get("gpu") for path in (args.before, args.after)}
        if len(gpus) != 1:
            named = ", ".join(sorted(map(str, gpus)))
            parser.exit(1, f"compare_bundles.py: the bundles are of two GPUs ({named})\n")
        report = compare(before, after, args.noise)
        report = header(args.before, args.after, args.noise) + report
    except (BundleError, OSError) as exc:
        parser.exit(1, f"compare_bundles.py: {exc}\n")
    if args.out:
        Path(args.out).write_text(report)
    else:
        print(report, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
