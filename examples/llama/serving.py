"""Many sequences at once: each step packs decode tokens and prefill chunks into one ``varlen_attention``.

:class:`BatchedServer` keeps the K/V of every live sequence in a ``BatchedSequenceCache`` (one
column per sequence) and runs a step of any mix of sequences and token counts as one forward of
``width`` packed rows, the smallest of its ``widths`` that holds the step. The cache plans the step
on the host (positions, write slots, the int32 ``seq_info`` table, copied into static per-width
buffers); everything after that reads device buffers only, so on a GPU the forward of each width
(and logits mode) is captured once in a CUDA graph and replayed for any later step of that width,
whatever its mix. The caches are then sized for ``capacity`` up front, so that storage never moves
under a captured graph.

:func:`serve_greedy` is a small scheduler on top: it admits prompts, feeds their prefill chunks
and decode tokens step by step, clones and removes sequences as asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tritune.kernels import BatchedSequenceCache

from .graphs import run_then_capture
from .model import LlamaModel


@dataclass
class _WidthBuffers:
    """The static inputs and outputs of one step width and logits mode."""

    tokens: torch.Tensor
    logit_rows: torch.Tensor
    logits: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    generation: int = -1


class BatchedServer:
    """Batched serving of up to ``max_seqs`` sequences of up to ``capacity`` positions.

    ``max_step`` bounds the tokens one sequence brings to one step (its prefill chunk);
    ``widths`` are the packed step widths (default: powers of two up to ``max_seqs * max_step``).
    ``graphs`` (default: on a CUDA device) captures each width's step after its first run.
    """

    def __init__(
        self,
        model: LlamaModel,
        *,
        max_seqs: int,
        capacity: int,
        max_step: int,
        widths: Sequence[int] | None = None,
        graphs: bool | None = None,
    ) -> None:
        cfg = model.config
        if capacity > model.max_positions:
            raise ValueError(f"capacity: {capacity} exceeds the model's {model.max_positions} positions")
        self.model = model
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        self.max_seqs = max_seqs
        self.cache = BatchedSequenceCache(
            num_layers=cfg.layers, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, max_seqs=max_seqs,
            capacity=capacity, max_step=max_step, dtype=model.dtype, device=model.device,
            grow_chunk=None if self.graphs else 256,
        )  # fmt: skip
        most = max_seqs * max_step
        powers = {min(1 << i, most) for i in range(most.bit_length() + 1)}
        self.widths = sorted(set(widths) if widths else powers)
        if self.widths[0] < 1:
            raise ValueError(f"widths: expected positive step widths, got {list(widths or [])}")
        self._buffers: dict[tuple[int, bool], _WidthBuffers] = {}
        # Steps run one after another: their graphs can share one memory pool.
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None

    # ---- sequences -----------------------------------------------------------------------------

    def add(self) -> int:
        """A new empty sequence; its id."""
        return self.cache.seq_new()

    def clone(self, seq: int) -> int:
        """A new sequence holding a copy of ``seq``'s positions (a fork); its id."""
        return self.cache.seq_clone(seq)

    def remove(self, seq: int) -> None:
        self.cache.seq_rm(seq)

    def length(self, seq: int) -> int:
        return self.cache.pos(seq)

    # ---- steps ---------------------------------------------------------------------------------

    def step(self, batch: Sequence[tuple[int, Sequence[int]]], *, all_logits: bool = False) -> list[torch.Tensor]:
        """Append each ``(seq, tokens)`` of ``batch`` and return each entry's float32 logits.

        An entry's logits are ``[1, vocab]`` for its last token, or ``[len(tokens), vocab]`` with
        ``all_logits``. They are views of a static buffer that the next step of the same width
        overwrites.
        """
        counts = []
        for seq, tokens in batch:
            if len(tokens) == 0:
                raise ValueError(f"batch: sequence {seq} brings no tokens")
            self.model.check_tokens(tokens, f"batch: sequence {seq}")
            counts.append((seq, len(tokens)))
        total = sum(count for _, count in counts)
        width = next((w for w in self.widths if w >= total), None)
        if width is None:
            raise ValueError(f"batch: {total} tokens exceed the widest step ({self.widths[-1]})")
        # The cache checks the batch (known sequences, max_step, capacity) before it changes anything.
        plan = self.cache.step(counts, width=width)
        buffers = self._buffers_for(width, all_logits)
        packed = [token for _, tokens in batch for token in tokens] + [0] * (width - total)
        self._upload(buffers.tokens, packed)
        if not all_logits:
            last = [q_start + q_len - 1 for _, q_start, q_len in plan.segments]
            self._upload(buffers.logit_rows, last + [0] * (len(buffers.logit_rows) - len(last)))

        cache = self.cache

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write(layer, k, v, plan)
            return cache.attention(layer, q, plan)

        def run() -> None:
            # For a flat cache a token's store row is its position: the plan's rows are RoPE's positions.
            positions = plan.slot_rows[None]
            logits = self.model.forward(buffers.tokens, positions, attend, logit_rows=buffers.logit_rows)
            buffers.logits.copy_(logits)

        if buffers.graph is not None and buffers.generation == cache.generation:
            buffers.graph.replay()
        elif self.graphs:
            buffers.graph, buffers.generation = run_then_capture(run, self.model.device, self._pool), cache.generation
        else:
            run()
        if all_logits:
            return [buffers.logits[q_start : q_start + q_len] for _, q_start, q_len in plan.segments]
        return [buffers.logits[i : i + 1] for i in range(len(plan.segments))]

    def _buffers_for(self, width: int, all_logits: bool) -> _WidthBuffers:
        key = (width, all_logits)
        if key not in self._buffers:
            device, vocab = self.model.device, self.model.config.vocab
            # Every sequence brings a token: a step of ``width`` rows has at most that many last
            # tokens, so the head runs on no more (a fixed count per width, as a graph needs).
            rows = width if all_logits else min(width, self.max_seqs)
            self._buffers[key] = _WidthBuffers(
                tokens=torch.zeros(width, dtype=torch.int64, device=device),
                logit_rows=torch.arange(rows, dtype=torch.int64, device=device),
                logits=torch.zeros(rows, vocab, dtype=torch.float32, device=device),
            )
        return self._buffers[key]

    def _upload(self, target: torch.Tensor, values: list[int]) -> None:
        host = torch.tensor(values, dtype=target.dtype)
        pinned = target.device.type == "cuda"
        # Pinned staging makes the copy asynchronous (the caching host allocator keeps it alive).
        target.copy_(host.pin_memory() if pinned else host, non_blocking=pinned)


