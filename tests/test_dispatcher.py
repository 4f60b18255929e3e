"""Dispatcher lookup order on a small real kernel: exact, nearest bucket, margin, pinned, fallback."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import toy_kernel
import triton
from toy_records import offer

from tritune.configs_db.records import WinnerRecord
from tritune.configs_db.store import ConfigStore
from tritune.kernels import dispatcher, pins, settings
from tritune.kernels.device import device_info
from tritune.kernels.dispatcher import DISPATCHER, dispatch_config
from tritune.kernels.pins import use_config
from tritune.search_spaces.base import ConfigError

CPU = device_info("cpu")


pytestmark = pytest.mark.usefixtures("toy_dispatch")


def _winner(n_bucket: int, chosen: dict, speedup: float, **overrides) -> WinnerRecord:
    spec = toy_kernel.SPEC
    key = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float32", n_bucket)
    fields = dict(
        kernel=spec.name,
        kernel_version=spec.version,
        gpu=CPU.slug,
        key=key.to_dict(),
        config=chosen,
        time_ms=1.0,
        portable_ms=speedup,
        speedup=speedup,
        trials=5,
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        tritune_version="test",
    )
    fields.update(overrides)
    return WinnerRecord(**fields)


def _store(*records: WinnerRecord) -> None:
    store = ConfigStore(settings.settings().db_url)
    for record in records:
        # Provenance is stamped from the environment row, so each record gets a matching one.
        assert offer(store, record)


def _served(n: int, dtype: torch.dtype = torch.float32) -> dict:
    spec = toy_kernel.SPEC
    x = torch.randn(n).to(dtype)
    config = dispatch_config("toy_scale", "cpu", -1, tuple(spec.facts(x)))
    return spec.space.to_dict(config)


def test_portable_default_without_winners():
    assert _served(100) == {"BLOCK": 32, "BROKEN": False, "num_warps": 4}


def test_exact_winner_served_when_it_clears_the_margin():
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    assert _served(100)["BLOCK"] == 64


def test_exact_winner_below_margin_serves_portable_not_a_neighbour():
    _store(
        _winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.01),
        _winner(256, {"BLOCK": 128, "BROKEN": False, "num_warps": 4}, speedup=2.0),
    )
    assert _served(100)["BLOCK"] == 32


def test_margin_setting_changes_the_rule():
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.05))
    assert _served(100)["BLOCK"] == 64
    with settings.override(margin=0.10):
        assert _served(100)["BLOCK"] == 32


def test_nearest_bucket_in_the_same_group():
    _store(
        _winner(256, {"BLOCK": 16, "BROKEN": False, "num_warps": 1}, speedup=1.2),
        _winner(1024, {"BLOCK": 128, "BROKEN": False, "num_warps": 4}, speedup=1.9),
    )
    # 300 -> bucket 512: log2 distance 1 to 256, 1 to 1024: tie broken by the larger speedup.
    assert _served(300)["BLOCK"] == 128
    # 200 -> bucket 256: exact.
    assert _served(200)["BLOCK"] == 16
    # 100 -> bucket 128: distance 1 to 256, 3 to 1024.
    assert _served(100)["BLOCK"] == 16


def test_a_no_gain_bucket_as_near_as_the_lender_keeps_the_portable_default():
    _store(
        _winner(256, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.01),
        _winner(1024, {"BLOCK": 128, "BROKEN": False, "num_warps": 4}, speedup=1.9),
    )
    # 300 -> bucket 512: distance 1 to both; 256's tune found the portable default as good.
    assert _served(300)["BLOCK"] == 32
    # 600 -> bucket 1024: exact, served whatever its neighbours say.
    assert _served(600)["BLOCK"] == 128


def test_a_farther_no_gain_bucket_does_not_block_the_nearest_lender():
    _store(
        _winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5),
        _winner(1024, {"BLOCK": 128, "BROKEN": False, "num_warps": 4}, speedup=1.01),
    )
    # 200 -> bucket 256: distance 1 to the lender at 128, 2 to the no-gain bucket 1024.
    assert _served(200)["BLOCK"] == 64


def test_far_buckets_never_lend():
    """A winner more than a factor of 4 away is not borrowed: the portable default serves."""
    _store(_winner(4096, {"BLOCK": 128, "BROKEN": False, "num_warps": 4}, speedup=1.9))
    assert dispatcher.NEAREST_MAX_LOG2 == 2.0
    assert _served(1024)["BLOCK"] == 128  # bucket 1024: distance 2
    assert _served(300)["BLOCK"] == 32  # bucket 512: distance 3


def test_other_group_never_borrows():
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    assert _served(100, torch.float64)["BLOCK"] == 32


@pytest.fixture
def float32_fallback(monkeypatch):
    """Keys of other dtypes fall back to the float32 key (as Q4_K's opt-in keys to the accurate ones)."""
    monkeypatch.setattr(
        toy_kernel.SPEC,
        "fallback_key",
        lambda key: dataclasses.replace(key, dtype="float32") if key.dtype != "float32" else None,
    )


def test_a_key_without_a_winner_serves_its_fallback_keys_winner(float32_fallback):
    """float16 calls fall back to the float32 key's winner (a stricter contract) when they have none."""
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    assert _served(100, torch.float16)["BLOCK"] == 64
    with settings.override(disable_tuned=True):
        assert _served(100, torch.float16)["BLOCK"] == 32


@pytest.mark.parametrize(("speedup", "served"), [(1.5, 16), (1.01, 32)], ids=["own-winner", "own-default"])
def test_a_key_with_its_own_winner_ignores_the_fallback(float32_fallback, speedup, served):
    """A key with a winner of its own never serves the fallback key's: its winner where that clears
    the margin, else its own default (the fallback's speedup was measured against another default)."""
    half_key = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float16", 128).to_dict()
    _store(
        _winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5),
        _winner(128, {"BLOCK": 16, "BROKEN": False, "num_warps": 1}, speedup=speedup, key=half_key),
    )
    assert _served(100, torch.float16)["BLOCK"] == served
    assert _served(100)["BLOCK"] == 64


