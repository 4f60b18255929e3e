"""The varlen benchmark's workload and the implementations it times (see ``bench_varlen.py``).

A mix is one serving step: decode tokens and prefill chunks of sequences whose K/V live in a
``[rows, cols, Hkv, D]`` column store, with queries packed ``[T, Hq, D]``, decode tokens first.
:func:`build_workload` makes its inputs and the fp32 reference; :func:`implementations` returns
every way of computing it that the benchmark compares, each as a call to time plus a way to read
its output back as packed rows. Nothing here imports triton or a kernel at import time:
``bench_varlen.py`` chooses the interpreter first.
"""

from __future__ import annotations

import inspect
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _benchlib as bl
import torch
import torch.nn.functional as F

DTYPE = torch.bfloat16
KERNEL = "varlen_sdpa"


@dataclass(frozen=True)
class MixSpec:
    """One step's shape: decode sequences, prefill chunks and the range their KV lengths are drawn from."""

    name: str
    decodes: int
    chunks: int
    chunk: int
    kv_min: int
    kv_max: int
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    @property
    def sequences(self) -> int:
        return self.decodes + self.chunks


MIXES = {
    "mixed": MixSpec("mixed", decodes=28, chunks=4, chunk=512, kv_min=1024, kv_max=32768),
    "decode": MixSpec("decode", decodes=64, chunks=0, chunk=0, kv_min=4096, kv_max=16384),
}
SMOKE_MIXES = {
    "mixed": MixSpec("mixed", decodes=3, chunks=1, chunk=8, kv_min=16, kv_max=48, q_heads=4, kv_heads=2, head_dim=64),
    "decode": MixSpec("decode", decodes=4, chunks=0, chunk=0, kv_min=16, kv_max=40, q_heads=4, kv_heads=2, head_dim=64),
}

SERVED = "tritune varlen (dispatcher)"
PORTABLE = "tritune varlen portable default"
BEST = "tritune varlen best stored trial"
LOOP = "loop: tritune attention per sequence"
DEDICATED = "dedicated: batched decode + prefill per chunk"
FLEX = "FlexAttention (document mask)"
VARLEN_ATTN = "varlen_attn (packed KV)"
STANDIN = "varlen_attn smoke stand-in (SDPA math, packed KV)"
GATHER = "gather alone (store -> packed KV)"
#: Row kinds: tritune varlen itself, the alternatives it is compared with, and rows that only inform.
ALTERNATIVES = ("ours", "peer")


@dataclass
class Workload:
    """One mix's inputs on the device, its segments (packed order) and the fp32 reference output."""

    mix: MixSpec
    q: torch.Tensor  # [T, Hq, D]
    k_store: torch.Tensor  # [rows, cols, Hkv, D]
    v_store: torch.Tensor
    seq_info: torch.Tensor  # int32 [S, 4]: q_start, q_len, col, kv_end
    kv_ends: torch.Tensor  # int32 [S], the segments' kv_end
    segments: list[tuple[int, int, int, int]]
    #: int64 [sum kv_end]: the flat store rows (row * cols + col) of the packed KV, segment after segment.
    pack_index: torch.Tensor
    expected: torch.Tensor  # fp32 [T, Hq, D]
    kv_bytes: int

    @property
    def packed_len(self) -> int:
        return int(self.pack_index.numel())

    def flat(self, store: torch.Tensor) -> torch.Tensor:
        """The store as ``[rows * cols, Hkv, D]`` (a view)."""
        return store.view(-1, *store.shape[2:])


@dataclass
class Impl:
    name: str
    kind: str  # varlen | ours | peer | info | standin
    fn: Callable[[], torch.Tensor] | None
    #: The packed ``[T, Hq, D]`` output from what ``fn`` returned (identity by default).
    to_packed: Callable[[torch.Tensor], torch.Tensor] = lambda out: out
    #: Replaces the comparison with the reference (the gather row checks its packed KV instead).
    check: Callable[[torch.Tensor], str | None] | None = None
    note: str = ""
    #: Why it cannot run here (reported as unavailable); ``fn`` is then None.
    error: str = ""


