"""The same decoder in plain PyTorch bf16: the baseline the kernel-backed model is measured against.

What a PyTorch user would write for this model, with no tritune kernel: every Q4_K weight is
dequantized once to bf16 (projections fused as in ``model.py``) and runs through ``F.linear``
(cuBLAS); attention is ``F.scaled_dot_product_attention`` over the same static KV cache. The
forward itself is ``LlamaModel.forward`` (float32 residual stream, norms and RoPE in float32) with
PyTorch glue (``glue.TorchGlue``: the element-wise ops a PyTorch user writes, where the tritune model
fuses them into four Triton launches a block); ``glue="triton"`` gives it tritune's glue, so that a
comparison differs in the linears and attention only.

- A prefill chunk attends with SDPA over the cache's first ``kv_count`` positions, bottom-right
  causal (``causal_lower_right``) with native GQA (``enable_gqa``): PyTorch picks the backend
  (FlashAttention-2 on an H100/H200). Where that call is refused, K/V heads are repeated instead.
  The slice and the mask are sized on the host, so chunks run eagerly: a graph captured at one
  position would replay its length at every other.
- A decode step must read its length from the device to be captured in a CUDA graph, so it
  attends over the whole static cache with an additive mask built from ``kv_len`` on the device
  (as gpt-fast does). Two layouts meet the ``Hkv`` cache heads without repeating them: "gqa",
  one query row per head (``[1, Hq, 1, D]``) with ``enable_gqa=True``, and "folded", the query
  heads of each KV head as query rows (``[1, Hkv, group, D]``), which needs no GQA support from
  the backend. Which layout and backend (efficient, cuDNN, flash, math or PyTorch's own choice)
  is fastest depends on the GPU and the context length: :meth:`TorchGenerator.choose_decode_backend`
  times every pair that runs and agrees with the math backend's output, once at the current length.

On the CPU every call runs eagerly on PyTorch's CPU kernels: the tests compare its logits with
``reference_logits`` as they do the kernel-backed model's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from tritune.kernels import Q4KWeight

from .config import LlamaConfig
from .generate import Generator
from .loader import LlamaWeights
from .model import Block, LlamaModel

log = logging.getLogger("llama.torch_model")

#: Decode backends tried by :meth:`TorchGenerator.choose_decode_backend` (None: PyTorch chooses).
DECODE_BACKENDS: dict[str, SDPBackend | None] = {
    "auto": None,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "math": SDPBackend.MATH,
}
#: Decode query layouts (see the module's docstring), each tried with every backend.
DECODE_LAYOUTS = ("gqa", "folded")
#: The decode step's (layout, backend) before :meth:`TorchGenerator.choose_decode_backend` times them.
DEFAULT_DECODE = "folded/auto"
#: Largest difference from the math backend's output a decode choice may show (bf16 rounding).
DECODE_TOLERANCE = 2e-2


def decode_choice(name: str) -> tuple[str, SDPBackend | None]:
    """``"layout/backend"`` (e.g. ``"gqa/cudnn"``) as the layout and the SDPA backend it names."""
    layout, _, backend = name.partition("/")
    if layout not in DECODE_LAYOUTS or backend not in DECODE_BACKENDS:
        raise ValueError(
            f"decode choice {name!r}: expected 'layout/backend' with a layout of {DECODE_LAYOUTS} "
            f"and a backend of {tuple(DECODE_BACKENDS)}"
        )
    return layout, DECODE_BACKENDS[backend]


def _dense(weights: Q4KWeight | torch.Tensor, *more: Q4KWeight | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of every weight stacked, dequantized exactly (float32) and cast to ``dtype`` once."""
    parts = [w.dequantize() if isinstance(w, Q4KWeight) else w.float() for w in (weights, *more)]
    return torch.cat(parts).to(dtype) if len(parts) > 1 else parts[0].to(dtype)


