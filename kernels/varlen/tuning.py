"""How the tuner exercises ``varlen_sdpa``: problem mixes, the accuracy check, default keys, first tiles.

Imported by the tuner only (the declaration names it as ``tuning=``), never by a serving process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from tritune.search_spaces.varlen_sdpa import HEAD_DIMS, SPACE, VarlenConfig, block_m_for

from .._sdpa_peer import SdpaCall, bottom_right_causal, bound_arguments, fastest_sdpa
from ..declare import KernelTuning
from ..device import DeviceInfo
from ..spec import Peer, Problem, pow2_bucket
from .kernel import KERNEL, VarlenKey
from .reference import compare

__all__ = ["TUNED_KV_HEADS", "TUNING", "VarlenTuning", "segment_lengths"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: KV heads of the problems the tuner times on a GPU.
TUNED_KV_HEADS = 8
#: Store rows of the dense-reference problem on a GPU (the timed problem is cross-checked instead).
_CHECK_ROWS = 2048
#: Problem sizes on the interpreter.
_CPU_MAX_ROWS, _CPU_MAX_TOKENS, _CPU_MAX_SEGMENTS = 64, 32, 16
#: The mixes ``tune`` sweeps on a GPU, (T, S, store rows): 32 decodes over a 32K store, 64 decodes over a
#: 16K store (a batch of shorter contexts: three buckets away from the first, too far to borrow from it),
#: 28 decodes + 4 prefill chunks, 4 prefill chunks.
_GPU_MIXES = ((32, 32, 32768), (64, 64, 16384), (4096, 32, 32768), (2048, 4, 32768))
#: The mixes on the interpreter: 4 decodes, 32 rows of decodes and short chunks over 16 slots.
_CPU_MIXES = ((4, 4, 64), (32, 16, 64))
#: Prefill chunk lengths of the problems (tokens a chunked-prefill engine adds per step).
_GPU_MAX_CHUNK, _CPU_MAX_CHUNK = 512, 16
#: The M tiles of the space: the largest is what a prefill chunk's many tokens fill best.
_M_TILES = tuple(int(m) for m in SPACE.dimensions["BLOCK_M"])
_SMALLEST_M, _LARGEST_M = min(_M_TILES), max(_M_TILES)


def segment_lengths(tokens: int, segments: int, max_chunk: int) -> list[int]:
    """New tokens per segment of a key's mix: decode-only when T <= S, else prefill chunks (and decodes).

    Chunks share the width up to ``max_chunk`` tokens each (a chunked-prefill size); whatever
    they leave is padding, as in a step padded to its width bucket.
    """
    if tokens <= segments:
        return [1] * tokens
    # Few slots: every segment is a prefill chunk; many: one in eight is, the rest decode one token.
    chunks = segments if segments <= 8 else segments // 8
    decodes = segments - chunks
    share, extra = divmod(tokens - decodes, chunks)
    return [min(share + (i < extra), max_chunk) for i in range(chunks)] + [1] * decodes


def _visible_keys(q_len: int, kv_end: int, rows: int, causal: bool, window: int | None, ring: bool) -> int:
    """Keys the segment's queries see in all (for flop counts)."""
    first = max(0, kv_end - rows) if ring else 0
    total = 0
    for j in range(q_len):
        position = kv_end - q_len + j
        hi = position + 1 if causal else kv_end
        lo = max(first, position - window + 1) if window is not None else first
        total += max(0, hi - lo)
    return total


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


