"""The harness every benchmark script shares: options, the device and pinned configs, PyTorch SDPA peers,
tuned-trial lookup and the report files.

A benchmark parses its options (:func:`add_common_arguments`), calls :func:`start` (logging, the
Triton interpreter for ``--smoke``, the device, a checked ``--db``), builds its rows (a
``TimedRow`` per implementation and shape) and fills each with ``measure`` (both in
``_bench_timing``: how a row is checked and timed), then writes its report after every shape
(:func:`write_report`). ``--smoke`` must switch the interpreter on before any kernel module is
imported, so this module imports triton and tritune only inside its functions: importing it
decides nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import datetime
import json
import logging
import os
import platform
import shlex
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from _bench_timing import TimedRow

log = logging.getLogger("tritune.bench")

#: Peak HBM bandwidth of the GPUs we report on (TB/s), for the "% of peak" lines of the headers.
HBM_TBPS = {"NVIDIA H200": 4.8, "NVIDIA H100 80GB HBM3": 3.35}


# ---- starting a run -------------------------------------------------------------------------------


def add_common_arguments(parser: argparse.ArgumentParser, *, flex: bool = True) -> None:
    """The options every kernel benchmark takes (``flex``: it also compares FlexAttention)."""
    parser.add_argument("--db", default=None, help="config DB holding the tuned winners and trials (settings db_url)")
    parser.add_argument("--out", default=None, help="markdown file to write the report to")
    parser.add_argument("--json", default=None, help="JSON file to write the rows to")
    if flex:
        parser.add_argument("--skip-flex", action="store_true", help="leave FlexAttention out (it compiles per shape)")
    parser.add_argument("--no-graph", action="store_true", help="eager timings only (no CUDA-graph replay column)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--smoke", action="store_true", help="CPU dry run on the Triton interpreter at tiny shapes")


@dataclass(frozen=True)
class BenchRun:
    """What :func:`start` settles for a benchmark run."""

    device: torch.device
    #: ``--db``, checked to exist (None: the default settings, user DB and shipped bundles).
    db: str | None
    #: Whether CUDA-graph replays are timed too (on a GPU, without ``--no-graph``).
    graphs: bool
    #: Device, versions, date and command line, for the report header and the JSON.
    env: dict[str, Any]


def start(args: argparse.Namespace) -> BenchRun:
    """Logging, the interpreter for ``--smoke``, the device, a checked ``--db`` and the environment."""
    setup_logging()
    if args.smoke:
        use_interpreter()
    device = bench_device(args.smoke)
    graphs = device.type == "cuda" and not args.no_graph
    return BenchRun(device, checked_db(args.db), graphs, environment(device, args.smoke))


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # Its own level: the library sets the "tritune" logger to settings' log_level on the first dispatch,
    # which would otherwise silence the per-row progress lines from then on.
    log.setLevel(logging.INFO)


def use_interpreter() -> None:
    """Run the kernels on the Triton interpreter (CPU tensors), as the test tiers and ``tune --device cpu`` do.

    Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so this must run before any kernel
    module of tritune is imported; child processes inherit the variable.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    from tritune.kernels._interpreter import fix_interpreter_index

    fix_interpreter_index()


def tuned_db(db: str | None) -> contextlib.AbstractContextManager[object]:
    """Serve the tuned configs of ``db`` (on top of the shipped bundles) while it is held; no-op for None."""
    if db is None:
        return contextlib.nullcontext()
    from tritune.kernels import settings

    return settings.override(db_url=db)


def compiled_flex() -> Callable[..., torch.Tensor]:
    """``torch.compile(flex_attention)`` with room for one static compile per benchmarked shape."""
    from torch.nn.attention.flex_attention import flex_attention

    # The default recompile limit of 8 would fall back to eager after the eighth shape.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), 64))
    return torch.compile(flex_attention, dynamic=False)


# ---- the device and the configs --------------------------------------------------------------------


