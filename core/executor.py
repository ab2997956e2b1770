"""Executors bind a DecodeGraph's nodes to callables. `local`: one process, the CPU partials on a
worker thread (the C++ kernel releases the GIL and runs on its own pool) concurrently with the
device nodes that do not depend on them."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from writescope.graph import DecodeGraph, Node

Binding = Callable[..., Any]  # (step, node, *input values) -> value


class LocalExecutor:
    name = "local"

    def __init__(self):
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="writescope-cpu-partial")

    def run(self, graph: DecodeGraph, bindings: dict[str, Binding], step: Any) -> dict[str, Any]:
        values: dict[str, Any] = {}
        try:
            for node in graph.nodes:
                inputs = [_resolve(values[name]) for name in node.inputs]
                if node.place == "cpu":
                    values[node.name] = self._cpu.submit(bindings[node.op], step, node, *inputs)
                else:
                    values[node.name] = bindings[node.op](step, node, *inputs)
        finally:  # a failing device node must not leave a CPU partial reading KV the caller then frees
            wait([v for v in values.values() if isinstance(v, Future)])
        return {name: _resolve(value) for name, value in values.items()}

    def shutdown(self) -> None:
        self._cpu.shutdown(wait=True)


def _resolve(value):
    return value.result() if isinstance(value, Future) else value


EXECUTORS = ("local", "ray")


def make_executor(name: str):
    if name == "local":
        return LocalExecutor()
    if name == "ray":
        raise ValueError("executor 'ray' comes with writescope.actors (the Ray runtime); use 'local' for now")
    raise ValueError(f"unknown executor {name!r}; known: {', '.join(EXECUTORS)}")


__all__ = ["LocalExecutor", "Node", "make_executor"]
