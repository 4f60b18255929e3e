"""Per call: which config serves this kernel at this key on this GPU.

Lookup order, resolved once per (kernel, key) and then served from a dict:

1. a config pinned with :func:`~.pins.use_config` (tests and benchmarks); on a GPU, one the
   space's rule finds infeasible at the call's key gives way to the kernel's stand-in (what its
   ``serve()`` picks, else the portable default), with a warning;
2. the stored winner at the exact key, if its speedup over the portable default is at least
   ``1 + margin``; a winner that is the key's default itself (the tune found nothing faster)
   serves only for its eager alternative, where it has one;
3. with no winner at the exact key, the nearest bucket of the same kernel, GPU, dtype and head dim
   (the same key group) whose winner clears the margin, within a factor of 4 in all (sizes a key
   type names ``NEAR``, as Q4_K's weight N and K, count as bucketed lengths here);
4. where the kernel names a fallback key (a key with a stricter numerics contract, see
   :meth:`~.spec.KernelSpec.fallback_key`) whose portable default is the key's own, and the key
   holds no winner of its own, that key's stored winner (exact or nearest, as in 2 and 3; never
   its portable default). A winner's speedup was measured against its key's default, and a key
   whose own winner falls short of the margin was tuned and found its default as good;
5. the key's own portable default, logged once per key.

A stored winner (2 to 4) may come with an eager alternative
(:class:`~tritune.configs_db.records.EagerAlternative`): the config the tuner found faster for
plain eager calls, whose host launch cost the winner's CUDA-graph timing leaves out. Eager calls
outside CUDA-graph capture are served that config; captures, ``torch.compile`` and every other
lookup get the winner (:class:`EagerChoice`).

With ``TRITUNE_JIT`` on, a key of an eager call with no winner of its own is tuned online before
steps 3 to 5 (:mod:`.jit`: in the calling thread, or handed to a worker process while 3 to 5 serve).

Stored winners are loaded on the first dispatch for a device (the shipped bundle, then the
user's DB on top), never at import. Reading the DB takes at most ``TRITUNE_DB_READ_TIMEOUT``
seconds, under a lock of that device alone: a DB that does not answer costs that device's first
call the bound and one warning, and the bundle and portable defaults serve. Nothing here tunes
(online tuning runs for eager calls only), synchronises the GPU or writes files inside CUDA-graph
capture or ``torch.compile`` tracing, so dispatching is safe there.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from tritune.configs_db.values import printable

from . import misses, registry
from . import settings as settings_module
from .device import DeviceInfo, device_info
from .pins import PINNED, infeasible_pin, log_pin_rewrite
from .registry import get_spec
from .spec import KernelSpec, TuningKey
from .winner_sources import load_table
from .winners import Entry, WinnerTable

log = logging.getLogger("tritune.dispatch")

#: Whether the current CUDA stream is capturing a graph (False on builds without CUDA, whose
#: ``torch._C`` holds a stand-in that raises).
_capturing: Any = torch._C._cuda_isCurrentStreamCapturing if torch.cuda._is_compiled() else (lambda: False)


class EagerChoice:
    """A key's winner (``graph``) and the config serving its eager calls outside capture (``eager``).

    A capture can only replay configs whose kernels were loaded before it began (loading a module
    is not allowed while a stream captures), and a model usually warms up eagerly before it
    captures: so the first eager call of each set of facts launches the winner once too
    (:meth:`for_call`; the caller sets ``graph_loaded`` once that launch has run). A pair lives in
    the dispatcher's memo, per call facts: each new set of facts (a new length, say) pays that one
    extra launch, once, which is what keeps the winner's specialization for those facts loaded.
    """

    __slots__ = ("eager", "graph", "graph_loaded")

    def __init__(self, graph: Any, eager: Any) -> None:
        self.graph, self.eager = graph, eager
        self.graph_loaded = False

    def for_call(self) -> tuple[Any, Any]:
        """``(config to launch, config to launch once before it or None)`` for an eager call now."""
        if _capturing():
            return self.graph, None
        if self.graph_loaded:
            return self.eager, None
        return self.eager, self.graph

    def __repr__(self) -> str:
        return f"EagerChoice(graph={self.graph!r}, eager={self.eager!r})"


def graph_config(choice: Any) -> Any:
    """The config of a dispatch result that serves everything but eager calls (captures, compiled graphs)."""
    return choice.graph if type(choice) is EagerChoice else choice


#: Bound on memoised (kernel, device, facts) entries: a server seeing ever new exact lengths
#: must not grow the memo forever; past the bound it starts over (resolution stays per key).
MEMO_LIMIT = 4096


#: How far (sum of log2 distances over a key's bucketed lengths) a winner may be borrowed from:
#: 2.0 is a factor of 4 in one length, or of 2 in two.
NEAREST_MAX_LOG2 = 2.0


class Dispatcher:
    def __init__(self) -> None:
        #: Guards the dicts below for a moment; never held while anything is read.
        self._lock = threading.Lock()
        #: Device slug -> the lock held while that device's winners are read (one read per device).
        self._loading: dict[str, threading.Lock] = {}
        self._tables: dict[str, WinnerTable] = {}
        self._resolved: dict[tuple[str, str, TuningKey], Any] = {}
        self._logged: set[tuple[str, TuningKey]] = set()
        #: (kernel, device type, device index, facts[, pin]) -> config: the steady-state hit.
        self._memo: dict[tuple[Any, ...], Any] = {}
        #: Choices online tuning put off (see :meth:`deferred`), with their generation: reused while
        #: no call could tune them (under a dispatch mode, or while other keys hold the seconds),
        #: so such calls cost a lookup, not a resolution (and one miss noted per deferral).
        self._deferred_memo: dict[tuple[Any, ...], tuple[Any, int]] = {}
        #: Bumped by :meth:`clear`; a resolution started before a clear is not cached after it.
        self.generation = 0
        #: Per thread: whether the last resolution met a miss online tuning put off (see :meth:`deferred`).
        self._local = threading.local()

    def clear(self) -> None:
        """Forget loaded winners and resolutions (settings changed, or :func:`reload_configs`)."""
        with self._lock:
            self.generation += 1
            self._tables.clear()
            self._resolved.clear()
            self._logged.clear()
            self._memo.clear()
            self._deferred_memo.clear()

    def declared(self, spec: KernelSpec[Any, Any]) -> None:
        """A kernel declared after winners were loaded: admit the stored records kept aside for it."""
        with self._lock:
            for slug, table in self._tables.items():
                admitted = table.admit_waiting(spec.name)
                if admitted:
                    log.info("%s: %d stored config(s) for %s admitted on its declaration", spec.name, admitted, slug)

    def deferred(self) -> bool:
        """Whether this thread's resolution since :meth:`start_resolution` met a miss that online
        tuning put off (a call under capture or tracing): its choice must not be remembered, or the
        key's next eager call would reuse it instead of tuning."""
        return getattr(self._local, "deferred", False)

    def start_resolution(self) -> None:
        """Begin resolving one call's config on this thread (see :meth:`deferred`)."""
        self._local.deferred = False

    def defer(self) -> None:
        """Mark this thread's resolution as met by a miss online tuning put off (see :meth:`deferred`)."""
        self._local.deferred = True

    def memo_get(self, memo: tuple[Any, ...]) -> Any:
        return self._memo.get(memo)

    def deferred_get(self, memo: tuple[Any, ...]) -> Any:
        """A choice put off earlier, while this call could not tune its key either; else ``None``
        (and the choice is dropped once a call could tune: that call resolves again, and tunes)."""
        held = self._deferred_memo.get(memo)
        if held is None:
            return None
        config, generation = held
        if generation == self.generation and not _could_tune():
            return config
        with self._lock:
            self._deferred_memo.pop(memo, None)
        return None

    def deferred_put(self, memo: tuple[Any, ...], values: Any, generation: int) -> None:
        with self._lock:
            if generation != self.generation:
                return
            if len(self._deferred_memo) >= MEMO_LIMIT:
                self._deferred_memo.clear()
            self._deferred_memo[memo] = (values, generation)

    def memo_put(self, memo: tuple[Any, ...], values: Any, generation: int) -> None:
        with self._lock:
            if generation != self.generation:
                return
            if len(self._memo) >= MEMO_LIMIT:
                self._memo.clear()
            self._memo[memo] = values

    def select(
        self, spec: KernelSpec[Any, Any], device: DeviceInfo, key: TuningKey, where: torch.device | None = None
    ) -> Any:
        """The config serving ``key`` (its winner); ``where``: the call's device, for a call (online tuning may run)."""
        return graph_config(self.choose(spec, device, key, where))

    def choose(
        self, spec: KernelSpec[Any, Any], device: DeviceInfo, key: TuningKey, where: torch.device | None = None
    ) -> Any:
        """:meth:`select`, or an :class:`EagerChoice` where the winner has an eager alternative."""
        pinned = PINNED.get()
        if pinned is not None and spec.name in pinned:
            return pinned[spec.name]
        config = self._resolved.get((spec.name, device.slug, key))
        if config is None:
            config = self._resolve(spec, device, key, where)
        return config

    def admit_online(self, device: DeviceInfo, kernel: str, key: TuningKey, entry: Entry) -> None:
        """A winner tuned online (:mod:`.jit`) joins the device's table; ``kernel``'s choices there are made again.

        The kernel's other keys may borrow it as their nearest bucket. A resolution under way in
        another thread is not cached (the generation moves), so none keeps the config it replaces.
        """
        with self._lock:
            self.generation += 1
            table = self._tables.get(device.slug)
            if table is not None:
                table.add(kernel, key, entry)
            for resolved in [r for r in self._resolved if r[0] == kernel and r[1] == device.slug]:
                del self._resolved[resolved]
            # The memo is read without the lock on every call: replaced whole, never changed in place.
            self._memo = {memo: config for memo, config in self._memo.items() if memo[0] != kernel}
            self._deferred_memo = {memo: held for memo, held in self._deferred_memo.items() if memo[0] != kernel}

    def table(self, device: DeviceInfo) -> WinnerTable:
        """The device's winners, read on first use; calls for other devices never wait for the read."""
        table = self._tables.get(device.slug)
        if table is not None:
            return table
        with self._lock:
            loading = self._loading.setdefault(device.slug, threading.Lock())
        with loading:
            table = self._tables.get(device.slug)
            if table is None:
                generation = self.generation
                table = load_table(device)
                with self._lock:
                    if generation == self.generation:
                        self._tables[device.slug] = table
        return table

    def _resolve(
        self, spec: KernelSpec[Any, Any], device: DeviceInfo, key: TuningKey, where: torch.device | None = None
    ) -> Any:
        generation = self.generation
        self.start_resolution()
        current = settings_module.settings()
        config, reason = None, ""
        if current.disable_tuned:
            reason = "tuned configs disabled (TRITUNE_DISABLE_TUNED)"
        else:
            config, reason = self._stored(spec, device, key, where)
            fallback = spec.fallback_key(key) if config is None else None
            if fallback is not None and fallback != key and not self._may_fall_back(spec, device, key, fallback):
                fallback = None
            if fallback is not None and fallback != key:
                # Only a winner stored for the fallback key serves here; its portable default does
                # not: this key's own default serves then, and says so below.
                config, _ = self._stored(spec, device, fallback, None)
                config = graph_config(config)  # a fallback key's eager alternative was timed on its own numerics
        if config is None:
            config = spec.default_config(key)
            if (spec.name, key) not in self._logged:
                self._logged.add((spec.name, key))
                log.info("%s: portable default serves %s: %s", spec.name, key, printable(reason, limit=1000))
        with self._lock:
            if generation == self.generation and not self.deferred():
                self._resolved[(spec.name, device.slug, key)] = config
        return config

    def _may_fall_back(
        self, spec: KernelSpec[Any, Any], device: DeviceInfo, key: TuningKey, fallback: TuningKey
    ) -> bool:
        """Whether the fallback key's winner may serve ``key``, which has none clearing the margin.

        Its speedup was measured against the fallback key's default, so it says nothing where
        ``key``'s own default differs (Q4_K's staged default under the opt-in from M=1024). And a
        winner of ``key``'s own (a provisional one too) that falls short of the margin says its
        default is as good as the best its tune measured there.
        """
        if spec.default_config(fallback) != spec.default_config(key):
            return False
        exact = self.table(device).exact.get((spec.name, key))
        return exact is None or spec.space.infeasible_reason(exact.config, key, spec.limits(device)) is not None

    def _stored(
        self, spec: KernelSpec[Any, Any], device: DeviceInfo, key: TuningKey, where: torch.device | None
    ) -> tuple[Any, str]:
        """The stored winner serving ``key`` (exact, else nearest bucket), or ``None`` and why there is none.

        ``where``: the device of a real call asking for ``key``. Only such a call is noted in the
        miss log and may tune ``key`` online; a lookup on behalf of another key (its fallback) or
        of a tool (``tune bench``) is neither.
        """
        current = settings_module.settings()
        threshold = 1.0 + current.margin
        limits = spec.limits(device)
        table = self.table(device)
        exact = table.exact.get((spec.name, key))
        if (exact is None or exact.provisional) and where is not None:
            # No current winner of its own: a provisional one serves until re-measured, as tune does.
            misses.note(spec, device, key)
            if current.jit != "off":
                from . import jit  # only where online tuning is on: serving alone never imports it

                if jit.eager():
                    tuned = jit.ONLINE.on_miss(self, spec, device, where, key)
                    exact = exact if tuned is None else tuned
                else:
                    self.defer()
        if exact is not None:
            why = spec.space.infeasible_reason(exact.config, key, limits)
            if why is not None:
                return None, f"stored winner is infeasible here ({why})"
            if exact.speedup >= threshold:
                return _with_eager(exact, key, spec, limits), ""
            if exact.config == spec.default_config(key):
                # The tune found nothing faster than this key's default, but its eager alternative
                # was timed against exactly that config: eager calls take it, the rest the default.
                choice = _with_eager(exact, key, spec, limits)
                if type(choice) is EagerChoice:
                    return choice, ""
            return None, f"stored winner is only {exact.speedup:.3f}x the portable default"
        # A neighbour's winner must also be feasible at this key (e.g. a split-K config tuned for
        # small M must not be borrowed at M=8192), and near it: a config tuned for a few decode
        # tokens can be several times slower than the portable default on a mix of thousands.
        neighbours = [
            (distance, e)
            for k, e in table.groups.get((spec.name, key.group()), [])
            if (distance := k.distance(key)) <= NEAREST_MAX_LOG2
        ]
        candidates = [
            (distance, -e.speedup, e)
            for distance, e in neighbours
            if e.speedup >= threshold and spec.space.infeasible_reason(e.config, key, limits) is None
        ]
        nearest = min(candidates, key=lambda c: (c[0], c[1])) if candidates else None
        if nearest is None:
            return None, "no tuned config for this key or a bucket near it"
        if any(d <= nearest[0] and e.speedup < threshold for d, e in neighbours):
            # A bucket as near whose tune found no gain says the portable default is near the best
            # here: borrowing the other neighbour's winner can then lose to it.
            return None, "a bucket as near as the nearest tuned winner found no gain over the portable default"
        # A neighbour's eager alternative was chosen against its own size's GPU time: not lent.
        return nearest[2].config, ""


