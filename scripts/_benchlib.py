"""What the benchmark scripts share: timing, CUDA-graph capture, tuned-trial lookup and the report files.

The scripts choose the Triton interpreter themselves (``--smoke``) before they import triton, so this
module imports triton only inside its functions: importing it decides nothing.

Timing on a GPU is ``triton.testing.do_bench`` (median; a warm-up, then the L2 flushed before every
repetition). A CUDA-graph time is the same ``do_bench`` around ``graph.replay()`` of one captured
call, so eager and graph numbers see the same cold L2. On the CPU (smoke mode) times are wall-clock
medians of the interpreter: they prove the script runs, nothing more.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import platform
import shlex
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tritune.bench")

#: Peak HBM bandwidth of the GPUs we report on (TB/s), for the "% of peak" lines of the headers.
HBM_TBPS = {"NVIDIA H200": 4.8, "NVIDIA H100 80GB HBM3": 3.35}


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # Its own level: the library sets the "tritune" logger to settings' log_level on the first dispatch,
    # which would otherwise silence the per-row progress lines from then on.
    log.setLevel(logging.INFO)


def prepare_interpreter() -> None:
    """Let the Triton 3.6 interpreter run our kernels (the test tiers and ``tune --device cpu`` do this too)."""
    from tritune.kernels._interpreter import fix_interpreter_index

    fix_interpreter_index()


def bench_device(smoke: bool) -> torch.device:
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: run on the GPU machine, or pass --smoke for the CPU dry run")
    return torch.device("cuda", torch.cuda.current_device())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of one call of ``fn``: ``do_bench`` on a GPU, wall-clock on the interpreter."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def capture_graph(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture one call of ``fn`` (warmed up on a side stream first); returns the graph and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def graph_replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """Median milliseconds of one replay, L2 flushed before each (``do_bench`` around ``replay``)."""
    import triton.testing

    return float(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))


def graph_replay_us(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    """Capture one call of ``fn`` and time its replays: median microseconds (L2 flushed before
    each) and the captured output."""
    graph, out = capture_graph(fn)
    return graph_replay_ms(graph) * 1e3, out


def graph_time(fn: Callable[[], torch.Tensor], check: Callable[[torch.Tensor], str | None]) -> tuple[float | None, str]:
    """Capture one call of ``fn``, poison its output with NaN, replay, check it, then time replays.

    ``check(out)`` returns None for a right output, else what is wrong with it. Returns (microseconds, status):
    the time only with status "ok"; otherwise "cannot capture: ...", "FAILED after replay: ..." or
    "replay failed: ...", whose part before the colon fits a table cell.
    """
    try:
        graph, out = capture_graph(fn)
    except Exception as exc:
        # torch.cuda.graph's exit ends a failed capture; make sure nothing is left pending.
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return None, f"cannot capture: {error_text(exc, 160)}"
    try:
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        problem = check(out)
        if problem is not None:
            return None, f"FAILED after replay: {problem}"
        return graph_replay_ms(graph) * 1e3, "ok"
    except Exception as exc:
        return None, f"replay failed: {error_text(exc, 160)}"
    finally:
        del graph


def log_row(label: str, r: Any, rate: Callable[[float | None], float | None], unit: str, quality: str) -> None:
    """One progress line per benchmark row: its label, status, eager and graph times with ``rate``."""

    def cell(us: float | None) -> str:
        return f"{us:10.1f} us {rate(us):7.2f} {unit}" if us else f"{'-':>{20 + len(unit)}s}"

    log.info(
        "  %s %-11s eager %s | graph %s %s | %s %s",
        label, r.status, cell(r.eager_us), cell(r.graph_us), r.graph_status, quality, r.note[:160],
    )  # fmt: skip


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


def finish_probe(device: torch.device, title: str, notes: Iterable[str], rows: list[str], out: Path | None) -> int:
    """A probe's report: the environment header, its notes and its table rows, written to ``out``
    (when given) and printed; the exit status (0)."""
    text = header_markdown(environment(device, smoke=False), title, notes) + "\n".join(rows) + "\n"
    if out:
        out.write_text(text)
    print(text)
    return 0


def host_and_wall_us(call: Callable[[], object], calls: int = 20) -> tuple[float, float]:
    """Microseconds per call: host time to issue ``calls`` back-to-back calls, and wall time until
    they finish. Where the first is the larger, the call is host-bound when run eagerly."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / calls * 1e6, (done - start) / calls * 1e6


def print_report(markdown: str) -> None:
    from rich.console import Console

    Console(soft_wrap=True).print(markdown, markup=False, highlight=False, emoji=False)


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
