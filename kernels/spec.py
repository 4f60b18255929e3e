"""The one seam between kernels, the dispatcher and the tuner: the kernel spec.

Each kernel family exposes exactly one :class:`KernelSpec`. It says what the kernel is called,
which version of its code is running (:mod:`.versioning`: an edited kernel invalidates stored configs),
how to build a tuning key from call arguments, what the portable default config is, how to launch
with a given config, what the reference computes, and how to make random problems for the tuner.
Neither the dispatcher nor the tuner knows anything about a kernel beyond this object.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from tritune.search_spaces.base import SearchSpace, TargetLimits

from .device import DeviceInfo
from .versioning import kernel_version

C = TypeVar("C")
K = TypeVar("K", bound="TuningKey")


def pow2_bucket(n: int, minimum: int = 16) -> int:
    """Round ``n`` up to a power of two, at least ``minimum`` (bucketed lengths in keys)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class TuningKey:
    """Base of every kernel's frozen key dataclass.

    Fields named in ``BUCKETS`` are bucketed lengths; the dispatcher's nearest-bucket lookup only
    moves along those and the ``NEAR`` fields and keeps every other field (GPU, dtype, head dim,
    ...) fixed. ``NEAR`` names exact sizes along which a winner may still be lent, as a GEMM's N
    and K: a shape no one tuned then borrows the config of the nearest tuned shape, measured in
    log2 like a bucket, rather than falling back to the portable default.
    """

    arch: str
    sm_count: int

    BUCKETS: ClassVar[tuple[str, ...]] = ()
    NEAR: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[K], values: Mapping[str, Any]) -> K:
        """Strictly rebuild a key read from a file: exact field set, exact types."""
        if not isinstance(values, Mapping):
            raise ValueError(f"{cls.__name__}: expected a mapping, got {type(values).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if set(values) != set(fields):
            raise ValueError(f"{cls.__name__}: fields {sorted(values)} differ from {sorted(fields)}")
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
        for name, value in values.items():
            # A string under ``from __future__ import annotations``, else the type itself.
            hint = hints[name]
            expected = {"int": int, "str": str, "bool": bool}.get(hint if isinstance(hint, str) else hint.__name__)
            if expected is None:
                raise ValueError(f"{cls.__name__}.{name}: unsupported field type {hints[name]!r}")
            if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
                raise ValueError(f"{cls.__name__}.{name}={value!r}: expected {expected.__name__}")
        return cls(**values)

    def group(self) -> tuple[Any, ...]:
        """The fields neither bucketed nor ``NEAR``: keys of one group may borrow each other's winners."""
        along = (*self.BUCKETS, *self.NEAR)
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in along)

    def distance(self, other: TuningKey) -> float:
        """Sum of log2 distances over the bucket and ``NEAR`` fields (only meaningful within one group)."""
        return sum(
            abs(math.log2(max(getattr(self, b), 1)) - math.log2(max(getattr(other, b), 1)))
            for b in (*self.BUCKETS, *self.NEAR)
        )


