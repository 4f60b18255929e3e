"""Triton's driver and compiler replaced on a machine without a GPU: launches reach a recorder.

The driver reports device 0, stream 7 and an sm_90 target; compiling a kernel makes a stub whose
launcher appends its arguments to a list. The binder, the specialization and ``JITFunction.run``
itself stay Triton's own.
"""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver


class FakeDriver:
    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 7

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


class FakeCompiled:
    """What a compiled kernel offers a launch: a launcher, a function handle, packed metadata."""

    def __init__(self, number: int, calls: list[tuple[Any, ...]]) -> None:
        self.function = 1000 + number
        self.packed_metadata = ("packed", number)
        self.run = lambda *args: self._launch(calls, args)

    @staticmethod
    def _launch(calls: list[tuple[Any, ...]], args: tuple[Any, ...]) -> None:
        # As Triton's launcher: the enter hook (when one is passed) sees the launch metadata.
        if args[7] is not None:
            args[7](args[6])
        calls.append(args)

    def launch_metadata(self, grid: Any, stream: int, *args: Any) -> str:
        return "metadata"


def stub_compiles(kernel: Any, monkeypatch) -> tuple[list[FakeCompiled], list[tuple[Any, ...]]]:
    """Make ``kernel`` "compile" to recording fakes on the fake driver; return (compiled, launches)."""
    compiled: list[FakeCompiled] = []
    launches: list[tuple[Any, ...]] = []

    def compile_stub(key, signature, device, constexprs, options, attrs, warmup):
        made = kernel.device_caches[device][0][key] = FakeCompiled(len(compiled), launches)
        compiled.append(made)
        return made

    monkeypatch.setattr(kernel, "_do_compile", compile_stub)
    monkeypatch.setattr(driver, "_active", FakeDriver())
    return compiled, launches