@dataclass
class _Request:
    pending: list[int]
    produced: list[int]


def serve_greedy(server: BatchedServer, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (``max_new_tokens`` ids each), served together.

    Each step gives every admitted sequence either its next prefill chunk (up to the server's
    ``max_step`` tokens) or its last generated token, as many as the widest step holds; a sequence
    is admitted when a column is free and removed when it is done. One host sync per step, to read
    the step's greedy tokens.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens}")
    chunk, widest = server.cache.max_step, server.widths[-1]
    waiting = list(enumerate(prompts))
    live: dict[int, tuple[int, _Request]] = {}
    results: dict[int, list[int]] = {}
    while waiting or live:
        while waiting and len(live) < server.max_seqs:
            index, prompt = waiting.pop(0)
            if not prompt:
                raise ValueError(f"prompts[{index}]: empty")
            live[server.add()] = (index, _Request(list(prompt), []))
        batch: list[tuple[int, list[int]]] = []
        room = widest
        for seq, (_, request) in live.items():
            tokens = request.pending[: min(chunk, room)] if request.pending else request.produced[-1:]
            if tokens:
                batch.append((seq, tokens))
                room -= len(tokens)
            if room == 0:
                break
        logits = server.step(batch)
        chosen = torch.cat([row.argmax(-1) for row in logits]).tolist()
        for (seq, tokens), token in zip(batch, chosen, strict=True):
            index, request = live[seq]
            if request.pending:
                del request.pending[: len(tokens)]
                if request.pending:
                    continue
            request.produced.append(token)
            if len(request.produced) == max_new_tokens:
                results[index] = request.produced
                server.remove(seq)
                del live[seq]
    return [results[i] for i in range(len(prompts))]
