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
from collections.abc import Callable, Iterator, Mapping
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
            raise ConfigError(
                f"{self.kernel}: a config must be a mapping of field names, got {type(values).__name__}"
            )
        unknown = sorted(set(values) - set(self.dimensions))
        if unknown:
            raise ConfigError(
                f"{self.kernel}: unknown config field(s) {unknown}; the space has {sorted(self.dimensions)}"
            )
        start = dataclasses.asdict(base if base is not None else self.default())  # type: ignore[call-overload]
        for name, value in values.items():
            options = self.dimensions[name]
            if not _same_kind(value, options[0]) or value not in options:
                raise ConfigError(
                    f"{self.kernel}: {name}={value!r} is not in the space; expected one of {options}"
                )
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


def pointer_attention_reason(
    block_m: int,
    block_n: int,
    head_dim_pad: int,
    num_warps: int,
    num_stages: int,
    limits: TargetLimits,
    *,
    max_registers: int,
) -> str | None:
    """The resource rule of the attention kernels that load K/V tiles through pointers (decode, varlen).

    Every thread issues 16-byte loads of the KV tile, the accumulator and scores stay in registers,
    and shared memory holds Q, K and V once per buffered stage and P staged for the second MMA.
    """
    threads = 32 * num_warps
    if block_n * head_dim_pad < 8 * threads:
        return f"a {block_n} x {head_dim_pad} KV tile leaves some of {threads} threads without a 16-byte load"
    reason = register_reason(block_m, block_n, head_dim_pad, num_warps, max_registers)
    if reason is not None:
        return reason
    # The pipeliner keeps num_stages - 1 K/V tiles in flight (checked against Triton 3.6's sm90 builds).
    buffers = max(num_stages - 1, 1)
    smem = tile_smem_bytes(
        (block_m, head_dim_pad, 2),  # Q
        (2 * buffers * block_n, head_dim_pad, 2),  # K and V, one copy per buffered stage
        (block_m, block_n, 2),  # P staged for the second MMA
    )
    return smem_reason(smem, limits)
