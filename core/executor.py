"""How a decode step runs: its task graph, the executors that run it, and the two sides of each
layer's split that the graph's nodes call.

The graph, built once (the batch lives in the step's tensors, not in the graph). Per layer l
(place: where the node runs):
    L{l}.transfer        device  starts copying layer l's first cpu_transfer chunk into ping-pong buffer
                                 l % 2 without waiting: it is placed right after layer l-1's device
                                 partial, so the copy runs while layer l-1 merges and runs its MoE
    L{l}.qkv             device  norm, projections, rope (MLA: absorbed query); the token's KV to store
    L{l}.window_write    device  the new token's KV into the GPU window
    L{l}.cpu_partial     cpu     partial attention over the batch's cpu_compute tokens (C++ kernel)
    L{l}.device_partial  device  partial attention over the window and the ping-pong chunks
    L{l}.merge           device  exact LSE merge of the partials
    L{l}.out_proj        device  output projection and residual
    L{l}.ffn             device  dense MLP or MoE, residual
then `logits` and `commit` (the step's tokens are final; full windows flush). cpu_partial depends
only on qkv, so an executor can run it while the device writes the window and attends its part.

Executors bind the graph's nodes to callables; an engine takes an executor object. `LocalExecutor`:
one process; its "cpu" nodes run on a worker thread beside the device nodes when the two sides are
different hardware (a GPU beside the CPU: `concurrent`), else inline in graph order (the device is
the CPU: both sides share the cores, and a thread would only add a hand-off and a lock wait to the
CPU side's time). The Ray GPU worker's is `writescope.actors.cpu_worker.ChannelExecutor`.

The CPU side of the split is one seam, `CPUPartial.attend(layer, q, view, scale) -> PendingPartial`
(and `attend_selected` for a sparse attention's chosen tokens), so the step does not know where it
is computed: `LocalCPUPartial` runs the C++ kernel over the cache's shards in this process (at once:
the result is ready); the channel-backed one sends the request to a CPU worker per NUMA node and
returns, so the device partial runs while they compute, and `result()` collects their answers.
Either reports the kernel's own seconds, never a wait for a queue or a lock, as the perf model's A
wants. The device side is `device_side`: the window (with this step's token) and cpu_transfer, in
place or through the ping-pong buffer, one attention call per group of sources, plus the
monolithic baseline's shipped cpu_compute, merged; calibration times the same function.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from writescope import ops
from writescope.inplace_kv_cache import selected_source

# ------------------------------------------------------------------ the task graph
LAYER_OPS = ("transfer", "qkv", "window_write", "cpu_partial", "device_partial", "merge", "out_proj", "ffn")


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    layer: int | None
    place: str  # "device" or "cpu"
    inputs: tuple[str, ...]


@dataclass(frozen=True)
class DecodeGraph:
    num_layers: int
    nodes: tuple[Node, ...]  # in a topological order

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def layer_nodes(self, layer: int) -> list[Node]:
        return [n for n in self.nodes if n.layer == layer]


def build_decode_graph(num_layers: int) -> DecodeGraph:
    """The same for every batch size: the batch lives in the step's tensors, not in the graph."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    nodes = [Node("embed", "embed", None, "device", ()), Node("L0.transfer", "transfer", 0, "device", ("embed",))]
    hidden = "embed"
    for layer in range(num_layers):
        p = f"L{layer}."
        nodes += [
            Node(p + "qkv", "qkv", layer, "device", (hidden,)),
            Node(p + "window_write", "window_write", layer, "device", (p + "qkv",)),
            Node(p + "cpu_partial", "cpu_partial", layer, "cpu", (p + "qkv",)),
            Node(p + "device_partial", "device_partial", layer, "device",
                 (p + "qkv", p + "window_write", p + "transfer")),
        ]
        if layer + 1 < num_layers:  # the next layer's copy starts as soon as this layer's buffer use ends
            nodes.append(Node(f"L{layer + 1}.transfer", "transfer", layer + 1, "device", (p + "device_partial",)))
        nodes += [
            Node(p + "merge", "merge", layer, "device", (p + "cpu_partial", p + "device_partial")),
            Node(p + "out_proj", "out_proj", layer, "device", (p + "merge", hidden)),
            Node(p + "ffn", "ffn", layer, "device", (p + "out_proj",)),
        ]
        hidden = p + "ffn"
    nodes += [Node("logits", "logits", None, "device", (hidden,)),
              Node("commit", "commit", None, "device", ("logits",))]
    return DecodeGraph(num_layers, tuple(nodes))