def bench_device(smoke: bool) -> torch.device:
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: run on the GPU machine, or pass --smoke for the CPU dry run")
    return torch.device("cuda", torch.cuda.current_device())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def served_under_pin(spec: Any, config: dict[str, Any], device: torch.device, facts: Iterable[Any]) -> dict[str, Any]:
    """:func:`served_config` with ``spec`` pinned to ``config``: the pin itself, or what the
    dispatcher serves instead where the pin cannot serve that call (a row timing it would time
    that stand-in under the pin's name)."""
    from tritune.kernels import use_config

    def choose() -> dict[str, Any]:
        with use_config(spec.name, config):
            return served_config(spec, facts, device)

    return contextvars.copy_context().run(choose)


def pinned_call(kernel: str, config: dict[str, Any], fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any):
    """``fn(*args, **kwargs)`` with ``kernel`` pinned to ``config``, the pin entered once, not per call.

    Entering ``use_config`` parses and checks the config (a pinned prefill call cost 33 us of host
    time on the dev CPU against 5 us for a plain one, before the dispatcher cached parsed pins;
    ``scripts/measure_overhead.py``). Inside a timed call, that host time shows in an eager GPU
    time wherever it outlasts the L2 flush ahead of the call (on the H200, the pinned D=128 Lq=512
    prefill row read 0.260 ms where the dispatcher, serving the same config, read 0.175 ms). The
    pin lives in a private copy of the context, so it covers exactly these calls (not re-entrant:
    one call at a time).
    """
    from tritune.kernels import use_config

    context = contextvars.copy_context()
    pin = use_config(kernel, config)
    try:
        context.run(pin.__enter__)
    except Exception as exc:  # a config the space refuses: its row reports it, the run goes on
        error = exc

        def refused() -> torch.Tensor:
            raise error

        return refused

    def run() -> torch.Tensor:
        return context.run(fn, *args, **kwargs)

    # The pin is left in the copy until ``run`` goes, then closed there (its token belongs to it).
    weakref.finalize(run, context.run, pin.__exit__, None, None, None)
    return run


def served_config(spec: Any, facts: Iterable[Any], device: torch.device) -> dict[str, Any]:
    """The config the dispatcher serves a call of ``spec`` with these facts on ``device`` (under any pin in force)."""
    from tritune.kernels._launch import device_index
    from tritune.kernels.dispatcher import dispatch_config

    config = dispatch_config(spec.name, device.type, device_index(device), tuple(facts))
    return spec.space.to_dict(config)


def eager_note(spec: Any, facts: Iterable[Any], device: torch.device) -> str:
    """``"; eager calls: <config>"`` where plain eager calls get another config than graphs (the
    key's eager alternative), else ``""``: a dispatcher row's eager column times that config."""
    from tritune.kernels.dispatcher import dispatch_config_eager

    graph = served_config(spec, facts, device)
    eager = spec.space.to_dict(dispatch_config_eager(spec.name, device, tuple(facts)))
    return "" if eager == graph else f"; eager calls: {config_text(eager)}"


def config_text(config: Mapping[str, Any]) -> str:
    """A config as ``NAME=value`` pairs, for a row's note."""
    return " ".join(f"{name}={value}" for name, value in config.items())


# ---- PyTorch SDPA peers ---------------------------------------------------------------------------------


@dataclass
class SdpaPeer:
    """One SDPA backend's call, ready to time: ``fn`` (None where it cannot run: ``error`` says why)."""

    fn: Callable[[], torch.Tensor] | None
    note: str = ""
    error: str = ""


def sdpa_peer(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **sdpa_args: Any) -> SdpaPeer:
    """SDPA pinned to ``backend`` over GQA K/V: ``enable_gqa=True``, else K/V heads repeated once, untimed.

    Every backend reads the bytes ours reads where it takes ``enable_gqa``; the repeat (the group
    times the K/V bytes) is the fallback of one that refuses it, made here so no timed call pays it.
    ``sdpa_args`` go to every call (``attn_mask``, ``is_causal``).
    """
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def call(key: torch.Tensor, value: torch.Tensor, gqa: bool) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, key, value, enable_gqa=gqa, **sdpa_args)

    group = q.shape[1] // k.shape[1]
    try:
        call(k, v, group > 1)
        return SdpaPeer(lambda: call(k, v, group > 1), note="enable_gqa=True" if group > 1 else "")
    except Exception as exc:
        refused = error_text(exc, 120)
    if group == 1:
        return SdpaPeer(None, error=refused)
    needed = 2 * k.numel() * group * k.element_size()
    if q.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(q.device)
        if needed > 0.8 * free:
            return SdpaPeer(
                None,
                error=f"refused enable_gqa ({refused}); repeating KV heads would need "
                f"{needed / 1e9:.1f} GB of {free / 1e9:.1f} GB free",
            )
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    try:
        call(k_rep, v_rep, False)
    except Exception as exc:
        return SdpaPeer(None, error=f"refused enable_gqa ({refused}); with repeated KV heads: {error_text(exc, 120)}")
    return SdpaPeer(
        lambda: call(k_rep, v_rep, False),
        note=f"refused enable_gqa, so KV heads repeated {group}x outside the timed region ({refused})",
    )


#: Kernel-name fragments of each SDPA backend, checked in this order (cuDNN's names also say "flash").
_BACKEND_FAMILIES = (
    ("cudnn", ("cudnn",)),
    ("flash", ("flash",)),
    ("mem-efficient", ("fmha", "efficient", "cutlass")),
    ("math", ("_scaled_dot_product_attention_math", "bmm", "gemm", "softmax")),
)


def backend_family(names: Iterable[str]) -> str:
    """The SDPA backend the kernel (GPU) or operator (CPU) names point to, and the name that shows it."""
    names = list(names)
    for family, fragments in _BACKEND_FAMILIES:
        for name in names:
            if any(fragment in name.lower() for fragment in fragments):
                return f"{family} ({name[:80]})"
    return "unknown (" + ", ".join(dict.fromkeys(n[:40] for n in names[:3])) + ")" if names else "unknown"


def backend_ran(fn: Callable[[], object], device: torch.device) -> str:
    """Which backend one call of ``fn`` ran, from ``torch.profiler``: a row's note, e.g. ``ran: cudnn (...)``.

    ``sdpa_kernel`` only allows backends, and a mask or a layout can send a call elsewhere (a
    causal_lower_right mask under cuDNN runs its dense-bias kernel): the note names what ran. On a
    GPU it reads the device kernels; on the CPU the ATen operators SDPA dispatched to.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            fn()
            synchronize(device)
        events = list(prof.events())
    except Exception as exc:  # the timed call reports its own errors; this note is best effort
        return f"ran: not recorded ({error_text(exc, 80)})"
    if device.type == "cuda":
        names = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        names = [e.name for e in events if e.name.startswith("aten::_") and ("attention" in e.name or "bmm" in e.name)]
    return "ran: " + backend_family(dict.fromkeys(names))


# ---- reports ------------------------------------------------------------------------------------------


def log_row(label: str, r: Any, rate: Callable[[float | None], float | None], unit: str, quality: str) -> None:
    """One progress line per benchmark row: its label, status, eager and graph times with ``rate``."""

    def cell(us: float | None) -> str:
        return f"{us:10.1f} us {rate(us):7.2f} {unit}" if us else f"{'-':>{20 + len(unit)}s}"

    log.info(
        "  %s %-11s eager %s | graph %s %s | %s %s",
        label, r.status, cell(r.eager_us), cell(r.graph_us), r.graph_status, quality, r.note[:160],
    )  # fmt: skip


def join_notes(*parts: str) -> str:
    """The non-empty parts of a note, joined by "; "."""
    return "; ".join(part for part in parts if part)


def graph_cells(row: TimedRow, *, scale: float = 1.0, digits: int = 1) -> tuple[str, str]:
    """A report row's graph cell and note: the graph time (us times ``scale``), or what kept it from one.

    The cell says what happened, the note says why; pipes are taken out of the note for the table.
    """
    cell = fmt(row.graph_us * scale, digits) if row.graph_us else (row.graph_status.split(":")[0] or "-")
    note = row.note if row.graph_status in ("", "ok") else join_notes(row.note, f"graph: {row.graph_status}")
    return cell, note.replace("|", "/")


def fastest(rows: Iterable[TimedRow], names: Iterable[str], attr: str) -> float | None:
    """The smallest ``attr`` time (``eager_us`` or ``graph_us``) among the passing rows of ``names``.

    A row that is not "ok" has no time worth comparing with (a graph replay that failed its
    recheck leaves the eager time of a row whose status stays ok; a FAILED row has none).
    """
    wanted = set(names)
    return min(
        (getattr(r, attr) for r in rows if r.impl in wanted and r.status == "ok" and getattr(r, attr)), default=None
    )


def tera_per_s(amount: float, us: float | None) -> float | None:
    """``amount`` (bytes or flops) per ``us`` microseconds, in units of 10**12 a second."""
    return amount / (us * 1e-6) / 1e12 if us else None


def error_text(exc: BaseException, limit: int = 240) -> str:
    """One line naming an exception, short enough for a table cell."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def environment(device: torch.device, smoke: bool) -> dict[str, Any]:
    """Device, versions, date and the exact command line of this run."""
    import triton

    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + shlex.join(sys.argv),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "smoke": smoke,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        env.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            cudnn=cudnn,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    else:
        env.update(gpu="CPU (Triton interpreter; smoke mode, times are meaningless)", sm_count=None, cudnn=None)
    return env


