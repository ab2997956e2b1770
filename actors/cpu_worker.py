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
    def __init__(self, node: NumaNode, shard_handle: bytes, channel):
        # Imported here, in the worker: Ray pickles this class by value, and its globals with it.
        from writescope.actors.channel import PartialServer
        from writescope.kv_regions import HostRegion
        from writescope.topology import pin_process

        pin_process(node.cpus)  # the threads Ray started before us and the kernel's pool
        self.node = node
        self.region = HostRegion.attach(shard_handle)  # its segments bound to the node as the cache commits them
        self.server = PartialServer(channel, self._partial, num_layers=self.region.handle.format.num_layers)

    def _partial(self, layer, q, block_table, seq_lens, scale):
        """q [num_seqs, num_q_heads, head_dim_qk] float32 -> (out [num_seqs, num_q_heads, head_dim_v], lse,
        the kernel's own seconds)."""
        from writescope import ops
        from writescope.inplace_kv_cache import compute_source

        # the channel checked the request's bounds; the C++ launcher checks every block id before a read
        return ops.cpu_paged_attention_timed(q, compute_source(self.region, layer, block_table, seq_lens), scale)

    def thread_affinities(self) -> dict[int, list[int]]:
        """CPU sets of every thread of this process, read by thread id (for checks from outside)."""
        return {int(tid): sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}

    def shard_page_nodes(self) -> list[int]:
        """The NUMA node of each page of this worker's shard (for checks from outside)."""
        from writescope.numa_memory import page_nodes

        return page_nodes(self.region.address, self.region.size_bytes)

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> bool:
        """The shard is mapped and the channel's thread is serving."""
        return self.region.attached and self.server.serving()

    def shutdown(self) -> None:
        self.server.close()
        self.region.close()
