"""Host regions of InplaceKVCache in shared memory, and the handles other processes attach them by.

A host region (`cpu_compute` shard or `cpu_transfer`) is one POSIX shared-memory segment holding
the K array (and the V array unless V lives inside K), laid out as `KVFormat.shape` says. The
process that creates a region owns it and unlinks it on `close()`; any other process attaches it
from a `RegionHandle` (a small msgpack message) and maps the same bytes. Handles are validated on
decode and on attach: a wrong kind, layout, dtype, size, offset or block id is a ValueError, never
an out-of-bounds access.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
from dataclasses import dataclass, field, fields
from multiprocessing import resource_tracker, shared_memory

import msgpack
import numpy as np
import torch

from writescope.kv_format import LAYOUTS, KVFormat

log = logging.getLogger(__name__)

HOST_KINDS = ("cpu_compute", "cpu_transfer")
_ALIGN_BYTES = 4096
_CREATED_HERE: set[str] = set()  # segments this process created (and the tracker knows as ours)
_NUMPY_STORAGE = {"bfloat16": np.int16, "float16": np.float16, "float32": np.float32}


def _align(n: int) -> int:
    return -(-n // _ALIGN_BYTES) * _ALIGN_BYTES


@dataclass(frozen=True)
class RegionHandle:
    kind: str
    shm_name: str
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
        if self.kind not in HOST_KINDS:
            raise ValueError(f"handle kind {self.kind!r} is not a host region; allowed: {', '.join(HOST_KINDS)}")
        if tuple(self.layout) != LAYOUTS[self.kind]:
            raise ValueError(f"handle layout {self.layout} does not match {self.kind}'s {LAYOUTS[self.kind]}")
        if not isinstance(self.format, KVFormat):
            raise ValueError("handle format must be a KVFormat")
        if not self.shm_name or not isinstance(self.shm_name, str):
            raise ValueError(f"handle shm_name must be a non-empty string, got {self.shm_name!r}")
        if self.shard < 0 or self.num_blocks < 0:
            raise ValueError(f"handle shard ({self.shard}) and num_blocks ({self.num_blocks}) must be >= 0")
        dims = self.format.stored_dims
        if len(self.offsets) != len(dims):
            raise ValueError(f"handle has {len(self.offsets)} offsets for {len(dims)} stored arrays")
        end = 0
        for offset, dim in zip(self.offsets, dims, strict=True):
            nbytes = _array_bytes(self.format, self.kind, self.num_blocks, dim)
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
        ints = ("shard", "num_blocks", "segment_bytes")
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


def _array_bytes(fmt: KVFormat, kind: str, num_blocks: int, head_dim: int) -> int:
    return int(np.prod(fmt.shape(kind, num_blocks, head_dim))) * fmt.itemsize


class HostRegion:
    """A `cpu_compute` shard or the `cpu_transfer` region in shared memory.

    Authoritative state: the bytes of the segment. The owner (creator) unlinks the segment on
    close(); attached views only unmap. Arrays are torch tensors over the mapping (zero-copy).
    """

    def __init__(self, shm, handle: RegionHandle, owner: bool):
        self._shm = shm
        self.handle = handle
        self.owner = owner
        self.arrays = [self._view(offset, dim) for offset, dim in zip(handle.offsets, handle.format.stored_dims,
                                                                       strict=True)]
        # Page-locking is per mapping: each process that maps a pinned region (the owner, or the GPU
        # worker attaching it) registers its own view with CUDA, where CUDA is present.
        self._pinned = handle.pinned and _pin(self._shm)

    @classmethod
    def create(cls, kind: str, fmt: KVFormat, num_blocks: int, *, shard: int = 0, pin: bool | None = None,
               name_prefix: str | None = None) -> HostRegion:
        """name_prefix must start with segment_prefix() of the creating process (the default), so a
        segment whose creator died without unlinking it can be found and removed later."""
        name_prefix = name_prefix or segment_prefix()
        offsets, end = [], 0
        for dim in fmt.stored_dims:
            offsets.append(end)
            end = _align(end + _array_bytes(fmt, kind, num_blocks, dim))
        pin = torch.cuda.is_available() and kind == "cpu_transfer" if pin is None else pin
        shm = shared_memory.SharedMemory(name=f"{name_prefix}_{kind}_{shard}_{secrets.token_hex(6)}", create=True,
                                         size=max(end, 1))
        _CREATED_HERE.add(shm.name)
        handle = RegionHandle(kind=kind, shm_name=shm.name, shard=shard, num_blocks=num_blocks,
                              segment_bytes=max(end, 1), offsets=tuple(offsets), layout=LAYOUTS[kind], format=fmt,
                              pinned=pin)
        return cls(shm, handle, owner=True)

    @classmethod
    def attach(cls, handle: RegionHandle | bytes) -> HostRegion:
        if isinstance(handle, bytes | bytearray):
            handle = RegionHandle.from_bytes(bytes(handle))
        handle.validate()
        try:
            shm = shared_memory.SharedMemory(name=handle.shm_name, create=False)
        except FileNotFoundError:
            raise ValueError(f"no shared-memory segment named {handle.shm_name!r}: the region is gone") from None
        # Python < 3.13 registers attached segments too, and would unlink them when this process exits.
        if handle.shm_name not in _CREATED_HERE:
            with contextlib.suppress(Exception):
                resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        if shm.size < handle.segment_bytes:
            shm.close()
            raise ValueError(f"segment {handle.shm_name!r} holds {shm.size} bytes, the handle says "
                             f"{handle.segment_bytes}")
        return cls(shm, handle, owner=False)

    @property
    def kind(self) -> str:
        return self.handle.kind

    @property
    def address(self) -> int:
        """Where the segment is mapped in this process (page-aligned)."""
        return _buffer_address(self._shm)

    @property
    def size_bytes(self) -> int:
        return self._shm.size

    @property
    def k(self) -> torch.Tensor:
        return self.arrays[0]

    @property
    def v(self) -> torch.Tensor:
        fmt = self.handle.format
        return self.arrays[0][..., : fmt.head_dim_v] if fmt.v_in_k else self.arrays[1]

    def _view(self, offset: int, head_dim: int) -> torch.Tensor:
        fmt = self.handle.format
        shape = fmt.shape(self.handle.kind, self.handle.num_blocks, head_dim)
        array = np.ndarray(shape, dtype=_NUMPY_STORAGE[fmt.dtype], buffer=self._shm.buf, offset=offset)
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if fmt.dtype == "bfloat16" else tensor

    def close(self) -> None:
        if self._shm is None:
            return
        if self._pinned:
            _unpin(self._shm)
        self.arrays = []
        with contextlib.suppress(BufferError):  # a caller still holds a view: the mapping lives on until exit
            self._shm.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
            _CREATED_HERE.discard(self.handle.shm_name)
        self._shm = None


_OWNED_NAME = re.compile(r"^writescope_p(\d+)_")


def segment_prefix(pid: int | None = None) -> str:
    """The name prefix of the shared-memory segments a process creates: it carries the creator's PID."""
    return f"writescope_p{os.getpid() if pid is None else pid}"


def reap_orphaned_segments(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlinks WriteScope segments whose creating process is gone: what a SIGKILLed engine (or a Ray
    cluster torn down under it) left behind. Returns the names removed. Assumes /dev/shm is not
    shared with another PID namespace (true of a host and of a container)."""
    removed = []
    for name in sorted(os.listdir(shm_dir)) if os.path.isdir(shm_dir) else []:
        match = _OWNED_NAME.match(name)
        if match and not _alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
    if removed:
        log.warning("removed %d shared-memory segments of dead WriteScope processes: %s", len(removed), removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _buffer_address(shm) -> int:
    return np.frombuffer(shm.buf, dtype=np.uint8).ctypes.data


def _pin(shm) -> bool:
    """Page-locks the segment for the CUDA runtime, so copies from it are true DMA."""
    if not torch.cuda.is_available():
        return False
    result = torch.cuda.cudart().cudaHostRegister(_buffer_address(shm), shm.size, 0)
    return int(result) == 0


def _unpin(shm) -> None:
    torch.cuda.cudart().cudaHostUnregister(_buffer_address(shm))
