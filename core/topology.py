"""NUMA topology of this host, or an emulated one that splits its CPUs into equal nodes (so
multi-node behaviour runs and is tested on a one-node machine)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from writescope import env

SYS_NODES = "/sys/devices/system/node"


@dataclass(frozen=True)
class NumaNode:
    index: int
    cpus: tuple[int, ...]
    emulated: bool = False


def parse_cpulist(text: str) -> tuple[int, ...]:
    """"0-3,8,10-11" -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return tuple(cpus)


def read_topology(root: str = SYS_NODES) -> list[NumaNode]:
    """The host's NUMA nodes with the CPUs this process may use; one node when sysfs has none."""
    allowed = set(os.sched_getaffinity(0))
    nodes = []
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            if name.startswith("node") and name[4:].isdigit():
                with open(os.path.join(root, name, "cpulist")) as f:
                    cpus = tuple(c for c in parse_cpulist(f.read()) if c in allowed)
                if cpus:
                    nodes.append(NumaNode(int(name[4:]), cpus))
    return nodes or [NumaNode(0, tuple(sorted(allowed)))]


def emulated_topology(num_nodes: int) -> list[NumaNode]:
    """This process's CPUs split into num_nodes contiguous groups of (nearly) equal size."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 1 <= num_nodes <= len(cpus):
        raise ValueError(f"cannot emulate {num_nodes} NUMA nodes on {len(cpus)} CPUs: allowed 1 to {len(cpus)}")
    bounds = [round(i * len(cpus) / num_nodes) for i in range(num_nodes + 1)]
    return [NumaNode(i, tuple(cpus[bounds[i]:bounds[i + 1]]), emulated=True) for i in range(num_nodes)]


def topology() -> list[NumaNode]:
    """`WRITESCOPE_NUMA_NODES=n` emulates n nodes; otherwise the host's."""
    value = env.NUMA_NODES.get()
    if value is None:
        return read_topology()
    if not value.isdigit():
        raise ValueError(f"{env.NUMA_NODES.name} must be a positive integer, got {value!r}")
    return emulated_topology(int(value))


def pin_process(cpus) -> None:
    """Every thread of this process (those already started: later ones inherit the mask) and the C++
    kernel's pool (one worker per CPU) onto `cpus`: a CPU worker's or an experiment's node."""
    import contextlib

    from writescope import _cpu

    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that just exited
            os.sched_setaffinity(int(tid), cpus)
    _cpu.set_num_threads(len(cpus), list(cpus))


def share_cores() -> None:
    """This process shares its cores with other busy processes (Ray's CPU and GPU workers of one
    node): the C++ pool's idle threads sleep at once instead of polling for the next job, unless
    WRITESCOPE_POOL_SPIN_US is set. Measured on a 2-vCPU host, Ray executor, 8K x 1: polling for
    200 us after each job cost 15-20% of decode tok/s, the pollers taking the cores the other
    workers needed; one process alone (the local executor) gains 10-17% from it."""
    if env.POOL_SPIN_US.get() is None:
        from writescope import _cpu

        _cpu.set_pool_spin(0)
