"""``tune --key FIELD=VALUES``: default keys with fields replaced by name, aliases, and usage errors."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest
import toy_kernel
import typer

from tritune.kernels.device import interpreter_device
from tritune.kernels.spec import TuningKey
from tritune.tuner.keys import KeyPlan, describe_key, parse_overrides

CPU = interpreter_device()
TOY = toy_kernel.SPEC


@dataclasses.dataclass(frozen=True)
class FlagKey(TuningKey):
    dtype: str
    causal: bool


class FlagSpec:
    """A kernel whose key has no length: options about lengths leave it alone."""

    name = "flags"
    key_type = FlagKey

    def default_keys(self, device: Any) -> list[FlagKey]:
        return [FlagKey(device.arch, device.sm_count, "float32", True)]


def keys(*entries: str, specs: tuple[Any, ...] = (TOY,), **options: list[int]) -> list[list[TuningKey]]:
    plan = KeyPlan(list(specs), parse_overrides(list(entries), options))
    return [plan.keys(spec, CPU) for spec in specs]


def test_without_overrides_the_default_keys_are_tuned():
    assert keys() == [TOY.default_keys(CPU)]


def test_a_field_replaced_in_every_default_key_is_tuned_once():
    (found,) = keys("n_bucket=512")
    assert [key.n_bucket for key in found] == [512]


def test_several_fields_give_every_combination():
    (found,) = keys("n_bucket=64,128", "dtype=float16,bfloat16")
    assert sorted((key.dtype, key.n_bucket) for key in found) == [
        ("bfloat16", 64), ("bfloat16", 128), ("float16", 64), ("float16", 128),
    ]  # fmt: skip


def test_an_alias_of_the_tuning_half_names_a_field_through_its_transform():
    (found,) = keys("n=100,120")
    assert [key.n_bucket for key in found] == [128]


def test_the_older_options_are_aliases_and_merge_with_key():
    (found,) = keys("n_bucket=1024", n=[100])
    assert sorted(key.n_bucket for key in found) == [128, 1024]


def test_keys_the_tuning_half_refuses_are_dropped():
    (found,) = keys("n_bucket=8,32")
    assert [key.n_bucket for key in found] == [32]
    with pytest.raises(typer.BadParameter, match="no key of toy_scale remains valid"):
        keys("dtype=int8")


def test_a_bool_field_reads_true_and_false():
    (found,) = keys("causal=false", specs=(FlagSpec(),))
    assert [key.causal for key in found] == [False]


def test_a_name_one_kernel_lacks_leaves_its_keys_alone():
    toy, flags = keys("n=512", specs=(TOY, FlagSpec()))
    assert [key.n_bucket for key in toy] == [512]
    assert flags == FlagSpec().default_keys(CPU)


FIELDS = "dtype (str), n_bucket (int); aliases: n -> n_bucket"


@pytest.mark.parametrize(
    ("entries", "options", "message"),
    [
        (["head_dim=64"], {}, f"--key head_dim=64: no kernel tuned has a key field or alias 'head_dim' "
                              f"(toy_scale: {FIELDS})"),
        (["n_bucket=big"], {}, f"--key n_bucket=big: 'big' is not an int (n_bucket of toy_scale's key; "
                               f"its fields: {FIELDS})"),
        (["arch=sm90"], {}, "--key arch=sm90: arch comes from --device, not from --key"),
        (["n_bucket"], {}, "'n_bucket': expected FIELD=VALUE[,VALUE...]"),
        (["n_bucket="], {}, "'n_bucket=': expected FIELD=VALUE[,VALUE...]"),
        ([], {"lq": [64]}, "--lq does not apply to kernel toy_scale"),
    ],
    ids=["unknown-field", "bad-value", "device-field", "no-values", "empty-values", "older-option"],
)  # fmt: skip
def test_usage_errors_name_the_field_and_list_the_keys_fields(entries, options, message):
    with pytest.raises(typer.BadParameter) as caught:
        keys(*entries, **options)
    assert message in str(caught.value)


def test_the_key_description_lists_fields_and_aliases():
    assert describe_key(TOY) == "dtype (str), n_bucket (int); aliases: n -> n_bucket"
    assert describe_key(FlagSpec()) == "dtype (str), causal (bool)"


class _Aliased(FlagSpec):
    key_aliases: ClassVar[dict[str, Any]] = {"dt": ("dtype", str.upper)}


def test_an_alias_with_a_non_int_transform_reads_ints_only():
    with pytest.raises(typer.BadParameter, match="'fp16' is not an int"):
        keys("dt=fp16", specs=(_Aliased(),))
