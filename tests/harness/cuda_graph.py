"""CUDA-graph capture for tests: warm up on a side stream, then record (what ``torch.cuda.graph`` wants)."""
from __future__ import annotations

from typing import Any, Callable

import torch


def capture(step: Callable[[], Any], warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run ``step()`` ``warmup`` times on a side stream (lazy allocations and one-time setup happen there,
    outside the capture), then record one call.  Returns the graph and that call's outputs, which every
    ``graph.replay()`` overwrites in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
