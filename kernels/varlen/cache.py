"""A batched-sequence KV cache laid out for ``varlen_attention``.

Each layer stores K and V as ``[rows, max_seqs + 1, Hkv, D]``: one column per live sequence,
position ``p`` of a sequence at row ``p`` (flat layers) or ``p % rows`` (ring layers, for
sliding-window attention). The last column is scratch: the padded entries of a step's static width
write there, and no ``seq_info`` row ever points at it.

- Flat layers grow by whole rows (``grow_chunk`` at a time) as sequences lengthen, up to
  ``capacity`` positions.
- A ring layer with window ``W`` needs at most ``min(capacity, W + max_step - 1)`` rows: the
  oldest query of a step of ``max_step`` new tokens still finds its whole window there. It grows
  like a flat layer until it reaches that size, then wraps.

A serving step calls :meth:`BatchedSequenceCache.step` outside the graph (host bookkeeping, growth,
one small host-to-device copy into static buffers), then inside the graph :meth:`~BatchedSequenceCache.write`
(the new K/V, an ``index_put_``) and :meth:`~BatchedSequenceCache.attention` per layer. Growth
re-allocates storage: a CUDA graph captured before it still points at the old tensors and must be
captured again (watch :attr:`~BatchedSequenceCache.generation`), or pass ``grow_chunk=None`` to size
every layer for ``capacity`` up front.

Bad operations raise :class:`SequenceCacheError` (a ValueError) and leave the cache unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tritune.search_spaces.varlen_sdpa import HEAD_DIMS

from .kernel import KERNEL, varlen_attention

__all__ = ["BatchedSequenceCache", "SequenceCacheError", "StepPlan"]

#: Positions and lengths travel to the kernels as int32 (``seq_info``).
MAX_CAPACITY = 2**31 - 1


def _kernel_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes ``varlen_attention`` serves, as its declaration lists them for ``q`` (the stores follow q)."""
    for argument in KERNEL.arguments:
        if argument.name == "q":
            dtypes: tuple[torch.dtype, ...] = getattr(argument, "dtypes", ())
            return dtypes
    raise LookupError("varlen_attention declares no argument q")


_DTYPES = _kernel_dtypes()


class SequenceCacheError(ValueError):
    """An operation the cache refuses (unknown sequence, full cache, ring floor, bad counts)."""


@dataclass(frozen=True)
class StepPlan:
    """What one step needs on the device, and how its query rows are packed.

    The tensors are the cache's static buffers for this ``width``: every :meth:`BatchedSequenceCache.step`
    of the same width overwrites them in place, so a graph captured with them replays any later step.
    """

    #: int32 ``[max_seqs, 4]``: (q_start, q_len, col, kv_end) per segment; unused rows are zeros.
    seq_info: torch.Tensor
    #: int64 ``[width]``: the store column of each new token (the scratch column for padding).
    slot_cols: torch.Tensor
    #: int64 ``[width]`` per layer kind (window, ``None`` for flat): the store row of each new token.
    slot_rows: dict[int | None, torch.Tensor]
    width: int
    tokens: int
    #: (seq, q_start, q_len) of each segment, in the order of ``seq_info``'s rows.
    segments: tuple[tuple[int, int, int], ...]


