"""``use_config`` pins of prefill configs the space finds infeasible for a call give way to a stand-in.

The dispatcher serves only feasible winners and defaults; a pin reaches ``serve`` first (the
dispatcher's own check, which serves the portable default, acts only where ``serve`` keeps an
infeasible pin). On a GPU, a pinned ws, TMA or portable config that would not build (a ws ``BLOCK_M`` of 64), overflow
shared memory or spill is replaced, with the space's reason (which the pin's one warning quotes).
On the interpreter, whose limits bound only the tuner's sweep, a pin runs as given. CPU tier:
``serve`` on the facts of meta tensors, for an H200 and the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from tritune.kernels import dispatcher, pins
from tritune.kernels.device import DeviceInfo, interpreter_device
from tritune.kernels.prefill.kernel import KERNEL, pinned_config, tma_default
from tritune.search_spaces.tma_prefill import SPACE

H200 = DeviceInfo(name="NVIDIA H200", vendor="nvidia", capability=(9, 0), sm_count=132, arch="sm90")


def _facts(head_dim: int = 128, causal: bool = True):
    """A [1, 16, 4096, D] call over 16384 keys on meta tensors (nothing allocated)."""
    meta = torch.device("meta")
    q = torch.empty(1, 16, 4096, head_dim, dtype=torch.bfloat16, device=meta)
    k = torch.empty(1, 2, 16384, head_dim, dtype=torch.bfloat16, device=meta)
    return KERNEL.facts(q, k, k, causal=causal, kv_len=None, out=torch.empty_like(q))


# (pin, head dim, causal, words of the reason, the path that stands in)
INFEASIBLE = {
    "ws-block-m-64": ({"path": "ws", "BLOCK_M": 64}, 128, True, "BLOCK_M = 128", "tma"),
    "ws-block-m-64-noncausal": ({"path": "ws", "BLOCK_M": 64}, 128, False, "BLOCK_M = 128", "portable"),
    "ws-four-stages-d128": (
        {"path": "ws", "BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 4},
        128,
        True,
        "shared memory",
        "tma",
    ),
    "tma-block-m-32": ({"path": "tma", "BLOCK_M": 32}, 128, True, "BLOCK_M >= 64", "tma"),
    "tma-four-stages-d128": ({"path": "tma", "BLOCK_N": 128, "num_stages": 4}, 128, True, "shared memory", "tma"),
    "tma-wide-n-d256": ({"path": "tma", "BLOCK_N": 128, "num_stages": 2}, 256, True, "BLOCK_N <= 64", "tma"),
    "portable-spills-d128": ({"BLOCK_M": 128, "BLOCK_N": 128}, 128, True, "registers", "portable"),
}


@pytest.mark.parametrize("pin, head_dim, causal, reason, stand_in", list(INFEASIBLE.values()), ids=list(INFEASIBLE))
def test_an_infeasible_pin_gives_way_with_the_spaces_reason(pin, head_dim, causal, reason, stand_in):
    f = _facts(head_dim, causal)
    config = pinned_config(pin)
    key = KERNEL.key_for(H200, tuple(f))
    limits = KERNEL.limits(H200)
    assert SPACE.infeasible_reason(config, key, limits) is not None
    served, why = KERNEL.serve_with_reason(config, H200, tuple(f))
    assert served != config
    assert why is not None and reason in why, why
    assert served.path == stand_in, served
    assert SPACE.infeasible_reason(served, key, limits) is None, served


def test_an_infeasible_tma_pin_gets_the_tma_default():
    f = _facts()
    served = KERNEL.serveable(pinned_config({"path": "tma", "BLOCK_M": 32}), H200, tuple(f))
    assert served == tma_default(KERNEL.key_for(H200, tuple(f)))


def test_feasible_pins_serve_as_given():
    f = _facts()
    for pin in ({"path": "ws", "BLOCK_N": 64, "num_stages": 3}, {"path": "tma"}, {"BLOCK_M": 64, "BLOCK_N": 64}):
        config = pinned_config(pin)
        assert KERNEL.serve_with_reason(config, H200, tuple(f)) == (config, None)


def test_pins_run_as_given_on_the_interpreter():
    """The interpreter's limits (tiles of at most 32, 4 warps, 2 stages) bound the tuner's sweep: a
    pin outside them runs, so that the CPU tier can pin the TMA path with its defaults' warps."""
    device = interpreter_device()
    f = _facts(64)
    for pin in ({"path": "tma", "BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8}):
        config = pinned_config(pin)
        assert SPACE.infeasible_reason(config, KERNEL.key_for(device, tuple(f)), KERNEL.limits(device)) is not None
        assert KERNEL.serveable(config, device, tuple(f)) is config


def test_a_pin_through_the_dispatcher_gets_the_kernels_own_stand_in(monkeypatch):
    """``use_config`` on a GPU: the ws pin of BLOCK_M=64 gets prefill's stand-in (the TMA default),
    not the dispatcher's generic portable default."""
    monkeypatch.setattr(dispatcher, "device_info", lambda where: H200)
    dispatcher.DISPATCHER.clear()
    f = _facts()
    try:
        with pins.use_config("tma_prefill", {"path": "ws", "BLOCK_M": 64}):
            served = dispatcher.dispatch_config("tma_prefill", "cuda", 0, tuple(f))
    finally:
        dispatcher.DISPATCHER.clear()
    assert served == tma_default(KERNEL.key_for(H200, tuple(f)))
