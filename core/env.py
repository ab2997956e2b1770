"""Every environment variable WriteScope reads, declared once with its type and meaning.

The C++ extension reads the `WRITESCOPE_CPU_*` variables itself when it is imported (so any
import path honours them); they are declared here so there is one list to document and check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    doc: str
    allowed: str

    def get(self) -> str | None:
        value = os.environ.get(self.name)
        return value if value else None

    def enabled(self) -> bool:
        """A flag: set and not "0"."""
        return self.get() not in (None, "0")


CPU_VARIANT = EnvVar(
    "WRITESCOPE_CPU_VARIANT",
    "Forces the CPU kernels' ISA variant, e.g. to test a lower one; an unavailable one fails the import.",
    "avx512bf16, avx512, avx2 or scalar, among those the CPU supports",
)
NUM_THREADS = EnvVar(
    "WRITESCOPE_NUM_THREADS",
    "Threads of the CPU kernels' pool, the calling thread included (default: the CPUs in the affinity mask).",
    "an integer in [1, 4096]",
)
POOL_SPIN_US = EnvVar(
    "WRITESCOPE_POOL_SPIN_US",
    "Microseconds an idle thread of the CPU kernels' pool polls for the next job before it sleeps (default "
    "200; Ray's CPU and GPU workers use 0 unless it is set, since they share their cores with each other).",
    "an integer in [0, 1000000]",
)

TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET",
    "Runs the Triton kernels in Triton's interpreter on CPU tensors (machines without a GPU). Read by "
    "Triton when `writescope.triton_attention` is imported: set it before that import.",
    "1 to interpret, unset or 0 to compile for the GPU",
)

CACHE_DIR = EnvVar(
    "WRITESCOPE_CACHE_DIR",
    "Where calibration results are cached (default: ~/.cache/writescope).",
    "a writable directory",
)

NUMA_NODES = EnvVar(
    "WRITESCOPE_NUMA_NODES",
    "Emulates this many NUMA nodes by splitting the CPUs (default: the host's real topology).",
    "a positive integer, at most the number of CPUs",
)

HUGE_PAGES = EnvVar(
    "WRITESCOPE_HUGE_PAGES",
    "Lays the host KV regions out in 2 MB pages advised for transparent huge pages (default auto: where "
    "/sys/kernel/mm/transparent_hugepage/shmem_enabled is not never or deny). Each region segment is then "
    "2 MB or more per layer, kv head and array; a host whose setting is never still gives 4 KB pages.",
    "auto, on or off",
)

ALL = (CPU_VARIANT, NUM_THREADS, POOL_SPIN_US, TRITON_INTERPRET, CACHE_DIR, NUMA_NODES, HUGE_PAGES)