def test_a_fallback_winner_measured_against_another_default_does_not_serve(float32_fallback, monkeypatch):
    """Where the key's portable default differs from the fallback key's (as Q4_K's staged default
    under the opt-in), the fallback key's winner, timed against its own default, does not serve."""
    spec = toy_kernel.SPEC
    own_default = spec.default_config

    def default_config(key):
        return dataclasses.replace(own_default(key), BLOCK=128) if key.dtype == "float16" else own_default(key)

    monkeypatch.setattr(spec, "default_config", default_config)
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    assert _served(100, torch.float16)["BLOCK"] == 128
    assert _served(100)["BLOCK"] == 64


def test_the_fallback_keys_portable_default_never_serves_for_a_key(float32_fallback, monkeypatch, caplog):
    """With no winner at the fallback key either, the key's own portable default serves, logged for the key."""
    spec = toy_kernel.SPEC
    # A key-dependent portable default: the float32 key's would be BLOCK=64.
    own_default = spec.default_config

    def default_config(key):
        return dataclasses.replace(own_default(key), BLOCK=64) if key.dtype == "float32" else own_default(key)

    monkeypatch.setattr(spec, "default_config", default_config)
    with caplog.at_level(logging.INFO, logger="tritune.dispatch"):
        assert _served(100, torch.float16)["BLOCK"] == 32
    half = toy_kernel.ToyKey(CPU.arch, CPU.sm_count, "float16", 128)
    assert any("portable default serves" in r.getMessage() and str(half) in r.getMessage() for r in caplog.records)


def test_pinned_config_wins_and_fills_defaults():
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    with use_config("toy_scale", {"BLOCK": 16}) as pinned:
        assert pinned == toy_kernel.ToyConfig(BLOCK=16)
        assert _served(100) == {"BLOCK": 16, "BROKEN": False, "num_warps": 4}
    assert _served(100)["BLOCK"] == 64


@pytest.mark.parametrize(
    "config, match",
    [
        ({"BLOCK": 48}, "BLOCK=48 is not in the space"),
        ({"BLOCK": "64"}, "BLOCK='64' is not in the space"),
        ({"BROKEN": 1}, "BROKEN=1 is not in the space"),
        ({"TILE": 16}, "unknown config field"),
        ([("BLOCK", 16)], "must be a mapping"),
        ({"BLOCK": [16]}, r"BLOCK=\[16\] is not in the space"),
    ],
    ids=["value", "type", "int-for-bool", "unknown-field", "not-a-mapping", "unhashable"],
)
def test_pinned_config_outside_space_refused(config, match):
    with pytest.raises(ConfigError, match=match), use_config("toy_scale", config):
        pass


