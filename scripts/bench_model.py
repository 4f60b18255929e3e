"""Benchmark the Llama example end to end: tritune's kernels against the same model in plain PyTorch bf16.

On the GPU machine (one H200 holds everything; the file is generated on the GPU when missing):

    python scripts/bench_model.py --profile --out docs/perf/DATE-model-llama3-8b-GPU.md --json ...json

The model is the Llama-3-8B shape (32 layers, hidden 4096, MLP 14336, 32 query and 8 KV heads of
128; ``--vocab`` cuts the vocabulary, 32768 by default) with random weights, written by
``scripts/make_llama_gguf.py`` (Llama-3.1 RoPE scaling, context 131072) unless ``--gguf`` names a
file. Two models run it, one after the other so that only one is resident:

- tritune (``examples/llama``): Q4_K weights through ``q4k_linear``, the element-wise work between
  kernels in four Triton launches a block (``--tritune-glue torch``: PyTorch ops), chunked
  ``prefill_attention`` with every chunk replaying a CUDA graph of its length, a shorter last chunk
  padded (``--no-prefill-graphs``: eager chunks), a decode step of ``decode_attention`` captured in
  one CUDA graph;
- the PyTorch baseline (``examples/llama/torch_model.py``): the same forward on the weights
  dequantized once to bf16, its element-wise work in PyTorch ops as a PyTorch user writes it
  (``--baseline-glue triton``: tritune's, so that the two differ in linears and attention only),
  ``F.linear`` on cuBLAS, SDPA over the same static cache (prefill: native GQA, bottom-right causal,
  PyTorch's backend choice; decode: the fastest of its backends, chosen once per context), the same
  chunk size, its decode step captured in one CUDA graph too. Its prefill chunks run eagerly: SDPA
  slices the cache to a host length, which a replay cannot change.

Per prompt length: prefill tokens/s (the whole prompt in chunks, from an empty cache) and decode
tokens/s (``--decode-steps`` graph replays after that prompt), each the median of timed runs after
a warm-up run (CUDA events around the host loop, then a sync), and the peak memory allocated. The
batched-serving phase serves ``--serve-seqs`` prompts of seeded mixed lengths through
``BatchedServer`` (``varlen_attention`` over one ``BatchedSequenceCache``) against a loop of
``Generator.generate`` over the same prompts. Before any timing, each model's logits on a few
random prompts (prefill in two chunks, then decode steps) are compared with a float64 reference
of the same dequantized weights (``_bench_model_check.py``); a model that fails is never given a
speedup. ``--profile`` adds a kernel-time breakdown of one prefill chunk and one decode step. The
report is rewritten after every phase, so a run cut short keeps what it measured.

``--smoke`` runs every phase on the CPU under ``TRITON_INTERPRET=1`` with the tiny preset and tiny
lengths: a dry run of the script, with meaningless times (and no CUDA graphs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import _bench_timing as bt
import _benchlib as bl
import torch
from _bench_model_check import CHECK_LENGTH, check_model, check_prompts, references
from _bench_model_report import IMPLS, LengthRow, Results, gib, report, settle_floors, to_json

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

log = logging.getLogger("tritune.bench")

LENGTHS = (512, 2048, 8192, 32768, 130048)
SMOKE_LENGTHS = (12, 20)
#: The interpreter runs a launch's programs one by one: fewer, larger Q4_K tiles (as the tests pin).
SMOKE_Q4K = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128}


# ---- options and the file --------------------------------------------------------------------------------


def _lengths(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated prompt lengths, got {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"expected prompt lengths of at least 2, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bl.add_common_arguments(p, flex=False)
    p.add_argument("--gguf", default=None, help="a Llama GGUF file (Q4_K linears); default: generate the 8B shape")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary of the generated file")
    p.add_argument("--layers", type=int, default=None, help="layers of the generated file (default: 32)")
    p.add_argument("--lengths", type=_lengths, default=None, help="prompt lengths (default: 512,...,130048)")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill tokens per launch (default 2048)")
    p.add_argument("--decode-steps", type=int, default=None, help="decode steps timed per length (default 32)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement after a warm-up (default 3)")
    p.add_argument("--run-seconds", type=float, default=10.0, help="fewer timed runs where one takes this long")
    p.add_argument("--serve-seqs", type=int, default=None, help="sequences served at once (default 32)")
    p.add_argument("--serve-lengths", type=_lengths, default=None, help="MIN,MAX prompt length (default 128,4096)")
    p.add_argument("--serve-new", type=int, default=None, help="new tokens per served sequence (default 32)")
    p.add_argument("--serve-step", type=int, default=512, help="prefill tokens per sequence and serving step")
    p.add_argument("--skip-serving", action="store_true", help="leave the batched-serving phase out")
    p.add_argument("--check-prompts", type=int, default=None, help="random prompts of the correctness check (4)")
    p.add_argument("--profile", action="store_true", help="kernel-time breakdown of a prefill chunk and a decode step")
    p.add_argument("--profile-length", type=int, default=None, help="context of the profiled steps (default 8192)")
    p.add_argument("--no-prefill-graphs", action="store_true", help="tritune's prefill chunks run eagerly too")
    p.add_argument(
        "--tritune-glue",
        choices=("triton", "torch"),
        default="triton",
        help="the tritune model's element-wise work: Triton launches (default) or PyTorch ops",
    )
    p.add_argument(
        "--baseline-glue",
        choices=("torch", "triton"),
        default="torch",
        help="the PyTorch model's element-wise work: PyTorch ops (default) or tritune's Triton glue",
    )
    return p


def defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options whose default depends on ``--smoke``."""
    smoke = args.smoke
    fill = {
        "lengths": list(SMOKE_LENGTHS if smoke else LENGTHS),
        "chunk_size": 8 if smoke else 2048,
        "decode_steps": 2 if smoke else 32,
        "repeats": 3,
        "serve_seqs": 2 if smoke else 32,
        "serve_lengths": [4, 12] if smoke else [128, 4096],
        "serve_new": 2 if smoke else 32,
        "check_prompts": 2 if smoke else 4,
    }
    for name, value in fill.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if smoke:
        args.serve_step = min(args.serve_step, 8)
    if len(args.serve_lengths) != 2 or args.serve_lengths[0] > args.serve_lengths[1]:
        raise SystemExit(f"--serve-lengths: expected MIN,MAX, got {args.serve_lengths}")
    if args.profile_length is None:
        fitting = [n for n in args.lengths if n <= (16 if smoke else 8192)]
        args.profile_length = max(fitting) if fitting else min(args.lengths)
    return args


