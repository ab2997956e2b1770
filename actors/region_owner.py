"""The region owner: the long-lived process that creates one engine's shared-memory segments (the
cpu_compute shards, cpu_transfer and the CPU workers' channels) and removes them at shutdown.

Authoritative state: the segments' existence. Workers attach by handle and never own; the GPU
worker and the CPU workers can die and restart without a byte of KV going away. This actor does
no work after creation, so it is not restarted: if it dies, its process's resource tracker unlinks
the segments and the engine must be rebuilt (check_health says so first).
"""

from __future__ import annotations

import contextlib
import os

import ray


@ray.remote(num_cpus=0)
class RegionOwner:
    def __init__(self, cache_config, channel_specs, name_prefix: str, pin: bool):
        from writescope.actors.channel import create_segment
        from writescope.kv_regions import HostRegion

        fmt = cache_config.format
        self.compute = [HostRegion.create("cpu_compute", fmt, cache_config.compute_blocks_per_shard, shard=s,
                                          pin=False, name_prefix=name_prefix)
                        for s in range(cache_config.num_shards)]
        # pinned by each process that maps it where CUDA is present (the GPU worker); the flag travels
        self.transfer = HostRegion.create("cpu_transfer", fmt, cache_config.transfer_blocks, pin=pin,
                                          name_prefix=name_prefix)
        self.channels = [create_segment(spec) for spec in channel_specs]

    def handles(self) -> tuple[list[bytes], bytes]:
        """([cpu_compute handle per shard], cpu_transfer handle), msgpack bytes."""
        return [r.handle.to_bytes() for r in self.compute], self.transfer.handle.to_bytes()

    def segment_names(self) -> list[str]:
        return [r.handle.shm_name for r in [*self.compute, self.transfer]] + [c.name for c in self.channels]

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> bool:
        return all(os.path.exists(f"/dev/shm/{name}") for name in self.segment_names())

    def close(self) -> None:
        """Unlinks every segment: the engine is finished."""
        for region in [*self.compute, self.transfer]:
            region.close()
        for segment in self.channels:
            with contextlib.suppress(BufferError):
                segment.close()
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()
        self.compute, self.channels = [], []
