"""``varlen_attention`` against a loop of the reference over single sequences: every mode, split-K, mixes.

CPU tier: the kernels run on the Triton interpreter at tiny shapes. The interpreter's SM count is 1,
which leaves almost every step with one split; the ``many_sms`` fixture makes the launch plan
believe in 4 SMs, and the pinned ``SPLIT`` config (short chunks, four waves) then splits the keys of
every tile that has more than 16 of them, so the split kernel, the merge and empty splits all run.
Stores hold NaN wherever no live position sits (past ``kv_end``, unused columns), and so do the
query rows no segment covers: none of it may reach the output.
GPU tier (``gpu`` marker): one captured CUDA graph replayed over different mixes, bigger shapes.
The op's contract (input checks, ``validate_seq_info``, torch.library) is in ``test_varlen_contract.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from varlen_cases import DEVICE, NAN, NO_SPLIT, SPLIT, Mix, config_of, make_inputs, run_and_compare

from tritune.kernels import _launch, validate_seq_info, varlen_attention
from tritune.kernels.pins import use_config
from tritune.kernels.prefill.reference import prefill_reference
from tritune.kernels.varlen import launch as varlen_launch
from tritune.kernels.varlen.reference import compare, segment_keys, sequence_reference, varlen_reference
from tritune.search_spaces.varlen_sdpa import VarlenConfig


@pytest.fixture
def many_sms(monkeypatch, device):
    """On the interpreter, plan splits as if the device had 4 SMs (a GPU keeps its own count)."""
    if device == "cpu":
        monkeypatch.setitem(_launch.SM_COUNTS, torch.device("cpu"), 4)


@dataclass(frozen=True)
class Schedule:
    """The schedule the kernels derive on the device, recomputed in Python (see _triton_varlen)."""

    #: Splits each tile uses, tile by tile.
    used: list[int]
    #: Work items (tiles x splits) in all; of them in split segments; tiles of split segments.
    work: int
    split_work: int
    split_tiles: int
    #: What the launch sized for them: work programs, workspace slots, merge programs.
    work_slots: int
    ws_slots: int
    merge_slots: int


def schedule(mix: Mix, config: dict, sm_count: int | None = None) -> Schedule:
    cfg = VarlenConfig(**{**dataclasses.asdict(VarlenConfig()), **config})
    sm_count = sm_count or varlen_launch.sm_count(torch.device(DEVICE))
    slots = mix.slots or len(mix.segments)
    plan = varlen_launch.plan(cfg, sm_count, slots, mix.rows, mix.kv_heads, mix.group, mix.head_dim, mix.causal,
                           mix.window or 0)  # fmt: skip
    tq, window = plan.tokens_per_tile, mix.window or 0
    segs = []
    for _, q_len, _, kv_end in mix.segments:
        ring_lo = max(kv_end - mix.rows, 0) if mix.ring else 0
        kv_end = kv_end if mix.ring else min(kv_end, mix.rows)
        cost = kv_end - ring_lo
        if mix.window is not None:
            cost = min(cost, (tq if mix.causal else q_len) + window - 1)
        segs.append((q_len, kv_end, ring_lo, -(-q_len // tq), cost))
    total = sum(tiles * cost for *_, tiles, cost in segs)
    chunk = min(max(-(-total // plan.budget), cfg.MIN_CHUNK), 1 << 30)
    used, work, split_work, split_tiles = [], 0, 0, 0
    for q_len, kv_end, ring_lo, tiles, cost in segs:
        seg_chunk = -(-max(chunk, -(-cost // cfg.MAX_SPLITS)) // cfg.BLOCK_N) * cfg.BLOCK_N
        splits = max(-(-cost // seg_chunk), 1) if plan.split else 1
        work += tiles * splits
        if splits > 1:
            split_work += tiles * splits
            split_tiles += tiles
        for t in range(tiles):
            first = kv_end - q_len + t * tq
            last = first + min(q_len - t * tq, tq) - 1
            lo = max(ring_lo, first - window + 1) if mix.window is not None else ring_lo
            hi = min(kv_end, last + 1) if mix.causal else kv_end
            used.append(min(-(-max(hi - lo, 0) // seg_chunk), splits) if plan.split else 1)
            assert -(-max(hi - lo, 0) // seg_chunk) <= splits or not plan.split
    work_slots = mix.tokens // tq + slots + (plan.budget if plan.split else 0)
    return Schedule(used, work, split_work, split_tiles, work_slots, plan.ws_slots, plan.budget if plan.split else 0)


def tile_splits(mix: Mix, config: dict) -> list[int]:
    return schedule(mix, config).used


def _packed_mix(lens, ends, rows, ring, causal, window, group, kv_heads) -> Mix:
    """Segments packed back to back, one column each, kv_end clamped to a flat store."""
    segments = []
    for i, q_len in enumerate(lens):
        segments.append((sum(lens[:i]), q_len, i, ends[i] if ring else min(ends[i], rows)))
    return Mix(tuple(segments), tokens=sum(lens), rows=rows, cols=len(lens), kv_heads=kv_heads, group=group,
               causal=causal, window=window, ring=ring)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    mix=st.builds(
        _packed_mix,
        lens=st.lists(st.sampled_from([0, 1, 1, 1, 4, 37, 300]), min_size=1, max_size=12),
        ends=st.lists(st.integers(300, 40000), min_size=12, max_size=12),
        rows=st.sampled_from([512, 4096, 32768]),
        ring=st.booleans(),
        causal=st.booleans(),
        window=st.sampled_from([None, 1, 100, 4000]),
        group=st.sampled_from([1, 4, 8]),
        kv_heads=st.sampled_from([1, 8]),
    ),
    config=st.fixed_dictionaries({
        "BLOCK_M": st.sampled_from([16, 64]), "BLOCK_N": st.sampled_from([16, 64]),
        "MAX_SPLITS": st.sampled_from([4, 16, 64]), "MIN_CHUNK": st.sampled_from([16, 128, 2048]),
        "TARGET_WAVES": st.sampled_from([1, 2, 4]),
    }),
    sm_count=st.sampled_from([1, 4, 132]),
)  # fmt: skip
def test_schedule_fits_the_grid(mix, config, sm_count):
    """Whatever the mix, the work, the partials and the merges fit what the launch sized from static facts."""
    plan = schedule(mix, config, sm_count)
    assert plan.work <= plan.work_slots
    assert plan.split_work <= plan.ws_slots
    assert plan.split_tiles <= plan.merge_slots


# ---- every mode against the reference ----------------------------------------------------------

# Segments: decode tokens (q_len 1), prefill chunks, draft blocks; gaps of uncovered rows; unused slots.
MODE_CASES = [
    pytest.param(Mix(((0, 1, 2, 37), (1, 9, 0, 40), (12, 1, 3, 1), (0, 0, 1, 5)), tokens=14, rows=48, cols=5,
                     kv_heads=2, group=1), id="causal-mha"),
    pytest.param(Mix(((3, 7, 1, 7), (0, 1, 4, 63), (10, 2, 0, 30)), tokens=13, rows=64, cols=5, group=4,
                     head_dim=80), id="causal-gqa4-d80"),
    pytest.param(Mix(((0, 5, 0, 33), (5, 1, 1, 17)), tokens=6, rows=40, cols=2, group=8, head_dim=128,
                     dtype=torch.bfloat16), id="causal-gqa8-d128-bf16"),
    pytest.param(Mix(((0, 4, 2, 29), (4, 1, 0, 50), (6, 3, 1, 3)), tokens=9, rows=50, cols=3, group=4,
                     causal=False), id="draft-noncausal-gqa4"),
    pytest.param(Mix(((0, 9, 1, 45), (9, 1, 0, 20), (10, 3, 2, 3)), tokens=13, rows=48, cols=3, group=2,
                     window=20), id="window-causal-gqa2"),
    pytest.param(Mix(((0, 4, 0, 40), (4, 1, 1, 9)), tokens=6, rows=40, cols=2, group=4, causal=False,
                     window=20), id="window-noncausal"),
    pytest.param(Mix(((0, 3, 1, 70), (3, 1, 0, 50), (4, 4, 2, 23)), tokens=9, rows=24, cols=3, group=4,
                     window=21, ring=True), id="ring-wrap-window"),
    pytest.param(Mix(((0, 2, 0, 11), (2, 1, 1, 30)), tokens=3, rows=32, cols=2, group=8, window=31,
                     ring=True), id="ring-nowrap-nan-tail"),
    pytest.param(Mix(((0, 1, 0, 100), (1, 5, 1, 41)), tokens=6, rows=20, cols=2, group=1, kv_heads=2,
                     ring=True), id="ring-no-window"),
    pytest.param(Mix(((0, 3, 0, 25), (3, 1, 1, 19)), tokens=4, rows=25, cols=2, group=7, head_dim=96,
                     dtype=torch.bfloat16), id="causal-gqa7-d96"),
]  # fmt: skip


@pytest.mark.parametrize("mix", MODE_CASES)
def test_default_config_matches_reference(mix):
    run_and_compare(mix)


@pytest.mark.parametrize("mix", MODE_CASES)
def test_split_k_matches_reference(many_sms, monkeypatch, mix):
    assert max(tile_splits(mix, SPLIT)) >= 2
    # The workspace is never initialised: poison it to prove only written partials are read.
    monkeypatch.setattr(varlen_launch, "workspace", lambda n, dev: torch.full((n,), NAN, device=dev))
    run_and_compare(mix, SPLIT)


def test_sixteen_splits_match_reference(many_sms, monkeypatch):
    """MAX_SPLITS=16, the most the interpreter admits: long decode segments cut into more than four
    chunks each, merged from a poisoned workspace."""
    mix = Mix(((0, 1, 0, 300), (1, 2, 1, 230)), tokens=3, rows=320, cols=2, group=4)
    config = {**SPLIT, "MAX_SPLITS": 16}
    assert max(tile_splits(mix, config)) > 4
    monkeypatch.setattr(varlen_launch, "workspace", lambda n, dev: torch.full((n,), NAN, device=dev))
    run_and_compare(mix, config)


def test_uncovered_rows_and_unused_slots_are_zero(many_sms):
    """Rows between, before and after the segments are zero; q_len = 0 slots change nothing."""
    mix = Mix(((2, 3, 0, 20), (0, 0, 1, 9), (7, 1, 1, 9), (0, 0, 0, 0)), tokens=11, rows=24, cols=2, slots=6)
    for config in (SPLIT, NO_SPLIT):
        out, _ = run_and_compare(mix, config)
        for rows in (slice(0, 2), slice(5, 7), slice(8, 11)):
            assert torch.equal(out[rows].float().cpu(), torch.zeros_like(out[rows].float().cpu()))


def test_many_slots_used_last(many_sms, monkeypatch):
    """40 slots (most unused, the used ones last), and zero-fill programs of 4 rows each."""
    monkeypatch.setattr(varlen_launch, "_ZERO_TILE", 256)
    varlen_launch.plan.cache_clear()
    segments = [(0, 0, 0, 0)] * 37 + [(3, 9, 0, 30), (20, 1, 1, 17), (25, 4, 2, 26)]
    mix = Mix(tuple(segments), tokens=31, rows=32, cols=3, group=2)
    assert varlen_launch.plan(config_of(SPLIT), 4, 40, 32, 1, 2, 64, True, 0).zero_tokens == 4
    out, _ = run_and_compare(mix, SPLIT)
    varlen_launch.plan.cache_clear()
    for rows in (slice(0, 3), slice(12, 20), slice(21, 25), slice(29, 31)):
        assert torch.equal(out[rows].float().cpu(), torch.zeros_like(out[rows].float().cpu()))


@pytest.mark.parametrize("tail", [3e4, float("inf"), NAN], ids=["huge", "inf", "nan"])
def test_garbage_past_kv_end_is_never_read(many_sms, tail):
    """Huge finite garbage past kv_end would dominate any score it reached; inf or NaN would poison it."""
    flat = Mix(((0, 2, 1, 21), (2, 1, 0, 34)), tokens=3, rows=40, cols=3, group=2)
    run_and_compare(flat, SPLIT, tail=tail)
    ring = dataclasses.replace(flat, segments=((0, 2, 1, 21), (2, 1, 0, 83)), rows=30, window=29, ring=True)
    run_and_compare(ring, SPLIT, tail=tail)


def test_large_logits_stay_exact(many_sms):
    mix = Mix(((0, 3, 0, 40), (3, 1, 1, 37)), tokens=4, rows=40, cols=2, group=4)
    q, k, v, seq_info = make_inputs(mix)
    q = (q.float() * 300.0).to(q.dtype)
    with use_config("varlen_sdpa", SPLIT):
        out = varlen_attention(q, k, v, seq_info, out=torch.full_like(q, float("nan")))
    assert compare(out, varlen_reference(q, k, v, seq_info), q.dtype) is None


def test_softmax_scale_and_allocated_out():
    mix = Mix(((0, 2, 0, 9),), tokens=2, rows=16, cols=1, group=2)
    q, k, v, seq_info = make_inputs(mix)
    out = varlen_attention(q, k, v, seq_info, softmax_scale=0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert compare(out, varlen_reference(q, k, v, seq_info, softmax_scale=0.3), q.dtype) is None


def test_strided_q_and_out(many_sms):
    """q and out seen through views with padded token strides; stores as views of wider ones."""
    mix = Mix(((0, 3, 1, 30), (3, 1, 0, 12)), tokens=4, rows=32, cols=2, group=2)
    q0, k0, v0, seq_info = make_inputs(mix)
    q = torch.full((4, 2, 64 + 16), NAN, dtype=q0.dtype, device=DEVICE)[:, :, :64]
    q.copy_(q0)
    k = torch.cat([k0, k0], dim=1)[:, :2]
    v = torch.cat([v0, v0], dim=1)[:, :2]
    out = torch.full((4, 2, 128), NAN, dtype=q0.dtype, device=DEVICE)[:, :, 32:96]
    with use_config("varlen_sdpa", SPLIT):
        varlen_attention(q, k, v, seq_info, out=out)
    assert compare(out, varlen_reference(q0, k0, v0, seq_info), q0.dtype) is None


# ---- random mixes ---------------------------------------------------------------------------------


@st.composite
def mixes(draw):
    """Decode tokens, prefill chunks and draft blocks in random columns, with gaps, in one mode."""
    ring = draw(st.booleans())
    causal = draw(st.booleans())
    rows = draw(st.integers(12, 40))
    kinds = draw(st.lists(st.sampled_from(["decode", "prefill", "draft"]), min_size=1, max_size=4))
    lengths = [{"decode": 1, "prefill": draw(st.integers(2, 9)), "draft": draw(st.integers(2, 4))}[k] for k in kinds]
    window = draw(st.one_of(st.none(), st.integers(1, rows - max(lengths) + 1)))
    if ring and window is None and not causal:
        window = rows - max(lengths) + 1
    cols = len(lengths) + draw(st.integers(0, 2))
    columns = draw(st.permutations(range(cols)))[: len(lengths)]
    segments, start = [], 0
    for q_len, col in zip(lengths, columns, strict=True):
        start += draw(st.integers(0, 2))
        top = 3 * rows if ring else rows
        segments.append((start, q_len, col, draw(st.integers(q_len, top))))
        start += q_len
    group = draw(st.sampled_from([1, 4, 8]))
    return Mix(tuple(segments), tokens=start + draw(st.integers(0, 2)), rows=rows, cols=cols,
               group=group, causal=causal, window=window, ring=ring, slots=len(segments) + 1)  # fmt: skip


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=mixes(), split=st.booleans(), seed=st.integers(0, 2**16))
def test_random_mixes_match_reference(many_sms, mix, split, seed):
    validate_seq_info(make_inputs(mix)[3], T=mix.tokens, rows=mix.rows, cols=mix.cols, ring=mix.ring)
    run_and_compare(mix, SPLIT if split else NO_SPLIT, seed=seed)


# ---- the reference itself -------------------------------------------------------------------------


def test_reference_loop_matches_prefill_reference():
    """Each flat causal segment equals an independent dense reference (prefill's) over its column."""
    mix = Mix(((0, 3, 1, 30), (3, 1, 0, 12), (4, 5, 2, 5)), tokens=9, rows=32, cols=3, group=2)
    q, k, v, seq_info = make_inputs(mix, tail=0.0)
    got = varlen_reference(q, k, v, seq_info)
    for q_start, q_len, col, kv_end in mix.segments:
        seg_q = q[q_start : q_start + q_len].transpose(0, 1)[None]  # [1, Hq, L, D]
        seg_k = k[:, col].transpose(0, 1)[None]  # [1, Hkv, rows, D]
        seg_v = v[:, col].transpose(0, 1)[None]
        kv_len = torch.tensor(kv_end, dtype=torch.int32)
        want = prefill_reference(seg_q, seg_k, seg_v, kv_len=kv_len, dtype=torch.float64)[0].transpose(0, 1)
        torch.testing.assert_close(got[q_start : q_start + q_len], want)


def test_reference_ring_gathers_the_last_rows_positions():
    k = torch.arange(10.0)[:, None, None, None].expand(10, 1, 1, 2)
    keys, _, positions = segment_keys(k, k, 0, 23, ring=True)
    assert positions.tolist() == list(range(13, 23))
    assert keys[:, 0, 0].tolist() == [p % 10 for p in range(13, 23)]
    assert sequence_reference(torch.zeros(0, 1, 2), keys, keys, positions[:0], positions).shape == (0, 1, 2)


# ---- GPU tier ------------------------------------------------------------------------------------


def _gpu_mix(seed: int, *, slots: int, tokens: int, rows: int, ring: bool = False, window: int | None = None):
    """Random decode tokens, 64-token prefill chunks and 4-token drafts filling part of ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    segments, start = [], 0
    cols = torch.randperm(slots, generator=gen).tolist()
    for s in range(slots):
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        q_len = (1, 1, 64, 4)[kind]
        if start + q_len > tokens:
            continue
        top = 3 * rows if ring else rows
        kv_end = int(torch.randint(q_len, top + 1, (1,), generator=gen))
        segments.append((start, q_len, cols[s], kv_end))
        start += q_len + int(torch.randint(0, 2, (1,), generator=gen))
    return tuple(segments)


#: The mixed-step shape of config on the H200: 128-row tiles, 16-row ones for decode tokens, descriptor loads.
GPU_TMA = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "MAX_SPLITS": 64, "MIN_CHUNK": 256,
           "TARGET_WAVES": 4, "SHORT_M": 16, "KV_TMA": True}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, GPU_TMA], ids=["dispatcher", "short-tma"])
@pytest.mark.parametrize("ring", [False, True], ids=["flat", "ring"])
def test_cuda_graph_replays_any_mix(ring, config):
    rows, slots, tokens = 4096, 16, 256
    window = rows - 63 if ring else None
    base = Mix(_gpu_mix(0, slots=slots, tokens=tokens, rows=rows, ring=ring), tokens=tokens, rows=rows,
               cols=slots + 1, kv_heads=8, group=4, head_dim=128, window=window, ring=ring, dtype=torch.bfloat16,
               slots=slots)  # fmt: skip
    q, k, v, seq_info = make_inputs(base, tail=0.0, device="cuda")
    out = torch.empty_like(q)
    pin = use_config("varlen_sdpa", config) if config else contextlib.nullcontext()
    with pin:
        varlen_attention(q, k, v, seq_info, out=out, **base.kwargs)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            varlen_attention(q, k, v, seq_info, out=out, **base.kwargs)
    for seed in range(1, 6):
        mix = dataclasses.replace(base, segments=_gpu_mix(seed, slots=slots, tokens=tokens, rows=rows, ring=ring))
        _, _, _, table = make_inputs(mix, device="cuda")
        seq_info.copy_(table)
        out.fill_(NAN)
        graph.replay()
        with use_config("varlen_sdpa", config) if config else contextlib.nullcontext():
            eager = varlen_attention(q, k, v, seq_info, **mix.kwargs)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"seed {seed}: replay differs from eager"
        problem = compare(out, varlen_reference(q, k, v, seq_info, **mix.kwargs), q.dtype)
        assert problem is None, f"seed {seed}: {problem}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "segments, rows, group, head_dim, kwargs",
    [
        (((0, 1, 0, 32768), (1, 1, 1, 1000), (2, 512, 2, 20000), (514, 1, 3, 7)), 32768, 4, 128, {}),
        (((0, 1, 0, 8191), (1, 128, 1, 4000)), 8192, 8, 64, {"window": 1024}),
        (((0, 1, 0, 70000), (1, 256, 1, 9000)), 4096, 4, 128, {"window": 3841, "ring": True}),
        (((0, 4, 0, 5000), (4, 4, 1, 300)), 8192, 1, 256, {"causal": False}),
    ],
    ids=["decode-heavy-long", "window-d64-gqa8", "ring-wrap", "draft-d256"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", [None, GPU_TMA], ids=["dispatcher", "short-tma"])
def test_gpu_bigger_shapes(segments, rows, group, head_dim, kwargs, dtype, config):
    tokens = max(s + n for s, n, _, _ in segments) + 3
    mix = Mix(segments, tokens=tokens, rows=rows, cols=len(segments) + 1, kv_heads=8, group=group,
              head_dim=head_dim, dtype=dtype, **kwargs)  # fmt: skip
    if config is not None and head_dim == 256:
        config = {**config, "BLOCK_M": 64, "num_warps": 4, "num_stages": 2}
    out, expected = run_and_compare(mix, config)
    # Within about twice the error of PyTorch's own SDPA in the same dtype against fp64, per segment.
    q, k, v, _ = make_inputs(mix, tail=0.0)
    for q_start, q_len, col, kv_end in segments:
        keys, values, positions = segment_keys(k, v, col, kv_end, ring=mix.ring)
        q_pos = torch.arange(kv_end - q_len, kv_end, device="cuda")
        visible = torch.ones(q_len, len(positions), dtype=torch.bool, device="cuda")
        if mix.causal:
            visible &= positions[None, :] <= q_pos[:, None]
        if mix.window is not None:
            visible &= positions[None, :] > q_pos[:, None] - mix.window
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q[q_start : q_start + q_len].transpose(0, 1),
            keys.transpose(0, 1).repeat_interleave(group, 0),
            values.transpose(0, 1).repeat_interleave(group, 0),
            attn_mask=visible,
        ).transpose(0, 1)
        rows_ = slice(q_start, q_start + q_len)
        sdpa_err = float((sdpa.double() - expected[rows_]).abs().max())
        err = float((out[rows_].double() - expected[rows_]).abs().max())
        # Half an ulp of the largest output: the rounding no implementation avoids.
        floor = torch.finfo(dtype).eps / 2 * float(expected[rows_].abs().max())
        assert err <= 2 * max(sdpa_err, floor), (err, sdpa_err, floor)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [SPLIT, {}], ids=["split", "default"])
def test_gpu_head_offsets_past_int32(config):
    """q and out as [T, Hq, D] views of [Hq, T, D] buffers: head offsets pass 2**31 elements."""
    heads, kv_heads, tokens, dim, rows = 32, 4, 557056, 128, 512
    assert (heads - 1) * tokens * dim >= 2**31
    gen = torch.Generator(device="cuda").manual_seed(15)
    q = torch.randn(heads, tokens, dim, generator=gen, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    out = torch.full((heads, tokens, dim), NAN, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    k = torch.randn(rows, 2, kv_heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(rows, 2, kv_heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    # Two segments at the end of the step (the largest offsets); every row before them is uncovered.
    segments = ((tokens - 9, 1, 1, 300), (tokens - 5, 5, 0, rows))
    seq_info = torch.tensor(segments, dtype=torch.int32, device="cuda")
    with use_config("varlen_sdpa", config):
        varlen_attention(q, k, v, seq_info, out=out)
    assert bool(torch.isfinite(out).all()), "some rows were never written"
    assert not bool(out[: tokens - 9].any()) and not bool(out[tokens - 8 : tokens - 5].any())
    for q_start, q_len, col, kv_end in segments:
        keys, values, positions = segment_keys(k, v, col, kv_end, ring=False)
        q_positions = torch.arange(kv_end - q_len, kv_end, device="cuda")
        rows_ = slice(q_start, q_start + q_len)
        expected = sequence_reference(q[rows_], keys, values, q_positions, positions)
        assert compare(out[rows_], expected, q.dtype) is None


# ---- the short tile and descriptor loads ------------------------------------------------------------

#: Short segments (new tokens fitting 16 rows) in 16-row tiles, the rest in 32-row ones, with splits.
SHORT = {**SPLIT, "BLOCK_M": 32, "SHORT_M": 16}


@pytest.mark.parametrize("mix", MODE_CASES)
def test_short_tile_matches_reference(many_sms, monkeypatch, mix):
    """Short segments (q_len <= 16 // group) take the 16-row tile and the rest the 32-row one; seven
    of the modes mix both in one launch (in the other four every segment fits the short tile), so a
    wrong row, token or workspace mapping in either tile fails here."""
    monkeypatch.setattr(varlen_launch, "workspace", lambda n, dev: torch.full((n,), NAN, device=dev))
    run_and_compare(mix, SHORT)


@pytest.mark.parametrize("mix", MODE_CASES)
def test_kv_tma_matches_reference(many_sms, monkeypatch, mix):
    """K/V through tensor descriptors (the interpreter runs them) where the layout allows, pointer
    loads elsewhere (ring stores, head dims that are not powers of two); NaN past kv_end as always."""
    built = []
    real = varlen_launch.unchecked_descriptor
    monkeypatch.setattr(varlen_launch, "unchecked_descriptor", lambda t, box: built.append(box) or real(t, box))
    run_and_compare(mix, {**SHORT, "KV_TMA": True})
    flat_pow2 = not mix.ring and mix.head_dim in (64, 128)
    assert bool(built) == flat_pow2
    if built:
        assert built[0] == [16, 1, 1, mix.head_dim]


@pytest.mark.parametrize("tail", [3e4, float("inf"), NAN], ids=["huge", "inf", "nan"])
def test_kv_tma_garbage_past_kv_end_is_never_read(many_sms, tail):
    """A descriptor box reads whole rows past kv_end (and zeros past the store): none of it may count."""
    mix = Mix(((0, 2, 1, 21), (2, 1, 0, 34), (3, 7, 2, 39)), tokens=10, rows=40, cols=3, group=2)
    run_and_compare(mix, {**SHORT, "KV_TMA": True}, tail=tail)
    run_and_compare(mix, {**NO_SPLIT, "KV_TMA": True}, tail=tail)


def test_kv_tma_reads_each_kv_heads_column(many_sms, monkeypatch):
    """Several KV heads with GQA: the descriptor coordinate [pos, col, head, 0] picks the right head."""
    built = []
    real = varlen_launch.unchecked_descriptor
    monkeypatch.setattr(varlen_launch, "unchecked_descriptor", lambda t, box: built.append(box) or real(t, box))
    mix = Mix(((0, 1, 2, 30), (1, 6, 0, 37), (7, 2, 1, 9)), tokens=10, rows=40, cols=3, kv_heads=4, group=2)
    run_and_compare(mix, {**SHORT, "KV_TMA": True})
    assert built, "the flat store should have taken descriptors"


def test_kv_tma_misaligned_store_keeps_pointer_loads(many_sms, monkeypatch):
    """A store whose data starts 8 bytes past a 16-byte boundary cannot be a descriptor's base: the
    launch keeps pointer loads (no TensorDescriptor assert) and the result is still right."""
    built = []
    real = varlen_launch.unchecked_descriptor
    monkeypatch.setattr(varlen_launch, "unchecked_descriptor", lambda t, box: built.append(box) or real(t, box))
    mix = Mix(((0, 1, 1, 20), (1, 4, 0, 31)), tokens=5, rows=32, cols=2, group=2)
    q, k, v, seq_info = make_inputs(mix)

    def shifted(store: torch.Tensor) -> torch.Tensor:
        flat = torch.empty(store.numel() + 4, dtype=store.dtype, device=store.device)
        view = flat[4:].view(store.shape)
        view.copy_(store)
        return view

    k8, v8 = shifted(k), shifted(v)
    assert k8.data_ptr() % 16 == 8
    out = torch.full_like(q, NAN)
    with use_config("varlen_sdpa", {**SHORT, "KV_TMA": True}):
        varlen_attention(q, k8, v8, seq_info, out=out)
    assert not built
    assert compare(out, varlen_reference(q, k, v, seq_info), q.dtype) is None
