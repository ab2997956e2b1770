"""Executors bind a DecodeGraph's nodes to callables. An engine takes an executor object (the Ray
GPU worker's is `writescope.actors.ray_engine.ChannelExecutor`). `local`: one process; its "cpu" nodes run
on a worker thread beside the device nodes when the two sides are different hardware (a GPU
beside the CPU: `concurrent`), else inline in graph order (the device is the CPU: both sides share
the cores, and a thread would only add a hand-off and a lock wait to the CPU side's time)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from writescope.cpu_partial import CPUPartial, LocalCPUPartial
from writescope.graph import DecodeGraph, Node

Binding = Callable[..., Any]  # (step, node, *input values) -> value


class LocalExecutor:
    """Runs the graph in this process; its CPU partial is the C++ kernel over the cache's shards."""

    name = "local"

    def __init__(self, concurrent: bool = False):
        self.concurrent = concurrent
        self.overlaps = concurrent  # the CPU partial runs while the device partial does
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="writescope-cpu-partial") \
            if concurrent else None

    def make_cpu_partial(self, cache, region: int = 0) -> CPUPartial:
        """The CPU side of the split over this cache, as this executor computes it. region: the cache's
        index among the engine's KV caches (where a CPU worker serves more than one)."""
        return LocalCPUPartial(cache)

    def run(self, graph: DecodeGraph, bindings: dict[str, Binding], step: Any) -> dict[str, Any]:
        values: dict[str, Any] = {}
        try:
            for node in graph.nodes:
                inputs = [_resolve(values[name]) for name in node.inputs]
                if node.place == "cpu" and self._cpu is not None:
                    values[node.name] = self._cpu.submit(bindings[node.op], step, node, *inputs)
                else:
                    values[node.name] = bindings[node.op](step, node, *inputs)
        finally:  # a failing device node must not leave a CPU partial reading KV the caller then frees
            wait([v for v in values.values() if isinstance(v, Future)])
        return {name: _resolve(value) for name, value in values.items()}

    def shutdown(self) -> None:
        if self._cpu is not None:
            self._cpu.shutdown(wait=True)


def _resolve(value):
    return value.result() if isinstance(value, Future) else value


__all__ = ["LocalExecutor", "Node"]
