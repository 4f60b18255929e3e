"""Online tuning's per-process state: what a forked child keeps of its parent's stop."""

from __future__ import annotations

import pytest
from test_jit import online  # noqa: F401

from tritune.kernels import jit


def test_a_forked_child_tunes_again_after_its_parents_worker_stopped(monkeypatch):
    monkeypatch.setattr(jit.ONLINE, "stopped", "online tuning worker died with exit code -9 (SIGKILL)")
    jit.ONLINE.after_fork()
    assert jit.ONLINE.stopped is None


def test_a_forked_child_keeps_the_stop_of_a_missing_tuner(monkeypatch):
    monkeypatch.setattr("tritune.kernels.jit._tuner_missing", lambda: ["optuna"])
    from test_jit import _served

    from tritune.kernels import settings

    with settings.override(jit="background"):
        _served(200)
    assert jit.ONLINE.stopped is not None
    jit.ONLINE.after_fork()
    assert jit.ONLINE.stopped is not None and "tune extra" in jit.ONLINE.stopped


def test_a_choice_put_off_under_a_dispatch_mode_is_resolved_once_and_tuned_at_the_next_eager_call(monkeypatch):
    import torch
    from test_jit import SPEC, _served
    from torch.utils._python_dispatch import TorchDispatchMode

    from tritune.kernels import misses, settings
    from tritune.kernels.dispatcher import dispatch_config

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    noted = []
    monkeypatch.setattr(misses, "note", lambda spec, device, key: noted.append(key))
    facts = tuple(SPEC.facts(torch.randn(200)))
    with settings.override(jit="sync", jit_trials=2):
        with Passthrough():
            for _ in range(20):
                dispatch_config("toy_scale", "cpu", -1, facts)
        assert len(noted) == 1, "the put-off choice is reused while no call could tune"
        assert not jit.ONLINE.attempted
        _served(200)
        assert len(jit.ONLINE.attempted) == 1, "the next eager call tunes the key"


def test_an_override_outside_a_settings_values_is_refused_naming_them():
    import pytest

    from tritune.kernels import settings

    with (
        pytest.raises(ValueError, match=r"jit='Background': expected off, sync or background"),
        settings.override(jit="Background"),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"cross_gpu='on': expected off, seed or serve"),
        settings.override(cross_gpu="on"),
    ):
        pass
    assert settings.settings().jit == "off"


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_nothing_is_tuned_inside_a_torch_func_transform(transform):
    import torch
    from test_jit import SPEC

    from tritune.kernels import settings
    from tritune.kernels.dispatcher import dispatch_config

    facts = tuple(SPEC.facts(torch.randn(200)))

    def body(x):
        dispatch_config("toy_scale", "cpu", -1, facts)
        return x * 2

    with settings.override(jit="sync", jit_trials=2):
        if transform == "vmap":
            torch.func.vmap(body)(torch.randn(3, 4))
        else:
            torch.func.grad(lambda x: body(x).sum())(torch.randn(4))
        assert not jit.ONLINE.attempted
