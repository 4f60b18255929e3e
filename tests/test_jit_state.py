"""Online tuning's per-process state: what a forked child keeps of its parent's stop."""

from __future__ import annotations

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
