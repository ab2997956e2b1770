"""The CPU worker: one Ray actor per NUMA node, computing the CPU partials over its node's
cpu_compute shard.

Authoritative state: none. The shard's bytes live in shared memory owned by the engine (the cache),
so a worker that crashes loses nothing. Rebuilt on (re)start: the pinning of the process and of the
kernel's thread pool to the node's CPUs, and the attachment of the shard from its handle.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import ray

from writescope.topology import NumaNode


def _pin_all_threads(cpus) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that just exited
            os.sched_setaffinity(int(tid), cpus)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class CPUWorker:
    def __init__(self, node: NumaNode, shard_handle: bytes, head_dim_v: int):
        # Imported here, in the worker: Ray pickles this class by value, and its globals with it.
        from writescope import _cpu
        from writescope.kv_regions import HostRegion

        _pin_all_threads(node.cpus)  # the threads Ray started before us too
        _cpu.set_num_threads(len(node.cpus), list(node.cpus))  # the kernel's pool, one worker per CPU
        self.node = node
        self.region = HostRegion.attach(shard_handle)
        self.head_dim_v = head_dim_v

    def partial(self, layer: int, q: np.ndarray, block_table: np.ndarray, seq_lens: np.ndarray, scale: float):
        """q [num_seqs, num_q_heads, head_dim_qk] float32 -> (out, lse, kernel seconds) as numpy arrays."""
        import torch

        from writescope import ops

        k = self.region.k[layer].permute(1, 0, 2, 3)  # [num_blocks, num_kv_heads, block_size, head_dim_k]
        v = self.region.v[layer].permute(1, 0, 2, 3)
        began = time.perf_counter()
        out, lse = ops.paged_partial_attention(torch.from_numpy(q), k, v, torch.from_numpy(block_table),
                                               torch.from_numpy(seq_lens), scale=scale, backend="cpu")
        return out.numpy(), lse.numpy(), time.perf_counter() - began

    def thread_affinities(self) -> dict[int, list[int]]:
        """CPU sets of every thread of this process, read by thread id (for checks from outside)."""
        return {int(tid): sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> bool:
        return self.region.k.numel() >= 0
