"""Each built-in kernel's peer (the PyTorch call a user would make instead) computes the kernel's function.

On the interpreter's tiny problems every peer is compared with the kernel's reference through the
kernel's own accuracy check, and the problems where SDPA cannot compute the same function give no peer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tritune.kernels import registry
from tritune.kernels.device import interpreter_device
from tritune.kernels.spec import KernelSpec, Peer, Problem

INTERPRETER = interpreter_device()
CPU = torch.device("cpu")
BUILTINS = ("tma_prefill", "splitk_decode", "varlen_sdpa", "q4k_fp8_gemm")


def _problems(name: str) -> list[tuple[str, KernelSpec, object, Problem]]:
    spec = registry.get_spec(name)
    keys = spec.default_keys(INTERPRETER)
    return [(name, spec, key, spec.make_problem(key, CPU, seed)) for seed, key in enumerate(keys)]


def _assert_matches_reference(spec: KernelSpec, problem: Problem, peer: Peer | None) -> None:
    assert peer is not None
    assert isinstance(peer.name, str) and 0 < len(peer.name) <= 64 and peer.name.isprintable()
    out = peer.fn()
    expected = spec.reference(*problem.args, **problem.kwargs)
    assert spec.check(out, expected, problem) is None
    # A second call (what the timer repeats) gives the same result: fn has no setup left to do.
    assert torch.equal(peer.fn(), out)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("name", "spec", "key", "problem"),
    [case for name in BUILTINS for case in _problems(name)],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_peer_at_each_interpreter_default_key_matches_the_reference(name, spec, key, problem) -> None:
    _assert_matches_reference(spec, problem, spec.peer(key, problem))


@pytest.mark.interpreter
def test_peer_names_say_what_runs() -> None:
    names = {}
    for name in BUILTINS:
        _, spec, key, problem = _problems(name)[0]
        peer = spec.peer(key, problem)
        assert peer is not None
        names[name] = peer.name
    assert names == {
        "tma_prefill": "SDPA math",
        "splitk_decode": "SDPA math",
        "varlen_sdpa": "per-sequence SDPA math",
        "q4k_fp8_gemm": "F.linear, dequantized weight",
    }


# ---- prefill: kv_len read at the key ---------------------------------------------------------


def _prefill(**kwargs: object) -> tuple[KernelSpec, object, Problem]:
    spec = registry.get_spec("tma_prefill")
    key = spec.default_keys(INTERPRETER)[0]
    problem = spec.make_problem(key, CPU, 3)
    return spec, key, dataclasses.replace(problem, kwargs={**problem.kwargs, **kwargs})


@pytest.mark.interpreter
def test_prefill_peer_slices_to_a_common_kv_len_below_the_cache() -> None:
    spec, key, problem = _prefill(kv_len=torch.tensor([40], dtype=torch.int32))
    _assert_matches_reference(spec, problem, spec.peer(key, problem))


@pytest.mark.interpreter
def test_prefill_peer_without_causality_or_kv_len() -> None:
    spec, key, problem = _prefill(causal=False, kv_len=None)
    _assert_matches_reference(spec, problem, spec.peer(key, problem))


@pytest.mark.interpreter
def test_prefill_has_no_peer_where_sdpa_cannot_compute_the_same_function() -> None:
    spec, key, problem = _prefill()
    q, k, v = problem.args
    ragged = Problem(args=(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)),
                     kwargs={**problem.kwargs, "kv_len": torch.tensor([64, 40], dtype=torch.int32)})  # fmt: skip
    assert spec.peer(key, ragged) is None
    # Causal with fewer keys than queries: the first rows see nothing (zeros here, NaN in SDPA).
    short = dataclasses.replace(problem, kwargs={**problem.kwargs, "kv_len": torch.tensor(8, dtype=torch.int32)})
    assert spec.peer(key, short) is None


# ---- decode: equal and ragged lengths ----------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("lengths", [[128, 128], [128, 77], [5, 128]], ids=["equal", "ragged", "short"])
@pytest.mark.parametrize("new_tokens", [1, 4])
def test_decode_peer_masks_or_slices_each_sequence(lengths: list[int], new_tokens: int) -> None:
    spec = registry.get_spec("splitk_decode")
    key = dataclasses.replace(spec.default_keys(INTERPRETER)[-1], lq=new_tokens)
    problem = spec.make_problem(key, CPU, 5)
    q, k_cache, v_cache, _ = problem.args
    problem = dataclasses.replace(problem, args=(q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32)))
    peer = spec.peer(key, problem)
    _assert_matches_reference(spec, problem, peer)
    assert peer is not None and peer.name == "SDPA math"


@pytest.mark.interpreter
def test_decode_has_no_peer_where_a_row_sees_no_key() -> None:
    spec = registry.get_spec("splitk_decode")
    key = dataclasses.replace(spec.default_keys(INTERPRETER)[0], lq=4)
    problem = spec.make_problem(key, CPU, 5)
    q, k_cache, v_cache, _ = problem.args
    problem = dataclasses.replace(problem, args=(q, k_cache, v_cache, torch.tensor([64, 2], dtype=torch.int32)))
    assert spec.peer(key, problem) is None


# ---- varlen: layouts a per-sequence loop cannot serve ------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize(("change", "value"), [("ring", True), ("windowed", True)])
def test_varlen_has_no_peer_for_a_ring_or_a_window(change: str, value: bool) -> None:
    spec = registry.get_spec("varlen_sdpa")
    key = dataclasses.replace(spec.default_keys(INTERPRETER)[-1], **{change: value})
    problem = spec.make_problem(key, CPU, 2)
    assert spec.peer(key, problem) is None


@pytest.mark.interpreter
def test_varlen_peer_without_causality() -> None:
    spec = registry.get_spec("varlen_sdpa")
    key = dataclasses.replace(spec.default_keys(INTERPRETER)[-1], causal=False)
    problem = spec.make_problem(key, CPU, 2)
    _assert_matches_reference(spec, problem, spec.peer(key, problem))


def test_a_kernel_that_names_no_peer_has_none() -> None:
    import toy_kernel

    spec = toy_kernel.SPEC
    key = spec.default_keys(INTERPRETER)[0]
    assert spec.peer(key, spec.make_problem(key, CPU, 0)) is None


# ---- the GPU tier: the backend chosen by timing still computes the kernel's function ----------


@pytest.mark.gpu
@pytest.mark.parametrize("name", BUILTINS)
def test_peer_on_the_gpu_matches_the_reference_at_the_first_default_key(name: str) -> None:
    from tritune.kernels.device import device_info

    spec = registry.get_spec(name)
    key = spec.default_keys(device_info(0))[0]
    # The check problem: small enough for the dense reference, the same function as the timed one.
    problem = spec.check_problem(key, torch.device("cuda"), 0)
    peer = spec.peer(key, problem)
    _assert_matches_reference(spec, problem, peer)
    assert peer is not None
    if name != "q4k_fp8_gemm":
        assert any(backend in peer.name for backend in ("SDPA flash", "SDPA cuDNN", "SDPA efficient")), peer.name
