"""Placing a mapped range's pages on one NUMA node: mbind(2) with MPOL_BIND.

The cache binds each segment of a cpu_compute shard to its node's memory when it commits the
segment, before allocating its pages, so the node's CPU worker reads local memory. On shared
memory the policy belongs to the shared object, so pages allocated later by any process (the
segment's fallocate, a first write) land on that node. Through the raw system calls (ctypes), so
no libnuma is needed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform

MPOL_BIND = 2
MPOL_MF_MOVE = 1 << 1
# (mbind, move_pages) system call numbers
_SYSCALLS = {"x86_64": (237, 279), "aarch64": (235, 239)}


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _numbers() -> tuple[int, int]:
    machine = platform.machine().lower()
    if machine not in _SYSCALLS:
        raise OSError(f"NUMA memory binding is implemented for {', '.join(_SYSCALLS)}, not {machine}")
    return _SYSCALLS[machine]


def bind_to_node(address: int, length: int, node: int) -> None:
    """Binds [address, address + length) to NUMA node `node`, moving pages already there: pages
    allocated in it from now on come from that node. address must be page-aligned."""
    if address % mmap.PAGESIZE:
        raise ValueError(f"address {address:#x} is not aligned to the page size {mmap.PAGESIZE}")
    if not 0 <= node < 1024:
        raise ValueError(f"node {node} is outside [0, 1024)")
    mask = (ctypes.c_ulong * 16)()  # 1024 bits
    mask[node // 64] = 1 << (node % 64)
    result = _libc().syscall(_numbers()[0], ctypes.c_void_p(address), ctypes.c_ulong(length), MPOL_BIND, mask,
                             ctypes.c_ulong(1024 + 1), MPOL_MF_MOVE)
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mbind to node {node} failed: {os.strerror(errno)}")


def page_nodes(address: int, length: int) -> list[int]:
    """The NUMA node of each page of the range (negative: not resident, as -errno), from move_pages(2)."""
    count = -(-length // mmap.PAGESIZE)
    pages = (ctypes.c_void_p * count)(*[address + i * mmap.PAGESIZE for i in range(count)])
    status = (ctypes.c_int * count)()
    result = _libc().syscall(_numbers()[1], 0, ctypes.c_ulong(count), pages, None, status, 0)
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"move_pages query failed: {os.strerror(errno)}")
    return list(status)
