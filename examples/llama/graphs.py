"""CUDA-graph capture of a step that has not run yet."""

from __future__ import annotations

from collections.abc import Callable

import torch


def run_then_capture(
    step: Callable[[], None], device: torch.device, pool: tuple[int, int] | None = None
) -> torch.cuda.CUDAGraph:
    """Run ``step`` once for real, then record it in a CUDA graph (recording runs nothing).

    The real run goes on a side stream, as PyTorch advises before a capture: kernels compile,
    tritune chooses each call's config, and lazily created CUDA state exists before recording.
    Replaying the graph then repeats the step on the same static buffers. Graphs that are only
    ever replayed one after another may share one memory ``pool`` (``torch.cuda.graph_pool_handle()``).
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph
