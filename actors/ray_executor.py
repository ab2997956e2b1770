"""The `ray` executor: the same decode graph, with each layer's CPU partial computed by CPUWorker
actors, one per NUMA node (real or emulated), each over its node's cpu_compute shard.

The engine (driver) owns the shared-memory regions, so a CPU worker that dies loses nothing: Ray
restarts it (max_restarts), it re-attaches its shard from the handle and re-pins, and the call is
retried (max_task_retries), giving the same partial. Actors exchange handles and small arrays (q,
partial out, lse), never KV bytes.
"""

from __future__ import annotations

import numpy as np
import ray
import torch

from writescope.actors.cpu_worker import CPUWorker
from writescope.executor import LocalExecutor, merge_all, register_executor
from writescope.topology import NumaNode, topology


class RayExecutor(LocalExecutor):
    name = "ray"

    def __init__(self, nodes: list[NumaNode] | None = None):
        super().__init__()
        if not ray.is_initialized():
            raise ValueError("executor 'ray' needs a running Ray: call ray.init() (or connect to a cluster) first")
        self.nodes = nodes or topology()
        self.workers = []

    def bind_cache(self, cache) -> None:
        super().bind_cache(cache)
        if cache.config.num_shards != len(self.nodes):
            raise ValueError(f"the cache has {cache.config.num_shards} cpu_compute shards for {len(self.nodes)} "
                             f"NUMA nodes: one shard per node")
        head_dim_v = cache.config.format.head_dim_v
        self.workers = [CPUWorker.remote(node, cache.compute[i].handle.to_bytes(), head_dim_v)
                        for i, node in enumerate(self.nodes)]
        ray.get([w.check_health.remote() for w in self.workers])

    def cpu_partial(self, layer: int, q, seq_ids, scale: float):
        q_np = q.float().numpy()
        calls, tokens = [], 0
        for shard, worker in enumerate(self.workers):
            source = self.cache.compute_source(layer, seq_ids, shard)
            tokens += int(source.seq_lens.sum())
            calls.append(worker.partial.remote(layer, q_np, source.block_table.numpy(), source.seq_lens.numpy(),
                                               scale))
        results = ray.get(calls)
        out, lse = merge_all([(torch.from_numpy(np.array(o)), torch.from_numpy(np.array(s))) for o, s, _ in results])
        return out, lse, tokens, max(seconds for _, _, seconds in results)

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        super().shutdown()


register_executor("ray", RayExecutor)
