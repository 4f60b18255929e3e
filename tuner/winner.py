"""The end of a key's search: re-time the best configs together and offer the fastest to the DB."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import triton

from tritune.configs_db.bundles import peer_problem
from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.values import printable

from .candidates import Bench, RetimeOutcome
from .options import KeyResult, TuningError, pick_winner, tritune_version

if TYPE_CHECKING:
    from .search import KeySearch

__all__ = ["offer_winner"]

log = logging.getLogger("tritune.tuner")


def offer_winner(search: KeySearch, bench: Bench, default: Any) -> KeyResult:
    """Re-time the best, the runner-up and the portable default in interleaved rounds; offer the fastest.

    The portable default wins unless another config is strictly faster; the DB keeps the faster of
    concurrent offers. A portable default without a time (it failed) fails the key. With
    ``options.time_peer`` the kernel's peer (the PyTorch call a user would make instead) is timed
    last in each of those rounds, in the same process and with the same timer, and its time is
    stored with the winner; a peer that is missing, unsupported or fails is logged at INFO and
    stored as NULL, never failing the key.
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
    rounds = search.options.final_rounds
    interleaved = len(contenders) > 1 and rounds > 0
    configs = [dict(ident) for ident in contenders] if interleaved else []
    time_peer = search.options.time_peer
    retimed: RetimeOutcome | None = None
    peer_ms: float | None = None
    peer_name: str | None = None
    if time_peer:
        # The peer is timed in the same rounds (alone where no contenders are re-timed).
        retimed = bench.retime(configs, max(rounds, 1), peer=True)
        peer_ms, peer_name = _peer_time(search, retimed)
        if retimed is None and interleaved and _peer_at_fault(bench):
            # A peer that takes the worker down must not cost the contenders their re-timing.
            retimed = bench.retime(configs, rounds)
    elif interleaved:
        retimed = bench.retime(configs, rounds)
    if interleaved and retimed is None:
        notes.append("final re-timing failed; the winner is chosen on the trial times")
    elif interleaved and retimed is not None:
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
        peer_ms=peer_ms,
        peer_name=peer_name,
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


def _peer_at_fault(bench: Bench) -> bool:
    """Whether the rounds that timed the peer with the contenders failed because of the peer.

    The contenders all ran as trials on this bench; the peer runs here for the first time. A
    peer that crashes or hangs the bench does so alone too (a peer that merely raises is reported
    in the outcome, never fails the rounds): then the contenders are re-timed without it, and
    otherwise not again.
    """
    return bench.retime([], 1, peer=True) is None


def _peer_time(search: KeySearch, retimed: RetimeOutcome | None) -> tuple[float | None, str | None]:
    """The peer's time and name from the final rounds; ``(None, None)``, logged at INFO, where there is none."""
    where = f"{search.spec.name} {search.key}"
    if retimed is None:
        log.info("%s: no peer time (the final rounds that time it failed)", printable(where))
        return None, None
    peer_ms, peer_name = retimed.get("peer_ms"), retimed.get("peer_name")
    problem = peer_problem(peer_ms, peer_name) if peer_ms is not None else retimed.get("peer_error")
    if peer_ms is None or problem is not None:
        log.info("%s: no peer time (%s)", printable(where), printable(str(problem or "none was timed")))
        return None, None
    return peer_ms, peer_name
