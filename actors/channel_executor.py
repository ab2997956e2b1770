"""The GPU worker's executor: the decode graph runs in the GPU worker, each layer's CPU partial on
the CPU workers, one request per shard over its shared-memory channel (writescope.actors.channel)."""

from __future__ import annotations

from writescope import ops
from writescope.actors.channel import ChannelSpec, PartialClient
from writescope.cpu_partial import CPUPartial, PendingPartial
from writescope.executor import LocalExecutor


class ChannelCPUPartial(CPUPartial):
    """The CPU side of the split computed by the CPU workers: one request per shard over its
    channel, all sent before any is waited for, so the workers run in parallel."""

    def __init__(self, specs: list[ChannelSpec], cache):
        if cache.config.num_shards != len(specs):
            raise ValueError(f"the cache has {cache.config.num_shards} cpu_compute shards for {len(specs)} "
                             f"CPU workers: one shard per worker")
        self.clients = [PartialClient(spec) for spec in specs]

    def attend(self, layer: int, q, view, scale: float) -> PendingPartial:
        for client, (table, lens) in zip(self.clients, view.compute, strict=True):
            client.send(layer, q, table, lens, scale)
        return PendingPartial(lambda: self._collect(view.compute_tokens))

    def _collect(self, tokens: int) -> ops.Partial:
        results = [client.receive() for client in self.clients]
        out, lse = ops.merge([(out, lse) for out, lse, _ in results])
        return ops.Partial(out, lse, tokens, max(seconds for _, _, seconds in results))

    def close(self) -> None:
        for client in self.clients:
            client.close()


class ChannelExecutor(LocalExecutor):
    """Inside the GPU worker: the graph runs here, each layer's CPU partial on the CPU workers, which
    compute while this thread runs the device partial (the request is sent, the answer collected at
    the merge: no thread hand-off in this process)."""

    name = "channel"

    def __init__(self, specs: list[ChannelSpec]):
        super().__init__(concurrent=False)
        self.overlaps = True
        self.specs = specs

    def make_cpu_partial(self, cache) -> CPUPartial:
        return ChannelCPUPartial(self.specs, cache)