class BatchedSequenceCache:
    """K/V storage for up to ``max_seqs`` sequences of up to ``capacity`` positions each.

    ``windows`` gives each layer's sliding window (``None``: a flat layer attending to every
    position); it defaults to all-flat ``num_layers`` layers. ``max_step`` bounds the new tokens
    one sequence brings in one step (ring layers are sized for it).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        max_seqs: int,
        capacity: int,
        max_step: int,
        windows: Sequence[int | None] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        grow_chunk: int | None = 256,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
            ("max_seqs", max_seqs), ("capacity", capacity), ("max_step", max_step),
        ):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SequenceCacheError(f"{name}: expected a positive int, got {value!r}")
        if capacity > MAX_CAPACITY:
            raise SequenceCacheError(
                f"capacity: expected at most {MAX_CAPACITY} positions (int32 on the device), got {capacity}"
            )
        if head_dim not in HEAD_DIMS:
            raise SequenceCacheError(
                f"head_dim: expected one of {HEAD_DIMS}, which varlen_attention serves, got {head_dim}"
            )
        if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
            raise SequenceCacheError(
                f"dtype: expected one of {list(_DTYPES)}, which varlen_attention serves, got {dtype!r}"
            )
        bad_chunk = isinstance(grow_chunk, bool) or not isinstance(grow_chunk, int) or grow_chunk < 1
        if grow_chunk is not None and bad_chunk:
            raise SequenceCacheError(f"grow_chunk: expected a positive int or None, got {grow_chunk!r}")
        layer_windows = [None] * num_layers if windows is None else list(windows)
        if len(layer_windows) != num_layers:
            raise SequenceCacheError(f"windows: expected one entry per layer ({num_layers}), got {len(layer_windows)}")
        for layer, w in enumerate(layer_windows):
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise SequenceCacheError(f"windows[{layer}]: expected a positive int or None, got {w!r}")
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.max_seqs = max_seqs
        self.capacity = capacity
        self.max_step = max_step
        self.dtype = dtype
        # An allocation resolves a bare "cuda" to the current device's index, as tensors report it.
        self.device = torch.empty(0, device=device).device
        self.grow_chunk = grow_chunk
        self._windows: list[int | None] = layer_windows
        #: Rows each layer kind ends at: capacity when flat, the ring size when windowed.
        self._caps = {w: self._cap(w) for w in set(layer_windows)}
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        for w in layer_windows:
            rows = self._caps[w] if grow_chunk is None else min(self._caps[w], grow_chunk)
            self._k.append(self._storage(rows))
            self._v.append(self._storage(rows))
        #: Bumped whenever storage is re-allocated (a captured graph must be captured again).
        self.generation = 0
        self._next_id = 0
        self._pos: dict[int, int] = {}
        self._col: dict[int, int] = {}
        #: Per sequence and ring kind: the oldest position its ring still holds.
        self._floor: dict[int, dict[int, int]] = {}
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor, dict[int | None, torch.Tensor]]] = {}

    # ---- layout ------------------------------------------------------------------------------

    @property
    def scratch_col(self) -> int:
        return self.max_seqs

    def window(self, layer: int) -> int | None:
        return self._windows[self._layer(layer)]

    def is_ring(self, layer: int) -> bool:
        return self.window(layer) is not None

    def rows(self, layer: int) -> int:
        return int(self._k[self._layer(layer)].shape[0])

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``[rows, max_seqs + 1, Hkv, D]`` K and V storage."""
        layer = self._layer(layer)
        return self._k[layer], self._v[layer]

    def _cap(self, window: int | None) -> int:
        return self.capacity if window is None else min(self.capacity, window + self.max_step - 1)

    def _storage(self, rows: int) -> torch.Tensor:
        shape = (rows, self.max_seqs + 1, self.kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise SequenceCacheError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    # ---- sequences ---------------------------------------------------------------------------

    def seqs(self) -> list[int]:
        """Live sequence ids, oldest first."""
        return list(self._pos)

    def pos(self, seq: int) -> int:
        """Positions the sequence holds (the next token's position)."""
        return self._pos[self._known(seq)]

    def _known(self, seq: int, name: str = "seq") -> int:
        # A bool would find sequence 0 or 1 (True == 1): ids are ints only.
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise SequenceCacheError(f"{name}: expected an int sequence id, got {seq!r}")
        if seq not in self._pos:
            raise SequenceCacheError(f"unknown sequence {seq!r}; live sequences: {self.seqs()}")
        return seq

    def _free_col(self) -> int:
        used = set(self._col.values())
        for col in range(self.max_seqs):
            if col not in used:
                return col
        raise SequenceCacheError(f"the cache already holds its maximum of {self.max_seqs} sequences")

    def _add(self, col: int, pos: int, floor: dict[int, int]) -> int:
        seq = self._next_id
        self._next_id += 1
        self._pos[seq] = pos
        self._col[seq] = col
        self._floor[seq] = dict(floor)
        return seq

    def seq_new(self) -> int:
        """A new empty sequence; returns its id (ids are never reused)."""
        return self._add(self._free_col(), 0, {w: 0 for w in self._caps if w is not None})

    def seq_rm(self, seq: int) -> None:
        """Forget a sequence and free its column (its rows are never read again)."""
        self._known(seq)
        del self._pos[seq], self._col[seq], self._floor[seq]

    def seq_clone(self, src: int) -> int:
        """A new sequence holding a device copy of ``src``'s positions (a fork, e.g. for beams)."""
        self._known(src, "src")
        col, src_col, pos = self._free_col(), self._col[src], self._pos[src]
        for layer in range(self.num_layers):
            rows = min(pos, self.rows(layer))
            for store in (self._k[layer], self._v[layer]):
                store[:rows, col] = store[:rows, src_col]
        return self._add(col, pos, self._floor[src])

    def rewind(self, seq: int, n: int) -> None:
        """Drop the last ``n`` positions of ``seq`` (rejected drafts).

        A ring layer must still hold the window the next token sees: rewinding past what it has
        already overwritten raises.
        """
        self._known(seq)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise SequenceCacheError(f"rewind: expected a non-negative int count, got {n!r}")
        pos = self._pos[seq]
        if n > pos:
            raise SequenceCacheError(f"rewind: sequence {seq} holds {pos} positions, cannot drop {n}")
        new = pos - n
        for window, floor in self._floor[seq].items():
            # The next token sees positions [new - window + 1, new): all must still be in the ring.
            needed = max(0, new - window + 1)
            if needed < min(new, floor):
                raise SequenceCacheError(
                    f"rewind: sequence {seq} back to position {new} needs position {needed} of its window-{window} "
                    f"ring, which holds positions from {floor} only"
                )
        self._pos[seq] = new
        for window, floor in self._floor[seq].items():
            # Below the new end the ring holds what it held; from there on, what the next steps write.
            self._floor[seq][window] = min(floor, new)

    # ---- steps -------------------------------------------------------------------------------

    def step(self, batch: Sequence[tuple[int, int]], *, width: int | None = None) -> StepPlan:
        """Plan a step adding ``count`` new tokens to each ``(seq, count)``, packed in list order.

        Grows storage where a sequence would outrun it, advances the positions and fills the static
        buffers of ``width`` (default: the step's token count) with the segments and write slots.
        The caller then writes each layer's new K/V (:meth:`write`) and attends (:meth:`attention`).
        The positions advance last, once nothing else can fail: a step that raises leaves them as
        they were (growth that ran out of memory half-way keeps the layers it grew, same contents,
        with :attr:`generation` bumped).
        """
        total = self._check_step(batch)
        width = total if width is None else width
        if isinstance(width, bool) or not isinstance(width, int) or width < total:
            raise SequenceCacheError(f"step: width {width!r} cannot hold the step's {total} tokens")

        info = torch.zeros(self.max_seqs, 4, dtype=torch.int32)
        positions = torch.zeros(width, dtype=torch.int64)
        cols = torch.full((width,), self.scratch_col, dtype=torch.int64)
        segments = []
        ends: dict[int, int] = {}
        q_start = 0
        for slot, (seq, count) in enumerate(batch):
            start, col = self._pos[seq], self._col[seq]
            end = ends[seq] = start + count
            if count:
                info[slot] = torch.tensor([q_start, count, col, end], dtype=torch.int32)
                positions[q_start : q_start + count] = torch.arange(start, end)
                cols[q_start : q_start + count] = col
            segments.append((seq, q_start, count))
            q_start += count
        rows = {w: positions if w is None else positions % self._caps[w] for w in self._caps}

        info_buf, cols_buf, rows_buf = self._step_buffers(width)
        pinned = self.device.type == "cuda"
        # Pinned staging makes the copies asynchronous; the host allocator keeps it alive until done.
        staged = [
            (target, host.pin_memory() if pinned else host)
            for target, host in ((info_buf, info), (cols_buf, cols), *((rows_buf[w], rows[w]) for w in rows))
        ]
        self._grow(max(ends.values(), default=0))
        for target, host in staged:
            target.copy_(host, non_blocking=pinned)
        for seq, end in ends.items():
            self._pos[seq] = end
            floors = self._floor[seq]
            for window in floors:
                floors[window] = max(floors[window], end - self._caps[window])
        return StepPlan(info_buf, cols_buf, rows_buf, width, total, tuple(segments))

    def _check_step(self, batch: Sequence[tuple[int, int]]) -> int:
        """Refuse a malformed step (naming the entry); returns its token count."""
        seen: set[int] = set()
        total = 0
        for i, entry in enumerate(batch):
            if not isinstance(entry, tuple | list) or len(entry) != 2:
                raise SequenceCacheError(f"step: expected (seq, new_token_count) pairs, got {entry!r}")
            seq, count = entry
            self._known(seq, f"step: batch[{i}]")
            if seq in seen:
                raise SequenceCacheError(f"step: sequence {seq} appears twice")
            seen.add(seq)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise SequenceCacheError(f"step: sequence {seq}: expected a non-negative int count, got {count!r}")
            if count > self.max_step:
                raise SequenceCacheError(f"step: sequence {seq}: {count} new tokens exceed max_step={self.max_step}")
            if self._pos[seq] + count > self.capacity:
                raise SequenceCacheError(
                    f"step: sequence {seq} would hold {self._pos[seq] + count} positions; capacity is {self.capacity}"
                )
            total += count
        return total

    def _step_buffers(self, width: int) -> tuple[torch.Tensor, torch.Tensor, dict[int | None, torch.Tensor]]:
        buffers = self._buffers.get(width)
        if buffers is None:
            info = torch.zeros(self.max_seqs, 4, dtype=torch.int32, device=self.device)
            cols = torch.zeros(width, dtype=torch.int64, device=self.device)
            rows = {w: torch.zeros(width, dtype=torch.int64, device=self.device) for w in self._caps}
            buffers = self._buffers[width] = (info, cols, rows)
        return buffers

    def _grow(self, needed: int) -> None:
        """Re-allocate the layers whose rows cannot hold ``needed`` positions (flat) or have not wrapped yet (ring)."""
        grown = False
        try:
            # Layer by layer, so growing needs spare memory for one layer's stores, not the cache's.
            for layer, window in enumerate(self._windows):
                rows, cap = self.rows(layer), self._caps[window]
                if needed <= rows or rows >= cap:
                    continue
                chunk = self.grow_chunk or cap
                new_rows = min(cap, -(-needed // chunk) * chunk)
                for stores in (self._k, self._v):
                    bigger = self._storage(new_rows)
                    bigger[:rows] = stores[layer]
                    stores[layer] = bigger
                    grown = True
        finally:
            # Even when an allocation fails part-way: a graph captured before holds replaced tensors.
            if grown:
                self.generation += 1

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, plan: StepPlan) -> None:
        """Store the step's new K/V (``[width, Hkv, D]``, packed like q) for ``layer``: in-graph, no sync."""
        layer = self._layer(layer)
        expected = (plan.width, self.kv_heads, self.head_dim)
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != expected:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise SequenceCacheError(f"write: {name}: expected shape {expected}, got {shape}")
            if t.dtype != self.dtype or t.device != self.device:
                raise SequenceCacheError(
                    f"write: {name}: expected {self.dtype} on {self.device}, got {t.dtype} on {t.device}"
                )
        index = (plan.slot_rows[self._windows[layer]], plan.slot_cols)
        self._k[layer].index_put_(index, k_new)
        self._v[layer].index_put_(index, v_new)

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        plan: StepPlan,
        *,
        causal: bool = True,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``varlen_attention`` of the step's packed ``q [width, Hq, D]`` over ``layer``'s storage."""
        # The plan's segments index q's rows: fewer rows would shift every position (and the
        # causal mask with it), so q must have exactly the width the plan was made for.
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] != plan.width:
            shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise SequenceCacheError(
                f"attention: q: expected shape [{plan.width}, Hq, D] (the plan's width), got {shape}"
            )
        k, v = self.kv(layer)
        window = self.window(layer)
        return varlen_attention(
            q, k, v, plan.seq_info, causal=causal, window=window, ring=window is not None,
            softmax_scale=softmax_scale, out=out,
        )  # fmt: skip
