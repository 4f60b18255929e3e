"""``BatchedSequenceCache`` against a plain Python model of the same semantics, and attention through it.

The model keeps every sequence's tokens as a list and simulates each ring layer as a dict from ring
slot to the position written there last. Random operation sequences (hypothesis, few examples) run
on both; after each operation the positions must agree, the storage must hold what the model says
each layer still needs (every position of a flat layer; a ring layer's window before the next
token), and an operation that fails must fail on both and leave the cache untouched.
Token ``i`` is stored as the value ``i + 1`` in every K element and ``-(i + 1)`` in every V element
(fp16 storage keeps them exact up to 2048).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritune.kernels import BatchedSequenceCache
from tritune.kernels.varlen.cache import SequenceCacheError
from tritune.kernels.varlen.reference import compare, sequence_reference

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
KV_HEADS, HEAD_DIM = 1, 64


class Model:
    """What the cache should hold: token lists, and per ring window, slot -> last position written."""

    def __init__(self, *, max_seqs: int, capacity: int, max_step: int, windows: list[int | None]) -> None:
        self.max_seqs, self.capacity, self.max_step = max_seqs, capacity, max_step
        self.windows = windows
        self.ring_size = {w: min(capacity, w + max_step - 1) for w in windows if w is not None}
        self.tokens: dict[int, list[int]] = {}
        self.rings: dict[int, dict[int, dict[int, int]]] = {}
        self.next_id = 0

    def new(self) -> int:
        if len(self.tokens) >= self.max_seqs:
            raise SequenceCacheError("full")
        seq, self.next_id = self.next_id, self.next_id + 1
        self.tokens[seq] = []
        self.rings[seq] = {w: {} for w in self.ring_size}
        return seq

    def known(self, seq: int) -> None:
        if seq not in self.tokens:
            raise SequenceCacheError("unknown")

    def rm(self, seq: int) -> None:
        self.known(seq)
        del self.tokens[seq], self.rings[seq]

    def clone(self, src: int) -> int:
        self.known(src)
        seq = self.new()
        self.tokens[seq] = list(self.tokens[src])
        self.rings[seq] = {w: dict(r) for w, r in self.rings[src].items()}
        return seq

    def rewind(self, seq: int, n: int) -> None:
        self.known(seq)
        pos = len(self.tokens[seq])
        if n < 0 or n > pos:
            raise SequenceCacheError("count")
        new = pos - n
        for w, ring in self.rings[seq].items():
            needed = range(max(0, new - w + 1), new)
            if any(ring.get(p % self.ring_size[w]) != p for p in needed):
                raise SequenceCacheError("ring floor")
        del self.tokens[seq][new:]

    def step(self, batch: list[tuple[int, int]], first_token: int) -> list[int]:
        seqs = [s for s, _ in batch]
        for seq, count in batch:
            self.known(seq)
            if count < 0 or count > self.max_step or len(self.tokens[seq]) + count > self.capacity:
                raise SequenceCacheError("count")
        if len(set(seqs)) != len(seqs):
            raise SequenceCacheError("duplicate")
        written = []
        token = first_token
        for seq, count in batch:
            for _ in range(count):
                p = len(self.tokens[seq])
                self.tokens[seq].append(token)
                for w, ring in self.rings[seq].items():
                    ring[p % self.ring_size[w]] = p
                written.append(token)
                token += 1
        return written


def check_storage(cache: BatchedSequenceCache, model: Model) -> None:
    assert sorted(cache.seqs()) == sorted(model.tokens)
    for seq, tokens in model.tokens.items():
        assert cache.pos(seq) == len(tokens)
        col = cache._col[seq]
        for layer, window in enumerate(model.windows):
            k, v = cache.kv(layer)
            pos = len(tokens)
            needed = range(pos) if window is None else range(max(0, pos - window + 1), pos)
            rows = [p if window is None else p % model.ring_size[window] for p in needed]
            want = torch.tensor([float(tokens[p] + 1) for p in needed], dtype=torch.float16)
            assert torch.equal(k[rows, col, 0, 0].cpu(), want), (seq, layer)
            assert torch.equal(v[rows, col, 0, 0].cpu(), -want), (seq, layer)


def snapshot(cache: BatchedSequenceCache):
    stores = [t.clone() for layer in range(cache.num_layers) for t in cache.kv(layer)]
    return dict(cache._pos), dict(cache._col), {s: dict(f) for s, f in cache._floor.items()}, stores


def assert_unchanged(cache: BatchedSequenceCache, before) -> None:
    pos, cols, floors, stores = snapshot(cache)
    assert (pos, cols, floors) == before[:3]
    assert all(torch.equal(a, b) for a, b in zip(stores, before[3], strict=True))


def make_pair(*, max_seqs=3, capacity=40, max_step=4, windows=(None, 5, 9), grow_chunk: int | None = 8):
    cache = BatchedSequenceCache(num_layers=len(windows), kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seqs=max_seqs,
                                 capacity=capacity, max_step=max_step, windows=list(windows), dtype=torch.float16,
                                 device=DEVICE, grow_chunk=grow_chunk)  # fmt: skip
    model = Model(max_seqs=max_seqs, capacity=capacity, max_step=max_step, windows=list(windows))
    return cache, model


def apply_step(cache: BatchedSequenceCache, batch, first_token: int, width: int | None = None):
    plan = cache.step(batch, width=width)
    values = torch.zeros(plan.width, KV_HEADS, HEAD_DIM, dtype=torch.float16)
    values[: plan.tokens] = torch.arange(first_token + 1, first_token + plan.tokens + 1, dtype=torch.float16)[
        :, None, None
    ]
    values = values.to(DEVICE)
    for layer in range(cache.num_layers):
        cache.write(layer, values, -values, plan)
    return plan


# ---- property test against the model ------------------------------------------------------------

#: Sequences are named by index into the live ones (-1: an id that was never handed out).
SEQ = st.integers(-1, 3)
#: Mostly valid steps over distinct live sequences (a start offset and counts); sometimes anything.
COUNT = st.sampled_from([0, 1, 2, 3, 3, 3, 3, -1, 4])
GOOD_STEP = st.tuples(st.just("step"), st.integers(0, 3), st.lists(COUNT, min_size=1, max_size=3))
ANY_STEP = st.tuples(st.just("step"), st.lists(st.tuples(SEQ, st.integers(-1, 4)), max_size=3))
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("new")),
        st.tuples(st.just("rm"), SEQ),
        st.tuples(st.just("clone"), SEQ),
        st.tuples(st.just("rewind"), SEQ, st.integers(-1, 7)),
        ANY_STEP,
        *[GOOD_STEP] * 6,
    ),
    min_size=20,
    max_size=50,
)


def _resolve(model: Model, op: tuple) -> tuple:
    live = sorted(model.tokens)

    def seq(i: int) -> int:
        return 1000 if i < 0 or not live else live[i % len(live)]

    name, *args = op
    if name in ("rm", "clone"):
        return name, seq(args[0])
    if name == "rewind":
        return name, seq(args[0]), args[1]
    if name == "step" and len(args) == 2:
        first, counts = args
        return name, [(live[(first + j) % len(live)], n) for j, n in enumerate(counts[: len(live)])]
    if name == "step":
        return name, [(seq(i), n) for i, n in args[0]]
    return (name,)


@settings(max_examples=40, deadline=None)
@given(ops=OPS, grow_chunk=st.sampled_from([None, 2, 8]))
def test_cache_matches_model(ops, grow_chunk):
    # Rings of 4 and 6 rows (windows 2 and 4, steps of up to 3 tokens) wrap within a few steps.
    cache, model = make_pair(capacity=24, max_step=3, windows=(None, 2, 4), grow_chunk=grow_chunk)
    for _ in range(2):
        assert cache.seq_new() == model.new()
    token = 0
    for op in ops:
        before = snapshot(cache)
        name, *args = _resolve(model, op)
        try:
            if name == "new":
                expected = model.new()
            elif name == "rm":
                model.rm(args[0])
            elif name == "clone":
                expected = model.clone(args[0])
            elif name == "rewind":
                model.rewind(*args)
            else:
                written = model.step(args[0], token)
        except SequenceCacheError:
            with pytest.raises(SequenceCacheError):
                if name == "step":
                    cache.step(args[0])
                else:
                    getattr(cache, {"new": "seq_new", "rm": "seq_rm", "clone": "seq_clone"}.get(name, name))(*args)
            assert_unchanged(cache, before)
            continue
        if name == "new":
            assert cache.seq_new() == expected
        elif name == "rm":
            cache.seq_rm(args[0])
        elif name == "clone":
            assert cache.seq_clone(args[0]) == expected
        elif name == "rewind":
            cache.rewind(*args)
        else:
            plan = apply_step(cache, args[0], token)
            assert plan.tokens == len(written)
            token += len(written)
        check_storage(cache, model)


# ---- operations one by one ----------------------------------------------------------------------


def test_step_plan_packs_segments_and_pads_to_the_scratch_column():
    cache, _ = make_pair(windows=(None, 5))
    a, b = cache.seq_new(), cache.seq_new()
    apply_step(cache, [(a, 3)], 0)
    plan = apply_step(cache, [(b, 2), (a, 1)], 3, width=6)
    assert plan.seq_info.tolist() == [[0, 2, 1, 2], [2, 1, 0, 4], [0, 0, 0, 0]]
    assert plan.segments == ((b, 0, 2), (a, 2, 1))
    assert plan.slot_cols.tolist() == [1, 1, 0, 3, 3, 3]
    assert plan.slot_rows[None].tolist() == [0, 1, 3, 0, 0, 0]
    # The ring of window 5 holds min(40, 5 + 4 - 1) = 8 rows.
    assert plan.slot_rows[5].tolist() == [0, 1, 3, 0, 0, 0]
    # Same width: the same buffers, overwritten in place (what a captured graph needs).
    again = cache.step([(a, 4)], width=6)
    assert again.seq_info is plan.seq_info and again.slot_cols is plan.slot_cols
    assert again.seq_info[0].tolist() == [0, 4, 0, 8]
    assert again.slot_rows[5][:4].tolist() == [4, 5, 6, 7]


def test_growth_by_chunks_and_ring_cap():
    cache, model = make_pair(capacity=40, max_step=4, windows=(None, 5), grow_chunk=8)
    assert [cache.rows(0), cache.rows(1)] == [8, 8]
    seq = cache.seq_new()
    model.new()
    token = 0
    for step in range(10):
        generation = cache.generation
        apply_step(cache, [(seq, 4)], token)
        model.step([(seq, 4)], token)
        token += 4
        check_storage(cache, model)
        pos = 4 * (step + 1)
        assert cache.rows(0) == min(40, -(-pos // 8) * 8)
        assert cache.generation == generation + (pos > 8 and pos % 8 == 4)
        # The ring stops at window + max_step - 1 = 8 rows and wraps.
        assert cache.rows(1) == 8
    with pytest.raises(SequenceCacheError, match="capacity is 40"):
        cache.step([(seq, 1)])


def test_presized_cache_never_grows():
    cache, _ = make_pair(capacity=24, windows=(None, 5), grow_chunk=None)
    assert [cache.rows(0), cache.rows(1)] == [24, 8]
    seq = cache.seq_new()
    for i in range(6):
        apply_step(cache, [(seq, 4)], 4 * i)
    assert cache.generation == 0 and cache.pos(seq) == 24


@pytest.mark.parametrize(
    "operation, message",
    [
        (lambda c, s: c.seq_rm(99), "unknown sequence 99"),
        (lambda c, s: c.seq_clone(99), "unknown sequence"),
        (lambda c, s: c.pos(99), "unknown sequence"),
        (lambda c, s: c.rewind(s, -1), "non-negative"),
        (lambda c, s: c.rewind(s, 13), "holds 12 positions, cannot drop 13"),
        (lambda c, s: c.rewind(s, 6), "ring, which holds positions from"),
        (lambda c, s: c.step([(s, -1)]), "non-negative"),
        (lambda c, s: c.step([(s, 5)]), "exceed max_step=4"),
        (lambda c, s: c.step([(s, 1), (s, 1)]), "appears twice"),
        (lambda c, s: c.step([(s, 2)], width=1), "width 1 cannot hold"),
        (lambda c, s: c.step([s]), r"expected \(seq, new_token_count\)"),
        (lambda c, s: [c.seq_new() for _ in range(3)], "maximum of 3 sequences"),
        (lambda c, s: c.write(0, torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), c.step([(s, 1)])), "expected shape"),
        (lambda c, s: c.kv(5), "layer: expected an int in"),
    ],
    ids=["rm-unknown", "clone-unknown", "pos-unknown", "rewind-negative", "rewind-too-far", "rewind-ring-floor",
         "step-negative", "step-max-step", "step-duplicate", "step-width", "step-malformed", "too-many-seqs",
         "write-shape", "bad-layer"],
)  # fmt: skip
def test_errors_name_the_problem_and_change_nothing(operation, message):
    cache, _ = make_pair(windows=(None, 5))
    seq = cache.seq_new()
    for i in range(3):
        apply_step(cache, [(seq, 4)], 4 * i)
    before = snapshot(cache)
    with pytest.raises(SequenceCacheError, match=message):
        operation(cache, seq)
    if message != "expected shape":  # write() runs after a (valid) step
        # A failed seq_new loop may have added sequences before failing: compare only the original one.
        if message.startswith("maximum"):
            assert cache.pos(seq) == 12
        else:
            assert_unchanged(cache, before)


def test_rewind_within_the_ring_and_clone():
    cache, model = make_pair(windows=(None, 5))
    seq = cache.seq_new()
    model.new()
    for i in range(3):
        apply_step(cache, [(seq, 4)], 4 * i)
        model.step([(seq, 4)], 4 * i)
    # Positions 0..11 written into an 8-row ring: 4..11 remain; the next token after a rewind of 3
    # (position 9) sees 5..8.
    cache.rewind(seq, 3)
    model.rewind(seq, 3)
    twin = cache.seq_clone(seq)
    model.clone(seq)
    check_storage(cache, model)
    apply_step(cache, [(twin, 2), (seq, 1)], 100)
    model.step([(twin, 2), (seq, 1)], 100)
    check_storage(cache, model)
    with pytest.raises(SequenceCacheError, match="ring"):
        cache.rewind(seq, 6)


def test_construction_errors():
    with pytest.raises(SequenceCacheError, match="max_seqs"):
        BatchedSequenceCache(num_layers=1, kv_heads=1, head_dim=64, max_seqs=0, capacity=8, max_step=1)
    with pytest.raises(SequenceCacheError, match="windows"):
        BatchedSequenceCache(num_layers=2, kv_heads=1, head_dim=64, max_seqs=1, capacity=8, max_step=1, windows=[4])
    with pytest.raises(SequenceCacheError, match=r"windows\[0\]"):
        BatchedSequenceCache(num_layers=1, kv_heads=1, head_dim=64, max_seqs=1, capacity=8, max_step=1, windows=[0])


# ---- attention through the cache ----------------------------------------------------------------


def _attention_through_cache(device: str, *, steps, windows=(None, 6), dtype=torch.float16, capture=False):
    """Run ``steps`` (lists of (seq index, count, draft?)) through a cache and compare each layer per segment."""
    torch.manual_seed(0)
    q_heads, kv_heads, head_dim = 4, 2, 64
    cache = BatchedSequenceCache(num_layers=len(windows), kv_heads=kv_heads, head_dim=head_dim, max_seqs=3,
                                 capacity=48, max_step=5, windows=list(windows), dtype=dtype, device=device,
                                 grow_chunk=16)  # fmt: skip
    seqs = [cache.seq_new() for _ in range(2)]
    history: dict[int, dict[int, list[torch.Tensor]]] = {s: {layer: [] for layer in range(len(windows))} for s in seqs}
    for batch in steps:
        plan = cache.step([(seqs[i], n) for i, n in batch], width=sum(n for _, n in batch) + 2)
        q = torch.randn(plan.width, q_heads, head_dim, device=device).to(dtype)
        for layer, window in enumerate(windows):
            k_new = torch.randn(plan.width, kv_heads, head_dim, device=device).to(dtype)
            v_new = torch.randn(plan.width, kv_heads, head_dim, device=device).to(dtype)
            cache.write(layer, k_new, v_new, plan)
            out = cache.attention(layer, q, plan, out=torch.full_like(q, float("nan")))
            for seq, q_start, q_len in plan.segments:
                keys = history[seq][layer]
                keys.append((k_new[q_start : q_start + q_len], v_new[q_start : q_start + q_len]))
                del keys[:-50]
                k_all = torch.cat([k for k, _ in keys])[-cache.pos(seq) :]
                v_all = torch.cat([v for _, v in keys])[-cache.pos(seq) :]
                positions = torch.arange(cache.pos(seq) - len(k_all), cache.pos(seq), device=device)
                want = sequence_reference(q[q_start : q_start + q_len], k_all, v_all, positions[-q_len:], positions,
                                          window=window)  # fmt: skip
                problem = compare(out[q_start : q_start + q_len], want, dtype)
                assert problem is None, (layer, seq, problem)
            assert torch.equal(out[plan.tokens :].float().cpu(), torch.zeros(plan.width - plan.tokens, q_heads, 64))


def test_attention_through_cache_matches_the_token_history():
    """Prefill chunks, decode tokens and a wrap of the window-6 ring (10 rows), checked per segment."""
    _attention_through_cache(DEVICE, steps=[[(0, 5), (1, 3)], [(0, 1), (1, 5)], [(1, 1), (0, 4)], [(0, 1)]])


@pytest.mark.gpu
def test_cuda_graph_of_a_cache_step_replays_any_mix():
    """One graph (write + attention per layer) captured once, replayed for steps of different mixes."""
    torch.manual_seed(0)
    windows = [None, 64]
    cache = BatchedSequenceCache(num_layers=2, kv_heads=8, head_dim=128, max_seqs=8, capacity=2048, max_step=16,
                                 windows=windows, dtype=torch.bfloat16, device="cuda", grow_chunk=None)  # fmt: skip
    seqs = [cache.seq_new() for _ in range(8)]
    width = 48
    q = torch.randn(width, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(2, width, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    outs = torch.empty(2, width, 32, 128, device="cuda", dtype=torch.bfloat16)

    def step(plan):
        for layer in range(2):
            cache.write(layer, k_new[layer], v_new[layer], plan)
            cache.attention(layer, q, plan, out=outs[layer])

    plan = cache.step([(s, 16) for s in seqs[:3]], width=width)
    step(plan)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    snapshot_k = [cache.kv(layer)[0].clone() for layer in range(2)]
    with torch.cuda.graph(graph):
        step(plan)
    for layer in range(2):  # capture does not run the step: nothing was written
        assert torch.equal(cache.kv(layer)[0], snapshot_k[layer])
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        counts = torch.randint(0, 17, (8,), generator=gen).tolist()
        total = 0
        batch = []
        for s, n in zip(seqs, counts, strict=True):
            n = min(n, width - total)
            batch.append((s, n))
            total += n
        before = [cache.kv(layer) for layer in range(2)]
        before = [(k.clone(), v.clone()) for k, v in before]
        plan = cache.step(batch, width=width)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [(cache.kv(layer)[0].clone(), outs[layer].clone()) for layer in range(2)]
        # Eager on the same state: restore the stores, run the step without the graph.
        for layer in range(2):
            cache.kv(layer)[0].copy_(before[layer][0])
            cache.kv(layer)[1].copy_(before[layer][1])
        step(plan)
        torch.cuda.synchronize()
        for layer in range(2):
            assert torch.equal(cache.kv(layer)[0], replayed[layer][0])
            assert torch.equal(outs[layer], replayed[layer][1])