# ------------------------------------------------------------------ the split's CPU side
class PendingPartial:
    """A CPU partial under way; result() waits for it (the first time) and returns it."""

    def __init__(self, collect):
        self._collect = collect  # () -> ops.Partial
        self._partial: ops.Partial | None = None

    @classmethod
    def done(cls, partial: ops.Partial) -> PendingPartial:
        pending = cls(None)
        pending._partial = partial
        return pending

    def result(self) -> ops.Partial:
        if self._partial is None:
            self._partial = self._collect()
        return self._partial


class CPUPartial(ABC):
    # True where attend() only sends the request (another process computes it): a caller then sends
    # it before its device work. False where attend() computes in the calling thread.
    runs_elsewhere = False

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, view, scale: float) -> PendingPartial:
        """q [num_seqs, num_q_heads, head_dim_qk] on the host; view: the step's StepView -> the partial
        over the view's cpu_compute tokens of `layer`, on the host, once its result() is asked for."""

    @abstractmethod
    def attend_selected(self, layer: int, q: torch.Tensor, selection: list, tokens: int,
                        scale: float) -> PendingPartial:
        """q [num_seqs, num_q_heads, head_dim] on the host; selection: per cpu_compute shard, (token table
        [num_seqs, width] int32, lens [num_seqs] int32): each row's chosen tokens of the shard (a
        sparse attention's selection; a region of one KV head, see inplace_kv_cache.selected_source);
        tokens: how many they are in all -> the partial over them, once its result() is asked for."""

    def close(self) -> None:  # noqa: B027 - most partials hold nothing of their own
        """Releases what the partial holds (sockets, say); the cache's regions are not its own."""


class LocalCPUPartial(CPUPartial):
    """Every shard with the C++ kernel in this process, one call per shard, merged."""

    def __init__(self, cache):
        self.cache = cache

    def attend(self, layer: int, q: torch.Tensor, view, scale: float) -> PendingPartial:
        # a shard with no tokens in this step is not attended: its partial would change no merge
        parts = [ops.cpu_paged_attention_timed(q, source, scale)
                 for source, tokens in zip(self.cache.compute_sources(layer, view), view.compute_shard_tokens,
                                           strict=True) if tokens]
        if not parts:
            return PendingPartial.done(ops.empty_partial(q, self.cache.config.format.head_dim_v))
        out, lse = ops.merge([(out, lse) for out, lse, _ in parts])
        return PendingPartial.done(ops.Partial(out, lse, view.compute_tokens, sum(s for _, _, s in parts)))

    def attend_selected(self, layer: int, q: torch.Tensor, selection: list, tokens: int,
                        scale: float) -> PendingPartial:
        parts = [ops.cpu_paged_attention_timed(q, selected_source(region, layer, table, lens), scale)
                 for region, (table, lens) in zip(self.cache.compute, selection, strict=True)]
        out, lse = ops.merge([(out, lse) for out, lse, _ in parts])
        return PendingPartial.done(ops.Partial(out, lse, tokens, sum(s for _, _, s in parts)))


# ------------------------------------------------------------------ the split's device side
def device_side(cache, layer: int, view, q: torch.Tensor, scale: float, backend: str, *,
                ships_compute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [num_seqs, num_q_heads, head_dim_qk] on the device -> (out [num_seqs, num_q_heads, head_dim_v],
    lse [num_seqs, num_q_heads]) over the view's window and cpu_transfer tokens of `layer` (and its
    cpu_compute tokens shipped whole when ships_compute), on the device. The caller started the
    layer's first ping-pong chunk (`cache.start_transfer`)."""
    partials = [ops.attend(q, group, scale, backend) for group in cache.device_source_groups(layer, view)]
    if ships_compute:
        partials.append(ops.attend(q, cache.shipped_compute_sources(layer, view), scale, backend))
    return ops.merge(partials)


# ------------------------------------------------------------------ executors
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