def build_workload(mix: MixSpec, device: torch.device, seed: int) -> Workload:
    """Random store, queries and lengths for ``mix``; decode tokens packed first, columns shuffled."""
    from tritune.kernels.varlen.reference import varlen_reference

    cpu_gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(mix.kv_min, mix.kv_max + 1, (mix.sequences,), generator=cpu_gen).tolist()
    # The longest context is present, so the store is as deep as the mix allows.
    lengths[0] = mix.kv_max
    # One column per sequence plus the scratch column BatchedSequenceCache keeps.
    cols = mix.sequences + 1
    columns = torch.randperm(cols, generator=cpu_gen)[: mix.sequences].tolist()
    segments = []
    q_start = 0
    for i, (col, kv_end) in enumerate(zip(columns, lengths, strict=True)):
        q_len = 1 if i < mix.decodes else mix.chunk
        segments.append((q_start, q_len, col, kv_end))
        q_start += q_len
    tokens = q_start

    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (mix.kv_max, cols, mix.kv_heads, mix.head_dim)
    q = torch.randn(tokens, mix.q_heads, mix.head_dim, generator=gen, device=device, dtype=DTYPE)
    k_store = torch.randn(shape, generator=gen, device=device, dtype=DTYPE)
    v_store = torch.randn(shape, generator=gen, device=device, dtype=DTYPE)
    seq_info = torch.tensor(segments, dtype=torch.int32, device=device)
    pack_index = torch.cat([torch.arange(end, device=device) * cols + col for _, _, col, end in segments])
    expected = varlen_reference(q, k_store, v_store, seq_info, causal=True, dtype=torch.float32)
    return Workload(
        mix=mix,
        q=q,
        k_store=k_store,
        v_store=v_store,
        seq_info=seq_info,
        kv_ends=seq_info[:, 3].contiguous(),
        segments=segments,
        pack_index=pack_index,
        expected=expected,
        kv_bytes=2 * sum(lengths) * mix.kv_heads * mix.head_dim * DTYPE.itemsize,
    )


# ---- implementations -----------------------------------------------------------------------------


def implementations(w: Workload, best_trials: dict, flex: Any, smoke: bool) -> list[Impl]:
    """Everything the benchmark times on ``w``, in report order (built before any is timed)."""
    impls = [*_tritune_impls(w, best_trials), _loop_impl(w), _dedicated_impl(w)]
    if flex is not None:
        impls.append(_flex_impl(flex, w))
    impls.append(_varlen_attn_impl(w))
    if smoke:
        impls.append(_varlen_attn_impl(w, standin=True))
    impls.append(_gather_impl(w))
    return impls


def _tritune_impls(w: Workload, best_trials: dict) -> list[Impl]:
    """varlen_attention as the dispatcher serves it, its portable default, and the best stored trial."""
    from tritune.kernels import varlen_attention
    from tritune.kernels.device import device_info
    from tritune.kernels.registry import get_spec

    spec = get_spec(KERNEL)
    q, k, v, seq_info = w.q, w.k_store, w.v_store, w.seq_info
    facts = spec.facts(q, k, v, seq_info, causal=True)
    key = spec.key_for(device_info(q.device), tuple(facts))
    portable = spec.space.to_dict(spec.default_config(key))
    served = bl.served_config(spec, facts, q.device)
    best = best_trials.get((json.dumps(key.to_dict(), sort_keys=True), "portable"))

    def pinned(config: dict[str, Any]) -> Callable[[], torch.Tensor]:
        return bl.pinned_call(KERNEL, config, varlen_attention, q, k, v, seq_info, causal=True, out=torch.empty_like(q))

    out = torch.empty_like(q)

    def run_served() -> torch.Tensor:
        return varlen_attention(q, k, v, seq_info, causal=True, out=out)

    tag = "same as portable" if served == portable else "tuned"
    impls = [
        Impl(SERVED, "varlen", run_served, note=f"{tag}: {bl.config_text(served)}"),
        Impl(PORTABLE, "varlen", pinned(portable), note=bl.config_text(portable)),
    ]
    if best is not None and best not in (served, portable):
        impls.append(Impl(BEST, "varlen", pinned(best), note=f"pinned: {bl.config_text(best)}"))
    return impls


def _loop_impl(w: Workload) -> Impl:
    """One ``attention`` call per sequence (decode or prefill by routing) on views of the store and of q."""
    from tritune.kernels import attention

    out = torch.empty_like(w.q)
    calls = []
    for i, (q_start, q_len, col, _) in enumerate(w.segments):
        rows = slice(q_start, q_start + q_len)
        calls.append(
            (
                w.q[rows].transpose(0, 1)[None],  # [1, Hq, L, D]
                w.k_store[:, col].transpose(0, 1)[None],  # [1, Hkv, rows, D]
                w.v_store[:, col].transpose(0, 1)[None],
                w.kv_ends[i : i + 1],
                out[rows].transpose(0, 1)[None],
            )
        )

    def run() -> torch.Tensor:
        for q, k, v, kv_len, o in calls:
            attention(q, k, v, kv_len=kv_len, causal=True, out=o)
        return out

    return Impl(LOOP, "ours", run, note=f"{len(calls)} calls; decode steps routed to splitk_decode, chunks to prefill")


