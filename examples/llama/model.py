"""The Llama decoder: one forward for every way of serving it.

:meth:`LlamaModel.forward` runs the blocks over ``T`` packed tokens and leaves attention to an
``attend`` callback, which stores the layer's new K/V and attends over what its cache holds. A
chunked prefill, a graph-captured decode step (``generate.py``) and a batched serving step
(``serving.py``) are the same forward with a different cache behind ``attend``.

Per block: RMSNorm, one fused Q4_K projection for Q, K and V, RoPE, attention, the output
projection; RMSNorm, one fused Q4_K projection for the SwiGLU gate and up halves, the down
projection. Four ``q4k_linear`` launches per block instead of seven.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from tritune.kernels import Q4KWeight, q4k_linear

from .config import LlamaConfig
from .layers import Rope, fuse_rows, rms_norm
from .loader import LlamaWeights


class Attend(Protocol):
    """Store a layer's new ``k, v [T, Hkv, D]`` and attend ``q [T, Hq, D]`` over the cache: ``[T, Hq, D]``."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class _Block:
    """One decoder block's parameters, with the projections fused."""

    def __init__(self, weights: LlamaWeights, layer: int) -> None:
        w = weights.layers[layer]
        self.attn_norm = w.attn_norm
        self.qkv = fuse_rows(w.attn_q, w.attn_k, w.attn_v)
        self.attn_output = w.attn_output
        self.ffn_norm = w.ffn_norm
        self.gate_up = fuse_rows(w.ffn_gate, w.ffn_up)
        self.ffn_down = w.ffn_down


class LlamaModel:
    """A Llama-3-architecture decoder whose linears and attention are tritune kernels.

    ``dtype`` is the activations' dtype at the kernels: bfloat16 by default (on a GPU and on the
    Triton interpreter alike). ``max_positions`` bounds the positions RoPE tables cover (default:
    the file's context length).
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: LlamaWeights,
        *,
        dtype: torch.dtype = torch.bfloat16,
        max_positions: int | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = weights.device
        self.max_positions = max_positions or config.context
        self.embedding = weights.token_embd
        self.blocks = [_Block(weights, i) for i in range(config.layers)]
        self.output_norm = weights.output_norm
        # A float head runs as a dense matmul in the activations' dtype.
        self.head: Q4KWeight | torch.Tensor = (
            weights.output if isinstance(weights.output, Q4KWeight) else weights.output.to(dtype)
        )
        self.rope = Rope(config, weights.rope_freq_factors, self.max_positions, self.device)

    def check_tokens(self, tokens: Sequence[int], name: str = "tokens") -> None:
        """Refuse token ids outside the vocabulary on the host (on a GPU the lookup would fault)."""
        bad = [t for t in tokens if not 0 <= t < self.config.vocab]
        if bad:
            raise ValueError(f"{name}: token ids {bad[:8]} are outside the vocabulary [0, {self.config.vocab})")

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        *,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float32 logits ``[R, vocab]`` for int64 ``tokens [T]`` at int64 ``positions [T]``.

        ``logit_rows`` (int64 ``[R]``) picks the rows that reach the output head (a prefill chunk
        needs only its last); default all ``T``. Only device tensors are read: no host sync.
        """
        cfg = self.config
        tokens_count = tokens.shape[0]
        h = F.embedding(tokens, self.embedding).float()  # [T, hidden], the float32 residual stream
        for layer, block in enumerate(self.blocks):
            x = rms_norm(h, block.attn_norm, cfg.rms_eps, self.dtype)
            q, k, v = q4k_linear(x, block.qkv).split((cfg.q_width, cfg.kv_width, cfg.kv_width), dim=-1)
            q = self.rope(q.view(tokens_count, cfg.heads, cfg.head_dim), positions)
            k = self.rope(k.view(tokens_count, cfg.kv_heads, cfg.head_dim), positions)
            v = v.reshape(tokens_count, cfg.kv_heads, cfg.head_dim)
            attn = attend(layer, q, k, v).reshape(tokens_count, cfg.q_width)
            h = h + q4k_linear(attn, block.attn_output).float()
            x = rms_norm(h, block.ffn_norm, cfg.rms_eps, self.dtype)
            gate, up = q4k_linear(x, block.gate_up).split((cfg.ffn, cfg.ffn), dim=-1)
            h = h + q4k_linear((F.silu(gate.float()) * up.float()).to(self.dtype), block.ffn_down).float()
        if logit_rows is not None:
            h = h.index_select(0, logit_rows)
        x = rms_norm(h, self.output_norm, cfg.rms_eps, self.dtype)
        if isinstance(self.head, Q4KWeight):
            return q4k_linear(x, self.head).float()
        return (x @ self.head.T).float()
