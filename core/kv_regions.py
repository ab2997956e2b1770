"""Host regions of InplaceKVCache in shared memory, and the handles other processes attach them by.

A host region (`cpu_compute` shard or `cpu_transfer`) is one shared-memory segment holding the K
array (and the V array unless V lives inside K), laid out as `KVFormat.shape` says. A segment is an
anonymous memfd, not a file in /dev/shm: its memory is freed by the kernel when the last process
holding it (its creator's descriptor, any process's mapping) is gone, so no kill, crash or torn-down
cluster can leave KV behind. Another process attaches a segment from a `RegionHandle` (a small
msgpack message naming the creator's PID and descriptor) by opening /proc/PID/fd/FD, which the
kernel allows to processes of the same user; the creator must be alive then (a worker restarted
by Ray re-attaches from the long-lived region owner). Handles are validated on decode and on
attach: a wrong kind, layout, dtype, size, offset, block id or descriptor is a ValueError, never
an out-of-bounds access.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from dataclasses import dataclass, field, fields

import msgpack
import numpy as np
import torch

from writescope.kv_format import HOST_REGIONS, LAYOUTS, KVFormat

log = logging.getLogger(__name__)

_ALIGN_BYTES = 4096
_NUMPY_STORAGE = {"bfloat16": np.int16, "float16": np.float16, "float32": np.float32}


def _align(n: int) -> int:
    return -(-n // _ALIGN_BYTES) * _ALIGN_BYTES


class Segment:
    """Shared memory that cannot outlive its users: an anonymous memfd mapped MAP_SHARED.

    create() makes one in this process, which keeps its descriptor until close(); attach() maps
    the creator's segment from (creator PID, descriptor, name, size) through /proc. The memory is
    freed when the creator has closed it (or died) and every mapping is gone.
    """

    def __init__(self, name: str, mapping: mmap.mmap, size: int, owner_pid: int, fd: int, owned: bool):
        self.name = name
        self.buf = mapping
        self.size = size
        self.owner_pid = owner_pid
        self.fd = fd  # the creator's descriptor number (open in this process only if owned)
        self.owned = owned

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, mapping, size, os.getpid(), fd, owned=True)

    @classmethod
    def attach(cls, name: str, owner_pid: int, fd: int, size: int) -> Segment:
        """ValueError when the creator is gone, the descriptor is not that segment, or it is smaller than size."""
        path = f"/proc/{owner_pid}/fd/{fd}"
        try:
            target = os.readlink(path)
            local_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ValueError(f"segment {name!r}: its owner (pid {owner_pid}) or its descriptor {fd} is gone; "
                             f"the region is gone") from None
        except PermissionError:
            raise ValueError(f"segment {name!r}: /proc/{owner_pid}/fd/{fd} cannot be opened (the owner runs as "
                             f"another user, or /proc is restricted)") from None
        try:
            if target != f"/memfd:{name} (deleted)":
                raise ValueError(f"descriptor {fd} of pid {owner_pid} is {target!r}, not segment {name!r}")
            actual = os.fstat(local_fd).st_size
            if actual < size:
                raise ValueError(f"segment {name!r} holds {actual} bytes, the handle says {size}")
            mapping = mmap.mmap(local_fd, size)
        finally:
            os.close(local_fd)  # the mapping keeps the memory
        return cls(name, mapping, size, owner_pid, fd, owned=False)

    @property
    def address(self) -> int:
        """Where the segment is mapped in this process (page-aligned)."""
        return np.frombuffer(self.buf, dtype=np.uint8).ctypes.data

    def close(self) -> None:
        """Unmaps (unless views are still held: the mapping then lives until they go) and, in the
        creator, closes the descriptor, so the memory goes with the last mapping."""
        with contextlib.suppress(BufferError):
            self.buf.close()
        if self.owned and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def segment_name(label: str) -> str:
    """A segment name unique on this host (it shows in /proc/PID/maps as /memfd:NAME)."""
    return f"writescope_{label}_{secrets.token_hex(6)}"


@dataclass(frozen=True)
class RegionHandle:
    kind: str
    shm_name: str  # the segment's memfd name
    owner_pid: int  # the process that created the segment and holds its descriptor
    fd: int  # that descriptor, in the owner
    shard: int
    num_blocks: int
    segment_bytes: int
    offsets: tuple[int, ...]  # byte offset of each stored array (K, then V unless V is inside K)
    layout: tuple[str, ...]
    format: KVFormat
    pinned: bool = False
    block_table: tuple[int, ...] = field(default=())  # optional: one sequence's blocks in this region

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.kind not in HOST_REGIONS:
            raise ValueError(f"handle kind {self.kind!r} is not a host region; allowed: {', '.join(HOST_REGIONS)}")
        if tuple(self.layout) != LAYOUTS[self.kind]:
            raise ValueError(f"handle layout {self.layout} does not match {self.kind}'s {LAYOUTS[self.kind]}")
        if not isinstance(self.format, KVFormat):
            raise ValueError("handle format must be a KVFormat")
        if not self.shm_name or not isinstance(self.shm_name, str):
            raise ValueError(f"handle shm_name must be a non-empty string, got {self.shm_name!r}")
        if self.shard < 0 or self.num_blocks < 0:
            raise ValueError(f"handle shard ({self.shard}) and num_blocks ({self.num_blocks}) must be >= 0")
        if self.owner_pid < 1 or self.fd < 0:
            raise ValueError(f"handle owner_pid ({self.owner_pid}) must be >= 1 and fd ({self.fd}) >= 0")
        stored = self.format.stored_arrays
        if len(self.offsets) != len(stored):
            raise ValueError(f"handle has {len(self.offsets)} offsets for {len(stored)} stored arrays")
        end = 0
        for offset, (array, dim) in zip(self.offsets, stored, strict=True):
            nbytes = _array_bytes(self.format, self.kind, self.num_blocks, dim, array)
            if offset < end or offset % _ALIGN_BYTES:
                raise ValueError(f"handle offset {offset} overlaps the previous array or is not {_ALIGN_BYTES}-aligned")
            end = offset + nbytes
        if end > self.segment_bytes:
            raise ValueError(f"handle arrays end at byte {end}, past the segment's {self.segment_bytes} bytes")
        bad = [b for b in self.block_table if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"handle block_table holds {bad[:5]}, outside [0, {self.num_blocks})")

    def with_block_table(self, blocks) -> RegionHandle:
        return RegionHandle(**{**self._fields(), "block_table": tuple(int(b) for b in blocks)})

    def to_bytes(self) -> bytes:
        data = self._fields()
        data["format"] = self.format.to_dict()
        return msgpack.packb(data)

    @classmethod
    def from_bytes(cls, payload: bytes) -> RegionHandle:
        try:
            data = msgpack.unpackb(payload)
        except Exception as error:  # msgpack raises several types for garbage
            raise ValueError(f"not a region handle: {error}") from None
        expected = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != expected:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"a region handle needs the fields {sorted(expected)}, got {got}")
        ints = ("owner_pid", "fd", "shard", "num_blocks", "segment_bytes")
        if not all(isinstance(data[k], int) for k in ints) or not isinstance(data["pinned"], bool):
            raise ValueError(f"handle fields {ints} must be integers and pinned a bool")
        for key, kind in (("offsets", int), ("block_table", int), ("layout", str)):
            if not isinstance(data[key], list) or not all(isinstance(x, kind) for x in data[key]):
                raise ValueError(f"handle field {key} must be a list of {kind.__name__}, got {data[key]!r}")
        if not isinstance(data["shm_name"], str) or not isinstance(data["kind"], str):
            raise ValueError("handle fields shm_name and kind must be strings")
        data["format"] = KVFormat.from_dict(data["format"])
        for key in ("offsets", "layout", "block_table"):
            data[key] = tuple(data[key])
        return cls(**data)

    def _fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _array_bytes(fmt: KVFormat, kind: str, num_blocks: int, head_dim: int, array: str) -> int:
    return int(np.prod(fmt.shape(kind, num_blocks, head_dim, array=array))) * fmt.itemsize


class HostRegion:
    """A `cpu_compute` shard or the `cpu_transfer` region in shared memory.

    Authoritative state: the bytes of the segment. The creator's close() lets the memory go once
    no process maps it; an attached region's close() only unmaps. Arrays are torch tensors over
    the mapping (zero-copy).
    """

    def __init__(self, segment: Segment, handle: RegionHandle):
        self._segment = segment
        self.handle = handle
        self.owner = segment.owned
        self.arrays = [self._view(offset, array, dim)
                       for offset, (array, dim) in zip(handle.offsets, handle.format.stored_arrays, strict=True)]
        # Page-locking is per mapping: each process that maps a pinned region (the owner, or the GPU
        # worker attaching it) registers its own view with CUDA, where CUDA is present.
        self._pinned = handle.pinned and _pin(segment)

    @classmethod
    def create(cls, kind: str, fmt: KVFormat, num_blocks: int, *, shard: int = 0, pin: bool | None = None,
               label: str = "cache") -> HostRegion:
        """label names the segment (with kind, shard and a random suffix) in /proc/PID/maps."""
        offsets, end = [], 0
        for array, dim in fmt.stored_arrays:
            offsets.append(end)
            end = _align(end + _array_bytes(fmt, kind, num_blocks, dim, array))
        pin = torch.cuda.is_available() and kind == "cpu_transfer" if pin is None else pin
        segment = Segment.create(segment_name(f"{label}_{kind}_{shard}"), max(end, 1))
        handle = RegionHandle(kind=kind, shm_name=segment.name, owner_pid=segment.owner_pid, fd=segment.fd,
                              shard=shard, num_blocks=num_blocks, segment_bytes=segment.size, offsets=tuple(offsets),
                              layout=LAYOUTS[kind], format=fmt, pinned=pin)
        return cls(segment, handle)

    @classmethod
    def attach(cls, handle: RegionHandle | bytes) -> HostRegion:
        if isinstance(handle, bytes | bytearray):
            handle = RegionHandle.from_bytes(bytes(handle))
        handle.validate()
        return cls(Segment.attach(handle.shm_name, handle.owner_pid, handle.fd, handle.segment_bytes), handle)

    @property
    def kind(self) -> str:
        return self.handle.kind

    @property
    def attached(self) -> bool:
        """The segment is mapped here (not closed)."""
        return self._segment is not None

    @property
    def address(self) -> int:
        """Where the segment is mapped in this process (page-aligned)."""
        return self._segment.address

    @property
    def size_bytes(self) -> int:
        return self._segment.size

    @property
    def k(self) -> torch.Tensor:
        return self.arrays[0]

    @property
    def v(self) -> torch.Tensor:
        fmt = self.handle.format
        return self.arrays[0][..., : fmt.head_dim_v] if fmt.v_in_k else self.arrays[1]

    def _view(self, offset: int, array: str, head_dim: int) -> torch.Tensor:
        fmt = self.handle.format
        shape = fmt.shape(self.handle.kind, self.handle.num_blocks, head_dim, array=array)
        array = np.ndarray(shape, dtype=_NUMPY_STORAGE[fmt.dtype], buffer=self._segment.buf, offset=offset)
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if fmt.dtype == "bfloat16" else tensor

    def close(self) -> None:
        if self._segment is None:
            return
        if self._pinned:
            _unpin(self._segment)
        self.arrays = []
        self._segment.close()
        self._segment = None


def _pin(segment: Segment) -> bool:
    """Page-locks the segment for the CUDA runtime, so copies from it are true DMA."""
    if not torch.cuda.is_available():
        return False
    result = torch.cuda.cudart().cudaHostRegister(segment.address, segment.size, 0)
    return int(result) == 0


def _unpin(segment: Segment) -> None:
    torch.cuda.cudart().cudaHostUnregister(segment.address)