def _dedicated_impl(w: Workload) -> Impl:
    """Our dedicated kernels in their own layouts: one decode over a padded batch cache, one prefill per chunk."""
    from tritune.kernels import decode_attention, prefill_attention

    decodes = [s for s in w.segments if s[1] == 1]
    chunks = [s for s in w.segments if s[1] > 1]
    nd = len(decodes)
    assert [s[0] for s in decodes] == list(range(nd)), "decode tokens are packed first"
    out = torch.empty_like(w.q)
    # Padded to the store's depth, as a batch cache sized for the longest context is.
    cols = torch.tensor([col for _, _, col, _ in decodes], device=w.q.device)
    k_cache = w.k_store[:, cols].permute(1, 2, 0, 3).contiguous()  # [Bd, Hkv, rows, D]
    v_cache = w.v_store[:, cols].permute(1, 2, 0, 3).contiguous()
    q_dec, out_dec, kv_len = w.q[:nd, :, None], out[:nd, :, None], w.kv_ends[:nd]  # [Bd, Hq, 1, D] views
    prefills = []
    for q_start, q_len, col, kv_end in chunks:
        rows = slice(q_start, q_start + q_len)
        prefills.append(
            (
                w.q[rows].transpose(0, 1)[None],
                w.k_store[:kv_end, col].transpose(0, 1)[None].contiguous(),  # [1, Hkv, kv_end, D]
                w.v_store[:kv_end, col].transpose(0, 1)[None].contiguous(),
                out[rows].transpose(0, 1)[None],
            )
        )

    def run() -> torch.Tensor:
        if nd:
            decode_attention(q_dec, k_cache, v_cache, kv_len, out=out_dec)
        for q, k, v, o in prefills:
            prefill_attention(q, k, v, causal=True, out=o)
        return out

    from tritune.kernels.registry import get_spec

    decode, prefill = get_spec("splitk_decode"), get_spec("tma_prefill")
    device = w.q.device
    notes = []
    if nd:
        served = bl.served_config(decode, tuple(decode.facts(q_dec, k_cache, v_cache, kv_len, out=out_dec)), device)
        notes.append(f"decode_attention over [{nd}, Hkv, {k_cache.shape[2]}, D] ({bl.config_text(served)})")
    if prefills:
        q_pre, k_pre, v_pre, out_pre = prefills[0]
        served = bl.served_config(prefill, tuple(prefill.facts(q_pre, k_pre, v_pre, causal=True, out=out_pre)), device)
        notes.append(
            f"{len(prefills)} prefill_attention calls over contiguous [1, Hkv, kv_end, D] "
            f"(first: {bl.config_text(served)})"
        )
    return Impl(DEDICATED, "ours", run, note=" + ".join(notes) + "; caches built outside the timed region")