class TorchLlamaModel(LlamaModel):
    """:class:`LlamaModel` with every linear a dense ``dtype`` (bf16) weight: ``F.linear`` on cuBLAS.

    Built from the loader's weights; the Q4_K tensors may be dropped afterwards (each weight is
    dequantized into a new tensor).
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: LlamaWeights,
        *,
        dtype: torch.dtype = torch.bfloat16,
        max_positions: int | None = None,
        glue: str = "torch",
    ) -> None:
        super().__init__(config, weights, dtype=dtype, max_positions=max_positions, glue=glue)
        if isinstance(self.head, Q4KWeight):
            self.head = _dense(self.head, dtype=dtype)

    def make_block(self, weights: LlamaWeights, layer: int) -> Block:
        w, dtype = weights.layers[layer], self.dtype
        return Block(
            w.attn_norm, _dense(w.attn_q, w.attn_k, w.attn_v, dtype=dtype), _dense(w.attn_output, dtype=dtype),
            w.ffn_norm, _dense(w.ffn_gate, w.ffn_up, dtype=dtype), _dense(w.ffn_down, dtype=dtype),
        )  # fmt: skip


def _backend(backend: SDPBackend | None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if backend is None else sdpa_kernel(backend)


class TorchGenerator(Generator):
    """:class:`Generator` with SDPA in place of ``prefill_attention`` and ``decode_attention``.

    Same static cache, same chunked prefill, same decode step captured in one CUDA graph. Prefill
    chunks always run eagerly (:attr:`chunk_needs_host_lengths`): SDPA takes the cache's valid
    positions as a slice and a mask sized on the host, which a replayed graph would keep at the
    capture's length. The decode step runs on ``decode_backend``, a ``"layout/backend"`` pair
    (default: the folded layout, PyTorch's choice of backend), which :meth:`choose_decode_backend`
    can set to the fastest at the current context.
    """

    #: A chunk's SDPA reads the cache's first ``kv_count`` positions, a host length.
    chunk_needs_host_lengths = True

    def __init__(
        self,
        model: LlamaModel,
        *,
        max_len: int | None = None,
        chunk_size: int = 256,
        graphs: bool | None = None,
        prefill_graphs: bool | None = None,
    ) -> None:
        super().__init__(model, max_len=max_len, chunk_size=chunk_size, graphs=graphs, prefill_graphs=prefill_graphs)
        cfg, device, max_len = model.config, model.device, self.cache.max_len
        self.decode_backend = DEFAULT_DECODE
        #: The decode step's additive mask: 0 at positions below ``kv_len``, -inf above.
        self._bias = torch.zeros(1, 1, 1, max_len, dtype=model.dtype, device=device)
        self._arange = torch.arange(max_len, dtype=torch.int32, device=device)
        self._group = cfg.heads // cfg.kv_heads
        #: Set when SDPA refused native GQA for a prefill chunk: K/V heads are repeated instead.
        self.repeat_kv = False

    # ---- prefill -------------------------------------------------------------------------------

    def attend_chunk(self, layer: int, q: torch.Tensor, kv_len: torch.Tensor, kv_count: int) -> torch.Tensor:
        count = q.shape[0]
        query = q.transpose(0, 1)[None]  # [1, Hq, C, D]
        k = self.cache.k[layer][:, :, :kv_count]
        v = self.cache.v[layer][:, :, :kv_count]
        if not self.repeat_kv:
            try:
                out = self._sdpa_chunk(query, k, v, count, kv_count, enable_gqa=True)
            except RuntimeError as exc:
                log.warning("SDPA refused native GQA for a prefill chunk (%s); repeating K/V heads instead", exc)
                self.repeat_kv = True
        if self.repeat_kv:
            k, v = k.repeat_interleave(self._group, dim=1), v.repeat_interleave(self._group, dim=1)
            out = self._sdpa_chunk(query, k, v, count, kv_count, enable_gqa=False)
        return out[0].transpose(0, 1)

    @staticmethod
    def _sdpa_chunk(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, kv_count: int, *, enable_gqa: bool
    ) -> torch.Tensor:
        if count == kv_count:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
        # Query i of the chunk sits at position kv_count - count + i: bottom-right causal.
        mask = causal_lower_right(count, kv_count)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)

    # ---- decode --------------------------------------------------------------------------------

    def attend_step(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if layer == 0:
            # Once per step, on the device: the mask follows kv_len without a host value.
            self._bias.copy_(torch.where(self._arange < self.kv_len, 0.0, float("-inf")).view_as(self._bias))
        return self._attend_one(q, self.cache.k[layer], self.cache.v[layer], self.decode_backend)

    def _attend_one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, choice: str) -> torch.Tensor:
        """One decode step's attention for one layer in the ``"layout/backend"`` of ``choice``."""
        cfg = self.model.config
        layout, backend = decode_choice(choice)
        with _backend(backend):
            if layout == "gqa":
                # One query row per head; SDPA maps query head h to KV head h // group.
                query = q.reshape(1, cfg.heads, 1, cfg.head_dim)
                out = F.scaled_dot_product_attention(query, k, v, attn_mask=self._bias, enable_gqa=True)
            else:
                # The query heads of KV head j are rows j*group .. j*group+group-1: one [group, D] block each.
                query = q.reshape(1, cfg.kv_heads, self._group, cfg.head_dim)
                out = F.scaled_dot_product_attention(query, k, v, attn_mask=self._bias)
        return out.reshape(1, cfg.heads, cfg.head_dim)

    def choose_decode_backend(self, time_ms: Callable[[Callable[[], object]], float]) -> dict[str, float | str]:
        """Time each decode layout and backend on layer 0's cache at the current length; keep the fastest right one.

        ``time_ms(fn)`` returns the median milliseconds of one call. A pair that raises, or whose
        output differs by more than bf16 rounding from the math backend's in the folded layout
        (so each layout is checked against the other), is left out. With graphs on, a pair must
        also capture. Returns each ``"layout/backend"`` pair's time or why it was left out. A
        captured decode graph is dropped when the choice changes (the next step captures again).
        """
        if self.length == 0:
            raise ValueError("choose_decode_backend: the sequence is empty; prefill it first")
        cfg = self.model.config
        generator = torch.Generator(device=self.model.device).manual_seed(0)
        q = torch.randn(1, cfg.heads, cfg.head_dim, generator=generator, device=self.model.device).to(self.model.dtype)
        self.kv_len.fill_(self.length)
        self._bias.copy_(torch.where(self._arange < self.kv_len, 0.0, float("-inf")).view_as(self._bias))
        k, v = self.cache.k[0], self.cache.v[0]
        expected = self._attend_one(q, k, v, "folded/math").float()
        results: dict[str, float | str] = {}
        for name in (f"{layout}/{backend}" for layout in DECODE_LAYOUTS for backend in DECODE_BACKENDS):
            try:
                got = self._attend_one(q, k, v, name).float()
                err = float((got - expected).abs().max())
                if not err <= DECODE_TOLERANCE:
                    results[name] = f"wrong (max err {err:.2e})"
                    continue
                if self.graphs:
                    # The step is replayed from a graph: a pair that cannot be captured is no choice.
                    with torch.cuda.graph(torch.cuda.CUDAGraph()):
                        self._attend_one(q, k, v, name)
                results[name] = time_ms(lambda name=name: self._attend_one(q, k, v, name))
            except RuntimeError as exc:
                results[name] = "refused: " + " ".join(str(exc).split())[:120]
        timed = {name: t for name, t in results.items() if isinstance(t, float)}
        if not timed:
            raise RuntimeError(f"no SDPA backend serves the decode step here: {results}")
        best = min(timed, key=timed.__getitem__)
        if best != self.decode_backend:
            self.decode_backend, self._graph = best, None
        return results
