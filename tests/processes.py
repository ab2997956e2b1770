"""What the processes of this host hold: the checks that nothing of an engine outlives it."""

import contextlib
import os


def processes_mapping(name: str) -> list[int]:
    """PIDs of every process that maps, or holds a descriptor of, the memfd called name."""
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as maps:
                if f"/memfd:{name} " in maps.read():
                    holders.append(int(pid))
                    continue
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == f"/memfd:{name} (deleted)"
                   for fd in os.listdir(f"/proc/{pid}/fd")):
                holders.append(int(pid))
    return sorted(holders)


def abstract_sockets(prefix: str) -> list[str]:
    """Abstract Unix socket names in use on this host that start with prefix."""
    with open("/proc/net/unix") as table:
        return [line.split()[-1] for line in table if line.split()[-1].startswith("@" + prefix)]