def gguf_file(args: argparse.Namespace, device: torch.device) -> Path:
    """``--gguf``, or the generated Llama-3-8B-shaped file (reused when it is already there)."""
    import make_llama_gguf as maker

    if args.gguf and Path(args.gguf).is_file():
        return Path(args.gguf)
    if args.smoke:
        shape = maker.PRESETS["tiny"]
    else:
        # Llama 3.1's long-context RoPE, so that 128k positions are the model's own.
        shape = dataclasses.replace(maker.PRESETS["llama3-8b"], vocab=args.vocab, context=131072, rope_scaling="llama3")
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
    name = f"tritune-bench-llama-{shape.layers}l-{shape.hidden}h-v{shape.vocab}-s{args.seed}.gguf"
    path = Path(args.gguf) if args.gguf else Path(tempfile.gettempdir()) / name
    if path.is_file():
        log.info("reusing %s", path)
        return path
    log.info("writing %s (random weights, quantized on %s)", path, device)
    partial = path.with_suffix(".partial")
    maker.make_llama_gguf(partial, shape, seed=args.seed, device=device)
    partial.replace(path)
    return path


# ---- timing ---------------------------------------------------------------------------------------------------


def elapsed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call: CUDA events around it (its host loop included), or the wall clock on the CPU."""
    if device.type != "cuda":
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(fn: Callable[[], object], args: argparse.Namespace, device: torch.device) -> tuple[float, int]:
    """Median of timed runs of ``fn`` after one warm-up run; fewer runs where one is long. (ms, runs).

    A smoke run times its one run without a warm-up: the interpreter's times mean nothing anyway.
    """
    first = elapsed_ms(fn, device)
    if args.smoke:
        return first, 1
    runs = max(1, min(args.repeats, int(args.run_seconds * 1e3 // max(first, 1e-3))))
    return statistics.median(elapsed_ms(fn, device) for _ in range(runs)), runs


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def release(device: torch.device) -> None:
    """Give the allocator's free blocks back and restart the peak count (between phases)."""
    # Generators and graphs of the last phase may sit in reference cycles (closures over them).
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    started = time.perf_counter()
    log.info("%s ...", name)
    yield
    log.info("%s: %.1f s", name, time.perf_counter() - started)


