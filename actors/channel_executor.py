"""The GPU worker's executor: the decode graph runs in the GPU worker, each layer's CPU partial on
the CPU workers, one request per shard over its shared-memory channel (writescope.actors.channel)."""

from __future__ import annotations

from writescope import ops
from writescope.actors.channel import BLOCKS, TOKENS, ChannelSpec, PartialClient
from writescope.cpu_partial import CPUPartial, PendingPartial
from writescope.executor import LocalExecutor


class ChannelCPUPartial(CPUPartial):
    """The CPU side of the split over one KV cache computed by the CPU workers: one request per shard
    over its channel, all sent before any is waited for, so the workers run in parallel. region: the
    cache's index among the shard regions each worker serves."""

    runs_elsewhere = True

    def __init__(self, clients: list[PartialClient], cache, region: int):
        if cache.config.num_shards != len(clients):
            raise ValueError(f"the cache has {cache.config.num_shards} cpu_compute shards for {len(clients)} "
                             f"CPU workers: one shard per worker")
        self.clients = clients
        self.region = region

    def attend(self, layer: int, q, view, scale: float) -> PendingPartial:
        for client, (table, lens) in zip(self.clients, view.compute, strict=True):
            client.send(layer, q, table, lens, scale, region=self.region, unit=BLOCKS)
        return PendingPartial(lambda: self._collect(view.compute_tokens))

    def attend_selected(self, layer: int, q, selection: list, tokens: int, scale: float) -> PendingPartial:
        for client, (table, lens) in zip(self.clients, selection, strict=True):
            client.send(layer, q, table, lens, scale, region=self.region, unit=TOKENS)
        return PendingPartial(lambda: self._collect(tokens))

    def _collect(self, tokens: int) -> ops.Partial:
        results = [client.receive() for client in self.clients]
        out, lse = ops.merge([(out, lse) for out, lse, _ in results])
        return ops.Partial(out, lse, tokens, max(seconds for _, _, seconds in results))


class ChannelExecutor(LocalExecutor):
    """Inside the GPU worker: the graph runs here, each layer's CPU partial on the CPU workers, which
    compute while this thread runs the device partial (the request is sent, the answer collected at
    the merge: no thread hand-off in this process). One client per channel, shared by the partials
    of every cache (a worker serves one connection; the step's requests never overlap on it)."""

    name = "channel"

    def __init__(self, specs: list[ChannelSpec]):
        super().__init__(concurrent=False)
        self.overlaps = True
        self.specs = specs
        self._clients: list[PartialClient] | None = None

    def make_cpu_partial(self, cache, region: int = 0) -> CPUPartial:
        if self._clients is None:
            clients = []
            try:
                for spec in self.specs:
                    clients.append(PartialClient(spec))
            except BaseException:
                for client in clients:
                    client.close()
                raise
            self._clients = clients
        return ChannelCPUPartial(self._clients, cache, region)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            for client in self._clients or []:
                client.close()
            self._clients = None
