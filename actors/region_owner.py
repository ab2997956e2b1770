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
    def __init__(self, cache_configs: dict, channel_specs, engine_id: str, pin: bool):
        """cache_configs: name -> CacheConfig of each KV cache of the engine (one for the MoE models,
        one per compression rate for DeepSeek-V4): the regions made for each."""
        from writescope.actors.cpu_worker import create_segment
        from writescope.inplace_kv_cache import create_region

        self.compute: dict[str, list] = {}
        self.transfer: dict[str, object] = {}
        for name, config in cache_configs.items():
            self.compute[name] = [create_region(config, "cpu_compute", shard=s, pin=False, label=engine_id)
                                  for s in range(config.num_shards)]
            # pinned segment by segment by the process that commits them where CUDA is present (the GPU
            # worker's cache); the flag travels in the handle
            self.transfer[name] = create_region(config, "cpu_transfer", pin=pin, label=engine_id)
        made = [create_segment(spec, f"{engine_id}_channel_{i}") for i, spec in enumerate(channel_specs)]
        self.specs = [spec for spec, _ in made]
        self.channels = [segment for _, segment in made]

    def channel_specs(self):
        """The channels' specs, naming the segments made here."""
        return self.specs

    def handles(self) -> dict[str, tuple[list[bytes], bytes]]:
        """Per cache: ([cpu_compute handle per shard], cpu_transfer handle), msgpack bytes."""
        return {name: ([r.handle.to_bytes() for r in self.compute[name]], self.transfer[name].handle.to_bytes())
                for name in self.compute}

    def _regions(self) -> dict[str, object]:
        """Every KV region by its name in memory(): cpu_compute_<shard> and cpu_transfer, prefixed with
        the cache's name where the engine has more than one cache."""
        regions = {}
        for name, shards in self.compute.items():
            prefix = f"{name}." if len(self.compute) > 1 else ""
            regions.update({f"{prefix}cpu_compute_{i}": r for i, r in enumerate(shards)})
            regions[f"{prefix}cpu_transfer"] = self.transfer[name]
        return regions

    def segment_names(self) -> list[str]:
        return [r.handle.shm_name for r in self._regions().values()] + [c.name for c in self.channels]

    def pid(self) -> int:
        return os.getpid()

    def memory(self) -> dict[str, dict[str, int]]:
        """Each KV region: its size (address space) and the bytes of it in memory (the segments the
        cache committed, and any page written outside them)."""
        return {name: region.memory() for name, region in self._regions().items()}

    def check_health(self) -> bool:
        """Every segment's descriptor is still open here (a closed owner can no longer be attached)."""
        descriptors = [r.handle.fd for r in self._regions().values()] + [c.fd for c in self.channels]
        return bool(descriptors) and all(fd >= 0 and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:writescope")
                                         for fd in descriptors)

    def close(self) -> None:
        """Lets go of every segment: the engine is finished (the memory goes with the last mapping)."""
        for region in self._regions().values():
            region.close()
        for segment in self.channels:
            segment.close()
        self.compute, self.transfer, self.channels = {}, {}, []
