"""UnionSpace: a config holds only its path's fields; proposals, pins and stored configs agree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tritune.kernels.versioning import space_fingerprint
from tritune.search_spaces.base import (
    ConfigError,
    SearchSpace,
    TargetLimits,
    UnionSpace,
    choice,
    hopper_or_newer,
    nvidia_capability,
)


@dataclass(frozen=True)
class Tiled:
    path: str = choice("tiled", ("tiled",))
    BLOCK_M: int = choice(64, (32, 64, 128))
    num_warps: int = choice(4, (4, 8))


@dataclass(frozen=True)
class Vector:
    path: str = choice("vector", ("vector",))
    BLOCK_N: int = choice(256, (128, 256, 512))
    num_warps: int = choice(2, (1, 2, 4))


@dataclass(frozen=True)
class Key:
    m: int


def _no_big_tiles_for_small_m(config: Tiled, key: Key, limits: TargetLimits) -> str | None:
    return "BLOCK_M exceeds M" if key.m < config.BLOCK_M else None


SPACE = UnionSpace(
    "toy",
    "path",
    [SearchSpace("toy", Tiled, feasibility=_no_big_tiles_for_small_m), SearchSpace("toy", Vector)],
)


def test_dimensions_are_the_union_of_the_members_choices():
    assert SPACE.dimensions == {
        "path": ("tiled", "vector"),
        "BLOCK_M": (32, 64, 128),
        "num_warps": (1, 2, 4, 8),
        "BLOCK_N": (128, 256, 512),
    }
    assert SPACE.size() == 3 * 2 + 3 * 3
    assert len(list(SPACE.grid())) == SPACE.size()


def test_parse_builds_the_named_member_and_refuses_foreign_fields():
    assert SPACE.parse({}) == Tiled()
    assert SPACE.parse({"path": "vector", "BLOCK_N": 512}) == Vector(BLOCK_N=512)
    with pytest.raises(ConfigError, match=r"path='vector' has no field\(s\) \['BLOCK_M'\]"):
        SPACE.parse({"path": "vector", "BLOCK_M": 64})
    with pytest.raises(ConfigError, match=r"path='sparse' is not in the space"):
        SPACE.parse({"path": "sparse"})
    with pytest.raises(ConfigError, match=r"num_warps=8 is not in the space"):
        SPACE.parse({"path": "vector", "num_warps": 8})


def test_a_base_of_another_member_does_not_leak_its_fields():
    assert SPACE.parse({"path": "vector"}, base=Tiled(BLOCK_M=128)) == Vector()
    assert SPACE.parse({"num_warps": 8}, base=Tiled(BLOCK_M=128)) == Tiled(BLOCK_M=128, num_warps=8)


def test_a_proposal_keeps_its_paths_fields_and_equal_launches_are_equal_configs():
    one = SPACE.from_proposal({"path": "vector", "BLOCK_M": 32, "num_warps": 4, "BLOCK_N": 128})
    two = SPACE.from_proposal({"path": "vector", "BLOCK_M": 128, "num_warps": 4, "BLOCK_N": 128})
    assert one == two == Vector(BLOCK_N=128, num_warps=4)
    with pytest.raises(ConfigError):
        SPACE.from_proposal({"path": "vector", "BLOCK_M": 32, "num_warps": 8, "BLOCK_N": 128})


def test_op_fields_round_trip_with_fillers_for_absent_fields():
    fields = SPACE.field_values(Vector(BLOCK_N=512))
    assert set(fields) == set(SPACE.dimensions)
    assert SPACE.from_fields(fields) == Vector(BLOCK_N=512)
    assert SPACE.field_types == {"path": str, "BLOCK_M": int, "num_warps": int, "BLOCK_N": int}


def test_feasibility_and_neighbours_are_the_members():
    limits = TargetLimits()
    assert SPACE.infeasible_reason(Tiled(BLOCK_M=128), Key(64), limits) == "BLOCK_M exceeds M"
    assert SPACE.infeasible_reason(Vector(), Key(1), limits) is None
    assert set(SPACE.neighbours(Vector())) == {Vector(BLOCK_N=128), Vector(BLOCK_N=512), Vector(num_warps=1),
                                               Vector(num_warps=4)}  # fmt: skip
    assert Tiled(BLOCK_M=128) not in SPACE.feasible(Key(64), limits)


def test_members_must_declare_their_discriminant_first():
    @dataclass(frozen=True)
    class Loose:
        BLOCK: int = choice(1, (1, 2))

    with pytest.raises(TypeError, match="must start with a field 'path'"):
        UnionSpace("toy", "path", [SearchSpace("toy", Loose)])


def test_the_fingerprint_sees_each_members_structure():
    def fingerprint(space: Any) -> str:
        return space_fingerprint(space, Key)

    wider = UnionSpace("toy", "path", [SearchSpace("toy", Tiled), SearchSpace("toy", Vector)])
    assert fingerprint(wider) != fingerprint(SPACE)  # the tiled member lost its rule


@pytest.mark.parametrize(
    ("arch", "capability", "hopper"),
    [
        ("sm61", (6, 1), False),
        ("sm90", (9, 0), True),
        ("sm120", (12, 0), True),
        ("sm9", None, False),
        ("gfx942", None, False),
        ("cpu-interpreter", None, False),
        ("smx0", None, False),
    ],
)
def test_the_capability_a_key_arch_names(arch, capability, hopper):
    """The spaces' rules read a key's ``arch`` through one parser: NVIDIA's "sm<major><minor>" only."""
    assert nvidia_capability(arch) == capability
    assert hopper_or_newer(arch) is hopper
