"""The record of ``scripts/bench_model.py``: what a run measured, as a markdown report and as JSON.

Kept apart from the script so that the phases (loading, checking, timing) and the rendering can
each be read on their own; the smoke test reads the report the script writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import _benchlib as bl

#: The two models, in the order they run.
IMPLS = ("tritune", "PyTorch bf16")


@dataclass
class Check:
    """A model's logits on the check prompts against the float64 reference."""

    impl: str
    rel_err: float
    bf16_rel_err: float
    top1: float
    bf16_top1: float
    #: The least passing top-1 agreement (``examples.llama.top1_floor`` of ``bf16_top1`` and ``rows``;
    #: for tritune, of the lower of that and the PyTorch bf16 model's: :func:`settle_floors`).
    top1_floor: float
    rows: int
    #: Rows whose top-1 token differs from the reference's, as ``prompt:position`` (``d`` marks a
    #: decoded row): where a failing agreement comes from (near ties in both, or one kind of call).
    misses: list[str] = field(default_factory=list)
    #: The same rows of PyTorch's own bf16 forward.
    bf16_misses: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        # The tests' bounds: no more than twice the error of PyTorch's own bf16 forward, and top-1
        # agreement within sampling noise of its (examples.llama.top1_floor).
        return self.rel_err <= 2 * self.bf16_rel_err and self.top1 >= self.top1_floor


def settle_floors(checks: dict[str, Check], floor: Callable[[float, int], float]) -> None:
    """Set tritune's top-1 floor from the lower agreement of the two bf16 forwards of the same
    weights the run measured: the reference module's in bf16 and the PyTorch bf16 model's.

    On random weights many rows are near ties, and which way a tie falls follows the GEMM kernels
    cuBLAS picks: on the same rows the reference's bf16 forward agreed on 0.961 on an H200 and
    0.891 on an H100, the PyTorch model on 0.930 and 0.930 (docs/perf/HISTORY.md). Either bf16
    forward is a fair yardstick, so tritune must reach the lower one's agreement less sampling
    noise (``floor``: ``examples.llama.top1_floor``). Nothing changes without both checks, or where
    the PyTorch model failed its own.
    """
    ours, peer = checks.get(IMPLS[0]), checks.get(IMPLS[1])
    if ours is not None and peer is not None and peer.ok:
        ours.top1_floor = floor(min(ours.bf16_top1, peer.top1), ours.rows)


@dataclass
class LengthRow:
    """One model at one prompt length."""

    impl: str
    length: int
    prefill_ms: float | None = None
    prefill_runs: int = 0
    decode_ms_per_token: float | None = None
    decode_runs: int = 0
    peak_bytes: int | None = None
    kv_bytes: int = 0
    note: str = ""


@dataclass
class Results:
    """Everything a run measured, in the order the phases fill it."""

    env: dict[str, Any]
    args: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, Check] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    lengths: list[LengthRow] = field(default_factory=list)
    serving: dict[str, Any] = field(default_factory=dict)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def rate(count: float, ms: float | None) -> float | None:
    return count / ms * 1e3 if ms else None


def to_json(results: Results) -> dict[str, Any]:
    args = {k: v for k, v in results.args.items() if not k.startswith("_")}
    return {
        "args": args, "config": results.config, "checks": [dataclasses.asdict(c) for c in results.checks.values()],
        "weights": results.weights, "lengths": [dataclasses.asdict(r) for r in results.lengths],
        "serving": results.serving, "profiles": results.profiles,
    }  # fmt: skip


def glue(args: dict[str, Any], option: str) -> str:
    """How a model's element-wise work ran, from its ``--*-glue`` option (PyTorch ops in a run that
    predates the option)."""
    if args.get(option, "torch") == "triton":
        return "in four Triton launches a block (examples/llama/glue.py)"
    return "in PyTorch ops (float32, one launch per op)"