# ---- the phases ----------------------------------------------------------------------------------------------


def bench_lengths(impl: str, make: Callable[..., Any], args: argparse.Namespace, run: bl.BenchRun) -> list[LengthRow]:
    """Prefill and decode throughput at every prompt length, one fresh cache per length."""
    device, rows = run.device, []
    for length in args.lengths:
        release(device)
        max_len = -(-(length + args.decode_steps + 1) // 64) * 64
        generator = make(max_len=max_len, chunk_size=args.chunk_size, graphs=run.graphs)
        row = LengthRow(impl=impl, length=length, kv_bytes=cache_bytes(generator))
        ids = torch.randint(generator.model.config.vocab, (length,), device=device,
                            generator=torch.Generator(device=device).manual_seed(args.seed + length))  # fmt: skip

        def prefill(generator: Any = generator, ids: torch.Tensor = ids) -> None:
            generator.reset()
            generator.prefill(ids)

        row.prefill_ms, row.prefill_runs = median_ms(prefill, args, device)
        if hasattr(generator, "choose_decode_backend"):
            times = generator.choose_decode_backend(lambda fn: bt.time_ms(fn, device))
            row.note = f"decode SDPA: {generator.decode_backend} ({backend_text(times)})"

        def decode(generator: Any = generator, length: int = length) -> None:
            generator.truncate(length)
            generator.decode(1)
            for _ in range(args.decode_steps - 1):
                generator.decode()

        total_ms, row.decode_runs = median_ms(decode, args, device)
        row.decode_ms_per_token = total_ms / args.decode_steps
        row.peak_bytes = peak_memory(device)
        if getattr(generator, "repeat_kv", False):
            row.note = bl.join_notes(row.note, "prefill SDPA refused native GQA: K/V heads repeated")
        log.info("  %s L=%d: prefill %.0f tokens/s (%d runs), decode %.1f tokens/s (%d runs), peak %s %s", impl,
                 length, length / row.prefill_ms * 1e3, row.prefill_runs, 1e3 / row.decode_ms_per_token,
                 row.decode_runs, gib(row.peak_bytes), row.note)  # fmt: skip
        rows.append(row)
        del generator, prefill, decode
    release(device)
    return rows


def cache_bytes(generator: Any) -> int:
    return sum(t.numel() * t.element_size() for t in (*generator.cache.k, *generator.cache.v))


def backend_text(times: dict[str, float | str]) -> str:
    return ", ".join(f"{name} {t:.3f} ms" if isinstance(t, float) else f"{name} {t.split(':')[0]}" for name, t in
                     times.items())  # fmt: skip


def bench_serving(llama: Any, model: Any, args: argparse.Namespace, run: bl.BenchRun) -> dict[str, Any]:
    """Seeded mixed-length prompts served together (varlen) and one after another (Generator)."""
    rng = random.Random(args.seed)
    low, high = args.serve_lengths
    sizes = [rng.randint(low, high) for _ in range(args.serve_seqs)]
    prompts = [[rng.randrange(model.config.vocab) for _ in range(n)] for n in sizes]
    capacity = max(sizes) + args.serve_new
    batched = _serve_batched(llama, model, prompts, capacity, args, run)
    loop = _serve_loop(llama, model, prompts, capacity, args, run)
    new_tokens = args.serve_new * args.serve_seqs
    same = sum(a == b for x, y in zip(batched[3], loop[3], strict=True) for a, b in zip(x, y, strict=True))
    result = {
        "sequences": args.serve_seqs, "prompt_tokens": sum(sizes), "new_tokens": new_tokens,
        "prompt_lengths": f"{min(sizes)}-{max(sizes)} (seeded uniform {low}-{high})", "max_step": args.serve_step,
        "batched_ms": batched[0], "batched_runs": batched[1], "batched_peak": batched[2],
        "loop_ms": loop[0], "loop_runs": loop[1], "loop_peak": loop[2], "same_tokens": same / new_tokens,
    }  # fmt: skip
    log.info("  serving: batched %.2f s, loop %.2f s, same greedy tokens %.3f", batched[0] / 1e3, loop[0] / 1e3,
             result["same_tokens"])  # fmt: skip
    return result


#: A serving mode's median milliseconds, timed runs, peak bytes and greedy outputs.
Served = tuple[float, int, int | None, list[list[int]]]


def _serve_batched(llama: Any, model: Any, prompts: list, capacity: int, args: argparse.Namespace,
                   run: bl.BenchRun) -> Served:  # fmt: skip
    release(run.device)
    server = llama.BatchedServer(model, max_seqs=len(prompts), capacity=capacity, max_step=args.serve_step,
                                 graphs=run.graphs)  # fmt: skip
    outputs: list[list[list[int]]] = []

    def serve() -> None:
        outputs[:] = [llama.serve_greedy(server, prompts, args.serve_new)]

    ms, runs = median_ms(serve, args, run.device)
    return ms, runs, peak_memory(run.device), outputs[0]


def _serve_loop(llama: Any, model: Any, prompts: list, capacity: int, args: argparse.Namespace,
                run: bl.BenchRun) -> Served:  # fmt: skip
    release(run.device)
    generator = llama.Generator(model, max_len=capacity, chunk_size=args.chunk_size, graphs=run.graphs,
                                **prefill_graphs(args))  # fmt: skip
    outputs: list[list[list[int]]] = []

    def one_by_one() -> None:
        outputs[:] = [[generator.generate(p, args.serve_new) for p in prompts]]

    ms, runs = median_ms(one_by_one, args, run.device)
    return ms, runs, peak_memory(run.device), outputs[0]


def profile_steps(make: Callable[..., Any], args: argparse.Namespace, run: bl.BenchRun) -> dict[str, Any]:
    """One prefill chunk (the last of a ``--profile-length`` prompt) and one decode step after it."""
    from llama.step_profile import profile_call

    device, length = run.device, args.profile_length
    chunk = min(args.chunk_size, length)
    release(device)
    generator = make(max_len=length + 64, chunk_size=chunk, graphs=run.graphs)
    ids = torch.randint(generator.model.config.vocab, (length,), device=device,
                        generator=torch.Generator(device=device).manual_seed(args.seed))  # fmt: skip
    generator.prefill(ids)

    def last_chunk() -> None:
        generator.truncate(length - chunk)
        generator.prefill(ids[length - chunk :])

    last_chunk()
    prefill = profile_call(last_chunk, device)
    if hasattr(generator, "choose_decode_backend"):
        generator.choose_decode_backend(lambda fn: bt.time_ms(fn, device))

    def step() -> None:
        generator.truncate(length)
        generator.decode(1)

    step()
    step()
    decode = profile_call(step, device)
    return {
        "length": length,
        "chunk": chunk,
        "prefill": dataclasses.asdict(prefill),
        "decode": dataclasses.asdict(decode),
    }


def prefill_graphs(args: argparse.Namespace) -> dict[str, bool]:
    """The ``prefill_graphs`` keyword of a generator: off with ``--no-prefill-graphs``, else as ``graphs``."""
    return {"prefill_graphs": False} if args.no_prefill_graphs else {}


def max_positions(args: argparse.Namespace) -> int:
    """The RoPE positions the model must cover: the longest cache of any phase.

    A prompt length's cache rounds ``length + decode_steps + 1`` up to 64 (at most ``+ 64``), the
    profile's is ``profile_length + 64``, the serving phase's its longest prompt plus ``serve_new``
    and the check's a prompt of 32 plus one.
    """
    single = max(*args.lengths, args.profile_length) + args.decode_steps + 64
    serving = args.serve_lengths[1] + args.serve_new
    return max(single, serving, CHECK_LENGTH + 1)


def run_model(
    llama: Any,
    impl: str,
    path: Path,
    args: argparse.Namespace,
    run: bl.BenchRun,
    results: Results,
    refs: list | None,
    save: Callable[[], None],
) -> list:
    """Load ``impl``'s model, check it, then run every phase on it; the model is dropped on return.

    The float64 reference is computed from the first model's weights (``refs`` None) and returned
    for the next, so that the file is read into host memory once per model only.
    """
    device = run.device
    tritune = impl == IMPLS[0]
    with phase(f"{impl}: load"):
        config, weights = llama.load_gguf(path, device=device)
        results.config = dataclasses.asdict(config)
        prompts = check_prompts(config.vocab, args.check_prompts, 8 if args.smoke else CHECK_LENGTH, args.seed)
        if refs is None:
            refs = references(llama, config, weights, prompts)
        model = (llama.LlamaModel if tritune else llama.TorchLlamaModel)(
            config,
            weights,
            max_positions=max_positions(args),
            glue=args.tritune_glue if tritune else args.baseline_glue,
        )
        # The model holds its own (fused or dense) copies: the file's tensors go.
        del weights
        release(device)
    generator_type = llama.Generator if tritune else llama.TorchGenerator

    def make(**kwargs: Any) -> Any:
        return generator_type(model, **prefill_graphs(args), **kwargs)

    results.weights[impl] = model.weight_bytes()
    with phase(f"{impl}: correctness"):
        results.checks[impl] = check_model(impl, make, prompts, refs, run.graphs)
    save()
    with phase(f"{impl}: prefill and decode"):
        results.lengths += bench_lengths(impl, make, args, run)
    save()
    if tritune and not args.skip_serving:
        with phase(f"{impl}: batched serving"):
            results.serving = bench_serving(llama, model, args, run)
        save()
    if args.profile:
        with phase(f"{impl}: profile"):
            results.profiles[impl] = profile_steps(make, args, run)
        save()
    return refs


def main(argv: Sequence[str] | None = None) -> int:
    args = defaults(parser().parse_args(argv))
    run = bl.start(args)
    # After start(): --smoke must switch the interpreter on before any kernel module is imported.
    import llama

    from tritune.kernels import use_config
    from tritune.kernels.settings import settings

    env = dict(run.env, q4k_fp8=settings().q4k_fp8, db=run.db or "default (shipped bundles, user DB)")
    results = Results(env=env, args=dict(vars(args)))

    def save() -> None:
        bl.write_report(report(results), env, [to_json(results)], args.out, args.json)

    with phase("model file"):
        path = gguf_file(args, run.device)
    pin = use_config("q4k_fp8_gemm", SMOKE_Q4K) if args.smoke else contextlib.nullcontext()
    refs = None
    with bl.tuned_db(run.db), pin:
        for impl in IMPLS:
            refs = run_model(llama, impl, path, args, run, results, refs, save)
        settle_floors(results.checks, llama.top1_floor)
        save()
    bl.print_report(report(results))
    return 0 if all(check.ok for check in results.checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
