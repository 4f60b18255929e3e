"""``scripts/bench_model.py`` sizes the model's RoPE positions for the longest cache of any phase.

A model sized for the prompt lengths alone refused the serving phase's cache once ``--serve-new``
outgrew ``--decode-steps + 64`` (``capacity: ... exceeds the model's ... positions``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT / "examples", ROOT / "scripts"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import _bench_model_check  # noqa: E402
import bench_model  # noqa: E402


def _needs(argv: list[str]) -> tuple[int, list[int]]:
    """``max_positions`` and what each phase's cache holds, for ``argv``."""
    args = bench_model.defaults(bench_model.parser().parse_args(argv))
    check = 8 if args.smoke else _bench_model_check.CHECK_LENGTH
    caches = [-(-(n + args.decode_steps + 1) // 64) * 64 for n in args.lengths]
    caches += [args.profile_length + 64, args.serve_lengths[1] + args.serve_new, check + 1]
    return bench_model.max_positions(args), caches


@pytest.mark.parametrize(
    "argv",
    [
        ["--smoke", "--lengths", "10", "--decode-steps", "1", "--serve-new", "80"],
        ["--smoke", "--serve-lengths", "4,200", "--serve-new", "2"],
        ["--smoke", "--lengths", "100", "--decode-steps", "30", "--serve-new", "1"],
        [],
        ["--serve-lengths", "128,4096", "--serve-new", "8192", "--lengths", "512"],
    ],
    ids=["serve-new", "serve-prompts", "prompt-lengths", "defaults", "long-serving"],
)
def test_max_positions_covers_every_phases_cache(argv: list[str]) -> None:
    positions, caches = _needs(argv)
    assert positions >= max(caches)