def test_unknown_kernel_refused():
    with pytest.raises(KeyError, match="unknown kernel 'nope'"), use_config("nope", {}):
        pass


def test_disable_tuned():
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    with settings.override(disable_tuned=True):
        assert _served(100)["BLOCK"] == 32


def test_fallback_logged_once_per_key(caplog):
    caplog.set_level(logging.INFO, logger="tritune.dispatch")
    for _ in range(5):
        _served(100)
    messages = [r.getMessage() for r in caplog.records if "portable default serves" in r.getMessage()]
    assert len(messages) == 1


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ({"kernel_version": "0123456789abcdef"}, "stale kernel version"),
        ({"config": {"BLOCK": 48, "BROKEN": False, "num_warps": 2}}, "outside the search space"),
        ({"key": {"arch": "sm90", "sm_count": 132, "dtype": "float32", "n_bucket": 128}}, "not this GPU"),
        ({"key": {"arch": "cpu-interpreter", "dtype": "float32", "n_bucket": 128}}, "malformed key"),
        ({"kernel": "gone_kernel"}, "unknown kernel"),
    ],
    ids=["stale-kernel", "config-outside-space", "key-other-gpu", "key-missing", "unknown-kernel"],
)
def test_refused_records_log_reason_and_portable_serves(caplog, overrides, reason):
    caplog.set_level(logging.WARNING, logger="tritune.dispatch")
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5, **overrides))
    assert _served(100)["BLOCK"] == 32
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_served_config_computes_the_right_thing():
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    spec = toy_kernel.SPEC
    x = torch.randn(100)
    config = dispatch_config("toy_scale", "cpu", -1, tuple(spec.facts(x)))
    out = torch.full_like(x, float("nan"))
    spec.launch(config, x, alpha=3.0, out=out)
    torch.testing.assert_close(out, x * 3.0)


def test_winner_of_another_gpu_in_the_db_is_not_served():
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5, gpu="nvidia-h200-sm90-132sm"))
    assert _served(100)["BLOCK"] == 32


# ---- the memo (the steady-state hit) and dispatch_eager, its eager entry -----------------------


def _served_eager(n: int) -> dict:
    spec = toy_kernel.SPEC
    config = dispatcher.dispatch_config_eager("toy_scale", torch.device("cpu"), tuple(spec.facts(torch.randn(n))))
    return spec.space.to_dict(config)


def test_dispatch_eager_serves_from_the_memo_that_dispatch_fills():
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    assert _served_eager(100)["BLOCK"] == 64
    facts = tuple(toy_kernel.SPEC.facts(torch.randn(100)))
    assert DISPATCHER._memo[("toy_scale", "cpu", -1, facts)] == toy_kernel.ToyConfig(64, False, 2)
    # A memo entry is what both entries serve: plant one and both return it.
    DISPATCHER._memo[("toy_scale", "cpu", -1, facts)] = toy_kernel.ToyConfig(16, False, 1)
    assert _served_eager(100)["BLOCK"] == 16
    assert _served(100)["BLOCK"] == 16


def test_pinned_config_overrides_a_memoised_choice():
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    assert _served_eager(100)["BLOCK"] == 64
    with use_config("toy_scale", {"BLOCK": 16}):
        assert _served_eager(100)["BLOCK"] == 16
        assert _served(100)["BLOCK"] == 16
    assert _served_eager(100)["BLOCK"] == 64


def test_pinned_choice_is_memoised_under_its_pin(monkeypatch):
    """A second pinned call with the same facts is a memo hit (no resolution, the pin parsed once),
    and the pinned and unpinned choices of the same facts are kept apart."""
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    resolved, parsed = [], []
    choose, parse = DISPATCHER.choose, toy_kernel.SPEC.pinned_config
    monkeypatch.setattr(DISPATCHER, "choose", lambda *args: resolved.append(args) or choose(*args))
    monkeypatch.setattr(toy_kernel.SPEC, "pinned_config", lambda values: parsed.append(values) or parse(values))
    monkeypatch.setattr(pins, "_parsed_pins", {})
    for _ in range(2):  # a pin entered around every call: parsed once, resolved once
        with use_config("toy_scale", {"BLOCK": 16}):
            assert _served_eager(100)["BLOCK"] == 16
    with use_config("toy_scale", {"BLOCK": 16}):
        assert _served(100)["BLOCK"] == 16
    assert len(resolved) == 1 and len(parsed) == 1
    assert _served_eager(100)["BLOCK"] == 64
    with use_config("toy_scale", {"BLOCK": 128, "num_warps": 2}):
        assert _served_eager(100)["BLOCK"] == 128
    assert len(resolved) == 3
    assert _served_eager(100)["BLOCK"] == 64
    assert len(resolved) == 3