def _with_eager(entry: Entry, key: TuningKey, spec: KernelSpec[Any, Any], limits: Any) -> Any:
    """``entry``'s config, or an :class:`EagerChoice` where its eager alternative differs and is feasible at ``key``."""
    eager = entry.eager_config
    if eager is None or eager == entry.config or spec.space.infeasible_reason(eager, key, limits) is not None:
        return entry.config
    return EagerChoice(entry.config, eager)


DISPATCHER = Dispatcher()
settings_module.on_change(DISPATCHER.clear)
registry.on_register(DISPATCHER.declared)


def reload_configs() -> None:
    """Drop every loaded winner and cached choice; the next call of each kernel reloads them.

    A serving process reads the bundle and the DB once per device. Call this after a tune or an
    import into the DB it uses (or restart the process). Graphs already compiled by
    ``torch.compile`` keep the config they were traced with.
    """
    DISPATCHER.clear()


def _could_tune() -> bool:
    """Whether a call now could tune a key online: eager, with seconds of the process's budget free."""
    from . import jit  # imported by the resolution that deferred: online tuning is on

    return jit.eager() and jit.ONLINE.seconds_free()


def _choose(kernel: str, device_type: str, device_index: int, facts: tuple[Any, ...], memo: tuple[Any, ...]) -> Any:
    """Resolve the config of one call's facts and memoise it under ``memo``."""
    held = DISPATCHER.deferred_get(memo)
    if held is not None:
        return held
    generation = DISPATCHER.generation
    DISPATCHER.start_resolution()
    spec = get_spec(kernel)
    where = torch.device(device_type, device_index) if device_type != "cpu" else torch.device("cpu")
    device = device_info(where)
    key = spec.key_for(device, facts)
    chosen = DISPATCHER.choose(spec, device, key, where)
    eager = None
    if type(chosen) is EagerChoice:
        chosen, eager = chosen.graph, chosen.eager
    config, why = spec.serve_with_reason(chosen, device, facts)
    pin = memo[4] if len(memo) > 4 else None
    if pin is not None and config == pin:
        # A kernel whose serve() knows a better stand-in for an infeasible pin has replaced it already.
        pin_why = infeasible_pin(spec, device, key, pin)
        if pin_why is not None:
            config, why = spec.serve_with_reason(spec.default_config(key), device, facts)[0], pin_why
    if pin is not None and config != pin:
        log_pin_rewrite(kernel, pin, config, why)
    if eager is not None and config == chosen:
        served_eager, _ = spec.serve_with_reason(eager, device, facts)
        if served_eager == eager:  # both serve this call as stored: keep the pair
            config = EagerChoice(config, eager)
    if not DISPATCHER.deferred():
        DISPATCHER.memo_put(memo, config, generation)
    else:
        DISPATCHER.deferred_put(memo, config, generation)
    return config