@dataclass
class Problem:
    """One random problem for the tuner: the call's arguments plus what a report needs."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    flops: float = 0.0
    bytes_moved: float = 0.0
    #: Whether timing should flush the L2 between repetitions (the real workload exceeds it).
    flush_l2: bool = True
    #: Time CUDA-graph replays instead of eager calls: the kernel is launch-bound at this size, or is
    #: served from captured graphs (decode and varlen steps), where the host's launch cost is not paid.
    launch_bound: bool = False


@dataclass(frozen=True)
class Peer:
    """The PyTorch call a user would make instead of the kernel, on one problem's inputs.

    ``fn`` takes no arguments and returns the same result as the kernel's launch on that problem;
    whatever setup the call needs (a dequantized weight, expanded KV heads, a mask) was done
    before, so timing ``fn`` times the call alone. ``name`` says what it is ("SDPA flash").
    """

    name: str
    fn: Callable[[], Any]


@dataclass(frozen=True)
class Replaced:
    """What a ``serve`` hook (:meth:`KernelSpec.serve_with_reason`) may return instead of a bare
    config when it replaces the one it was given: the stand-in, and why the given one cannot serve
    the call (the one warning a ``use_config`` pin replaced this way gets names it)."""

    config: Any
    reason: str


class KernelSpec(ABC, Generic[C, K]):
    """Everything the dispatcher and the tuner may know about one kernel."""

    #: Kernel name used in the DB, bundles, the CLI and ``use_config``.
    name: ClassVar[str]
    #: The Triton kernels the launch may run; with the functions they call, their code is part
    #: of the version (see :mod:`.versioning`).
    jit_kernels: ClassVar[tuple[Any, ...]]
    #: Bumped by hand when host-side launch geometry or the timing method changes: stored times
    #: and configs of another protocol no longer describe what runs.
    protocol: ClassVar[int]
    key_type: ClassVar[type[TuningKey]]
    space: SearchSpace[C, K]

    @functools.cached_property
    def version(self) -> str:
        """Fingerprint of the code, the config space, the key type and the protocol number."""
        return kernel_version(self.jit_kernels, self.space, self.key_type, self.protocol)

    # ---- the runtime half --------------------------------------------------------------

    @abstractmethod
    def facts(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The call's arguments reduced to a tuple of Python scalars (shapes, dtype, flags).

        Facts are what key building and path eligibility may look at. Being plain scalars, they
        let ``torch.compile`` treat the whole config choice as a constant (see
        :func:`tritune.kernels.dispatcher.dispatch`). Runs on every call: keep it cheap.
        """

    @abstractmethod
    def key_for(self, device: DeviceInfo, facts: tuple[Any, ...]) -> K:
        """The tuning key of a call, from its facts."""

    def default_config(self, key: K) -> C:
        """The portable configuration for ``key``; the dataclass defaults unless overridden."""
        return self.space.default()

    def pinned_config(self, values: Mapping[str, Any]) -> C:
        """Turn a ``use_config`` dict into a config (fields left out take the defaults)."""
        return self.space.parse(values)

    def fallback_key(self, key: K) -> K | None:
        """A key whose winner may serve ``key`` when ``key`` has none of its own (a hook; none by default).

        For a key whose numerics contract admits more paths than another's (an opt-in to faster,
        less accurate paths): where the looser key has no tuned winner, the stricter key's winner
        is as valid there and serves instead of the portable default.
        """
        return None

    def serveable(self, config: C, device: DeviceInfo, facts: tuple[Any, ...]) -> C:
        """Last word before launch: replace a config that cannot serve this call (a hook).

        Kernels with an optimized path check its eligibility here (target, strides, settings)
        and fall back to their portable config where it is not valid.
        """
        return config

    def serve_with_reason(self, config: C, device: DeviceInfo, facts: tuple[Any, ...]) -> tuple[C, str | None]:
        """:meth:`serveable`'s config and, where it replaced ``config`` and says why, the reason."""
        return self.serveable(config, device, facts), None

    @abstractmethod
    def launch(self, config: C, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run the kernel with ``config`` on already-validated call arguments.

        Takes the public op's arguments, ``out=`` included: the tuner passes a NaN-poisoned
        ``out`` so that a config which leaves part of the output unwritten cannot pass its check.
        """

    def prepare(self, config: C, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        """``launch(config, *args, **kwargs)`` as a function of no arguments, for timing loops.

        A kernel whose launch checks or binds its arguments does that work here, once, so that a
        timed call costs what the launch itself costs (the tuner and the benchmarks time this).
        """
        return functools.partial(self.launch, config, *args, **kwargs)

    # ---- the tuning half ---------------------------------------------------------------

    @abstractmethod
    def reference(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The pure-PyTorch result of the same call, in fp32 or better."""

    @abstractmethod
    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        """``None`` if ``out`` is close enough to ``expected``, else why not.

        ``config`` is the config that produced ``out`` (the tuner passes it), for kernels whose
        paths have different accuracy floors; ``None`` means the loosest floor applies.
        """

    @abstractmethod
    def make_problem(self, key: K, device: torch.device, seed: int) -> Problem:
        """Fresh random inputs representative of ``key`` (tiny shapes on the interpreter)."""

    def check_problem(self, key: K, device: torch.device, seed: int) -> Problem:
        """The problem the tuner's correctness gate compares with the reference.

        Defaults to a fresh :meth:`make_problem`. Kernels whose timed size is too large for a dense
        reference return a smaller problem of the same key here; the tuner then also cross-checks
        each candidate against the portable output at the timed size.
        """
        return self.make_problem(key, device, seed)

    def check_full(self, out: torch.Tensor, portable: torch.Tensor, config: Any) -> str | None:
        """At the timed size, where no reference is computed: why ``out`` (of ``config``) is too far
        from the portable default's output, or ``None``. Besides the tuner's loose check (5% of
        max|out|), for kernels whose :meth:`check_problem` is smaller than the timed problem."""
        return None

    def starting_configs(self, key: K, device: DeviceInfo) -> list[C]:
        """Configs the tuner measures first at ``key``, after the portable default (none by default).

        Where the author knows where the good tiles lie (from compiler output, or a paper), the
        study starts there instead of hoping that a random sample of a large space lands near
        them; they are measured and gated like any other proposal, and may lose.
        """
        return []

    def winner_variants(self, config: C, key: K, device: DeviceInfo) -> list[C]:
        """Configs the tuner measures right after a stored winner ``config`` (none by default): see
        :meth:`~.tuning_half.KernelTuning.winner_variants`."""
        return []

    def peer(self, key: K, problem: Problem) -> Peer | None:
        """The PyTorch call users judge the kernel against, on ``problem`` (built for ``key``); none by default.

        The tuner times it beside the winner at every key it tunes and stores its time with the
        winner; ``tune bench`` times it live. ``None`` where the kernel names no peer, or where no
        PyTorch call computes the same function at this problem.
        """
        return None

    @abstractmethod
    def default_keys(self, device: DeviceInfo, **options: Any) -> list[K]:
        """Keys ``tune`` sweeps when the user names none (CLI options narrow them)."""

    def limits(self, device: DeviceInfo) -> TargetLimits:
        """Shared memory per block the feasibility rules may assume on this GPU."""
        if device.is_interpreter:
            return TargetLimits(interpreter=True)
        if device.is_rocm:
            # A ROCm capability (MI300X: 9.4) is no NVIDIA one: the table below would give 227 KiB.
            return TargetLimits(smem_bytes=lds_limit_bytes(device.arch))
        return TargetLimits(smem_bytes=smem_limit_bytes(device.capability))


def smem_limit_bytes(capability: tuple[int, int]) -> int:
    """Opt-in shared memory per block by compute capability (the CUDA C++ Programming Guide's
    "maximum amount of shared memory per thread block")."""
    major, minor = capability
    if major in (9, 10):
        return 227 * 1024  # Hopper, datacenter Blackwell
    if (major, minor) in ((8, 0), (8, 7)):
        return 163 * 1024  # A100, Orin
    if major in (8, 12):
        return 99 * 1024  # Ampere/Ada consumer, consumer Blackwell
    if (major, minor) == (7, 5):
        return 64 * 1024  # Turing
    if major < 7:
        return 48 * 1024  # Maxwell, Pascal
    return 96 * 1024  # Volta (7.0, 7.2), and a GPU the guide did not list when this was written


def lds_limit_bytes(arch: str) -> int:
    """LDS an AMD GPU gives one workgroup, by LLVM target name: 160 KiB on gfx950 (MI350X, MI355X),
    64 KiB on every other (MI300X and MI325X are gfx942), per ROCm's "AMD GPU specifications" table."""
    return 160 * 1024 if arch == "gfx950" else 64 * 1024