def header_markdown(env: dict[str, Any], title: str, notes: Iterable[str]) -> str:
    lines = [
        f"# {title}",
        "",
        f"GPU: {env['gpu']}" + (f" ({env['sm_count']} SMs, {env['memory_gib']} GiB)" if env.get("sm_count") else ""),
        "",
        f"torch {env['torch']} | triton {env['triton']} | CUDA {env['cuda']} | cuDNN {env['cudnn']} | "
        f"Python {env['python']} | {env['date_utc']}",
        "",
        f"Command: `{env['command']}`",
        "",
    ]
    lines.extend(f"- {note}" for note in notes)
    return "\n".join(lines) + "\n\n"


def write_report(
    markdown: str, env: dict[str, Any], rows: list[dict[str, Any]], out: str | None, json_path: str | None
) -> None:
    """Write the markdown report and the JSON rows (called after every shape: a killed run keeps its results)."""
    if out:
        Path(out).write_text(markdown)
    if json_path:
        Path(json_path).write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")


def print_report(markdown: str) -> None:
    from rich.console import Console

    Console(soft_wrap=True).print(markdown, markup=False, highlight=False, emoji=False)


# ---- tuned DBs -----------------------------------------------------------------------------------------


def checked_db(db: str | None) -> str | None:
    """``--db`` must name an existing file (or a URL): a typo must not silently benchmark an empty DB."""
    if db is None or "://" in db:
        return db
    if not Path(db).expanduser().is_file():
        raise SystemExit(f"--db {db}: no such file (tune into it first, or leave --db out)")
    return db


def best_trials_by_path(db: str, kernel: str, version: str, gpu: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Fastest ok trial per (key JSON, path) of ``kernel`` at this source version on this GPU."""
    from sqlalchemy import create_engine, text

    from tritune.kernels import settings

    engine = create_engine(settings.db_url_from(db))
    query = text(
        "SELECT t.key_json, t.config_json, t.time_ms FROM trials t JOIN environments e ON e.id = t.environment_id "
        "WHERE t.kernel = :kernel AND t.kernel_version = :version AND t.status = 'ok' AND e.gpu = :gpu "
        "AND t.time_ms IS NOT NULL"
    )
    best: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
    try:
        with engine.connect() as conn:
            for key_json, config_json, time_ms in conn.execute(
                query, {"kernel": kernel, "version": version, "gpu": gpu}
            ):
                config = json.loads(config_json)
                slot = (json.dumps(json.loads(key_json), sort_keys=True), str(config.get("path", "portable")))
                if slot not in best or time_ms < best[slot][0]:
                    best[slot] = (time_ms, config)
    finally:
        engine.dispose()
    return {slot: config for slot, (_, config) in best.items()}


def fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(reference: float | None, value: float | None) -> str:
    """``reference / value`` as ``1.23x`` (above 1: faster than the reference)."""
    return f"{reference / value:.2f}x" if reference and value else "-"
