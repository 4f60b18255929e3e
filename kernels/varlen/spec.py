"""The ``varlen_sdpa`` kernel spec: its key, facts, launch, reference and tuning problems."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tritune.search_spaces.varlen_sdpa import HEAD_DIMS, SPACE, VarlenConfig, portable_config, short_block_m

from ..device import DeviceInfo, target_supports
from ..spec import KernelSpec, Problem, TuningKey, pow2_bucket
from ._triton_varlen import _varlen_fwd_kernel, _varlen_merge_kernel
from .op import DTYPE_NAMES, DYNAMIC, KERNEL, VarlenFacts, check_inputs, launch
from .reference import compare, varlen_reference

_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
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
#: Prefill chunk lengths of the problems (tokens a chunked-prefill engine adds per step).
_GPU_MAX_CHUNK, _CPU_MAX_CHUNK = 512, 16


def _bucket(n: int, minimum: int) -> int:
    return DYNAMIC if n == DYNAMIC else pow2_bucket(n, minimum=minimum)


@dataclass(frozen=True)
class VarlenKey(TuningKey):
    dtype: str
    head_dim: int
    #: Query heads per KV head (not ``group``: that name is TuningKey.group(), the bucket group).
    gqa_group: int
    causal: bool
    windowed: bool
    ring: bool
    #: The step's static width T, rounded up to a power of two (0: symbolic under torch.compile).
    t_bucket: int
    #: The static number of segment slots S, rounded up to a power of two (0: symbolic).
    s_bucket: int
    #: Store rows, rounded up to a power of two (0: symbolic); the true lengths live on the device.
    rows_bucket: int

    BUCKETS: ClassVar[tuple[str, ...]] = ("t_bucket", "s_bucket", "rows_bucket")


def _key_for(arch: str, sm_count: int, facts: tuple[Any, ...]) -> VarlenKey:
    f = VarlenFacts(*facts)
    return VarlenKey(
        arch=arch,
        sm_count=sm_count,
        dtype=f.dtype,
        head_dim=f.head_dim,
        gqa_group=f.q_heads // f.kv_heads,
        causal=f.causal,
        windowed=f.windowed,
        ring=f.ring,
        t_bucket=_bucket(f.tokens, 1),
        s_bucket=_bucket(f.segments, 1),
        rows_bucket=_bucket(f.rows, 16),
    )


def _segment_lengths(tokens: int, segments: int, max_chunk: int) -> list[int]:
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


class VarlenSpec(KernelSpec[VarlenConfig, VarlenKey]):
    name = KERNEL
    jit_kernels = (_varlen_fwd_kernel, _varlen_merge_kernel)
    protocol = 1
    key_type = VarlenKey
    space = SPACE

    # ---- the runtime half --------------------------------------------------------------

    def facts(
        self,
        q: torch.Tensor,
        k_store: torch.Tensor,
        v_store: torch.Tensor,
        seq_info: torch.Tensor,
        *,
        causal: bool = True,
        window: int | None = None,
        ring: bool = False,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> VarlenFacts:
        return check_inputs(
            q, k_store, v_store, seq_info, causal=causal, window=window, ring=ring, softmax_scale=softmax_scale, out=out
        )

    def key_for(self, device: DeviceInfo, facts: tuple[Any, ...]) -> VarlenKey:
        return _key_for(device.arch, device.sm_count, tuple(facts))

    def default_config(self, key: VarlenKey) -> VarlenConfig:
        return portable_config(key, interpreter=key.arch == "cpu-interpreter")

    def serveable(self, config: VarlenConfig, device: DeviceInfo, facts: tuple[Any, ...]) -> VarlenConfig:
        """A pinned ``KV_TMA`` config keeps pointer loads where the target lacks tensor-memory loads
        (before SM90, ROCm, or a ``TORCH_CUDA_ARCH_LIST`` naming an older GPU); the interpreter runs
        descriptors. The launch also keeps pointer loads for ring stores and while tracing."""
        if config.KV_TMA and not (device.is_interpreter or target_supports(device, (9, 0))):
            return dataclasses.replace(config, KV_TMA=False)
        return config

    def launch(
        self,
        config: VarlenConfig,
        q: torch.Tensor,
        k_store: torch.Tensor,
        v_store: torch.Tensor,
        seq_info: torch.Tensor,
        *,
        causal: bool = True,
        window: int | None = None,
        ring: bool = False,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        launch(config, q, k_store, v_store, seq_info, out, causal=causal, window=window, ring=ring, softmax_scale=scale)
        return out

    # ---- the tuning half ---------------------------------------------------------------

    def reference(
        self,
        q: torch.Tensor,
        k_store: torch.Tensor,
        v_store: torch.Tensor,
        seq_info: torch.Tensor,
        *,
        causal: bool = True,
        window: int | None = None,
        ring: bool = False,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return varlen_reference(
            q, k_store, v_store, seq_info, causal=causal, window=window, ring=ring, softmax_scale=softmax_scale
        )

    def check(self, out: torch.Tensor, expected: torch.Tensor, problem: Problem, config: Any = None) -> str | None:
        """Within the dtype's tolerance of the fp64 reference (see ``reference.compare``); NaN never passes."""
        return compare(out, expected, problem.args[0].dtype)

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
        lengths = [min(n, rows) for n in _segment_lengths(tokens, segments, max_chunk)]
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

    def starting_configs(self, key: VarlenKey, device: DeviceInfo) -> list[VarlenConfig]:
        """Configs the tuner measures first on a GPU, where the space is too large to search at random.

        Varlen candidates compile slowly, so a tune sees few trials a key. Decode-only mixes (at most
        one new token a segment) favour small M tiles and few splits; mixes with prefill chunks favour
        prefill-sized tiles with a short tile for their decode segments (``SHORT_M``) and descriptor
        loads (``KV_TMA``). Measured and gated like any other proposal; only those the space admits
        at ``key``.
        """
        if device.is_interpreter:
            return []
        few_splits = {"MAX_SPLITS": 4, "MIN_CHUNK": 512, "num_stages": 4, "num_warps": 4}
        # Prefill-sized tiles with decode tokens in 16-row ones, K/V through descriptors (SM90+):
        # what tma_prefill's winners look like, plus the short tile this kernel adds.
        prefill_tiles = {"BLOCK_M": 128, "num_warps": 8, "num_stages": 3, "MAX_SPLITS": 64, "MIN_CHUNK": 256,
                         "TARGET_WAVES": 4, "SHORT_M": 16}
        starts = [
            {**prefill_tiles, "BLOCK_N": 128, "KV_TMA": True},
            {**prefill_tiles, "BLOCK_N": 64, "KV_TMA": True},
            {**few_splits, "BLOCK_M": 64, "BLOCK_N": 64, "TARGET_WAVES": 1},
            # One prefill-sized tile for every segment (no short tile): the mixed step's layout before SHORT_M.
            {"BLOCK_M": 128, "BLOCK_N": 128, "MAX_SPLITS": 64, "MIN_CHUNK": 2048, "TARGET_WAVES": 4, "num_stages": 3,
             "num_warps": 8, "SHORT_M": 128},
        ]  # fmt: skip
        if key.t_bucket <= key.s_bucket:
            starts[:0] = [
                {**few_splits, "BLOCK_M": 16, "BLOCK_N": 128, "TARGET_WAVES": 4, "MIN_CHUNK": 128, "num_stages": 3,
                 "KV_TMA": True},
                {**few_splits, "BLOCK_M": 16, "BLOCK_N": 16, "TARGET_WAVES": 4},
                {**few_splits, "BLOCK_M": 16, "BLOCK_N": 64, "TARGET_WAVES": 2},
            ]  # fmt: skip
        limits = self.limits(device)
        configs = []
        for values in starts:
            config = self.space.parse(values)
            # A wide GQA group raises both tiles to whole groups: seed the space's canonical short
            # tile for it (SHORT_M=16 would be refused as a duplicate at groups above 16).
            configs.append(dataclasses.replace(config, SHORT_M=short_block_m(config, key.gqa_group)))
        return [c for c in configs if self.space.infeasible_reason(c, key, limits) is None]

    def default_keys(self, device: DeviceInfo, head_dims: int | Iterable[int] | None = None) -> list[VarlenKey]:
        """GPU: bf16 causal GQA-4, D 128 and 64, at four mixes: 32 decode tokens (32K-row store), 64 decode
        tokens (16K rows), 28 decodes + 4 prefill chunks of 512 (width 4096, 32K rows), 4 chunks of 512 (width
        2048, 32K rows). Interpreter: D 64, GQA 2, tiny.
        """
        if head_dims is None:
            dims = [64] if device.is_interpreter else [128, 64]
        else:
            dims = [head_dims] if isinstance(head_dims, int) else [int(d) for d in head_dims]
        for d in dims:
            if d not in HEAD_DIMS:
                raise ValueError(f"head_dims: {d} is not served; expected one of {HEAD_DIMS}")
        if device.is_interpreter:
            mixes, group = ((4, 4, 64), (32, 16, 64)), 2
        else:
            mixes, group = _GPU_MIXES, 4
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


SPEC = VarlenSpec()
