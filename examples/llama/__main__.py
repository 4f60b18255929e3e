"""Run a prompt (token ids) through a Llama GGUF file: ``PYTHONPATH=examples python -m llama FILE ...``.

    python -m llama model.gguf --tokens 1,2,3 --max-new-tokens 16                 # one sequence, GPU
    python -m llama model.gguf --tokens 1,2,3 --tokens 4,5 --batched --max-step 8  # served together
    TRITON_INTERPRET=1 python -m llama tiny.gguf --device cpu --tokens 1,2,3      # the interpreter

Prints the greedy continuation of each prompt as token ids (and as the file's token strings when
it carries a ``tokenizer.ggml.tokens`` list). Greedy only: this is a check of the kernels, not a
chat front end.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

import torch
from rich.console import Console

from .generate import Generator
from .loader import load_gguf, open_gguf
from .model import LlamaModel
from .serving import BatchedServer, serve_greedy

log = logging.getLogger("llama")


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got {text!r}")
    return ids


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m llama", description=__doc__.split("\n")[0])
    parser.add_argument("file", help="a Llama GGUF file with Q4_K linear layers")
    parser.add_argument("--tokens", type=_token_ids, action="append", required=True, help="a prompt (repeatable)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=16, help="greedy tokens per prompt (>= 1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--chunk-size", type=_positive_int, default=256, help="prefill tokens per launch (one sequence)"
    )
    parser.add_argument("--max-len", type=int, default=None, help="cache positions (default: what the prompts need)")
    parser.add_argument("--batched", action="store_true", help="serve every prompt together (varlen attention)")
    parser.add_argument(
        "--max-step", type=_positive_int, default=64, help="batched: prefill tokens per sequence and step"
    )
    parser.add_argument("--no-graphs", action="store_true", help="run decode steps eagerly on a GPU")
    return parser


def _token_strings(path: str) -> list[str] | None:
    field = open_gguf(path).fields.get("tokenizer.ggml.tokens")
    return None if field is None else list(field.contents())


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        log.error("--device cpu runs the kernels on the Triton interpreter: set TRITON_INTERPRET=1")
        return 2
    started = time.perf_counter()
    config, weights = load_gguf(args.file, device=device)
    longest = max(len(p) for p in args.tokens) + args.max_new_tokens
    positions = args.max_len or longest
    if positions < longest:
        log.error("--max-len %d cannot hold the longest prompt and its new tokens (%d)", positions, longest)
        return 2
    model = LlamaModel(config, weights, max_positions=positions)
    log.info("loaded %s in %.1f s: %s", args.file, time.perf_counter() - started, config)
    graphs = False if args.no_graphs else None
    started = time.perf_counter()
    if args.batched:
        server = BatchedServer(
            model, max_seqs=len(args.tokens), capacity=positions, max_step=args.max_step, graphs=graphs
        )
        outputs = serve_greedy(server, args.tokens, args.max_new_tokens)
    else:
        generator = Generator(model, max_len=positions, chunk_size=args.chunk_size, graphs=graphs)
        outputs = [generator.generate(prompt, args.max_new_tokens) for prompt in args.tokens]
    elapsed = time.perf_counter() - started
    produced = sum(len(out) for out in outputs)
    log.info("generated %d tokens in %.2f s (%.1f tokens/s, prefill included)", produced, elapsed, produced / elapsed)
    strings = _token_strings(args.file)
    console = Console()
    for prompt, out in zip(args.tokens, outputs, strict=True):
        console.print(f"{prompt} -> {out}")
        if strings is not None:
            console.print(repr("".join(strings[t] for t in out if t < len(strings))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