def report(results: Results) -> str:
    env, args, cfg = results.env, results.args, results.config
    shape = (
        f"{cfg.get('layers')} layers, hidden {cfg.get('hidden')}, MLP {cfg.get('ffn')}, {cfg.get('heads')}/"
        f"{cfg.get('kv_heads')} heads of {cfg.get('head_dim')}, vocabulary {cfg.get('vocab')}"
        if cfg
        else "-"
    )
    tritune_chunks = (
        "every chunk eager (--no-prefill-graphs)"
        if args.get("no_prefill_graphs")
        else f"each chunk of {args['chunk_size']} tokens replays one CUDA graph, a shorter last chunk the graph of "
        "its length padded to a power of two up to 128 tokens or a multiple of 128 above"
    )
    notes = [
        f"Model: {shape}; random weights (make_llama_gguf.py), every linear Q4_K. Batch 1 unless stated.",
        f"tritune: q4k_linear, chunked prefill_attention ({tritune_chunks}), decode_attention in one CUDA graph "
        "per step. PyTorch bf16: the same forward on the weights dequantized once to bf16, F.linear (cuBLAS), SDPA "
        "over the same static cache (prefill: native GQA, bottom-right causal, PyTorch's backend, chunks run "
        "eagerly as SDPA needs the cache's length on the host; decode: masked, the fastest backend at that "
        "context), its decode step in one CUDA graph too. Both keep a float32 residual stream. Element-wise "
        f"work between kernels (residual adds, RMSNorm, RoPE, SwiGLU): tritune {glue(args, 'tritune_glue')}, "
        f"PyTorch bf16 {glue(args, 'baseline_glue')}.",
        f"Prefill: the whole prompt from an empty cache in chunks of {args['chunk_size']} tokens, last-token "
        f"logits per chunk. Decode: {args['decode_steps']} greedy steps after that prompt (graph replays), "
        "tokens/s = steps / time.",
        "Times: one warm-up run, then the median of up to --repeats runs (fewer where one run exceeds "
        f"{args['run_seconds']:g} s), CUDA events around the host loop. ratio = tritune tokens/s / PyTorch tokens/s "
        "(above 1: tritune faster); no ratio where a correctness check failed.",
        f"Settings: TRITUNE_Q4K_FP8={int(bool(env.get('q4k_fp8')))}, configs: {env.get('db')}.",
    ]
    if env["smoke"]:
        notes.append("Smoke run on the CPU interpreter: no CUDA graphs, times meaningless.")
    parts = [bl.header_markdown(env, "Llama end to end: tritune vs PyTorch bf16", notes)]
    parts.append(checks_table(results))
    parts.append(lengths_table(results))
    parts.append(memory_table(results))
    if results.serving:
        parts.append(serving_table(results.serving))
    for impl, prof in results.profiles.items():
        parts.append(profile_table(impl, prof, int(cfg.get("layers") or 1)))
    return "\n".join(parts)