@torch.compiler.assume_constant_result
def dispatch_config(kernel: str, device_type: str, device_index: int, facts: tuple[Any, ...]) -> Any:
    """The config serving one call, from plain scalars only.

    Callers pass their facts as a plain ``tuple`` (Dynamo hands a NamedTuple to an
    ``assume_constant_result`` function as an empty tuple). Under ``torch.compile`` the choice is
    made once at trace time and baked in as a constant: a compiled graph keeps the config (pinned
    or stored) that was in force when it was traced. In eager mode a call whose facts were seen
    before costs one dict lookup.
    """
    pinned = PINNED.get()
    pin = pinned.get(kernel) if pinned is not None else None
    # A pinned call's choice is memoised under the pin as well: what serves it (the pin, or what
    # replaces it where it cannot serve) depends only on the pin, the device and the facts.
    memo: tuple[Any, ...] = (kernel, device_type, device_index, facts)
    if pin is not None:
        memo = (*memo, pin)
    config = DISPATCHER.memo_get(memo)
    if config is None:
        config = _choose(kernel, device_type, device_index, facts, memo)
    return graph_config(config)


#: Device -> its ``(type, index)`` as :func:`dispatch_config` takes them (one entry per device a process uses).
_DEVICE_ARGS: dict[torch.device, tuple[str, int]] = {}


