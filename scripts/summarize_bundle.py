"""A bundle's winners for one kernel as a Markdown table: what each key's tune found and what serves.

    python scripts/summarize_bundle.py configs_db/bundles/nvidia-h200-sm90-132sm.json --kernel splitk_decode

The times are the tuner's final interleaved re-timing of the winner and the portable default at
the key (as stored in the bundle); "serves" is what the dispatcher does with the entry at the
current margin (tuned where the speedup reaches ``1 + margin``, else the portable default). Reads
the JSON only: nothing is imported from the kernels and no GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from tritune.configs_db.records import key_text
from tritune.kernels.settings import settings


def _config_text(config: dict[str, Any]) -> str:
    return " ".join(f"{name}={value}" for name, value in sorted(config.items()))


def summarize(bundle: dict[str, Any], kernel: str, margin: float) -> str:
    entries = sorted(
        (e for e in bundle["winners"] if e["kernel"] == kernel), key=lambda e: json.dumps(e["key"], sort_keys=True)
    )
    if not entries:
        raise SystemExit(f"--kernel: the bundle has no {kernel} entries")
    threshold = 1.0 + margin
    speedups = [float(e["speedup"]) for e in entries]
    served = sum(s >= threshold for s in speedups)
    versions = sorted({e["kernel_version"] for e in entries})
    lines = [
        f"# {kernel}: the tuned winners of {bundle['gpu']} ({bundle['gpu_name']})",
        "",
        f"Bundle created {bundle['created']}; provenance {bundle['provenance']}; kernel version(s) "
        f"{', '.join(versions)}.",
        "",
        f"Command: `python scripts/summarize_bundle.py <bundle> --kernel {kernel}`",
        "",
        f"{len(entries)} keys. Speedup over the portable default: median {statistics.median(speedups):.2f}x, "
        f"range {min(speedups):.2f}x-{max(speedups):.2f}x. The tuned config serves at {served} keys "
        f"(speedup >= {threshold:.2f}, the dispatcher's margin); the portable default at the other "
        f"{len(entries) - served}.",
        "",
        "| key | winner | trials | time ms | portable ms | speedup | serves |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in entries:
        serves = "tuned" if float(e["speedup"]) >= threshold else "portable"
        lines.append(
            f"| {key_text(e['key'])} | {_config_text(e['config'])} | {e['trials']} | {e['time_ms']:.4f} | "
            f"{e['portable_ms']:.4f} | {e['speedup']:.3f}x | {serves} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path, help="a bundle JSON (configs_db/bundles/<gpu>.json)")
    parser.add_argument("--kernel", required=True, help="kernel name, e.g. splitk_decode")
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown here (default: print it)")
    args = parser.parse_args()
    text = summarize(json.loads(args.bundle.read_text()), args.kernel, settings().margin)
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
