"""The CPU worker: one Ray actor per NUMA node, computing the CPU partials over its node's
cpu_compute shard, served over a shared-memory channel (writescope.actors.channel) to the GPU worker.
On a real (not emulated) NUMA node the shard's pages lie in the node's memory: the cache binds each
segment of the shard to the node (mbind) when it commits it, before any KV is written there.

Authoritative state: none. The shard's bytes and the channel's segment live in shared memory owned
by the region owner, so a worker that crashes loses nothing. Rebuilt on (re)start: the pinning of
the process and of the kernel's thread pool to the node's CPUs, the attachment of the shard from
its handle, and the channel's listening socket (the GPU worker reconnects and resends).
"""

from __future__ import annotations

import os

import ray

from writescope.topology import NumaNode


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class CPUWorker:
    def __init__(self, node: NumaNode, shard_handles: list[bytes], channel):
        """shard_handles: this node's cpu_compute shard of each of the engine's KV caches (one, or one
        per compression rate for DeepSeek-V4); a request names its region by index in this list."""
        # Imported here, in the worker: Ray pickles this class by value, and its globals with it.
        from writescope.actors.channel import PartialServer
        from writescope.kv_regions import HostRegion
        from writescope.topology import pin_process

        pin_process(node.cpus)  # the threads Ray started before us and the kernel's pool
        self.node = node
        # their segments bound to the node as the cache commits them
        self.regions = [HostRegion.attach(handle) for handle in shard_handles]
        self.server = PartialServer(channel, self._partial,
                                    region_layers=[r.handle.format.num_layers for r in self.regions])

    def _partial(self, region, layer, q, table, seq_lens, scale, unit):
        """q [num_seqs, num_q_heads, head_dim_qk] float32; table: blocks of the region, or (unit TOKENS)
        tokens of it -> (out [num_seqs, num_q_heads, head_dim_v], lse, the kernel's own seconds)."""
        from writescope import ops
        from writescope.actors.channel import TOKENS
        from writescope.inplace_kv_cache import compute_source, selected_source

        shard = self.regions[region]
        source = (selected_source if unit == TOKENS else compute_source)(shard, layer, table, seq_lens)
        # the channel checked the request's bounds; the C++ launcher checks every block id before a read
        return ops.cpu_paged_attention_timed(q, source, scale)

    def thread_affinities(self) -> dict[int, list[int]]:
        """CPU sets of every thread of this process, read by thread id (for checks from outside)."""
        return {int(tid): sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}

    def shard_page_nodes(self) -> list[int]:
        """The NUMA node of each page of this worker's shard (for checks from outside)."""
        from writescope.numa_memory import page_nodes

        return [node for r in self.regions for node in page_nodes(r.address, r.size_bytes)]

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> bool:
        """The shard is mapped and the channel's thread is serving."""
        return all(r.attached for r in self.regions) and self.server.serving()

    def shutdown(self) -> None:
        self.server.close()
        for region in self.regions:
            region.close()