@pytest.mark.parametrize(
    "odd", [{"BLOCK": 16.0, "BROKEN": False}, {"BLOCK": 16, "BROKEN": 0}], ids=["float", "int-for-bool"]
)
def test_a_cached_pin_does_not_let_an_equal_value_of_another_type_through(odd):
    """16.0 and 0 hash like 16 and False: the parsed-pin cache must not hand them the parse of those."""
    with use_config("toy_scale", {"BLOCK": 16, "BROKEN": False}):
        pass
    with pytest.raises(ConfigError), use_config("toy_scale", odd):
        pass


def test_reload_configs_drops_memoised_choices():
    assert _served_eager(100)["BLOCK"] == 32
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    # The memo (and the loaded table) still serve what was resolved before the winner was stored.
    assert _served_eager(100)["BLOCK"] == 32
    dispatcher.reload_configs()
    assert _served_eager(100)["BLOCK"] == 64


@pytest.mark.parametrize("change", [{"margin": 0.6}, {"disable_tuned": True}], ids=["margin", "disable-tuned"])
def test_settings_changes_drop_memoised_choices(change):
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    assert _served_eager(100)["BLOCK"] == 64
    with settings.override(**change):
        assert _served_eager(100)["BLOCK"] == 32
    assert _served_eager(100)["BLOCK"] == 64


def test_resolution_started_before_a_clear_is_not_memoised():
    facts = tuple(toy_kernel.SPEC.facts(torch.randn(100)))
    generation = DISPATCHER.generation
    DISPATCHER.clear()
    DISPATCHER.memo_put(("toy_scale", "cpu", -1, facts), (16, False, 1), generation)
    assert ("toy_scale", "cpu", -1, facts) not in DISPATCHER._memo
    assert _served_eager(100)["BLOCK"] == 32


def test_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(dispatcher, "MEMO_LIMIT", 3)
    for n in (1, 2, 3, 4, 5):
        _served_eager(n)
    assert 0 < len(DISPATCHER._memo) <= 3
    assert _served_eager(5)["BLOCK"] == 32


# ---- what a serving process survives ------------------------------------------------------------


@pytest.mark.parametrize(
    "name, raw",
    [
        ("TRITUNE_MARGIN", "abc"),
        ("TRITUNE_DISABLE_TUNED", "yes please"),
        ("TRITUNE_ENABLE_TMA_CAUSAL_PREFILL", "auto-ish"),
        ("TRITUNE_LOG_LEVEL", "chatty"),
    ],
)
def test_a_typo_in_a_setting_never_fails_a_kernel_call(monkeypatch, caplog, name, raw):
    monkeypatch.setattr(settings, "_warned", set(), raising=False)
    caplog.set_level(logging.WARNING, logger="tritune")
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5))
    monkeypatch.setenv(name, raw)
    settings.reload()
    for _ in range(3):
        assert _served(100)["BLOCK"] == 64
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(messages) == 1 and messages[0].startswith(f"{name}='{raw}'"), messages


