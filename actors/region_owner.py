"""The region owner: the long-lived process that creates one engine's shared-memory segments (the
cpu_compute shards, cpu_transfer and the CPU workers' channels) and removes them at shutdown.

Authoritative state: the segments' existence. Workers attach by handle and never own; the GPU
worker and the CPU workers can die and restart without a byte of KV going away. This actor does
no work after creation, so it is not restarted: if it dies, the engine must be rebuilt
(check_health says so first). Segment names carry this process's PID, so segments left by an owner
that died with its cluster are removed by the next owner or cache created on the machine.
"""

from __future__ import annotations

import contextlib
import os

import ray


@ray.remote(num_cpus=0)
class RegionOwner:
    def __init__(self, cache_config, channel_specs, engine_id: str, pin: bool):
        import dataclasses

        from writescope.actors.channel import create_segment
        from writescope.kv_regions import HostRegion, reap_orphaned_segments, segment_prefix

        reap_orphaned_segments()  # what owners killed with their cluster left behind
        name_prefix = f"{segment_prefix()}_{engine_id}"  # the PID in the name: orphans can be found
        channel_specs = [dataclasses.replace(spec, shm_name=f"{name_prefix}_channel_{i}")
                         for i, spec in enumerate(channel_specs)]
        self.specs = channel_specs
        fmt = cache_config.format
        self.compute = [HostRegion.create("cpu_compute", fmt, cache_config.compute_blocks_per_shard, shard=s,
                                          pin=False, name_prefix=name_prefix)
                        for s in range(cache_config.num_shards)]
        # pinned by each process that maps it where CUDA is present (the GPU worker); the flag travels
        self.transfer = HostRegion.create("cpu_transfer", fmt, cache_config.transfer_blocks, pin=pin,
                                          name_prefix=name_prefix)
        self.channels = [create_segment(spec) for spec in channel_specs]

    def channel_specs(self):
        """The channels' specs with the names of the segments made here."""
        return self.specs

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