def _packed_kv(w: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every segment back to back, ``[sum kv_end, Hkv, D]`` (built outside the timed region)."""
    return w.flat(w.k_store)[w.pack_index], w.flat(w.v_store)[w.pack_index]


def _flex_impl(flex: Any, w: Workload) -> Impl:
    """flex_attention over the packed KV with a document mask: same segment, key position <= query position."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        device = w.q.device
        block = 128
        length = w.packed_len
        padded = -(-length // block) * block
        k_packed, v_packed = _packed_kv(w)
        k_flex = torch.zeros(1, w.mix.kv_heads, padded, w.mix.head_dim, device=device, dtype=DTYPE)
        v_flex = torch.zeros_like(k_flex)
        k_flex[0, :, :length] = k_packed.transpose(0, 1)
        v_flex[0, :, :length] = v_packed.transpose(0, 1)
        del k_packed, v_packed
        # Document id and position in its sequence of every query row and every key (padding: document -1).
        q_doc = torch.cat([torch.full((n,), s, dtype=torch.int32) for s, (_, n, _, _) in enumerate(w.segments)])
        q_pos = torch.cat([torch.arange(end - n, end, dtype=torch.int32) for _, n, _, end in w.segments])
        kv_doc = torch.full((padded,), -1, dtype=torch.int32)
        kv_doc[:length] = torch.cat(
            [torch.full((end,), s, dtype=torch.int32) for s, (*_, end) in enumerate(w.segments)]
        )
        kv_pos = torch.zeros(padded, dtype=torch.int32)
        kv_pos[:length] = torch.cat([torch.arange(end, dtype=torch.int32) for *_, end in w.segments])
        q_doc, q_pos, kv_doc, kv_pos = (t.to(device) for t in (q_doc, q_pos, kv_doc, kv_pos))

        def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (q_doc[q_idx] == kv_doc[kv_idx]) & (kv_pos[kv_idx] <= q_pos[q_idx])

        tokens = w.q.shape[0]
        block_mask = create_block_mask(document_causal, B=None, H=None, Q_LEN=tokens, KV_LEN=padded, device=device)
    except Exception as exc:
        return Impl(FLEX, "peer", None, error=f"building the block mask: {bl.error_text(exc)}")
    q_flex = w.q.transpose(0, 1)[None].contiguous()  # [1, Hq, T, D]

    def run() -> torch.Tensor:
        return flex(q_flex, k_flex, v_flex, block_mask=block_mask, enable_gqa=True)

    return Impl(
        FLEX,
        "peer",
        run,
        to_packed=lambda out: out[0].transpose(0, 1),
        note=f"torch.compile(flex_attention), enable_gqa; packed KV [1, Hkv, {padded}, D] built outside the "
        "timed region (add the gather row for the same store)",
    )


def _varlen_attn_impl(w: Workload, *, standin: bool = False) -> Impl:
    """varlen_attn on packed contiguous KV built outside the timed region, as FlexAttention's is.

    Both peers need the store's K/V packed; neither is charged for packing it (the gather row
    times that alone, for a reader who wants to add it).
    """
    name = STANDIN if standin else VARLEN_ATTN
    if standin:
        api: Callable[..., torch.Tensor] = _sdpa_varlen
        kwargs: dict[str, Any] = {}
        note = "CPU stand-in: the same packed KV and cu_seqlens, per-segment SDPA math with a bottom-right mask"
    else:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as exc:
            return Impl(name, "peer", None, error=f"torch {torch.__version__} has no varlen_attn ({exc})")
        api = varlen_attn
        try:
            kwargs, note = _varlen_attn_kwargs(api)
        except TypeError as exc:
            return Impl(name, "peer", None, error=str(exc))
    device = w.q.device
    k_packed, v_packed = _packed_kv(w)
    q_lens = [n for _, n, _, _ in w.segments]
    kv_lens = [end for *_, end in w.segments]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    max_q, max_k = max(q_lens), max(kv_lens)

    def run() -> torch.Tensor:
        return api(w.q, k_packed, v_packed, cu_q, cu_k, max_q, max_k, **kwargs)

    kind = "standin" if standin else "peer"
    return Impl(
        name,
        kind,
        run,
        note=f"{note}; packed KV [{w.packed_len}, Hkv, D] built outside the timed region (add the gather row "
        "for the same store)",
    )


def _varlen_attn_kwargs(api: Callable[..., torch.Tensor]) -> tuple[dict[str, Any], str]:
    """Causal and GQA arguments in the form this torch's varlen_attn takes them."""
    params = inspect.signature(api).parameters
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        raise TypeError(f"varlen_attn{inspect.signature(api)} takes neither window_size nor is_causal")
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs, ", ".join(f"{k}={v}" for k, v in kwargs.items()) + " (GQA native)"


def _sdpa_varlen(query, key, value, cu_q, cu_k, max_q, max_k) -> torch.Tensor:
    """varlen_attn's contract (causal, aligned bottom-right) through SDPA math, one segment at a time."""
    group = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()), strict=True):
        q = query[q0:q1].transpose(0, 1)
        k = key[k0:k1].transpose(0, 1).repeat_interleave(group, 0)
        v = value[k0:k1].transpose(0, 1).repeat_interleave(group, 0)
        position = torch.arange(k1 - k0 - (q1 - q0), k1 - k0, device=query.device)
        mask = torch.arange(k1 - k0, device=query.device)[None, :] <= position[:, None]
        out[q0:q1] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)
    return out


def _gather_impl(w: Workload) -> Impl:
    """The gather alone (what the packed-KV peers pay before attending), checked against the packed KV."""
    k_flat, v_flat = w.flat(w.k_store), w.flat(w.v_store)
    k_want, v_want = _packed_kv(w)
    k_buf, v_buf = torch.empty_like(k_want), torch.empty_like(v_want)

    def run() -> torch.Tensor:
        torch.index_select(k_flat, 0, w.pack_index, out=k_buf)
        torch.index_select(v_flat, 0, w.pack_index, out=v_buf)
        return k_buf

    def check(k_out: torch.Tensor) -> str | None:
        if torch.equal(k_out, k_want) and torch.equal(v_buf, v_want):
            return None
        return "gathered K/V differ from the packed K/V"

    return Impl(GATHER, "info", run, check=check, note="not attention: K+V index_select only, for reference")
