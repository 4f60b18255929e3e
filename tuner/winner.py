"""The end of a key's search: re-time the best configs together and offer the fastest to the DB."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import triton

from tritune.configs_db.records import EagerAlternative, WinnerRecord
from tritune.configs_db.values import canonical_json, printable
from tritune.configs_db.winner_fields import eager_fields, eager_problem, peer_problem
from tritune.kernels.settings import settings

from .candidates import Bench, RetimeOutcome
from .options import EAGER_MAX_MS, KeyResult, TuningError, pick_winner, tritune_version

if TYPE_CHECKING:
    from .search import KeySearch

__all__ = ["EAGER_CONTENDERS", "EAGER_MARGIN", "eager_alternative", "kept_winner", "offer_winner"]

log = logging.getLogger("tritune.tuner")

#: Most configs besides the winner whose launches' host cost is timed for the eager choice.
EAGER_CONTENDERS = 8
#: How much faster eagerly an alternative must be than the winner to be stored (host timings of
#: back-to-back launches vary by a few percent between rounds).
EAGER_MARGIN = 0.05


def offer_winner(search: KeySearch, bench: Bench, default: Any) -> KeyResult:
    """Re-time the best, the runner-up and the portable default in interleaved rounds; offer the fastest.

    The portable default wins unless another config is strictly faster; the DB keeps the faster of
    concurrent offers (and a faster winner stored earlier): the result says whether it took this
    one, and which it kept where not. A portable default without a time (it failed) fails the key. With
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
    eager = None
    eager_measured = False
    time_eager = search.options.time_eager
    if time_eager is None:
        time_eager = search.torch_device.type == "cuda"
    if time_eager and best_ms < EAGER_MAX_MS:
        eager, eager_measured = eager_alternative(search, bench, timed, winner, default_ident, notes)
        problem = None if eager is None else eager_problem(eager_fields(eager))
        if problem is not None:  # the store would refuse the winner with it: keep the winner alone
            notes.append(f"eager alternative dropped: {problem}")
            eager, eager_measured = None, False
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
        eager=eager,
        portable_config=search.space.to_dict(default),
    )
    # An alternative measured as a serving process runs eager calls (replayed) replaces the one a
    # kept winner of the same config holds; a failed or replay-off timing leaves that one alone.
    refresh = eager_measured and settings().eager_replay
    stored = search.store.offer_winner(record, search.env_id, refresh_eager=refresh)
    kept = None if stored else kept_winner(search, record)
    if refresh and kept is not None and kept.config == record.config:
        notes.append("the stored winner, faster in an earlier run, kept; its eager alternative re-timed")
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
        stored=stored,
        kept=kept,
    )


def kept_winner(search: KeySearch, offered: WinnerRecord) -> WinnerRecord | None:
    """The winner the DB keeps at the offer's key instead of the offer; ``None`` if none is readable.

    The summary of a tune shows it in place of the offer, which the DB did not take.
    """
    key = canonical_json(offered.key)
    for stored in search.store.winners(gpu=offered.gpu, kernel=offered.kernel):
        if stored.kernel_version == offered.kernel_version and canonical_json(stored.key) == key:
            return stored
    return None


def eager_alternative(
    search: KeySearch, bench: Bench, timed: dict[Any, float], winner: Any, default: Any, notes: list[str]
) -> tuple[EagerAlternative | None, bool]:
    """The config serving eager calls of this key faster than the winner, or None; and whether the
    host times were measured (False: timing failed, and None says nothing about the key).

    An eager caller pays about ``max(GPU time, host time)`` per call when calls follow each other
    (the host queues the next launch while the GPU runs this one). The GPU times are the trials'
    (or the final rounds', where re-timed); host times are measured here (each config's launch plus
    the public call's checks and dispatch). First the winner's, which bounds the rest: only a
    config whose GPU time is below the winner's eager time can beat it. Then the fastest such
    configs (at most :data:`EAGER_CONTENDERS`, the portable default among them where it qualifies)
    with the winner again, in one set of interleaved rounds; the best of them is re-timed on the
    GPU beside the winner, and returned if it beats the winner by :data:`EAGER_MARGIN`.
    """
    known = search.known
    gpu_ms = {**known.times, **timed}
    first = bench.host_times([dict(winner)])
    if not first:
        notes.append("the launches' host cost could not be timed: no eager alternative")
        return None, False
    bound = max(gpu_ms[winner], first[0]) / (1 + EAGER_MARGIN)
    fastest = sorted((i for i in gpu_ms if i != winner and gpu_ms[i] < bound), key=lambda i: gpu_ms[i])
    contenders = list(dict.fromkeys([*fastest[:EAGER_CONTENDERS], *([default] if default in fastest else [])]))
    if not contenders:
        return None, True  # nothing runs on the GPU faster than the winner's eager call
    # The winner again, in the same interleaved rounds as its contenders: one clock for all.
    host = bench.host_times([dict(ident) for ident in [winner, *contenders]])
    if host is None or len(host) != len(contenders) + 1:
        notes.append("the launches' host cost could not be timed: no eager alternative")
        return None, False
    host_ms = dict(zip([winner, *contenders], host, strict=True))
    best = min(contenders, key=lambda ident: max(gpu_ms[ident], host_ms[ident]))
    # GPU times of the trials and of the final rounds are not one clock either: re-time the pair.
    retimed = bench.retime([dict(winner), dict(best)], max(1, search.options.final_rounds))
    if retimed is not None:
        gpu_ms[winner], gpu_ms[best] = retimed["ms"]
    winner_eager = max(gpu_ms[winner], host_ms[winner])
    best_eager = max(gpu_ms[best], host_ms[best])
    if best_eager * (1 + EAGER_MARGIN) >= winner_eager:
        return None, True
    config = search.space.to_dict(known.config(best))
    notes.append(
        f"eager calls: {config} (about {best_eager * 1e3:.1f} us a call against the winner's "
        f"{winner_eager * 1e3:.1f} us, {host_ms[winner] * 1e3:.1f} us of it host work)"
    )
    # The host times came from prepared launches, which replay as eager calls do while replay is on.
    alternative = EagerAlternative(
        config=config, ms=best_eager, winner_ms=winner_eager, replayed=settings().eager_replay
    )
    return alternative, True


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
