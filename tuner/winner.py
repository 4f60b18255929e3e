"""The end of a key's search: re-time the best configs together and offer the fastest to the DB."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import triton

from tritune.configs_db.records import WinnerRecord

from .candidates import Bench
from .options import KeyResult, TuningError, pick_winner, tritune_version

if TYPE_CHECKING:
    from .search import KeySearch

__all__ = ["offer_winner"]


def offer_winner(search: KeySearch, bench: Bench, default: Any) -> KeyResult:
    """Re-time the best, the runner-up and the portable default in interleaved rounds; offer the fastest.

    The portable default wins unless another config is strictly faster; the DB keeps the faster of
    concurrent offers. A portable default without a time (it failed) fails the key.
    """
    known = search.known
    default_ident = known.ident(default)
    if default_ident not in known.times:
        status = known.status.get(default_ident)
        error = known.errors.get(default_ident)
        detail = f"{status}: {error}" if error else str(status)
        raise TuningError(f"{search.spec.name} {search.key}: the portable default failed ({detail})")
    ranked = sorted(known.times, key=lambda i: known.times[i])
    # Winner, runner-up and portable default, each once.
    contenders = list(dict.fromkeys([*ranked[:2], default_ident]))
    timed = {ident: known.times[ident] for ident in contenders}
    notes: list[str] = []
    if len(contenders) > 1 and search.options.final_rounds > 0:
        retimed = bench.retime([dict(ident) for ident in contenders], search.options.final_rounds)
        if retimed is None:
            notes.append("final re-timing failed; the winner is chosen on the trial times")
        else:
            # Interleaved re-timing: all contenders see the same clocks and temperature.
            timed = dict(zip(contenders, retimed["ms"], strict=True))
            notes.extend(retimed["notes"])
    winner = pick_winner(timed, default_ident)
    if winner == default_ident and ranked[0] != default_ident:
        notes.append("re-timing found no gain over the portable default")
    elif winner != ranked[0]:
        notes.append("re-timing put the runner-up of the trials ahead")
    best = search.space.to_dict(known.config(winner))
    best_ms, portable_ms = timed[winner], timed[default_ident]
    record = WinnerRecord(
        kernel=search.spec.name,
        kernel_version=search.spec.version,
        gpu=search.device.slug,
        key=search.key_dict,
        config=best,
        time_ms=best_ms,
        portable_ms=portable_ms,
        speedup=portable_ms / best_ms,
        trials=known.counts["measured"] + known.counts["reused"],
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        tritune_version=tritune_version(),
    )
    search.store.offer_winner(record, search.env_id)
    return KeyResult(
        kernel=search.spec.name,
        key=search.key,
        config=best,
        best_ms=best_ms,
        portable_ms=portable_ms,
        measured=known.counts["measured"],
        reused=known.counts["reused"],
        failed=known.counts["failed"],
        pruned=known.counts["pruned"],
        notes=notes,
    )