def test_refusals_of_stored_records_are_escaped(caplog):
    caplog.set_level(logging.WARNING, logger="tritune.dispatch")
    _store(_winner(128, {"BLOCK": 64, "BROKEN": False, "num_warps": 2}, speedup=1.5, kernel="gone\nCRITICAL \x1b[31m"))
    assert _served(100)["BLOCK"] == 32
    (message,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert message.isprintable() and "gone\\nCRITICAL \\x1b[31m: unknown kernel" in message


# ---- a pin that cannot serve --------------------------------------------------------------------


@pytest.mark.parametrize("reason", [None, "BLOCK=16 needs a feature this device lacks"], ids=["no-reason", "reason"])
def test_a_replaced_pin_is_one_warning_naming_the_reason(monkeypatch, caplog, reason):
    """A pin the spec's serve hook replaces gets one warning line per (pin, stand-in), with the
    hook's reason where it gives one (``KernelSpec.serve_with_reason``), however many calls."""
    spec = toy_kernel.SPEC
    stand_in = toy_kernel.ToyConfig(64, False, 2)

    def serve_with_reason(config, device, facts):
        return (stand_in, reason) if config.BLOCK == 16 else (config, None)

    monkeypatch.setattr(spec, "serve_with_reason", serve_with_reason)
    monkeypatch.setattr(pins, "_rewritten_pins", set())
    caplog.set_level(logging.WARNING, logger="tritune")
    with use_config("toy_scale", {"BLOCK": 16}) as pinned:
        assert [_served(n)["BLOCK"] for n in (100, 100, 3000)] == [64, 64, 64]
    with use_config("toy_scale", {"BLOCK": 32}):
        assert _served(100)["BLOCK"] == 32
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"toy_scale: pinned config {pinned} cannot serve this call"), message
    assert message.endswith(f"; serving {stand_in} instead"), message
    assert (f"({reason})" in message) == (reason is not None), message


def _q4k_winner(n: int, k: int, chosen: dict) -> WinnerRecord:
    from tritune.kernels.q4k.kernel import Q4KKey
    from tritune.kernels.registry import get_spec

    spec = get_spec("q4k_fp8_gemm")
    key = Q4KKey(CPU.arch, CPU.sm_count, "bfloat16", m_bucket=1, n=n, k=k, fp8=False)
    return dataclasses.replace(_winner(128, chosen, speedup=1.5), kernel=spec.name, kernel_version=spec.version,
                               key=key.to_dict())  # fmt: skip


def _q4k_served(n: int, k: int) -> dict:
    from tritune.kernels import Q4KWeight
    from tritune.kernels.registry import get_spec

    spec = get_spec("q4k_fp8_gemm")
    facts = spec.facts(torch.randn(1, k, dtype=torch.bfloat16), Q4KWeight.quantize(torch.randn(n, k) * 0.02))
    return spec.space.to_dict(dispatch_config(spec.name, "cpu", -1, tuple(facts)))


def test_a_weight_shape_nobody_tuned_borrows_the_nearest_tuned_shapes_winner():
    """Q4_K's N and K are ``NEAR`` fields: a fused projection (N three halves of a tuned one) gets
    the tuned shape's config; a shape more than a factor of 4 away in all keeps the portable default."""
    tuned = {"path": "portable", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 2,
             "num_stages": 1, "SPLIT_K": 1}  # fmt: skip
    _store(_q4k_winner(128, 256, tuned))
    default = _q4k_served(32, 1024)
    assert default != tuned, "N 4x and K 4x away: too far to borrow"
    assert _q4k_served(128, 256) == tuned  # exact
    assert _q4k_served(192, 256) == tuned  # N 1.5x
    assert _q4k_served(64, 512) == tuned  # N and K 2x: distance 2
    assert _q4k_served(64, 1024) == default  # distance 3


def test_a_pin_the_rule_finds_infeasible_on_a_gpu_gives_way_to_the_portable_default(monkeypatch, caplog):
    """On a GPU, a pin the space's rule refuses at the call's key would not build or would compute
    garbage: the portable default serves, and the warning names the rule's reason. On the
    interpreter (whose rules bound only the sweep) the same pin runs as given."""
    h200 = dataclasses.replace(CPU, name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")
    infeasible = {"BLOCK": 128, "num_warps": 1}
    with use_config("toy_scale", infeasible):
        assert _served(100)["BLOCK"] == 128
    monkeypatch.setattr(dispatcher, "device_info", lambda where: h200)
    DISPATCHER.clear()  # the CPU tensors' memo entry was the interpreter's choice
    with caplog.at_level(logging.WARNING, logger="tritune"), use_config("toy_scale", infeasible):
        assert _served(100) == {"BLOCK": 32, "BROKEN": False, "num_warps": 4}
    assert "too many elements per thread" in caplog.text
    with use_config("toy_scale", {"BLOCK": 128, "num_warps": 2}):
        assert _served(100)["BLOCK"] == 128
