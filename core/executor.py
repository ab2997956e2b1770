"""Executors bind a DecodeGraph's nodes to callables. `local`: one process, the CPU partials on a
worker thread (the C++ kernel releases the GIL and runs on its own pool) concurrently with the
device nodes that do not depend on them."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from writescope import ops
from writescope.graph import DecodeGraph, Node

Binding = Callable[..., Any]  # (step, node, *input values) -> value


class LocalExecutor:
    """CPU partials in this process, on the C++ kernel's own pool."""

    name = "local"

    def __init__(self):
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="writescope-cpu-partial")
        self.cache = None

    def bind_cache(self, cache) -> None:
        self.cache = cache

    def cpu_partial(self, layer: int, q, seq_ids, scale: float):
        """Partial over the batch's cpu_compute tokens, every shard: (out, lse, tokens, kernel seconds)."""
        parts, tokens, seconds = [], 0, 0.0
        for shard in range(self.cache.config.num_shards):
            source = self.cache.compute_source(layer, seq_ids, shard)
            began = time.perf_counter()
            parts.append(ops.multi_source_partial_attention(q, [source], scale=scale, backend="cpu"))
            seconds += time.perf_counter() - began
            tokens += int(source.seq_lens.sum())
        out, lse = merge_all(parts)
        return out, lse, tokens, seconds

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


def merge_all(partials):
    """One partial from several (out, lse) partials of disjoint parts."""
    if len(partials) == 1:
        return partials[0]
    return ops.merge_partials(torch.stack([p[0] for p in partials]), torch.stack([p[1] for p in partials]))


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


__all__ = ["LocalExecutor", "Node", "check_executor", "engine_factory", "make_executor", "merge_all",
           "register_executor"]
