"""The correctness check of ``scripts/bench_model.py``: a model's logits on random prompts against float64.

Each model (tritune's and the PyTorch bf16 baseline) prefills all but the last two tokens of each
prompt in two chunks and decodes those two; every row of logits is compared with a float64 forward
of the same dequantized weights, next to PyTorch's own bf16 forward of them (the yardstick of
:class:`~_bench_model_report.Check`). The references are computed once, from the first model's
weights. Like the benchmark, this module imports the Llama example only inside its functions.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import torch
from _bench_model_report import Check

log = logging.getLogger("tritune.bench")

#: Tokens of each correctness-check prompt (8 with ``--smoke``).
CHECK_LENGTH = 32


def check_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def references(llama: Any, config: Any, weights: Any, prompts: list[list[int]]) -> list[tuple[torch.Tensor, ...]]:
    """Per prompt: the float64 reference logits and PyTorch's bf16 forward, on the weights' device."""
    device = weights.device
    return [
        (
            llama.reference_logits(config, weights, p, device=device).cpu(),
            llama.reference_logits(config, weights, p, dtype=torch.bfloat16, device=device).double().cpu(),
        )
        for p in prompts
    ]


def check_model(impl: str, make: Callable[..., Any], prompts: list[list[int]], refs: list, graphs: bool) -> Check:
    """Prefill all but the last two tokens in two chunks, decode those two; compare every row with the reference."""
    ours, exact, bf16 = [], [], []
    for prompt, (ref, ref_bf16) in zip(prompts, refs, strict=True):
        cut = len(prompt) - 2
        generator = make(max_len=len(prompt) + 1, chunk_size=max(1, (cut + 1) // 2), graphs=graphs)
        rows = [generator.prefill(prompt[:cut], all_logits=True).double().cpu()]
        rows += [generator.decode(token).double().cpu() for token in prompt[cut:]]
        ours.append(torch.cat(rows))
        exact.append(ref)
        bf16.append(ref_bf16)
    from llama import top1_floor  # imported by main() once the interpreter is settled

    got, want, yard = torch.cat(ours), torch.cat(exact), torch.cat(bf16)
    bf16_top1 = float((yard.argmax(-1) == want.argmax(-1)).double().mean())
    names = row_names(prompts)
    if len(names) != got.shape[0]:
        raise RuntimeError(f"{impl}: {got.shape[0]} rows of logits for {len(names)} prompt positions")
    check = Check(
        impl=impl,
        rel_err=float((got - want).norm() / want.norm()),
        bf16_rel_err=float((yard - want).norm() / want.norm()),
        top1=float((got.argmax(-1) == want.argmax(-1)).double().mean()),
        bf16_top1=bf16_top1,
        top1_floor=top1_floor(bf16_top1, got.shape[0]),
        rows=got.shape[0],
        misses=missed_rows(got, want, names),
        bf16_misses=missed_rows(yard, want, names),
    )
    log.info("%s: rel. error %.4f (PyTorch bf16 %.4f), top-1 %.3f over %d rows: %s", impl, check.rel_err,
             check.bf16_rel_err, check.top1, check.rows, "ok" if check.ok else "FAILED")  # fmt: skip
    return check


def row_names(prompts: list[list[int]]) -> list[str]:
    """``prompt:position`` of each row :func:`check_model` compares, ``d`` after a decoded one (the
    last two positions of each prompt; the rows before them come from the prefill)."""
    return [
        f"{index}:{position}" + ("d" if position >= len(prompt) - 2 else "")
        for index, prompt in enumerate(prompts)
        for position in range(len(prompt))
    ]


def missed_rows(logits: torch.Tensor, reference: torch.Tensor, names: list[str]) -> list[str]:
    """The names of the rows whose top-1 token is not the reference's."""
    off = (logits.argmax(-1) != reference.argmax(-1)).nonzero().flatten().tolist()
    return [names[row] for row in off]
