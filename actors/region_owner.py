"""The region owner: the long-lived process that creates one engine's shared-memory segments (the
cpu_compute shards, cpu_transfer and the CPU workers' channels) and holds them for the engine's life.

Authoritative state: the segments. They are memfds whose descriptors this process holds; workers
attach them by handle (through /proc/PID/fd of this process) and never own, so the GPU worker and
the CPU workers can die and restart without a byte of KV going away. When this process ends, for
any reason, the memory goes with the last worker that still maps it: nothing is ever left behind
in /dev/shm or elsewhere. It does no work after creation, so it is not restarted: if it dies, the
engine must be rebuilt (check_health says so first).
"""

from __future__ import annotations

import os

import ray


@ray.remote(num_cpus=0)
class RegionOwner:
    def __init__(self, cache_config, channel_specs, engine_id: str, pin: bool):
        from writescope.actors.channel import create_segment
        from writescope.kv_regions import HostRegion

        fmt = cache_config.format
        self.compute = [HostRegion.create("cpu_compute", fmt, cache_config.compute_blocks_per_shard, shard=s,
                                          pin=False, label=engine_id)
                        for s in range(cache_config.num_shards)]
        # pinned by each process that maps it where CUDA is present (the GPU worker); the flag travels
        self.transfer = HostRegion.create("cpu_transfer", fmt, cache_config.transfer_blocks, pin=pin,
                                          label=engine_id)
        made = [create_segment(spec, f"{engine_id}_channel_{i}") for i, spec in enumerate(channel_specs)]
        self.specs = [spec for spec, _ in made]
        self.channels = [segment for _, segment in made]

    def channel_specs(self):
        """The channels' specs, naming the segments made here."""
        return self.specs

    def handles(self) -> tuple[list[bytes], bytes]:
        """([cpu_compute handle per shard], cpu_transfer handle), msgpack bytes."""
        return [r.handle.to_bytes() for r in self.compute], self.transfer.handle.to_bytes()

    def segment_names(self) -> list[str]:
        return [r.handle.shm_name for r in [*self.compute, self.transfer]] + [c.name for c in self.channels]

    def pid(self) -> int:
        return os.getpid()

    def memory(self) -> dict[str, dict[str, int]]:
        """Each KV region's segment: its size and the bytes of it in memory (pages written so far;
        a memfd's pages are allocated on first touch, in shared memory)."""
        regions = {f"cpu_compute_{i}": r for i, r in enumerate(self.compute)} | {"cpu_transfer": self.transfer}
        figures = {}
        for name, region in regions.items():
            status = os.fstat(region.handle.fd)
            figures[name] = {"size_bytes": status.st_size, "resident_bytes": status.st_blocks * 512}
        return figures

    def check_health(self) -> bool:
        """Every segment's descriptor is still open here (a closed owner can no longer be attached)."""
        descriptors = [r.handle.fd for r in [*self.compute, self.transfer]] + [c.fd for c in self.channels]
        return bool(descriptors) and all(fd >= 0 and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:writescope")
                                         for fd in descriptors)

    def close(self) -> None:
        """Lets go of every segment: the engine is finished (the memory goes with the last mapping)."""
        for region in [*self.compute, self.transfer]:
            region.close()
        for segment in self.channels:
            segment.close()
        self.compute, self.channels = [], []
