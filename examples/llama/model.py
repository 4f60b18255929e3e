"""The Llama decoder: one forward for every way of serving it.

:meth:`LlamaModel.forward` runs the blocks over ``T`` packed tokens and leaves attention to an
``attend`` callback, which stores the layer's new K/V and attends over what its cache holds. A
chunked prefill, a graph-captured decode step (``generate.py``) and a batched serving step
(``serving.py``) are the same forward with a different cache behind ``attend``.

Per block: RMSNorm, one fused Q4_K projection for Q, K and V, RoPE, attention, the output
projection; RMSNorm, one fused Q4_K projection for the SwiGLU gate and up halves, the down
projection. Four ``q4k_linear`` launches per block instead of seven. The element-wise work between
them (residual adds, norms, RoPE, SwiGLU) is the model's ``glue`` (``glue.py``): four Triton
launches a block by default, or PyTorch ops. A block's weights may also be dense tensors
(``F.linear``): ``torch_model.py`` runs this same forward on bf16 weights with cuBLAS and PyTorch
glue, as a PyTorch user writes the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from tritune.kernels import Q4KWeight, q4k_linear

from .config import LlamaConfig
from .glue import Glue, TorchGlue, TritonGlue
from .layers import Rope, fuse_rows
from .loader import LlamaWeights

#: The glue implementations ``LlamaModel(glue=...)`` names.
GLUES: dict[str, type[TritonGlue] | type[TorchGlue]] = {"triton": TritonGlue, "torch": TorchGlue}


class Attend(Protocol):
    """Store a layer's new ``k, v [T, Hkv, D]`` and attend ``q [T, Hq, D]`` over the cache: ``[T, Hq, D]``."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


#: A linear weight ``[N, K]``: Q4_K through ``q4k_linear``, or dense through ``F.linear``.
Linear = Q4KWeight | torch.Tensor


def linear(x: torch.Tensor, weight: Linear) -> torch.Tensor:
    """``x @ weight.T`` in ``x``'s dtype, on the kernel that suits the weight's storage."""
    return q4k_linear(x, weight) if isinstance(weight, Q4KWeight) else F.linear(x, weight)


class Block:
    """One decoder block's parameters, with the projections fused (Q, K and V; gate and up)."""

    def __init__(
        self, attn_norm: torch.Tensor, qkv: Linear, attn_output: Linear, ffn_norm: torch.Tensor, gate_up: Linear,
        ffn_down: Linear,
    ) -> None:  # fmt: skip
        self.attn_norm = attn_norm
        self.qkv = qkv
        self.attn_output = attn_output
        self.ffn_norm = ffn_norm
        self.gate_up = gate_up
        self.ffn_down = ffn_down

    @classmethod
    def q4k(cls, weights: LlamaWeights, layer: int) -> Block:
        """Layer ``layer`` of ``weights`` with its Q4_K projections fused (exact: Q4_K blocks run along rows)."""
        w = weights.layers[layer]
        return cls(w.attn_norm, fuse_rows(w.attn_q, w.attn_k, w.attn_v), w.attn_output, w.ffn_norm,
                   fuse_rows(w.ffn_gate, w.ffn_up), w.ffn_down)  # fmt: skip

    def weights(self) -> tuple[Linear, ...]:
        """The linear weights, in the order the forward uses them."""
        return self.qkv, self.attn_output, self.gate_up, self.ffn_down


class LlamaModel:
    """A Llama-3-architecture decoder whose linears and attention are tritune kernels.

    ``dtype`` is the activations' dtype at the kernels: bfloat16 by default (on a GPU and on the
    Triton interpreter alike). ``max_positions`` bounds the positions RoPE tables cover (default:
    the file's context length). ``glue`` names the element-wise work's implementation
    (:data:`GLUES`: "triton", four launches a block, or "torch", PyTorch ops).
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: LlamaWeights,
        *,
        dtype: torch.dtype = torch.bfloat16,
        max_positions: int | None = None,
        glue: str = "triton",
    ) -> None:
        if glue not in GLUES:
            raise ValueError(f"glue: expected one of {sorted(GLUES)}, got {glue!r}")
        self.config = config
        self.dtype = dtype
        self.device = weights.device
        self.max_positions = max_positions or config.context
        self.embedding = weights.token_embd
        self.blocks = [self.make_block(weights, i) for i in range(config.layers)]
        self.output_norm = weights.output_norm
        # A float head runs as a dense matmul in the activations' dtype.
        self.head: Linear = weights.output if isinstance(weights.output, Q4KWeight) else weights.output.to(dtype)
        self.rope = Rope(config, weights.rope_freq_factors, self.max_positions, self.device)
        self.glue: Glue = GLUES[glue](config.heads, config.kv_heads, config.head_dim, config.rms_eps, self.rope, dtype)

    def make_block(self, weights: LlamaWeights, layer: int) -> Block:
        """Block ``layer``'s parameters as this model runs them (here: fused Q4_K projections)."""
        return Block.q4k(weights, layer)

    def weight_bytes(self) -> int:
        """Bytes of every parameter the forward reads (linears, norms, embedding, head)."""
        tensors: list[Linear] = [self.embedding, self.output_norm, self.head]
        for block in self.blocks:
            tensors += [block.attn_norm, block.ffn_norm, *block.weights()]
        return sum(t.nbytes if isinstance(t, Q4KWeight) else t.numel() * t.element_size() for t in tensors)

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
        cfg, glue = self.config, self.glue
        tokens_count = tokens.shape[0]
        h = F.embedding(tokens, self.embedding).float()  # [T, hidden], the float32 residual stream
        # Each residual add is fused with the norm after it: the next block's, or the output norm
        # (of the logit rows only).
        norms = [block.attn_norm for block in self.blocks[1:]] + [self.output_norm]
        first = self.blocks[0].attn_norm if self.blocks else self.output_norm
        x = glue.norm(h, first, None if self.blocks else logit_rows)
        for layer, block in enumerate(self.blocks):
            q, k, v = glue.rope_qkv(linear(x, block.qkv), positions)
            attn = attend(layer, q, k, v).reshape(tokens_count, cfg.q_width)
            h_attn, x = glue.add_norm(h, linear(attn, block.attn_output), block.ffn_norm)
            assert h_attn is not None  # no rows given: the stream continues
            rows = logit_rows if layer + 1 == len(self.blocks) else None
            h_next, x = glue.add_norm(h_attn, linear(glue.swiglu(linear(x, block.gate_up)), block.ffn_down),
                                      norms[layer], rows)  # fmt: skip
            h = h_next if h_next is not None else h_attn
        return linear(x, self.head).float()