def checks_table(results: Results) -> str:
    lines = [
        "## Correctness (before any timing)",
        "",
        f"Logits on {results.args['check_prompts']} random prompts (all but the last two tokens prefilled in two "
        "chunks, those two decoded; graphs on a GPU) against a float64 forward of the same dequantized weights "
        "(examples/llama/reference.py), next to PyTorch's own bf16 forward of them. ok: relative error at most "
        "twice bf16's, and top-1 agreement at least 0.9 or PyTorch bf16's own less three binomial standard "
        "errors, whichever is lower (examples.llama.top1_floor); for tritune, bf16's own is the lower agreement "
        "of the two bf16 forwards (the reference's and the PyTorch bf16 model's), as near ties fall with the "
        "GEMM kernels a GPU picks.",
        "",
        "| model | rel. error vs fp64 | PyTorch bf16 forward's | top-1 agreement | PyTorch bf16 forward's | least "
        "passing | rows | check |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in results.checks.values():
        lines.append(f"| {c.impl} | {c.rel_err:.4f} | {c.bf16_rel_err:.4f} | {c.top1:.3f} | {c.bf16_top1:.3f} | "
                     f"{c.top1_floor:.3f} | {c.rows} | {'ok' if c.ok else 'FAILED'} |")  # fmt: skip
    lines.append("")
    for c in results.checks.values():
        shared = len(set(c.misses) & set(c.bf16_misses))
        lines.append(f"- {c.impl}: rows off the reference's top-1 (prompt:position, d = decoded): "
                     f"{', '.join(c.misses) or 'none'}; PyTorch bf16 forward's: {', '.join(c.bf16_misses) or 'none'} "
                     f"({shared} shared)")  # fmt: skip
    return "\n".join(lines) + "\n"


def _ratio(results: Results, ours: float | None, theirs: float | None) -> str:
    if any(not c.ok for c in results.checks.values()):
        return "- (check FAILED)"
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def lengths_table(results: Results) -> str:
    lines = [
        "## Prefill and decode, one sequence",
        "",
        "| prompt tokens | tritune prefill tok/s | PyTorch prefill tok/s | prefill ratio | tritune decode tok/s | "
        "PyTorch decode tok/s | decode ratio | tritune peak | PyTorch peak | runs (prefill/decode) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_key = {(r.impl, r.length): r for r in results.lengths}
    for length in dict.fromkeys(r.length for r in results.lengths):
        ours, theirs = by_key.get((IMPLS[0], length)), by_key.get((IMPLS[1], length))
        cells: list[str] = [str(length)]
        pre = [rate(length, r.prefill_ms) if r else None for r in (ours, theirs)]
        dec = [rate(1, r.decode_ms_per_token) if r else None for r in (ours, theirs)]
        cells += [bl.fmt(pre[0], 0), bl.fmt(pre[1], 0), _ratio(results, *pre)]
        cells += [bl.fmt(dec[0], 1), bl.fmt(dec[1], 1), _ratio(results, *dec)]
        cells += [gib(r.peak_bytes) if r else "-" for r in (ours, theirs)]
        cells.append(" / ".join(f"{r.prefill_runs}/{r.decode_runs}" for r in (ours, theirs) if r))
        cells.append("; ".join(r.note for r in (ours, theirs) if r and r.note).replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def memory_table(results: Results) -> str:
    lines = [
        "## GPU memory",
        "",
        "Weights: every tensor the forward reads (embedding float32 in both). KV cache: bf16 K and V of every layer "
        "for the longest prompt and its decode steps. Peak: torch.cuda.max_memory_allocated over that length's "
        "runs (weights, cache, activations, graph pools).",
        "",
        "| model | linear weights | weights | KV cache per token | KV cache, longest prompt | peak, longest prompt |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for impl, kind in zip(IMPLS, ("Q4_K (4.625 bits)", "bf16"), strict=True):
        rows = [r for r in results.lengths if r.impl == impl]
        if impl not in results.weights:
            continue
        longest = max(rows, key=lambda r: r.length) if rows else None
        cfg = results.config
        per_token = 2 * cfg["layers"] * cfg["kv_heads"] * cfg["head_dim"] * 2
        lines.append(
            f"| {impl} | {kind} | {gib(results.weights[impl])} | {per_token / 2**10:.1f} KiB | "
            f"{gib(longest.kv_bytes) if longest else '-'} | {gib(longest.peak_bytes) if longest else '-'} |"
        )
    return "\n".join(lines) + "\n"


def serving_table(s: dict[str, Any]) -> str:
    total = s["prompt_tokens"] + s["new_tokens"]
    lines = [
        "## Batched serving (tritune)",
        "",
        f"{s['sequences']} sequences, prompt lengths {s['prompt_lengths']}, {s['new_tokens'] // s['sequences']} greedy "
        f"new tokens each. batched: BatchedServer + serve_greedy (varlen_attention over one BatchedSequenceCache, "
        f"up to {s['max_step']} prefill tokens per sequence and step, each step width captured once in a CUDA graph). "
        "loop: Generator.generate over the prompts one after another (chunked prefill, graph-replayed decode). "
        f"Greedy tokens the two agree on: {s['same_tokens']:.3f} (bf16 near-ties of random weights may differ).",
        "",
        "| mode | time (s) | tokens/s (prompt + new) | new tokens/s | vs loop | peak | runs |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in ("batched", "loop"):
        ms = s[f"{mode}_ms"]
        lines.append(
            f"| {mode} | {ms / 1e3:.2f} | {total / ms * 1e3:.0f} | {s['new_tokens'] / ms * 1e3:.1f} | "
            f"{s['loop_ms'] / ms:.2f}x | {gib(s[f'{mode}_peak'])} | {s[f'{mode}_runs']} |"
        )
    return "\n".join(lines) + "\n"


def profile_table(impl: str, prof: dict[str, Any], layers: int) -> str:
    lines = [
        f"## Profile: {impl}",
        "",
        f"torch.profiler kernel time of one prefill chunk ({prof['chunk']} tokens ending at position "
        f"{prof['length']}) and one decode step after it, grouped by kernel name (examples/llama/step_profile.py). "
        "Per layer: the step's time / layers (embedding and head included). Host gaps: the part of the span no "
        "kernel covers.",
        "",
        "| step | group | us | us per layer | share of span |",
        "| --- | --- | --- | --- | --- |",
    ]
    tops = []
    for step in ("prefill", "decode"):
        p = prof[step]
        span = p["span_us"] or 1.0
        gaps = max(0.0, p["span_us"] - p["busy_us"])
        for group, us in [*p["groups"].items(), ("host gaps", gaps), ("span", p["span_us"])]:
            lines.append(f"| {step} | {group} | {us:.0f} | {us / layers:.1f} | {us / span:.1%} |")
        tops.append(f"- {step}, longest kernels: " + "; ".join(
            f"`{name[:60]}` ({group}) {us:.0f} us x{count}" for name, group, us, count in p["top"]))  # fmt: skip
    return "\n".join(lines) + "\n\n" + "\n".join(tops) + "\n"