class VarlenTuning(KernelTuning):
    """Random mixes at a key's buckets, the dtype's tolerance, the default mixes and tile rules."""

    #: ``tune --key`` names for a step's sizes: the key field each sets, and its bucketing.
    key_aliases: ClassVar[dict[str, tuple[str, Callable[[int], int]]]] = {
        "tokens": ("t_bucket", lambda t: pow2_bucket(t, minimum=1)),
        "segments": ("s_bucket", lambda s: pow2_bucket(s, minimum=1)),
        "rows": ("rows_bucket", pow2_bucket),
    }

    def make_problem(self, key: VarlenKey, device: torch.device, seed: int) -> Problem:
        """A random mix at the key's buckets: T = t_bucket rows, S = s_bucket slots, rows_bucket store rows.

        T <= S: T decode tokens. Otherwise up to 8 slots are all prefill chunks sharing T; more
        slots hold one chunk per eight slots and decode tokens in the rest; chunks take at most 512
        tokens and leave the rest of the width as padding (32 slots, T 4096: 28 decodes and 4
        chunks of 512). KV lengths are drawn over the store (one sequence full length); a
        ring's run past it. On the interpreter: one KV head and tiny sizes.
        """
        return self._problem(key, torch.device(device), seed, max_rows=None)

    def check_problem(self, key: VarlenKey, device: torch.device, seed: int) -> Problem:
        """On a GPU, the same mix over at most 2048 store rows (the dense reference stays small)."""
        return self._problem(key, torch.device(device), seed, max_rows=_CHECK_ROWS)

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        """Within the dtype's tolerance of the fp64 reference (see ``reference.compare``); NaN never passes."""
        return compare(out, expected, problem.args[0].dtype)

    def _problem(self, key: VarlenKey, device: torch.device, seed: int, max_rows: int | None) -> Problem:
        dtype = _DTYPES[key.dtype]
        tokens, segments, rows = max(key.t_bucket, 1), max(key.s_bucket, 1), max(key.rows_bucket, 16)
        if device.type == "cpu":
            kv_heads = 1
            tokens, segments = min(tokens, _CPU_MAX_TOKENS), min(segments, _CPU_MAX_SEGMENTS)
            rows = min(rows, _CPU_MAX_ROWS)
        else:
            kv_heads = TUNED_KV_HEADS
            rows = min(rows, max_rows) if max_rows is not None else rows
        max_chunk = _CPU_MAX_CHUNK if device.type == "cpu" else _GPU_MAX_CHUNK
        lengths = [min(n, rows) for n in segment_lengths(tokens, segments, max_chunk)]
        window = None
        if key.windowed:
            window = max(1, rows - max(lengths) + 1) if key.ring else max(1, rows // 4)
        cpu_gen = torch.Generator().manual_seed(seed)

        def draw(low: int, high: int) -> int:
            return int(torch.randint(low, high + 1, (1,), generator=cpu_gen))

        # Columns and query ranges in random orders; the first segment drawn is full length.
        columns = torch.randperm(segments + 1, generator=cpu_gen)[: len(lengths)].tolist()
        order = torch.randperm(len(lengths), generator=cpu_gen).tolist()
        table = torch.zeros(segments, 4, dtype=torch.int32)
        q_start = 0
        visible = 0
        for slot, i in enumerate(order):
            q_len = lengths[i]
            top = 3 * rows if key.ring else rows
            kv_end = top if slot == 0 else draw(max(q_len, rows // 32, 1), top)
            table[slot] = torch.tensor([q_start, q_len, columns[i], kv_end], dtype=torch.int32)
            visible += _visible_keys(q_len, kv_end, rows, key.causal, window, key.ring)
            q_start += q_len
        gen = torch.Generator(device=device).manual_seed(seed)

        def normal(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

        q_heads = kv_heads * key.gqa_group
        q = normal(tokens, q_heads, key.head_dim)
        k_store = normal(rows, segments + 1, kv_heads, key.head_dim)
        v_store = normal(rows, segments + 1, kv_heads, key.head_dim)
        element = torch.finfo(dtype).bits // 8
        keys_read = sum(min(int(e), rows) for e in table[:, 3].tolist()) * kv_heads
        bytes_moved = (2 * keys_read * key.head_dim + 2 * q.numel()) * element
        return Problem(
            args=(q, k_store, v_store, table.to(device)),
            kwargs={"causal": key.causal, "window": window, "ring": key.ring, "softmax_scale": None},
            flops=4.0 * visible * q_heads * key.head_dim,
            bytes_moved=float(bytes_moved),
            flush_l2=True,
            # Always timed as CUDA-graph replays: a serving step is one captured launch, and eager
            # timing would count the host's launch cost wherever it outlasts the GPU work.
            launch_bound=True,
        )

    def default_keys(self, device: DeviceInfo) -> list[VarlenKey]:
        """GPU: bf16 causal GQA-4, D 128 and 64, at four mixes: 32 decode tokens (32K-row store), 64 decode
        tokens (16K rows), 28 decodes + 4 prefill chunks of 512 (width 4096, 32K rows), 4 chunks of 512 (width
        2048, 32K rows). Interpreter: D 64, GQA 2, tiny.
        """
        dims: tuple[int, ...]
        mixes: tuple[tuple[int, int, int], ...]
        if device.is_interpreter:
            dims, mixes, group = (64,), _CPU_MIXES, 2
        else:
            dims, mixes, group = (128, 64), _GPU_MIXES, 4
        return [
            VarlenKey(
                arch=device.arch,
                sm_count=device.sm_count,
                dtype="bf16",
                head_dim=d,
                gqa_group=group,
                causal=True,
                windowed=False,
                ring=False,
                t_bucket=pow2_bucket(t, minimum=1),
                s_bucket=pow2_bucket(s, minimum=1),
                rows_bucket=pow2_bucket(rows),
            )
            for d in dims
            for t, s, rows in mixes
        ]

    def valid_key(self, key: VarlenKey) -> bool:
        """A served dtype and head dim, a whole GQA group, and static power-of-two buckets (0 is symbolic)."""
        return (
            key.dtype in _DTYPES
            and key.head_dim in HEAD_DIMS
            and key.gqa_group >= 1
            and _is_pow2(key.t_bucket)
            and _is_pow2(key.s_bucket)
            and _is_pow2(key.rows_bucket)
            and key.rows_bucket >= 16
        )

    def starting_configs(self, key: VarlenKey, device: DeviceInfo) -> list[VarlenConfig]:
        """Tile shapes the key's mix calls for, measured first on a GPU (varlen candidates compile
        slowly, so a tune sees few trials a key, and the space is too large to sample at random).

        - A decode-only mix (T <= S: at most one new token a segment) in the M tile of one token's
          GQA group: a larger tile spends its MMAs on rows no token fills.
        - A mix with prefill chunks in the largest M tile, with the decode tokens in the short tile
          of one group (``SHORT_M``), and in the largest tile for every segment (one tile for all).
        - One warp per 16 rows of the M tile (at least 4); K/V through descriptors (``KV_TMA``) and
          through pointers alike, where the target, the store and the head dim allow descriptors.

        Every other field keeps the space's default; only the configs the space admits at ``key``.
        Measured winners are not listed here: they reach the tuner as stored winners.
        """
        if device.is_interpreter:
            return []
        group_tile = min(block_m_for(_SMALLEST_M, key.gqa_group), _LARGEST_M)
        if key.t_bucket <= key.s_bucket:
            tiles = [(group_tile, group_tile)]
        else:
            tiles = [(_LARGEST_M, group_tile), (_LARGEST_M, _LARGEST_M)]
        limits = KERNEL.limits(device)
        configs: list[VarlenConfig] = []
        for block_m, short_m in tiles:
            for kv_tma in (True, False):
                warps = min(8, max(4, block_m // 16))
                config = VarlenConfig(BLOCK_M=block_m, SHORT_M=short_m, num_warps=warps, KV_TMA=kv_tma)
                if config not in configs and SPACE.infeasible_reason(config, key, limits) is None:
                    configs.append(config)
        return configs

    def peer(self, key: VarlenKey, problem: Problem) -> Peer | None:
        """A loop of ``scaled_dot_product_attention`` calls, one per segment, on the fastest backend here.

        What a user without a varlen kernel writes: ``seq_info`` is read once (before timing), and
        each segment's queries attend its column's first ``kv_end`` store rows (views, no copies),
        bottom-right causal where the segment has several tokens; the results are written to
        the step's rows (rows no segment covers stay zero, as the kernel leaves them).
        ``None`` where such a loop would not compute what the kernel does: a ring store (a
        sequence's positions wrap around the store, out of order) or a window (each call would
        need a dense mask); a flat segment whose ``kv_end`` passes the store's rows; and query
        rows that see no key (fewer keys than the segment's tokens under causality, or none),
        which the kernel returns as zeros and SDPA as NaN.
        """
        call = bound_arguments(KERNEL.arguments, problem)
        if call.get("ring") or call.get("window") is not None:
            return None
        q, k_store, v_store = call["q"], call["k_store"], call["v_store"]
        causal, scale = call.get("causal", True), call.get("softmax_scale")
        rows = k_store.shape[0]
        segments: list[tuple[int, int]] = []
        calls: list[SdpaCall] = []
        for q_start, q_len, col, kv_end in call["seq_info"].tolist():
            if q_len <= 0:
                continue
            if kv_end > rows or kv_end <= 0 or (causal and kv_end < q_len):
                return None
            segments.append((q_start, q_len))
            calls.append(
                SdpaCall(
                    q[q_start : q_start + q_len].transpose(0, 1)[None],  # [1, Hq, q_len, D]
                    k_store[:kv_end, col].transpose(0, 1)[None],  # [1, Hkv, kv_end, D]
                    v_store[:kv_end, col].transpose(0, 1)[None],
                    bottom_right_causal(q_len, kv_end) if causal else None,
                    scale,
                )
            )
        out = torch.zeros_like(q)

        def assemble(outs: list[torch.Tensor]) -> torch.Tensor:
            for (q_start, q_len), part in zip(segments, outs, strict=True):
                out[q_start : q_start + q_len] = part[0].transpose(0, 1)
            return out

        return fastest_sdpa(calls, assemble, prefix="per-sequence ")


TUNING = VarlenTuning()
