"""What ``BatchedSequenceCache`` refuses up front, and what a failing step leaves behind.

Arguments the kernel cannot serve are refused at construction (naming the argument), not at the
first ``attention``; a ``q`` narrower or wider than the step's plan is refused before it can shift
positions; a step that fails after its checks (out of memory) leaves the positions unchanged.
"""

from __future__ import annotations

import pytest
import torch

from tritune.kernels import BatchedSequenceCache
from tritune.kernels.varlen.cache import SequenceCacheError


def make(**overrides) -> BatchedSequenceCache:
    fields = {
        "num_layers": 2, "kv_heads": 1, "head_dim": 64, "max_seqs": 2, "capacity": 32, "max_step": 4,
        "windows": [None, 4], "dtype": torch.float16, "grow_chunk": 8,
    }  # fmt: skip
    return BatchedSequenceCache(**{**fields, **overrides})


def state(cache: BatchedSequenceCache):
    stores = [t.clone() for layer in range(cache.num_layers) for t in cache.kv(layer)]
    return dict(cache._pos), {s: dict(f) for s, f in cache._floor.items()}, cache.generation, stores


def assert_same(before, after) -> None:
    assert before[:3] == after[:3]
    assert all(torch.equal(a, b) for a, b in zip(before[3], after[3], strict=True))


# ---- construction -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dtype": torch.float32}, r"dtype: expected one of \[torch.bfloat16, torch.float16\].*got torch.float32"),
        ({"dtype": torch.int8}, "dtype: expected one of"),
        ({"dtype": "bfloat16"}, "dtype: expected one of .* got 'bfloat16'"),
        ({"head_dim": 72}, r"head_dim: expected one of \(64, .*got 72"),
        ({"capacity": 2**31}, f"capacity: expected at most {2**31 - 1} positions .*got {2**31}"),
        ({"capacity": 2**40, "windows": [8, 8]}, "capacity: expected at most"),
    ],
    ids=["float32", "int8", "dtype-string", "head-dim-72", "capacity-2**31", "capacity-ring-only"],
)
def test_construction_refuses_what_the_kernel_cannot_serve(overrides, message):
    with pytest.raises(SequenceCacheError, match=message):
        make(**overrides)


def test_capacity_up_to_int32_max_is_served():
    # Ring layers only: the storage stays window + max_step - 1 rows whatever the capacity.
    cache = make(capacity=2**31 - 1, windows=[8, 8])
    a, b = cache.seq_new(), cache.seq_new()
    cache._pos[b] = 2**31 - 3  # stands in for a sequence that has run that long
    plan = cache.step([(a, 1), (b, 2)])
    assert plan.seq_info[:2].tolist() == [[0, 1, 0, 1], [1, 2, 1, 2**31 - 1]]
    assert cache.pos(b) == 2**31 - 1
    with pytest.raises(SequenceCacheError, match="capacity is 2147483647"):
        cache.step([(b, 1)])


# ---- sequence ids -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "operation, message",
    [
        (lambda c: c.step([(True, 1)]), r"step: batch\[0\]: expected an int sequence id, got True"),
        (lambda c: c.step([(0, 1), (1.0, 1)]), r"step: batch\[1\]: expected an int sequence id, got 1.0"),
        (lambda c: c.seq_rm(True), "seq: expected an int sequence id, got True"),
        (lambda c: c.pos(False), "seq: expected an int sequence id, got False"),
        (lambda c: c.rewind(True, 0), "seq: expected an int sequence id"),
        (lambda c: c.seq_clone(True), "src: expected an int sequence id"),
    ],
    ids=["step-bool", "step-float", "rm-bool", "pos-bool", "rewind-bool", "clone-bool"],
)
def test_sequence_ids_are_ints_not_bools(operation, message):
    """``True == 1``: a bool would silently name sequence 1."""
    cache = make()
    for _ in range(2):
        cache.seq_new()
    before = state(cache)
    with pytest.raises(SequenceCacheError, match=message):
        operation(cache)
    assert_same(before, state(cache))


# ---- attention ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [2, 4])
def test_attention_refuses_q_of_another_width_than_the_plan(rows):
    """A short q would put its rows at later positions (seeing future keys); a long one is as wrong."""
    cache = make()
    seq = cache.seq_new()
    plan = cache.step([(seq, 3)])
    q = torch.zeros(rows, 2, 64, dtype=torch.float16)
    with pytest.raises(SequenceCacheError, match=rf"attention: q: expected shape \[3, Hq, D\].*got \({rows}, 2, 64\)"):
        cache.attention(0, q, plan)
    with pytest.raises(SequenceCacheError, match=r"attention: q: expected shape \[3, Hq, D\].*got list"):
        cache.attention(0, [[0.0]], plan)


# ---- failing steps ------------------------------------------------------------------------------


def test_a_step_failing_after_its_checks_leaves_the_cache_unchanged(monkeypatch):
    """Out of memory for a new width's buffers: no position advanced, no layer grown."""
    cache = make()
    seq = cache.seq_new()
    for _ in range(2):
        cache.step([(seq, 4)])
    before = state(cache)

    def out_of_memory(width: int):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(cache, "_step_buffers", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        cache.step([(seq, 4)], width=5)  # position 12 needs a third chunk of rows
    assert_same(before, state(cache))


def test_growth_failing_part_way_keeps_positions_and_bumps_the_generation(monkeypatch):
    """The layers grown before the failure keep their contents; a graph captured before must be re-captured."""
    cache = make(windows=[None, None])
    seq = cache.seq_new()
    plan = cache.step([(seq, 4)])
    cache.write(0, torch.ones(4, 1, 64, dtype=torch.float16), torch.ones(4, 1, 64, dtype=torch.float16), plan)
    cache.step([(seq, 4)])
    pos, generation, k_before = cache.pos(seq), cache.generation, cache.kv(0)[0].clone()
    real_storage, calls = cache._storage, []

    def storage(rows: int) -> torch.Tensor:
        calls.append(rows)
        if len(calls) == 2:  # layer 0's K grown, its V not
            raise RuntimeError("out of memory")
        return real_storage(rows)

    monkeypatch.setattr(cache, "_storage", storage)
    with pytest.raises(RuntimeError, match="out of memory"):
        cache.step([(seq, 4)])
    assert cache.pos(seq) == pos
    assert cache.generation == generation + 1
    k, v = cache.kv(0)
    assert (k.shape[0], v.shape[0]) == (16, 8)
    assert torch.equal(k[:8], k_before) and torch.equal(k[:4, 0], torch.ones(4, 1, 64, dtype=torch.float16))
