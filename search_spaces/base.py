"""Declarative search spaces: a frozen config dataclass whose fields carry their allowed values.

A kernel's config type is an ordinary frozen dataclass; each tunable field is declared with
:func:`choice`, which records the values the tuner may try. :class:`SearchSpace` reads those
declarations, validates configs that come from outside (bundles, databases, ``use_config``),
enumerates the grid, and applies the kernel's analytic feasibility rule before anything compiles.

Validation is strict on purpose: a config read from a file is only ever *checked against* the
declared choices, never evaluated, so a hostile or stale file cannot reach a kernel launch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

Value = int | str | bool
C = TypeVar("C")
K = TypeVar("K")

#: Hopper's opt-in shared memory per block; the default limit for feasibility estimates.
DEFAULT_SMEM_LIMIT_BYTES = 227 * 1024
#: Head dims the attention kernels serve; 80 and 96 are padded to 128 inside the kernels.
HEAD_DIMS = (64, 80, 96, 128, 256)


def choice(default: Value, options: tuple[Value, ...] | list[Value]) -> Any:
    """Declare a tunable dataclass field: its default and the values the tuner may try."""
    options = tuple(options)
    if default not in options:
        raise ValueError(f"default {default!r} must be one of the options {options!r}")
    return dataclasses.field(default=default, metadata={"choices": options})


@dataclass(frozen=True)
class TargetLimits:
    """What the feasibility rule may assume about the compile target."""

    smem_bytes: int = DEFAULT_SMEM_LIMIT_BYTES
    #: Under the Triton interpreter nothing compiles, so resource estimates do not apply.
    interpreter: bool = False


class ConfigError(ValueError):
    """A config that is not a member of its kernel's search space."""


#: A feasibility rule returns ``None`` for a config that may compile, else the reason it cannot.
FeasibilityRule = Callable[[C, K, TargetLimits], "str | None"]


class SearchSpace(Generic[C, K]):
    """The tunable dimensions of one kernel, read from its frozen config dataclass."""

    def __init__(
        self,
        kernel: str,
        config_type: type[C],
        feasibility: Callable[[C, K, TargetLimits], str | None] | None = None,
    ) -> None:
        if not dataclasses.is_dataclass(config_type):
            raise TypeError(f"config_type for {kernel} must be a dataclass, got {config_type!r}")
        self.kernel = kernel
        self.config_type = config_type
        self._feasibility = feasibility
        self.dimensions: dict[str, tuple[Value, ...]] = {}
        for f in dataclasses.fields(config_type):
            options = f.metadata.get("choices")
            if options is None:
                raise TypeError(f"{config_type.__name__}.{f.name} must be declared with choice()")
            self.dimensions[f.name] = options

    # ---- conversion and validation -------------------------------------------------------

    def default(self) -> C:
        """The dataclass defaults: the kernel's portable configuration."""
        return self.config_type()

    def parse(self, values: Mapping[str, Any], base: C | None = None) -> C:
        """Build a config from a plain mapping, refusing anything outside the space.

        Fields left out take their value from ``base`` (or the dataclass defaults). Unknown
        fields, values of the wrong type and values not among the declared choices raise
        :class:`ConfigError` naming the field.
        """
        if not isinstance(values, Mapping):
            raise ConfigError(f"{self.kernel}: a config must be a mapping of field names, got {type(values).__name__}")
        unknown = sorted(set(values) - set(self.dimensions))
        if unknown:
            raise ConfigError(
                f"{self.kernel}: unknown config field(s) {unknown}; the space has {sorted(self.dimensions)}"
            )
        start = dataclasses.asdict(base if base is not None else self.default())  # type: ignore[call-overload]
        for name, value in values.items():
            options = self.dimensions[name]
            if not _same_kind(value, options[0]) or value not in options:
                raise ConfigError(f"{self.kernel}: {name}={value!r} is not in the space; expected one of {options}")
            start[name] = value
        return self.config_type(**start)

    def to_dict(self, config: C) -> dict[str, Value]:
        return dataclasses.asdict(config)  # type: ignore[call-overload, no-any-return]

    @property
    def field_types(self) -> dict[str, type]:
        """Field name -> Python type of every field an op call carries for a config of this space."""
        return {name: type(options[0]) for name, options in self.dimensions.items()}

    def from_fields(self, fields: Mapping[str, Any]) -> C:
        """The config an op call's keyword fields describe (every field of :attr:`field_types`)."""
        return self.parse(fields)

    def field_values(self, config: C) -> dict[str, Value]:
        """The keyword fields an op call carries for ``config``: :meth:`from_fields` reverses it.

        Plain attribute reads (not ``dataclasses.asdict``), so ``torch.compile`` can trace them.
        """
        return {name: getattr(config, name) for name in self.dimensions}

    def contains(self, config: C) -> bool:
        try:
            self.parse(self.to_dict(config))
        except ConfigError:
            return False
        return True

    # ---- enumeration and pruning ---------------------------------------------------------

    def size(self) -> int:
        n = 1
        for options in self.dimensions.values():
            n *= len(options)
        return n

    def grid(self) -> Iterator[C]:
        names = list(self.dimensions)
        for combo in itertools.product(*(self.dimensions[n] for n in names)):
            yield self.config_type(**dict(zip(names, combo, strict=True)))

    def from_proposal(self, params: Mapping[str, Any]) -> C:
        """The config a sampler's proposal (a value for every dimension) stands for."""
        return self.parse(params)

    def neighbours(self, config: C) -> list[C]:
        """Configs one step away from ``config``: one field moved to the choice next to its own.

        The choices are ordered (tiles, warps, stages), so these are the nearest configs a hill
        climb from ``config`` tries first; feasibility is the caller's to check.
        """
        values = self.to_dict(config)
        found = []
        for name, options in self.dimensions.items():
            position = options.index(values[name])
            for step in (-1, 1):
                if 0 <= position + step < len(options):
                    found.append(self.parse({**values, name: options[position + step]}))
        return found

    def fingerprint(self) -> list[str]:
        """The structure that decides what a stored config means (see ``kernels/versioning.py``)."""
        rule = self._feasibility
        lines = [f"field {name}={options!r}" for name, options in self.dimensions.items()]
        if rule is not None:
            # The rule's name, not its module: a kernel loaded from its file and the same kernel
            # imported from its package are one kernel.
            lines.append(f"rule {rule.__qualname__}")
        return lines

    def infeasible_reason(self, config: C, key: K, limits: TargetLimits) -> str | None:
        """Why ``config`` cannot run for ``key`` on this target, or ``None`` if it may."""
        if self._feasibility is None:
            return None
        return self._feasibility(config, key, limits)

    def feasible(self, key: K, limits: TargetLimits) -> list[C]:
        return [c for c in self.grid() if self.infeasible_reason(c, key, limits) is None]


