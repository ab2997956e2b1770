"""Executors bind a DecodeGraph's nodes to callables. `local`: one process; its "cpu" nodes run
on a worker thread beside the device nodes when the two sides are different hardware (a GPU
beside the CPU: `concurrent`), else inline in graph order (the device is the CPU: both sides share
the cores, and a thread would only add a hand-off and a lock wait to the CPU side's time)."""

from __future__ import annotations

import importlib
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

    def make_cpu_partial(self, cache) -> CPUPartial:
        """The CPU side of the split over this cache, as this executor computes it."""
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


EXECUTORS = ("local", "ray")
# Executors outside core register here; "ray" lives in writescope.actors (core imports no Ray). An
# executor may also register an engine factory: `Engine.from_pretrained(executor=name)` then returns
# what it builds (ray: the engine runs inside a GPU worker actor, the caller gets a proxy).
_PLUGINS = {"ray": "writescope.actors.ray_engine", "channel": "writescope.actors.ray_engine"}
_FACTORIES: dict[str, Callable] = {"local": LocalExecutor}
_ENGINE_FACTORIES: dict[str, Callable] = {}


def register_executor(name: str, factory: Callable, engine: Callable | None = None) -> None:
    _FACTORIES[name] = factory
    if engine is not None:
        _ENGINE_FACTORIES[name] = engine


def _load(name: str) -> None:
    if name not in _FACTORIES and name in _PLUGINS:
        importlib.import_module(_PLUGINS[name])  # registers itself


def engine_factory(name: str) -> Callable | None:
    """The engine factory registered for an executor, or None: the engine runs in this process."""
    _load(name)
    return _ENGINE_FACTORIES.get(name)


def check_executor(name: str) -> None:
    """Raises a ValueError naming the known executors unless `name` is one (or a registered one)."""
    if name not in EXECUTORS and name not in _PLUGINS and name not in _FACTORIES:
        raise ValueError(f"unknown executor {name!r}; known: {', '.join(EXECUTORS)}")


def make_executor(name: str, **options):
    check_executor(name)
    _load(name)
    return _FACTORIES[name](**options)


__all__ = ["LocalExecutor", "Node", "check_executor", "engine_factory", "make_executor", "register_executor"]