def dispatch_config_eager(kernel: str, device: torch.device, facts: tuple[Any, ...]) -> Any:
    """The config serving a plain eager call now: a key's eager alternative outside CUDA-graph
    capture, else what :func:`dispatch_config` serves. (A call launches through
    :func:`dispatch_choice_eager`, which also loads the winner before any capture needs it.)"""
    choice = dispatch_choice_eager(kernel, device, facts)
    if type(choice) is EagerChoice:
        return choice.graph if _capturing() else choice.eager
    return choice


def dispatch_choice_eager(kernel: str, device: torch.device, facts: tuple[Any, ...]) -> Any:
    """:func:`dispatch_config` for a plain eager call, from the tensor's device object: the config,
    or an :class:`EagerChoice` where the key's winner has an eager alternative.

    Reading ``device.type`` builds a string per read and costs as much as the memo hit itself;
    a dict keyed by the device costs a fraction of that. Only for eager calls: under
    ``torch.compile`` callers use :func:`dispatch_config` with plain scalars.
    """
    where = _DEVICE_ARGS.get(device)
    if where is None:
        where = _DEVICE_ARGS[device] = (device.type, -1 if device.index is None else device.index)
    pinned = PINNED.get()
    pin = pinned.get(kernel) if pinned is not None else None
    memo: tuple[Any, ...] = (kernel, where[0], where[1], facts)
    if pin is not None:
        memo = (*memo, pin)
    config = DISPATCHER._memo.get(memo)
    if config is None:
        config = _choose(kernel, where[0], where[1], facts, memo)
    return config
