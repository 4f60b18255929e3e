"""One sequence at a time: chunked prefill with ``prefill_attention``, decode with ``decode_attention``.

The cache is static: per layer ``[1, Hkv, max_len, D]`` K and V, allocated once, of which the first
``length`` positions are valid. A prefill chunk of ``C`` tokens writes its K/V at its positions and
attends with ``kv_len = length + C`` on the device, bottom-right causal: query ``i`` of the chunk
sits at position ``kv_len - C + i``. Its token ids, positions and ``kv_len`` are device tensors and
the kernels' configs depend on ``C`` and ``max_len`` alone, so on a GPU a chunk of ``C`` tokens is
captured once in a CUDA graph and replayed at any start position, its inputs refilled on the device.
A shorter chunk (a prompt's tail) is padded to one of a few graph lengths: its padding rows sit past
its last token, so bottom-right causal attention keeps them out of every real row, and what they
write to the cache lies past ``length``, where nothing reads before a later token overwrites it.
A decode step is one token through the same forward, reading its token, position and length from
device buffers, writing the next token (greedy) and advancing the position on the device: it never
synchronises with the host, so on a GPU it is captured once in a CUDA graph and replayed for every
later step. On the CPU (the Triton interpreter) everything runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tritune.kernels import decode_attention, prefill_attention

from .graphs import run_then_capture
from .model import LlamaModel


class SequenceCache:
    """Per-layer K/V of one sequence, ``[1, Hkv, max_len, D]`` in the model's dtype."""

    def __init__(self, model: LlamaModel, max_len: int) -> None:
        cfg = model.config
        shape = (1, cfg.kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.layers)]
        self.max_len = max_len

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [T, Hkv, D]`` at int64 ``positions [T]`` (a device index: no sync)."""
        self.k[layer][0].index_copy_(1, positions, k.transpose(0, 1))
        self.v[layer][0].index_copy_(1, positions, v.transpose(0, 1))


@dataclass
class _ChunkGraph:
    """The static inputs and output of one captured prefill chunk (a length and logits mode)."""

    ids: torch.Tensor
    positions: torch.Tensor
    kv_len: torch.Tensor
    #: int64 ``[1]``: the row whose logits a last-token chunk returns (the real tokens' last).
    last: torch.Tensor
    logits: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None


class Generator:
    """Greedy generation for one sequence of up to ``max_len`` positions (default: the model's).

    ``chunk_size`` bounds the tokens of one prefill launch. ``graphs`` (default: on a CUDA device)
    captures the decode step in a CUDA graph after its first, eager, run. ``prefill_graphs``
    (default: ``graphs``, unless :attr:`chunk_needs_host_lengths`) does the same for prefill chunks:
    one graph per (graph length, logits mode), captured on the first such chunk and replayed at any
    start position, so that a chunk's tens of launches per layer cost no host time. A chunk of
    ``chunk_size`` tokens replays its own length; a shorter one is padded to the next power of two
    up to ``graph_multiple`` tokens, above that to the next multiple of ``graph_multiple`` (at most
    ``chunk_size``), so that a prompt's tail is never host-bound and a few graphs serve every tail
    length; a chunk whose padding would run past the cache runs eagerly. All graphs share one
    memory pool: they are replayed one after another and read and write only static buffers
    allocated outside it. Attention is two methods, :meth:`attend_chunk` and :meth:`attend_step`,
    which ``torch_model.TorchGenerator`` replaces with SDPA.
    """

    #: Whether :meth:`attend_chunk` reads its host ``kv_count``: a captured chunk would replay the
    #: capture's count at every position, so such a generator refuses prefill graphs.
    chunk_needs_host_lengths = False

    def __init__(
        self,
        model: LlamaModel,
        *,
        max_len: int | None = None,
        chunk_size: int = 256,
        graphs: bool | None = None,
        prefill_graphs: bool | None = None,
        graph_multiple: int = 128,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
        if graph_multiple < 1:
            raise ValueError(f"graph_multiple: expected a positive int, got {graph_multiple}")
        max_len = max_len or model.max_positions
        if not 1 <= max_len <= model.max_positions:
            raise ValueError(f"max_len: expected 1..{model.max_positions} (the model's positions), got {max_len}")
        self.model = model
        self.chunk_size = chunk_size
        self.graph_multiple = graph_multiple
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        if prefill_graphs and self.chunk_needs_host_lengths:
            raise ValueError(
                f"prefill_graphs: {type(self).__name__} attends a prefill chunk with host lengths, "
                "which a replayed graph cannot follow"
            )
        if prefill_graphs is None:
            prefill_graphs = self.graphs and not self.chunk_needs_host_lengths
        self.prefill_graphs = prefill_graphs
        self.cache = SequenceCache(model, max_len)
        #: Positions the cache holds; the host tracks it, the device buffers below mirror it.
        self.length = 0
        device = model.device
        # The decode step's static buffers: its input token, that token's position, the cache
        # length it attends over, and its logits.
        self._token = torch.zeros(1, dtype=torch.int64, device=device)
        self._position = torch.zeros(1, dtype=torch.int64, device=device)
        #: int32 ``[1]``: the positions a decode step attends over (its own included).
        self.kv_len = torch.zeros(1, dtype=torch.int32, device=device)
        self._logits = torch.zeros(1, model.config.vocab, dtype=torch.float32, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        #: Captured prefill chunks by (graph length, all_logits).
        self._chunk_graphs: dict[tuple[int, bool], _ChunkGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs or self.prefill_graphs else None

    @property
    def captured(self) -> bool:
        """Whether decode steps replay a captured CUDA graph."""
        return self._graph is not None

    @property
    def next_token(self) -> torch.Tensor:
        """int64 ``[1]`` on the device: the greedy choice of the last decode step, the next one's input."""
        return self._token

    def reset(self) -> None:
        """Start a new sequence (the cache is reused: positions past ``length`` are never read)."""
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on: the next token goes to position ``length``.

        The cache keeps its storage (a captured decode step stays valid), so a benchmark can time
        the same decode steps again at the same context without a new prefill.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"length: expected 0..{self.length} (the positions held), got {length}")
        self.length = length
        self._position.fill_(length)

    # ---- prefill -------------------------------------------------------------------------------

    def prefill(self, tokens: Sequence[int] | torch.Tensor, *, all_logits: bool = False) -> torch.Tensor:
        """Append ``tokens`` in chunks of ``chunk_size``; float32 logits of the last token ``[1, vocab]``.

        ``all_logits`` returns every token's logits ``[len(tokens), vocab]`` instead. Token ids given
        as a tensor are not checked against the vocabulary (that would synchronise).
        """
        if not isinstance(tokens, torch.Tensor):
            self.model.check_tokens(tokens)
        ids = torch.as_tensor(tokens, dtype=torch.int64).to(self.model.device)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"tokens: expected a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        if self.length + ids.numel() > self.cache.max_len:
            raise ValueError(f"tokens: {self.length} + {ids.numel()} positions exceed max_len={self.cache.max_len}")
        vocab = self.model.config.vocab
        out = torch.empty(ids.numel() if all_logits else 1, vocab, dtype=torch.float32, device=self.model.device)
        for start in range(0, ids.numel(), self.chunk_size):
            chunk = ids[start : start + self.chunk_size]
            logits = self._prefill_chunk(chunk, all_logits)
            # A replayed chunk's logits are a static buffer that its next replay overwrites: copy them now.
            if all_logits:
                out[start : start + chunk.numel()].copy_(logits)
        if not all_logits:
            out.copy_(logits)
        self._position.fill_(self.length)
        return out

    def attend_chunk(self, layer: int, q: torch.Tensor, kv_len: torch.Tensor, kv_count: int) -> torch.Tensor:
        """A prefill chunk's attention ``[C, Hq, D]`` for ``q [C, Hq, D]`` over the cache's first positions.

        The chunk's K/V are already in the cache; ``kv_len`` (int32 ``[1]``, on the device) and
        ``kv_count`` (on the host) both say how many positions are valid, the chunk's last. Under a
        prefill graph ``kv_count`` is the capture's: an override that reads it sets
        :attr:`chunk_needs_host_lengths`.
        """
        cfg = self.model.config
        # out [C, Hq, D] in memory, handed to the kernel as the [1, Hq, C, D] view it writes.
        out = torch.empty(q.shape[0], cfg.heads, cfg.head_dim, dtype=q.dtype, device=q.device)
        prefill_attention(
            q.transpose(0, 1)[None], self.cache.k[layer], self.cache.v[layer], causal=True, kv_len=kv_len,
            out=out.transpose(0, 1)[None],
        )  # fmt: skip
        return out

    def graph_length(self, count: int, start: int) -> int | None:
        """The captured length a prefill chunk of ``count`` tokens at ``start`` replays (None: eager)."""
        if not self.prefill_graphs:
            return None
        if count == self.chunk_size:
            length = count
        elif count <= self.graph_multiple:
            length = min(1 << (count - 1).bit_length(), self.chunk_size)
        else:
            length = min(-(-count // self.graph_multiple) * self.graph_multiple, self.chunk_size)
        return length if start + length <= self.cache.max_len else None

    def _prefill_chunk(self, ids: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """The chunk's logits, replayed from a graph when :meth:`graph_length` names one."""
        device = self.model.device
        count, start = ids.numel(), self.length
        length = self.graph_length(count, start)
        if length is not None:
            logits = self._replay_chunk(ids, start, length, all_logits)
        else:
            positions = torch.arange(start, start + count, dtype=torch.int64, device=device)
            kv_len = torch.full((1,), start + count, dtype=torch.int32, device=device)
            logits = self._chunk_forward(ids, positions, kv_len, start + count, all_logits)
        self.length += count
        return logits

    def _chunk_forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv_len: torch.Tensor,
        kv_count: int,
        all_logits: bool,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of every row, or of row ``last`` (int64 ``[1]``; default the chunk's last row)."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.cache.write(layer, positions, k, v)
            return self.attend_chunk(layer, q, kv_len, kv_count)

        if not all_logits and last is None:
            last = torch.full((1,), ids.numel() - 1, dtype=torch.int64, device=ids.device)
        return self.model.forward(ids, positions, attend, logit_rows=None if all_logits else last)

    def _replay_chunk(self, ids: torch.Tensor, start: int, length: int, all_logits: bool) -> torch.Tensor:
        """Fill the ``length``-token graph's static inputs on the device (no sync): the chunk's tokens,
        then padding; replay the graph (captured on first use) and return the real rows' logits."""
        device, count = self.model.device, ids.numel()
        chunk = self._chunk_graphs.get((length, all_logits))
        if chunk is None:
            rows = length if all_logits else 1
            chunk = self._chunk_graphs[(length, all_logits)] = _ChunkGraph(
                ids=torch.zeros(length, dtype=torch.int64, device=device),
                positions=torch.zeros(length, dtype=torch.int64, device=device),
                kv_len=torch.zeros(1, dtype=torch.int32, device=device),
                last=torch.zeros(1, dtype=torch.int64, device=device),
                logits=torch.zeros(rows, self.model.config.vocab, dtype=torch.float32, device=device),
            )
        chunk.ids[:count].copy_(ids)
        chunk.ids[count:].zero_()
        torch.arange(start, start + length, out=chunk.positions)
        chunk.kv_len.fill_(start + length)
        chunk.last.fill_(count - 1)
        if chunk.graph is None:

            def step(chunk: _ChunkGraph = chunk, kv_count: int = start + length) -> None:
                logits = self._chunk_forward(chunk.ids, chunk.positions, chunk.kv_len, kv_count, all_logits, chunk.last)
                chunk.logits.copy_(logits)

            chunk.graph = run_then_capture(step, device, self._pool)
        else:
            chunk.graph.replay()
        return chunk.logits[:count] if all_logits else chunk.logits

    # ---- decode --------------------------------------------------------------------------------

    def decode(self, token: int | None = None) -> torch.Tensor:
        """Append one token and return the next position's float32 logits ``[1, vocab]``.

        ``token`` defaults to the greedy choice of the previous step, which the step left on the
        device. The result is a static buffer that the next step overwrites.
        """
        if self.length == 0:
            raise ValueError("decode: the sequence is empty; prefill it first")
        if self.length >= self.cache.max_len:
            raise ValueError(f"decode: the cache is full ({self.cache.max_len} positions)")
        if token is not None:
            self.model.check_tokens([token], "token")
            self._token.fill_(token)
        if self._graph is not None:
            self._graph.replay()
        elif self.graphs:
            self._graph = run_then_capture(self._decode_step, self.model.device, self._pool)
        else:
            self._decode_step()
        self.length += 1
        return self._logits

    def _decode_step(self) -> None:
        """The whole step on device buffers: forward, greedy next token, position advance."""
        self.kv_len.copy_(self._position + 1)
        self._logits.copy_(self.model.forward(self._token, self._position, self._attend_decode))
        self._token.copy_(self._logits.argmax(-1))
        self._position.add_(1)

    def _attend_decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self._position, k, v)
        return self.attend_step(layer, q)

    def attend_step(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """A decode step's attention ``[1, Hq, D]`` over the cache's first ``kv_len`` positions (device values only)."""
        cfg = self.model.config
        out = torch.empty(1, cfg.heads, cfg.head_dim, dtype=q.dtype, device=q.device)
        decode_attention(
            q.transpose(0, 1)[None], self.cache.k[layer], self.cache.v[layer], self.kv_len,
            out=out.transpose(0, 1)[None],
        )  # fmt: skip
        return out

    # ---- generation ----------------------------------------------------------------------------

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt``: ``max_new_tokens`` ids, synchronising once at the end."""
        self.reset()
        logits = self.prefill(prompt)
        if max_new_tokens <= 0:
            return []
        self._token.copy_(logits.argmax(-1))
        produced = [self._token.clone()]
        for _ in range(max_new_tokens - 1):
            self.decode()
            produced.append(self._token.clone())
        return torch.cat(produced).tolist()
