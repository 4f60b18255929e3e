"""A minimal Llama-3-architecture decoder on tritune's kernels, with weights from a GGUF file.

Every linear layer is a ``Q4KWeight`` through ``q4k_linear``; attention is ``prefill_attention``
(chunked prefill), ``decode_attention`` (a graph-capturable decode step) or ``varlen_attention``
over a ``BatchedSequenceCache`` (batched serving). Put ``examples/`` on ``sys.path`` and import
``llama``::

    PYTHONPATH=examples python -m llama model.gguf --tokens 1,2,3 --max-new-tokens 16

Modules: ``config`` (hyper-parameters from the metadata), ``loader`` (tensors from the file),
``layers`` (RMSNorm, RoPE, fused projections), ``glue`` (the element-wise work between kernels, in
Triton or PyTorch), ``model`` (the forward), ``generate`` (one
sequence), ``serving`` (many sequences), ``reference`` (a plain PyTorch forward for checking), ``torch_model``
(the same decoder in plain PyTorch bf16, the baseline ``scripts/bench_model.py`` measures against).
"""

from .config import LlamaConfig, config_from_gguf
from .generate import Generator, SequenceCache
from .glue import TorchGlue, TritonGlue
from .loader import LayerWeights, LlamaWeights, load_gguf, open_gguf
from .model import Attend, LlamaModel
from .reference import reference_logits, top1_floor
from .serving import BatchedServer, serve_greedy
from .torch_model import TorchGenerator, TorchLlamaModel

__all__ = [
    "Attend",
    "BatchedServer",
    "Generator",
    "LayerWeights",
    "LlamaConfig",
    "LlamaModel",
    "LlamaWeights",
    "SequenceCache",
    "TorchGenerator",
    "TorchGlue",
    "TorchLlamaModel",
    "TritonGlue",
    "config_from_gguf",
    "load_gguf",
    "open_gguf",
    "reference_logits",
    "serve_greedy",
    "top1_floor",
]