def _same_kind(value: Any, example: Value) -> bool:
    # bool is a subclass of int: keep True from passing as BLOCK_M=1 and 1 as a flag.
    if isinstance(example, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(example, bool)
    return isinstance(value, type(example))


class UnionSpace(Generic[K]):
    """A space made of member spaces, one per path of a kernel, chosen by a discriminant field.

    Each member is a :class:`SearchSpace` over its own frozen dataclass with its own feasibility
    rule; its first field is the discriminant, declared with a single choice (its own name), so
    every config says which member it belongs to. A config holds only the fields its path reads:
    no field is "only used by path X", and two configs that launch the same thing are equal.

    The union's :attr:`dimensions` (the sampler's view) hold every field of any member with the
    union of its choices; :meth:`from_proposal` keeps the fields of the proposed path and refuses
    values outside that path's choices. Op schemas carry every field of the union
    (:attr:`field_types`); a field the config's path lacks travels as a filler and is ignored.
    """

    def __init__(self, kernel: str, discriminant: str, members: Sequence[SearchSpace[Any, K]]) -> None:
        self.kernel = kernel
        self.discriminant = discriminant
        self.members: dict[str, SearchSpace[Any, K]] = {}
        for member in members:
            options = member.dimensions.get(discriminant, ())
            if list(member.dimensions)[:1] != [discriminant] or len(options) != 1:
                raise TypeError(
                    f"{kernel}: {member.config_type.__name__} must start with a field {discriminant!r} "
                    "declared with one choice, its own name"
                )
            self.members[str(options[0])] = member
        self.dimensions: dict[str, tuple[Value, ...]] = {discriminant: tuple(self.members)}
        for member in self.members.values():
            for name, options in member.dimensions.items():
                if name != discriminant:
                    merged = list(self.dimensions.get(name, ()))
                    merged += [o for o in options if o not in merged]
                    self.dimensions[name] = tuple(sorted(merged)) if _sortable(merged) else tuple(merged)
        self._fillers = {name: options[0] for name, options in self.dimensions.items()}

    def member_of(self, config: Any) -> SearchSpace[Any, K]:
        return self.members[getattr(config, self.discriminant)]

    @property
    def config_types(self) -> tuple[type, ...]:
        return tuple(m.config_type for m in self.members.values())

    # ---- conversion and validation -------------------------------------------------------

    def default(self) -> Any:
        """The first member's defaults: the kernel's portable configuration."""
        return next(iter(self.members.values())).default()

    def _member_for(self, values: Mapping[str, Any], base: Any = None) -> SearchSpace[Any, K]:
        if not isinstance(values, Mapping):
            raise ConfigError(f"{self.kernel}: a config must be a mapping of field names, got {type(values).__name__}")
        path = values.get(self.discriminant, getattr(base, self.discriminant, None))
        if path is None:
            return next(iter(self.members.values()))
        member = self.members.get(path) if isinstance(path, str) else None
        if member is None:
            raise ConfigError(
                f"{self.kernel}: {self.discriminant}={path!r} is not in the space; "
                f"expected one of {tuple(self.members)}"
            )
        return member

    def parse(self, values: Mapping[str, Any], base: Any = None) -> Any:
        """A config of the member ``values[discriminant]`` names (or ``base``'s, or the first).

        Fields left out take ``base``'s values where ``base`` is of the same member, else that
        member's defaults. A field the member does not have is refused, naming it and the path.
        """
        member = self._member_for(values, base)
        foreign = sorted(set(values) - set(member.dimensions))
        if foreign:
            path = member.dimensions[self.discriminant][0]
            raise ConfigError(
                f"{self.kernel}: {self.discriminant}={path!r} has no field(s) {foreign}; its fields are "
                f"{sorted(member.dimensions)}"
            )
        same = base is not None and isinstance(base, member.config_type)
        return member.parse(values, base if same else None)

    def from_proposal(self, params: Mapping[str, Any]) -> Any:
        """The config of the proposed path, from a proposal holding a value for every union field."""
        member = self._member_for(params)
        return member.parse({name: value for name, value in params.items() if name in member.dimensions})

    def to_dict(self, config: Any) -> dict[str, Value]:
        return self.member_of(config).to_dict(config)

    def contains(self, config: Any) -> bool:
        try:
            return bool(self.parse(self.to_dict(config)) == config)
        except (ConfigError, KeyError, AttributeError):
            return False

    @property
    def field_types(self) -> dict[str, type]:
        return {name: type(options[0]) for name, options in self.dimensions.items()}

    def from_fields(self, fields: Mapping[str, Any]) -> Any:
        member = self._member_for(fields)
        return member.parse({name: fields[name] for name in member.dimensions})

    def field_values(self, config: Any) -> dict[str, Value]:
        """Every union field: the config's own, fillers for the fields its path lacks.

        No ``getattr`` with a default: dynamo cannot trace one that misses on a config it reached
        through the dispatcher's tables (``torch.compile`` traces this on every compiled call).
        """
        own = self.member_of(config).dimensions
        return {name: getattr(config, name) if name in own else filler for name, filler in self._fillers.items()}

    # ---- enumeration and pruning ---------------------------------------------------------

    def size(self) -> int:
        return sum(member.size() for member in self.members.values())

    def grid(self) -> Iterator[Any]:
        return itertools.chain.from_iterable(member.grid() for member in self.members.values())

    def neighbours(self, config: Any) -> list[Any]:
        return self.member_of(config).neighbours(config)

    def fingerprint(self) -> list[str]:
        lines = [f"union on {self.discriminant}"]
        for path, member in self.members.items():
            lines += [f"{path}: {line}" for line in member.fingerprint()]
        return lines

    def infeasible_reason(self, config: Any, key: K, limits: TargetLimits) -> str | None:
        member = self.members.get(getattr(config, self.discriminant, None))  # type: ignore[arg-type]
        if member is None or not isinstance(config, member.config_type):
            return f"{config!r} is not a config of {self.kernel}"
        return member.infeasible_reason(config, key, limits)

    def feasible(self, key: K, limits: TargetLimits) -> list[Any]:
        return [c for c in self.grid() if self.infeasible_reason(c, key, limits) is None]


def _sortable(values: list[Value]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def nvidia_capability(arch: str) -> tuple[int, int] | None:
    """The compute capability a key's ``arch`` names: (9, 0) for "sm90", (12, 0) for "sm120";
    ``None`` for anything that is not an NVIDIA architecture ("gfx942", "cpu-interpreter")."""
    digits = arch.removeprefix("sm")
    if not arch.startswith("sm") or len(digits) < 2 or not digits.isdigit():
        return None
    return int(digits[:-1]), int(digits[-1])


def hopper_or_newer(arch: str) -> bool:
    """Whether a key's ``arch`` is an NVIDIA GPU of SM90 or later (TMA, tensor descriptors)."""
    capability = nvidia_capability(arch)
    return capability is not None and capability >= (9, 0)


def tile_smem_bytes(*tiles: tuple[int, int, int]) -> int:
    """Bytes of shared memory for tiles given as (rows, cols, element_bytes)."""
    return sum(r * c * b for r, c, b in tiles)


# ---- attention tiles ---------------------------------------------------------------------------


def padded_head_dim(head_dim: int) -> int:
    """The power of two a head dim is padded to inside the attention kernels."""
    return 1 << (max(head_dim, 16) - 1).bit_length()


def register_reason(block_m: int, block_n: int, head_dim_pad: int, num_warps: int, limit: int) -> str | None:
    """Why the fp32 accumulator ``[block_m, D]`` and score tile ``[block_m, block_n]`` would spill, or ``None``."""
    per_thread = (block_m * head_dim_pad + block_m * block_n) // (32 * num_warps)
    if per_thread > limit:
        return f"accumulator and scores take {per_thread} fp32 registers per thread (> {limit})"
    return None


def smem_reason(smem_bytes: int, limits: TargetLimits) -> str | None:
    """Why ``smem_bytes`` of shared memory per block do not fit the target, or ``None``."""
    if smem_bytes > limits.smem_bytes:
        return f"needs about {smem_bytes // 1024} KiB of shared memory (> {limits.smem_bytes // 1024} KiB)"
    return None


#: Shared memory a TMA build of the attention kernels holds beyond its tiles (mbarriers, and at
#: most 1,024 bytes in Triton 3.6's sm_90 builds with wgmma).
KV_TMA_EXTRA_SMEM = 1024


def attention_wgmma(block_m: int, num_warps: int) -> bool:
    """Whether Triton 3.6 builds the attention MMAs for sm_90 as wgmma (a warp group per 64 rows of
    the M tile), which takes P from registers; else as mma.sync, which stages P in shared memory."""
    return block_m % 64 == 0 and num_warps >= 4


def attention_smem_bytes(
    block_m: int, block_n: int, head_dim_pad: int, num_warps: int, num_stages: int, *, kv_tma: bool = False
) -> int:
    """Shared memory Triton 3.6 allocates for sm_90 (``metadata.shared``) to the attention kernels
    that load K/V tiles by pointers or, with ``kv_tma``, by TMA descriptors (decode, varlen), as
    fitted to their builds on 2026-12-05 (head dims 64/128, BLOCK_M 16-128, BLOCK_N 16-128, 1-4
    stages, 2-8 warps). With tiles Q ``[block_m, D]``, P ``[block_m, block_n]`` and one K or V tile
    ``[block_n, D]`` (bf16), a build holds:

    - with mma.sync (:func:`attention_wgmma` false): Q + P + ``2 (num_stages - 1)`` K/V tiles
      (one tile with a single stage); exact at 16- and 32-row M tiles;
    - with wgmma: Q + ``2 num_stages`` K/V tiles and no P (the pipeliner keeps one more K/V pair
      in flight for the asynchronous MMA); exact at 64-row M tiles, 4 warps;
    - with TMA loads: Q + P + ``2 num_stages`` K/V tiles (Q alone with wgmma) and
      :data:`KV_TMA_EXTRA_SMEM` for the barriers, within one K/V tile plus P above the builds;
    - at least the fp32 accumulator ``[block_m, D]``, which the epilogue converts through shared
      memory (what small tiles need).
    """
    tile = block_n * head_dim_pad * 2
    wgmma = attention_wgmma(block_m, num_warps)
    # mma.sync with pointer loads: num_stages - 1 K/V pairs in flight, K and V sharing one tile unpipelined.
    kv_tiles = 2 * num_stages if kv_tma or wgmma else max(2 * (num_stages - 1), 1)
    p_tile = 0 if wgmma else block_m * block_n * 2
    smem = block_m * head_dim_pad * 2 + p_tile + kv_tiles * tile
    if kv_tma:
        smem += KV_TMA_EXTRA_SMEM
    return max(smem, block_m * head_dim_pad * 4)


def pointer_attention_reason(
    block_m: int,
    block_n: int,
    head_dim_pad: int,
    num_warps: int,
    num_stages: int,
    limits: TargetLimits,
    *,
    max_registers: int,
    kv_tma: bool = False,
) -> str | None:
    """The resource rule of the attention kernels that load K/V tiles through pointers, or with
    ``kv_tma`` through TMA descriptors (decode, varlen).

    Every thread issues 16-byte loads of the KV tile and the accumulator and scores stay in
    registers; shared memory is :func:`attention_smem_bytes`, fitted to Triton 3.6's sm_90 builds.
    """
    threads = 32 * num_warps
    if block_n * head_dim_pad < 8 * threads:
        return f"a {block_n} x {head_dim_pad} KV tile leaves some of {threads} threads without a 16-byte load"
    reason = register_reason(block_m, block_n, head_dim_pad, num_warps, max_registers)
    if reason is not None:
        return reason
    smem = attention_smem_bytes(block_m, block_n, head_dim_pad, num_warps, num_stages, kv_tma=kv_tma)
    return smem_reason(smem, limits)
