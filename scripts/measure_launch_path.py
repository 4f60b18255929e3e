"""Host cost of launching tritune's kernels through Triton, on any machine, with the driver stubbed.

    python scripts/measure_launch_path.py [--out FILE]

For each public entry point's bare launch (the config the dispatcher serves, checked arguments,
the same launch function as a call's) three ways of reaching the compiled kernel are timed:

- torch's ``wrap_triton`` wrapper, then ``JITFunction.run`` (how launches went before bound
  launches);
- ``JITFunction.run`` alone (``TRITUNE_FAST_LAUNCH=0``);
- bound launches (``kernels/_fastlaunch.py``, the default).

Nothing reaches a GPU: Triton's driver is replaced by one that names device 0 and an sm_90
target, and compiling by a stub whose launcher does nothing, so what is timed is the Python
between the launch function's first line and the launcher's C code (which, with
``cuLaunchKernel``, all three ways share). Run it on the machine whose host cost matters: on the
H200 machine ``scripts/measure_overhead.py`` times the real launches instead.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # real JITFunctions: set before any kernel module is imported
os.environ["TRITUNE_DISABLE_TUNED"] = "1"  # the portable defaults serve: no DB or bundle decides the launches

import torch
import triton
from torch.library import wrap_triton as torch_wrap_triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

CALLS = 3000
ROUNDS = 7


class StubDriver:
    """Device 0, stream 0, an sm_90 target: what ``JITFunction.run`` asks a driver."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


class StubCompiled:
    """A compiled kernel whose launcher does nothing."""

    function = 0
    packed_metadata = ()
    name = "stub"

    def __init__(self) -> None:
        self.run = lambda *args: None

    def launch_metadata(self, grid: Any, stream: int, *args: Any) -> Any:
        from triton.compiler.compiler import LazyDict

        # What Triton 3.6 builds per launch while its (empty) launch hook chains exist.
        return LazyDict({"name": self.name, "function": self.function, "stream": stream})


@contextmanager
def stubbed_triton() -> Iterator[None]:
    """Triton's driver and compiler stubbed for the block."""
    from tritune.kernels import _fastlaunch

    def compile_stub(self: JITFunction[Any], key: Any, *args: Any, **kwargs: Any) -> StubCompiled:
        made = self.device_caches[0][0][key] = StubCompiled()
        return made

    saved = (driver._active, JITFunction._do_compile)
    driver._active = StubDriver()
    JITFunction._do_compile = compile_stub  # type: ignore[method-assign]
    try:
        yield
    finally:
        driver._active, JITFunction._do_compile = saved
        _fastlaunch.forget()


def bare_launches() -> dict[str, Callable[[], None]]:
    """Each public entry point's bare launch at a small serving shape, on CPU tensors."""
    from tritune.kernels import Q4KWeight
    from tritune.kernels._oplib import run_unwrapped
    from tritune.kernels.decode.kernel import KERNEL as DECODE
    from tritune.kernels.dispatcher import dispatch_config_eager
    from tritune.kernels.prefill.kernel import KERNEL as PREFILL
    from tritune.kernels.q4k.kernel import KERNEL as Q4K
    from tritune.kernels.varlen.kernel import KERNEL as VARLEN

    bf16 = torch.bfloat16
    q, k = torch.randn(1, 16, 16, 64, dtype=bf16), torch.randn(1, 2, 128, 64, dtype=bf16)
    dq, dk = torch.randn(1, 32, 1, 128, dtype=bf16), torch.randn(1, 8, 1024, 128, dtype=bf16)
    vq, vk = torch.randn(32, 32, 128, dtype=bf16), torch.randn(1024, 4, 8, 128, dtype=bf16)
    seq_info = torch.tensor([[0, 1, 0, 900], [1, 1, 1, 300], [2, 30, 2, 30]], dtype=torch.int32)
    weight = Q4KWeight.quantize(torch.randn(4096, 256) * 0.02)
    calls: dict[str, tuple[Any, tuple[Any, ...]]] = {
        "prefill q [1, 16, 16, 64], k/v [1, 2, 128, 64]": (
            PREFILL,
            (q, k, torch.randn_like(k), torch.tensor(128, dtype=torch.int32), True, None, torch.empty_like(q)),
        ),
        "decode q [1, 32, 1, 128], cache [1, 8, 1024, 128]": (
            DECODE,
            (dq, dk, torch.randn_like(dk), torch.full((1,), 1024, dtype=torch.int32), None, torch.empty_like(dq)),
        ),
        "varlen q [32, 32, 128], stores [1024, 4, 8, 128], 3 segments": (
            VARLEN,
            (vq, vk, torch.randn_like(vk), seq_info, True, None, False, None, torch.empty_like(vq)),
        ),
        "q4k_linear x [1, 256], W [4096, 256]": (
            Q4K,
            (torch.randn(1, 256, dtype=bf16), weight, None, torch.empty(1, 4096, dtype=bf16)),
        ),
    }
    launches = {}
    for name, (kernel, args) in calls.items():
        kernel.cpu_allowed = True  # CPU tensors stand in for CUDA ones: nothing reads their memory
        facts, device, checked = kernel.fast_check().fn(*args)
        config = dispatch_config_eager(kernel.name, device, facts)
        launch = kernel._launch

        def run(launch: Any = launch, arguments: tuple[Any, ...] = (config, *checked)) -> None:
            run_unwrapped(launch, arguments, ())

        launches[f"{name} ({config.path if hasattr(config, 'path') else 'default'})"] = run
    return launches


@contextmanager
def launching(way: str) -> Iterator[None]:
    """Route op bodies' launches one of the three ways for the block."""
    from tritune.kernels import _fastlaunch, _oplib, settings

    saved = _oplib.bound
    if way == "torch":
        _oplib.bound = torch_wrap_triton
    with settings.override(fast_launch=way == "bound"):
        try:
            yield
        finally:
            _oplib.bound = saved
            _fastlaunch.forget()


WAYS = {
    "torch wrap_triton + JITFunction.run": "torch",
    "JITFunction.run": "triton",
    "bound launch": "bound",
}


def host_us(fn: Callable[[], None]) -> float:
    for _ in range(200):
        fn()
    samples = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        samples.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from tritune.kernels import _fastlaunch

    if not _fastlaunch._TRITON_MIRRORED:
        print(f"bound launches mirror Triton {', '.join(_fastlaunch.MIRRORED_TRITON)}; this is {triton.__version__}")
        return 1
    times: dict[str, dict[str, float]] = {}
    with stubbed_triton():
        launches = bare_launches()
        for way_name, way in WAYS.items():
            with launching(way):
                for name, fn in launches.items():
                    times.setdefault(name, {})[way_name] = host_us(fn)
    lines = [
        f"CPU: {platform.processor() or platform.machine()} | torch {torch.__version__} | triton {triton.__version__}",
        "Command: `python scripts/measure_launch_path.py`",
        f"Host us per bare launch (Triton's driver and compiler stubbed): median of {ROUNDS} rounds of {CALLS}.",
        "",
        "| launch | " + " | ".join(WAYS) + " | saved |",
        "| --- | " + " | ".join("---" for _ in WAYS) + " | --- |",
    ]
    for name, row in times.items():
        first, last = row[next(iter(WAYS))], row["bound launch"]
        lines.append(f"| {name} | " + " | ".join(f"{row[w]:.2f}" for w in WAYS) + f" | {first - last:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
